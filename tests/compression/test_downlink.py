"""Download codecs: cast halves the model, deltas rebuild the server's reference bit for
bit at every site, and the reference never drifts from the global model."""

from __future__ import annotations

import pytest
import torch

from fedtrain.compression import build_codec
from fedtrain.compression.downlink import (
    ReferenceTrack,
    SiteModels,
    apply_change,
    cast,
    decode,
    encode,
)
from fedtrain.compression.settings import DownloadSettings
from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.tensors import ModelState


def model(seed: int, n: int = 5_000) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState(
        {
            "w": torch.randn(n, generator=g),
            "b": torch.randn(3, generator=g),
            "steps": torch.tensor(7),
        }
    )


def versions(count: int, step: float = 0.01) -> list[ModelState]:
    """A global model moving a little each version (as training moves it)."""
    out = [model(0)]
    for i in range(1, count):
        moved = {
            n: t + step * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
            for n, t in out[-1].items()
            if t.is_floating_point()
        }
        out.append(ModelState({**moved, "steps": torch.tensor(7 + i)}))
    return out


def worst(a: ModelState, b: ModelState) -> float:
    return max(
        float((a[n].double() - b[n].double()).abs().max()) for n in a if a[n].is_floating_point()
    )


@pytest.mark.parametrize(("name", "tol"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_a_cast_download_halves_the_model_and_rounds_each_value_once(name: str, tol: float) -> None:
    g = model(1)
    codec = build_codec(name)
    sent = cast(codec, "v1", g)
    assert sent.nbytes < 0.51 * g.nbytes
    got = decode(codec, sent.parts, g.specs)
    assert got.specs == g.specs and torch.equal(got["steps"], g["steps"])
    assert float(((got["w"] - g["w"]).abs() / g["w"].abs()).max()) <= tol


def test_a_tensor_beyond_fp16_range_travels_as_itself() -> None:
    g = ModelState({"big": torch.tensor([1e6, 1.0]), "w": torch.ones(4)})
    codec = build_codec("fp16")
    parts = encode(codec, g)
    assert parts["big"].dtype == torch.float32 and "w::fp16" in parts
    assert decode(codec, parts, g.specs)["big"].tolist() == [1e6, 1.0]


@pytest.mark.parametrize(
    ("name", "options"),
    [("fp16", {}), ("bf16", {}), ("int8", {"block": 256}), ("topk", {"fraction": 0.05})],
)
def test_a_site_following_the_changes_holds_the_reference_bit_for_bit(
    name: str, options: dict
) -> None:
    settings = DownloadSettings(codec=name, delta=True, **options)
    track = ReferenceTrack(settings.build())
    site_codec = settings.build()  # built from what the server tells the site, as a site does
    held: ModelState | None = None
    for i, g in enumerate(versions(8)):
        track.advance(f"v{i}", g)
        sent = track.download(f"v{i - 1}" if held is not None else "")
        if held is None:
            assert sent.base == "" and sent.parts.equal(g)  # the first reference is G itself
            held = sent.parts.clone()
        else:
            assert sent.base == f"v{i - 1}" and sent.nbytes < 0.55 * g.nbytes
            held = apply_change(site_codec, sent.parts.clone(), held)
            assert held.digest() == sent.digest
        assert held.equal(track.reference)


@pytest.mark.parametrize(
    ("name", "options", "bound"),
    [
        ("int8", {"block": 256}, 0.02 * 0.01 * 8),
        ("fp16", {}, 1e-4),
        ("topk", {"fraction": 0.1}, None),
    ],
)
def test_the_reference_trails_the_global_model_by_one_encoding_and_never_drifts(
    name: str, options: dict, bound: float | None
) -> None:
    track = ReferenceTrack(DownloadSettings(codec=name, delta=True, **options).build())
    history = versions(40)
    errors = []
    for i, g in enumerate(history):
        track.advance(f"v{i}", g)
        errors.append(worst(track.sites_model(), g))
    if bound is not None:  # one encoding of one step: no growth over 40 versions
        assert max(errors) <= bound
    assert max(errors[20:]) <= 2 * max(errors[1:20])
    # When the global model stops moving, what was held back arrives: the sites catch up.
    for j in range(60):
        track.advance(f"still{j}", history[-1])
    assert worst(track.sites_model(), history[-1]) <= 1e-6


def test_a_site_holding_another_version_gets_the_whole_reference() -> None:
    track = ReferenceTrack(build_codec("fp16"))
    for i, g in enumerate(versions(3)):
        track.advance(f"v{i}", g)
    assert track.download("v1").base == "v1"
    for held in ("", "v0", "made-up"):
        whole = track.download(held)
        assert whole.base == "" and whole.reference and whole.parts.equal(track.reference)


def test_parts_that_do_not_fit_the_model_are_refused() -> None:
    codec = build_codec("fp16")
    g = model(2)
    parts = dict(encode(codec, g))
    with pytest.raises(UpdateRejected, match="travels as"):
        decode(codec, ModelState({**parts, "b": torch.zeros(4)}), g.specs)
    with pytest.raises(UpdateRejected, match="both whole and as parts"):
        decode(codec, ModelState({**parts, "w": g["w"]}), g.specs)
    del parts["w::fp16"]
    with pytest.raises(UpdateRejected, match="lacks 'w::fp16'"):
        decode(codec, ModelState(parts), g.specs)


def test_site_models_are_what_a_deployment_serves_and_count_its_bytes() -> None:
    history = versions(3)
    sites = SiteModels(DownloadSettings(codec="int8", delta=True))
    track = ReferenceTrack(DownloadSettings(codec="int8", delta=True).build())
    full = history[0].nbytes
    for i, g in enumerate(history):
        track.advance(f"v{i}", g)
        assert sites.model(f"v{i}", g).equal(track.reference)
        sent = sites.send(["a", "b"] if i < 2 else ["b", "c"])
        change = track.change.nbytes if track.change else 0
        assert sent == [2 * full, 2 * change, change + full][i]
    plain = SiteModels(DownloadSettings())
    assert plain.model("v0", history[0]) is history[0] and plain.send(["a"]) == full
    halves = SiteModels(DownloadSettings(codec="bf16"))
    assert worst(halves.model("v0", history[0]), history[0]) > 0
    assert halves.send(["a", "b"]) < 1.02 * full


def test_download_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"needs download\.delta = true"):
        DownloadSettings(codec="int8")
    with pytest.raises(ConfigError, match="needs a codec"):
        DownloadSettings(delta=True)
    with pytest.raises(ConfigError, match=r"download\.fraction"):
        DownloadSettings(codec="topk", delta=True, fraction=2.0)
