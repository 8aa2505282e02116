"""Update codecs: shrink what a site uploads, decoded by the server before folding.

A codec turns a delta (a `ModelState`) into another `ModelState` that travels through
the same chunked stream (so it composes with everything the transport already
checks), and back. Encoded tensors are named `<tensor>::<part>`; a tensor a codec
leaves alone travels as itself.

- `fp16` / `bf16`: cast floating tensors (2x smaller than float32, lossy in mantissa).
- `int8`: per-block linear quantization (min/scale per block of `block` elements):
  ~4x smaller, error at most half a step per element.
- `topk`: keep the `fraction` largest-magnitude entries of each tensor (values +
  int32 indices); with error feedback the site keeps what it did not send and adds it
  to its next update, so nothing is lost, only delayed (Stich et al. 2018).

None of them composes with secure aggregation: masked vectors are uniform in
Z_{2^32} and cannot be compressed, and sums of per-site scales or indices mean
nothing. Secure aggregation quantizes on its own (`secagg` bits); `check_secagg`
refuses the combination at configuration time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedtrain.errors import ConfigError, UpdateRejected
from fedtrain.tensors import ModelState, TensorSpec, dtype_name, torch_dtype

SEP = "::"


class Codec:
    """Encode at the site, decode at the server. Stateless unless it says otherwise."""

    name = "none"

    def encode(self, delta: ModelState) -> ModelState:
        return delta

    def encoded_specs(self, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        """What `encode` makes of an update shaped like `specs`: the tensors a server
        accepts on the wire before it decodes them (a pure function of the specs)."""
        return specs

    def site_state(self) -> dict[str, torch.Tensor]:
        """What the codec keeps at the site between rounds (top-k's residual); {} if nothing."""
        return {}

    def load_site_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from an earlier `site_state()` (a simulation swaps clients in and out)."""
        if state:
            raise ValueError(f"codec {self.name!r} keeps no state, got {sorted(state)}")

    def decode(self, encoded: ModelState, specs: tuple[TensorSpec, ...]) -> ModelState:
        """Dense tensors shaped and typed like `specs`; refuses anything else."""
        out = {}
        for spec in specs:
            if spec.name in encoded:
                out[spec.name] = encoded[spec.name]
            else:
                out[spec.name] = self.decode_tensor(encoded, spec)
        extra = {n.split(SEP)[0] for n in encoded} - {s.name for s in specs}
        if extra:
            raise UpdateRejected(f"encoded update names unknown tensors {sorted(extra)}")
        return ModelState(out)

    def decode_tensor(self, encoded: ModelState, spec: TensorSpec) -> torch.Tensor:
        raise UpdateRejected(
            f"update is missing tensor {spec.name!r} (codec {self.name!r} sent no parts for it)"
        )


def _part(encoded: ModelState, spec: TensorSpec, part: str) -> torch.Tensor:
    key = f"{spec.name}{SEP}{part}"
    if key not in encoded:
        raise UpdateRejected(f"encoded update lacks {key!r}; was it sent with another codec?")
    return encoded[key]


class PartsCodec(Codec):
    """Encodes each non-empty floating tensor into named parts; others travel as they are."""

    def encode(self, delta: ModelState) -> ModelState:
        out: dict[str, torch.Tensor] = {}
        for n, t in delta.items():
            if not t.is_floating_point() or t.numel() == 0:
                out[n] = t
                continue
            for part, value in self.encode_tensor(n, t).items():
                out[f"{n}{SEP}{part}"] = value
        return ModelState(out)

    def encode_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def encoded_specs(self, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        out: list[TensorSpec] = []
        for spec in specs:
            if not torch_dtype(spec.dtype).is_floating_point or spec.numel == 0:
                out.append(spec)
                continue
            for part, (dtype, shape) in self.part_specs(spec).items():
                out.append(TensorSpec(f"{spec.name}{SEP}{part}", dtype_name(dtype), shape))
        return tuple(out)

    def part_specs(self, spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """part -> (dtype, shape) of what `encode_tensor` returns for a tensor of `spec`."""
        raise NotImplementedError


class CastCodec(PartsCodec):
    """Floating tensors travel in a narrower float dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def encode_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: tensor.to(self.dtype)}

    def part_specs(self, spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {self.name: (self.dtype, spec.shape)}

    def decode_tensor(self, encoded: ModelState, spec: TensorSpec) -> torch.Tensor:
        t = _part(encoded, spec, self.name)
        if tuple(t.shape) != spec.shape or t.dtype != self.dtype:
            raise UpdateRejected(f"{spec.name!r}: {self.name} part has {t.dtype} {tuple(t.shape)}")
        return t.to(torch_dtype(spec.dtype))


class Int8Codec(PartsCodec):
    """Per-block min/scale linear quantization into uint8."""

    name = "int8"

    def __init__(self, block: int = 4096) -> None:
        if block < 1:
            raise ConfigError(f"compression.block must be >= 1, got {block}")
        self.block = block

    def encode_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = tensor.reshape(-1).to(torch.float32)
        pad = (-flat.numel()) % self.block
        blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, self.block)
        lo = blocks.min(dim=1).values
        hi = blocks.max(dim=1).values
        scale = ((hi - lo) / 255.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((blocks - lo[:, None]) / scale[:, None]).round().clamp(0, 255).to(torch.uint8)
        return {"q": q.reshape(-1)[: flat.numel()].contiguous(), "lo": lo, "scale": scale}

    def part_specs(self, spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        blocks = -(-spec.numel // self.block)
        return {
            "q": (torch.uint8, (spec.numel,)),
            "lo": (torch.float32, (blocks,)),
            "scale": (torch.float32, (blocks,)),
        }

    def decode_tensor(self, encoded: ModelState, spec: TensorSpec) -> torch.Tensor:
        q, lo, scale = (_part(encoded, spec, p) for p in ("q", "lo", "scale"))
        blocks = -(-spec.numel // self.block)
        if q.numel() != spec.numel or lo.numel() != blocks or scale.numel() != blocks:
            raise UpdateRejected(
                f"{spec.name!r}: int8 parts hold {q.numel()} values / {lo.numel()} blocks, "
                f"expected {spec.numel} / {blocks}"
            )
        index = torch.arange(spec.numel) // self.block
        values = q.to(torch.float32) * scale[index] + lo[index]
        return values.reshape(spec.shape).to(torch_dtype(spec.dtype))


class TopKCodec(PartsCodec):
    """The `fraction` largest-magnitude entries per tensor, with site-side error feedback."""

    name = "topk"

    def __init__(self, fraction: float = 0.01, error_feedback: bool = True) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"compression.fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.error_feedback = error_feedback
        self.residual: dict[str, torch.Tensor] = {}  # kept at the site, never sent

    def site_state(self) -> dict[str, torch.Tensor]:
        return dict(self.residual)

    def load_site_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.residual = dict(state)

    def encode_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = tensor.reshape(-1).to(torch.float32)
        if self.error_feedback and name in self.residual:
            flat = flat + self.residual[name]
        k = self.kept(flat.numel())
        idx = flat.abs().topk(k, sorted=False).indices.sort().values
        values = flat[idx]
        if self.error_feedback:
            rest = flat.clone()
            rest[idx] = 0.0
            self.residual[name] = rest
        return {"idx": idx.to(torch.int32), "val": values.to(tensor.dtype)}

    def kept(self, numel: int) -> int:
        """Entries sent of a tensor of `numel` (at least one)."""
        return max(1, int(self.fraction * numel))

    def part_specs(self, spec: TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        k = self.kept(spec.numel)
        return {"idx": (torch.int32, (k,)), "val": (torch_dtype(spec.dtype), (k,))}

    def decode_tensor(self, encoded: ModelState, spec: TensorSpec) -> torch.Tensor:
        idx, val = _part(encoded, spec, "idx"), _part(encoded, spec, "val")
        if idx.dtype != torch.int32 or idx.numel() != val.numel() or idx.dim() != 1:
            raise UpdateRejected(f"{spec.name!r}: top-k indices and values do not pair up")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
            raise UpdateRejected(f"{spec.name!r}: top-k index outside 0..{spec.numel - 1}")
        dense = torch.zeros(spec.numel, dtype=torch_dtype(spec.dtype))
        dense[idx.long()] = val.to(dense.dtype)
        return dense.reshape(spec.shape)


def build_codec(name: str, **options: float | int | bool) -> Codec:
    """The codec a config names (`compression.codec`), with its options."""
    factories = {
        "none": Codec,
        "fp16": lambda: CastCodec(torch.float16),
        "bf16": lambda: CastCodec(torch.bfloat16),
        "int8": lambda **o: Int8Codec(**o),
        "topk": lambda **o: TopKCodec(**o),
    }
    if name not in factories:
        raise ConfigError(
            f"compression.codec = {name!r} is unknown; choose one of {list(factories)}"
        )
    try:
        return factories[name](**options)
    except TypeError as exc:
        raise ConfigError(f"compression.codec = {name!r}: bad option ({exc})") from None


def check_secagg(codec: Codec, secagg: bool) -> None:
    """Refuse a codec together with secure aggregation, saying why."""
    if secagg and codec.name != "none":
        raise ConfigError(
            f"compression.codec = {codec.name!r} cannot be combined with secure aggregation: "
            "masked updates are uniformly random and cannot be compressed, and per-site "
            "scales or indices do not add up. Secure aggregation quantizes on its own; "
            'lower `secagg.bits` to shrink uploads, or set compression.codec = "none"'
        )
