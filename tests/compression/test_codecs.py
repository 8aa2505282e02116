"""Update codecs: bounded error, fewer bytes, error feedback loses nothing, bad input refused."""

from __future__ import annotations

import pytest
import torch

from fedtrain.compression import SEP, build_codec, check_secagg
from fedtrain.compression.fold import DecodingFold
from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.strategy import WeightedSum
from fedtrain.tensors import Chunk, ModelState, assemble, torch_dtype


def delta(seed: int = 0, n: int = 10_000) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState(
        {
            "w": torch.randn(n, generator=g) * 0.01,
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "steps": torch.tensor(3),
        }
    )


def over_the_wire(state: ModelState) -> ModelState:
    chunks = [Chunk(c.name, c.dtype, c.shape, c.offset, bytes(c.data)) for c in state.chunks(999)]
    return assemble(chunks, state.specs)


@pytest.mark.parametrize(
    ("name", "ratio", "tol"), [("fp16", 0.55, 2**-11), ("bf16", 0.55, 2**-8), ("int8", 0.3, None)]
)
def test_dense_codecs_shrink_and_bound_the_error(name, ratio, tol):
    d = delta()
    codec = build_codec(name)
    encoded = codec.encode(d)
    assert encoded.nbytes < ratio * d.nbytes
    decoded = codec.decode(over_the_wire(encoded), d.specs)
    assert decoded.specs == d.specs
    assert torch.equal(decoded["steps"], d["steps"])
    err = (decoded["w"] - d["w"]).abs().max().item()
    if tol is None:  # int8: at most half a quantization step per block
        step = (d["w"].max() - d["w"].min()).item() / 255
        assert err <= step / 2 + 1e-7
    else:  # half an ulp of the cast dtype, relative to the largest value
        assert err <= tol * d["w"].abs().max().item()


def test_topk_sends_the_largest_entries_and_error_feedback_loses_nothing():
    codec = build_codec("topk", fraction=0.1)
    total_sent = torch.zeros(10_000)
    total_true = torch.zeros(10_000)
    for r in range(30):
        d = delta(seed=r)
        encoded = codec.encode(d)
        assert encoded[f"w{SEP}idx"].numel() == 1000
        assert encoded.nbytes < 0.25 * d.nbytes
        total_sent += codec.decode(over_the_wire(encoded), d.specs)["w"]
        total_true += d["w"]
    # sent + still-held residual == everything the site produced
    torch.testing.assert_close(total_sent + codec.residual["w"], total_true, rtol=0, atol=1e-5)
    assert codec.residual["w"].norm() < 0.5 * total_true.norm()


def test_topk_without_feedback_keeps_exactly_the_top_entries():
    d = ModelState({"w": torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0])})
    codec = build_codec("topk", fraction=0.4, error_feedback=False)
    out = codec.decode(codec.encode(d), d.specs)["w"]
    assert out.tolist() == [0.0, -5.0, 0.0, 3.0, 0.0]
    assert codec.residual == {}


def test_malformed_encoded_updates_are_refused():
    d = delta()
    codec = build_codec("topk", fraction=0.1)
    enc = dict(codec.encode(d).items())
    bad_index = {**enc, f"w{SEP}idx": enc[f"w{SEP}idx"].clone().fill_(10_000)}
    with pytest.raises(UpdateRejected, match="outside"):
        codec.decode(ModelState(bad_index), d.specs)
    missing = {k: v for k, v in enc.items() if not k.startswith("w")}
    with pytest.raises(UpdateRejected, match="lacks 'w::idx'"):
        codec.decode(ModelState(missing), d.specs)
    with pytest.raises(UpdateRejected, match="unknown tensors"):
        codec.decode(ModelState({**enc, "z::idx": torch.zeros(1, dtype=torch.int32)}), d.specs)
    int8 = build_codec("int8")
    short = dict(int8.encode(d).items())
    short[f"w{SEP}q"] = short[f"w{SEP}q"][:-1].clone()
    with pytest.raises(UpdateRejected, match="int8 parts"):
        int8.decode(ModelState(short), d.specs)


def test_config_errors_and_secagg_refusal():
    with pytest.raises(ConfigError, match="unknown"):
        build_codec("zip")
    with pytest.raises(ConfigError, match="fraction"):
        build_codec("topk", fraction=0.0)
    with pytest.raises(ConfigError, match="bad option"):
        build_codec("fp16", fraction=0.5)
    with pytest.raises(ConfigError, match="cannot be combined with secure aggregation"):
        check_secagg(build_codec("int8"), secagg=True)
    check_secagg(build_codec("none"), secagg=True)
    check_secagg(build_codec("topk"), secagg=False)


CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {"block": 999}), ("topk", {})]


@pytest.mark.parametrize(("name", "options"), CODECS)
def test_encoded_specs_are_what_encode_makes(name, options):
    """The server checks uploads against `encoded_specs` before it ever sees one."""
    d = ModelState({**dict(delta().items()), "empty": torch.zeros(0), "h": torch.randn(3, 4)})
    codec = build_codec(name, **options)
    assert codec.encoded_specs(d.specs) == codec.encode(d).specs


@pytest.mark.parametrize(("name", "options"), CODECS)
def test_decoding_fold_adds_the_decoded_update_whatever_the_chunk_order(name, options):
    d = delta(seed=4)
    codec = build_codec(name, **options)
    encoded = build_codec(name, **options).encode(d)  # a twin: top-k's residual is separate
    target = WeightedSum(d.specs)
    fold = DecodingFold(codec, d.specs, target)
    chunks = list(encoded.chunks(777))
    for c in reversed(chunks):  # parts and pieces may come in any order
        values = torch.frombuffer(bytearray(c.data), dtype=torch_dtype(c.dtype))
        fold.add_chunk(c.name, c.offset // values.element_size(), values, 3.0)
    fold.commit(3.0)
    assert (target.count, target.total_weight, fold.count) == (1, 3.0, 1)
    want = codec.decode(encoded, d.specs)
    for n, total in target.sums.items():
        torch.testing.assert_close(total, 3.0 * want[n].reshape(-1).to(total.dtype))
