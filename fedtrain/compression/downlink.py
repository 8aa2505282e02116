"""Download codecs: the global model reaches the sites in fewer bytes (`[download]`).

Two ways, both made once per model version on the server and the same bytes sent to
every site that takes them:

- **cast** (`codec = "fp16"|"bf16"`): floating tensors travel in the narrower dtype,
  half the bytes of float32. The site trains from the cast model; its update (the
  delta from what it trained from) is added to the server's exact model, so the
  rounding (relative 2^-11 for fp16, 2^-8 for bf16) perturbs where a round's
  gradients are taken, never the global model, and never accumulates.
- **delta** (`delta = true`, any codec, `int8` and `topk` included): the change
  since the version the site holds. The server keeps the *reference*: the model
  every site following the deltas holds, bit for bit,

      R_0 = G_0,   R_v = R_{v-1} + decode(encode(G_v - R_{v-1}))

  where G_v is the server's global model. The change is taken from the reference,
  not from G_{v-1}, so what a codec drops (top-k's small entries, int8's rounding)
  is part of the next change: R trails G by one encoding's error and never drifts
  (error feedback on the downlink). Sites train from R_v, the server aggregates
  into G_v as always. The decoded sum is computed the same way at both ends (the
  same codec code on the CPU, one IEEE addition per element), and the manifest
  carries R_v's digest, which the site checks: a site whose sum differs (or that
  was told a base it does not hold) asks for the model whole. A site that does not
  hold R_{v-1} (new, reconnected after a server restart, left out of the last
  version) gets R_v whole, exact, in its own dtypes.

Either way a tensor whose encoding would not be finite (a float32 value beyond
fp16's 65504) travels as itself. Non-floating tensors (integer buffers) always
travel as themselves, whole.

Why not send G_v - G_{v-1} in fp16 and add it? `a + (b - a)` is not `b` in floating
point, and top-k of that change would lose what it dropped for good; the sites'
models would drift apart from each other and from what the server assumes. The
reference keeps them identical and the error bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fedtrain.compression import SEP, Codec
from fedtrain.compression.settings import DownloadSettings
from fedtrain.errors import UpdateRejected
from fedtrain.tensors import ModelState, TensorSpec, torch_dtype

#: A site's Join capability for each download codec it decodes, and for deltas.
CAPABILITY_PREFIX = "download/"
DELTA = "delta"
#: What a site may accept (site.toml `download_codecs`): the codecs, and deltas.
DOWNLOAD_CODECS = ("fp16", "bf16", "int8", "topk", DELTA)


def capability(name: str) -> str:
    """The Join capability that says a site decodes downloads with `name` (or deltas)."""
    return f"{CAPABILITY_PREFIX}{name}"


def required_capabilities(codec: str, delta: bool) -> frozenset[str]:
    """What a site must announce to be served `codec` (and deltas); empty for none."""
    if codec == "none":
        return frozenset()
    return frozenset({capability(codec), *((capability(DELTA),) if delta else ())})


@dataclass(frozen=True)
class Download:
    """One model version as it travels to a site."""

    version: str
    #: What travels: the model's tensors (codec "none") or a codec's parts.
    parts: ModelState
    codec: str = "none"
    #: The reference version the parts change ("": the parts are the whole model).
    base: str = ""
    #: The site ends with the server's reference for `version`: it may ask for the
    #: change from it next time.
    reference: bool = False
    #: `ModelState.digest()` of what the site ends with, when it adds a change.
    digest: str = ""

    @property
    def nbytes(self) -> int:
        return self.parts.nbytes


def encode(codec: Codec, state: ModelState) -> ModelState:
    """`state` encoded tensor by tensor; a tensor whose encoding decodes to non-finite
    values (fp16 overflow) travels as itself."""
    return _encode_decoded(codec, state)[0]


def _encode_decoded(codec: Codec, state: ModelState) -> tuple[ModelState, dict[str, torch.Tensor]]:
    """(`encode(codec, state)`, what a receiver decodes from it, tensor by tensor: the
    same `decode_tensor` calls a receiver's `decode` makes, so the same bits)."""
    parts: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        one = ModelState({name: tensor})
        encoded = codec.encode(one)
        value = codec.decode(encoded, one.specs)[name] if name not in encoded else tensor
        if tensor.is_floating_point() and not bool(torch.isfinite(value).all()):
            encoded, value = one, tensor
        parts.update(encoded)
        decoded[name] = value
    return ModelState(parts), decoded


def decode(codec: Codec, parts: ModelState, specs: tuple[TensorSpec, ...]) -> ModelState:
    """The dense tensors `parts` encode, shaped and typed like `specs`; refuses parts
    that do not fit (raises `UpdateRejected`, which names the tensor)."""
    split = {n.split(SEP)[0] for n in parts if SEP in n}
    for spec in specs:
        if spec.name in parts:
            t = parts[spec.name]
            if t.dtype != torch_dtype(spec.dtype) or tuple(t.shape) != spec.shape:
                raise UpdateRejected(
                    f"{spec.name!r} travels as {t.dtype} {tuple(t.shape)}, expected "
                    f"{spec.dtype} {spec.shape}"
                )
            if spec.name in split:
                raise UpdateRejected(f"{spec.name!r} travels both whole and as parts")
    return codec.decode(parts, specs)


def apply_change(codec: Codec, parts: ModelState, base: ModelState) -> ModelState:
    """`base` plus the change `parts` encode, added into `base`'s memory (a site's copy
    of the reference, which nothing else reads): floating tensors add, others are
    replaced. The server's `ReferenceTrack` computes the same sums."""
    change = decode(codec, parts, base.specs)
    return ModelState(
        {
            n: old.add_(change[n]) if old.is_floating_point() else change[n]
            for n, old in base.items()
        }
    )


def cast(codec: Codec, version: str, state: ModelState) -> Download:
    """The cast download of `state` (the same for every site)."""
    return Download(version, encode(codec, state), codec.name)


class ReferenceTrack:
    """The model sites following delta downloads hold, advanced once per version.

    Not thread-safe: the server advances it from one place at a time. Memory: the
    reference (one model) and the latest change (a codec's parts).
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.version = ""
        self.reference: ModelState | None = None
        self.change: Download | None = None

    def advance(self, version: str, state: ModelState) -> None:
        """Make `version` (the global model `state`) the track's current version."""
        if version == self.version:
            return
        if self.reference is None:
            self.reference = state.clone()  # R_0 = G_0, exactly
            self.change = None
        else:
            diff = ModelState(
                {
                    n: (t - self.reference[n]) if t.is_floating_point() else t
                    for n, t in state.items()
                }
            )
            parts, change = _encode_decoded(self.codec, diff)
            self.reference = ModelState(
                {
                    n: (old + change[n]) if old.is_floating_point() else change[n]
                    for n, old in self.reference.items()
                }
            )
            self.change = Download(
                version,
                parts,
                self.codec.name,
                base=self.version,
                reference=True,
                digest=self.reference.digest(),
            )
        self.version = version

    def whole(self) -> Download:
        """The current reference, whole and exact."""
        assert self.reference is not None, "advance() first"
        return Download(self.version, self.reference, reference=True)

    def download(self, held: str) -> Download:
        """What a site holding the reference of version `held` ("": none) is sent."""
        if self.change is not None and held and held == self.change.base:
            return self.change
        return self.whole()

    def sites_model(self) -> ModelState:
        """What every site trains from at the current version (the simulation's broadcast)."""
        assert self.reference is not None, "advance() first"
        return self.reference


class SiteModels:
    """What the sites train from, version by version, and the bytes sending it takes.

    The simulation's model of a deployment's downloads, every client accepting the
    codec: clients train from the cast model, or from the reference; a client that
    received the previous version's reference is sent the change, any other the whole
    reference (as a deployed site that missed a version is)."""

    def __init__(self, settings: DownloadSettings) -> None:
        self.codec = settings.build() if settings.enabled else None
        self.track = ReferenceTrack(self.codec) if settings.delta and self.codec else None
        self.version = ""
        self._sent: Download | None = None  # the cast or plain download of the version
        self._holding: set[str] = set()  # clients sent the current version
        self._held: set[str] = set()  # clients sent the previous version

    def model(self, version: str, state: ModelState) -> ModelState:
        """The model every site trains from at `version` (the global model `state`)."""
        if version != self.version:
            self.version = version
            self._held, self._holding = self._holding, set()
            self._sent = None
        if self.codec is None:
            self._sent = Download(version, state)
            return state
        if self.track is None:
            if self._sent is None:
                self._sent = cast(self.codec, version, state)
            return decode(self.codec, self._sent.parts, state.specs)
        self.track.advance(version, state)
        return self.track.sites_model()

    def send(self, clients: Iterable[str]) -> int:
        """Bytes of sending the current version to `clients` (who then hold it)."""
        total = 0
        for client in clients:
            if client in self._holding:
                continue
            if self.track is not None:
                change = self.track.change
                held = change is not None and client in self._held
                total += change.nbytes if held and change is not None else self.track.whole().nbytes
            else:
                assert self._sent is not None, "model() first"
                total += self._sent.nbytes
            self._holding.add(client)
        return total
