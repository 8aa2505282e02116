"""The model state that travels: named tensors <-> flat chunks, bit-exact.

A `ModelState` is an ordered set of named CPU tensors (a module's parameters and
buffers). It splits into `Chunk`s of at most `chunk_bytes` raw little-endian bytes,
each with a small header (name, dtype, shape, byte offset), and a `StateAssembler`
puts chunks back together, validating everything a peer could get wrong.

Chunks are zero-copy views of the tensors' storage: splitting a 10 GB model costs
no extra memory. Bytes are raw tensor memory, never pickle, so every dtype that
models use (including bfloat16, which numpy lacks) round-trips bit-exactly.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import torch

from fedtrain.errors import TensorStreamError

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

# Wire names of the dtypes that travel. The names are part of the protocol.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("fedtrain's wire format is little-endian raw tensor memory")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; a clear error for dtypes that cannot travel."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TensorStreamError(
            f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise TensorStreamError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor is, without its data: enough to validate and preallocate."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Chunk:
    """A contiguous byte range of one tensor, with the header that places it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset inside the tensor
    data: bytes | memoryview

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, sharing its memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class ModelState(Mapping[str, torch.Tensor]):
    """An ordered set of named, contiguous CPU tensors: what a model is on the wire.

    It is a read-only mapping; tensors are held as given (no copies) once they are
    contiguous and on the CPU.
    """

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TensorStreamError(f"{name!r} is a {type(t).__name__}, not a tensor")
            dtype_name(t.dtype)  # fail early on dtypes that cannot travel
            out[name] = t.detach().to("cpu").contiguous()
        self._tensors = out

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_module(
        cls, module: torch.nn.Module, names: Collection[str] | None = None
    ) -> ModelState:
        """Parameters and buffers of a module, in state_dict order (copied to CPU).

        `names`: only these state-dict entries (a task's federated tensors, when a
        frozen base stays at the site); None: all of them. Tensors are cloned so later
        training of the module cannot change this state.
        """
        own = select(module.state_dict(), names)
        return cls({k: v.detach().to("cpu", copy=True) for k, v in own.items()})

    def load_into(self, module: torch.nn.Module, names: Collection[str] | None = None) -> None:
        """Copy this state into a module (on whatever device it lives), strictly.

        `names`: the state must hold exactly these entries of the module (its
        federated tensors; the rest of the module is left as it is); None: all of them.
        """
        own = select(module.state_dict(), names)
        if set(own) != set(self._tensors):
            missing = sorted(set(own) - set(self._tensors))
            extra = sorted(set(self._tensors) - set(own))
            raise TensorStreamError(
                f"state does not match the model: missing {missing}, unexpected {extra}"
            )
        with torch.no_grad():
            for name, target in own.items():
                src = self._tensors[name]
                if src.shape != target.shape or src.dtype != target.dtype:
                    raise TensorStreamError(
                        f"{name!r}: state has {src.dtype} {tuple(src.shape)}, "
                        f"model has {target.dtype} {tuple(target.shape)}"
                    )
                target.copy_(src)

    # -- mapping --------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"ModelState({len(self)} tensors, {self.nbytes} bytes)"

    # -- description ----------------------------------------------------------------
    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self._tensors.items()
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def digest(self) -> str:
        """SHA-256 over names, dtypes, shapes and bytes: the identity of a model version."""
        h = hashlib.sha256()
        for spec, t in zip(self.specs, self._tensors.values(), strict=True):
            h.update(f"{spec.name}|{spec.dtype}|{spec.shape}\n".encode())
            h.update(_byte_view(t))
        return h.hexdigest()

    def clone(self) -> ModelState:
        return ModelState({k: v.clone() for k, v in self._tensors.items()})

    def equal(self, other: ModelState) -> bool:
        """Bit-exact equality (NaN payloads included), names and order too."""
        if self.specs != other.specs:
            return False
        return all(
            bytes(_byte_view(a)) == bytes(_byte_view(b))
            for a, b in zip(self._tensors.values(), other._tensors.values(), strict=True)
        )

    # -- chunking -------------------------------------------------------------------
    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
        """Split into chunks of at most `chunk_bytes`, never splitting an element.

        Every tensor yields at least one chunk (an empty tensor yields one empty chunk)
        so the receiver learns about every name.
        """
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        for spec, t in zip(self.specs, self._tensors.values(), strict=True):
            raw = _byte_view(t)
            step = max(spec.itemsize, chunk_bytes - chunk_bytes % spec.itemsize)
            if len(raw) == 0:
                yield Chunk(spec.name, spec.dtype, spec.shape, 0, raw)
                continue
            for off in range(0, len(raw), step):
                yield Chunk(spec.name, spec.dtype, spec.shape, off, raw[off : off + step])


def select(
    tensors: Mapping[str, torch.Tensor], names: Collection[str] | None
) -> dict[str, torch.Tensor]:
    """The entries of `tensors` named in `names` (all when None), in `tensors`' order;
    a name `tensors` lacks is an error, not a silent omission."""
    if names is None:
        return dict(tensors)
    wanted = set(names)
    if unknown := sorted(wanted - set(tensors)):
        raise TensorStreamError(f"no tensors named {unknown[:5]} in the model")
    return {k: v for k, v in tensors.items() if k in wanted}


def chunk_values(chunk: Chunk) -> torch.Tensor:
    """The elements a chunk carries, as a flat tensor (zero-copy over the chunk's bytes).

    The element index of the first value is `chunk.offset // itemsize`. The result
    shares the chunk's (possibly read-only) memory: read it, never write to it.
    """
    dtype = torch_dtype(chunk.dtype)
    if len(chunk.data) % dtype.itemsize:
        raise TensorStreamError(
            f"chunk of {chunk.name!r} has {len(chunk.data)} bytes, "
            f"not a multiple of {chunk.dtype}'s {dtype.itemsize}"
        )
    if len(chunk.data) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # gRPC hands us read-only bytes; callers only read the result, never write it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(chunk.data, dtype=dtype)


class ChunkValidator:
    """Vets chunks against expected specs and tracks the byte ranges received.

    It keeps no tensor data, only ranges, so the same checks serve `StateAssembler`
    (which fills preallocated tensors) and a receiver that spools an untrusted stream
    to disk before any of it may touch an aggregate. Every mistake a peer can make
    raises `TensorStreamError` naming the tensor: an unknown or wrong-typed tensor, a
    misaligned, overlapping (duplicate) or out-of-range (oversized) byte range, and,
    at `check_complete()`, anything missing or truncated.
    """

    def __init__(self, specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise TensorStreamError("expected specs name a tensor twice")
        self.specs = {s.name: s for s in specs}
        self._ranges: dict[str, list[tuple[int, int]]] = {n: [] for n in self.specs}
        self.bytes_received = 0

    @property
    def expected_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def check(self, chunk: Chunk) -> TensorSpec:
        """Validate one chunk and record its byte range; returns its tensor's spec."""
        spec = self.specs.get(chunk.name)
        if spec is None:
            raise TensorStreamError(f"unexpected tensor {chunk.name!r}: not in the model")
        if chunk.dtype != spec.dtype or tuple(chunk.shape) != spec.shape:
            raise TensorStreamError(
                f"{chunk.name!r}: got {chunk.dtype} {tuple(chunk.shape)}, "
                f"expected {spec.dtype} {spec.shape}"
            )
        start, size = chunk.offset, len(chunk.data)
        if start < 0 or start % spec.itemsize or size % spec.itemsize:
            raise TensorStreamError(
                f"{chunk.name!r}: byte range [{start}, {start + size}) is not aligned "
                f"to {spec.dtype} elements ({spec.itemsize} bytes)"
            )
        end = start + size
        if end > spec.nbytes:
            raise TensorStreamError(
                f"{chunk.name!r}: byte range [{start}, {end}) runs past the tensor's "
                f"{spec.nbytes} bytes (oversized stream)"
            )
        ranges = self._ranges[chunk.name]
        if size == 0:
            if spec.nbytes != 0 or ranges:
                raise TensorStreamError(f"{chunk.name!r}: empty chunk for a non-empty tensor")
            ranges.append((0, 0))
            return spec
        for a, b in ranges:
            if start < b and a < end:
                raise TensorStreamError(
                    f"{chunk.name!r}: byte range [{start}, {end}) overlaps [{a}, {b}) "
                    "already received (duplicate chunk)"
                )
        ranges.append((start, end))
        self.bytes_received += size
        return spec

    def missing(self) -> dict[str, int]:
        """Bytes still missing per tensor (empty when complete)."""
        out = {}
        for name, spec in self.specs.items():
            ranges = self._ranges[name]
            got = sum(b - a for a, b in ranges)
            if got < spec.nbytes or (spec.nbytes == 0 and not ranges):
                out[name] = spec.nbytes - got
        return out

    def check_complete(self) -> None:
        """Raise if any tensor is missing or truncated."""
        missing = self.missing()
        if missing:
            detail = ", ".join(f"{n!r} ({b} bytes)" for n, b in list(missing.items())[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise TensorStreamError(
                f"stream ended early: missing {detail}{more} "
                f"({self.bytes_received} of {self.expected_bytes} bytes received)"
            )


class StateAssembler:
    """Reassembles chunks into a `ModelState`, validating against expected specs.

    Validation is `ChunkValidator`'s (see there for what is refused). Memory is
    preallocated once, so a hostile stream cannot make it grow.
    """

    def __init__(
        self, specs: tuple[TensorSpec, ...] | list[TensorSpec], reuse: ModelState | None = None
    ) -> None:
        """`reuse`: a state of the same specs whose (CPU) memory may be overwritten; a
        fresh 400 MB buffer costs ~0.1 s of page faults before the first byte lands."""
        self._validator = ChunkValidator(specs)
        self._specs = self._validator.specs
        if reuse is not None and reuse.specs == tuple(self._specs.values()):
            self._buffers = {n: t for n, t in reuse.items() if t.device.type == "cpu"}
        else:
            self._buffers = {}
        for s in self._specs.values():
            if s.name not in self._buffers:
                self._buffers[s.name] = torch.empty(s.shape, dtype=torch_dtype(s.dtype))
        self._raw = {n: _byte_view(t) for n, t in self._buffers.items()}

    @property
    def expected_bytes(self) -> int:
        return self._validator.expected_bytes

    @property
    def bytes_received(self) -> int:
        return self._validator.bytes_received

    def add(self, chunk: Chunk) -> None:
        self._validator.check(chunk)
        if len(chunk.data):
            self._raw[chunk.name][chunk.offset : chunk.offset + len(chunk.data)] = chunk.data

    def missing(self) -> dict[str, int]:
        """Bytes still missing per tensor (empty when complete)."""
        return self._validator.missing()

    def finish(self) -> ModelState:
        self._validator.check_complete()
        return ModelState({n: self._buffers[n] for n in self._specs})


def assemble(chunks: Iterator[Chunk] | list[Chunk], specs: tuple[TensorSpec, ...]) -> ModelState:
    """Reassemble a whole stream of chunks (see `StateAssembler`)."""
    asm = StateAssembler(specs)
    for c in chunks:
        asm.add(c)
    return asm.finish()
