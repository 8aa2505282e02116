"""The messages of the protocol: small frozen dataclasses with an explicit binary format.

Format of every message: ``b"SA"`` + version byte + type byte, then fields in a fixed
order: unsigned little-endian ints (u8/u16/u32/u64), f64, byte strings prefixed by
their u32 length, and lists prefixed by their u32 count. No pickle, no schema
library; a decoder rejects unknown types, short or trailing bytes with SecAggError.

Stage by stage (server -> site, then site -> server):

0. ``SetupRequest(params)``            -> ``AdvertiseKeys`` (signed when sites have identities)
1. ``KeysBroadcast`` (neighbour keys)  -> ``ShareKeys`` (encrypted shares per neighbour)
2. ``RoutedShares`` (shares for me)    -> ``MaskedInput`` (the masked uint32 vector)
3. ``ConsistencyRequest`` (U3)         -> ``ConsistencySignature`` (only with the
   consistency check, ``RoundParams.consistency_check``)
4. ``UnmaskRequest`` (who survived, and with the check the others' signatures)
                                       -> ``UnmaskShares``

``MaskedInput`` carries the (large) masked vector; ``header_bytes()`` + ``payload()``
let a transport send it without copying, or stream the vector in chunks on its own
channel and feed :meth:`SecAggServer.receive_masked_chunk`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.secagg.quantize import Quantizer

_MAGIC = b"SA"
#: 2: signed advertisements, the consistency stage, min_included (a v1 peer is refused
#: with "unsupported message version" rather than a confusing decode error).
_VERSION = 2


class _Writer:
    def __init__(self, type_id: int) -> None:
        self.buf = bytearray(_MAGIC)
        self.buf += bytes((_VERSION, type_id))

    def u8(self, v: int) -> None:
        self.buf += struct.pack("<B", v)

    def u32(self, v: int) -> None:
        self.buf += struct.pack("<I", v)

    def u64(self, v: int) -> None:
        self.buf += struct.pack("<Q", v)

    def f64(self, v: float) -> None:
        self.buf += struct.pack("<d", v)

    def blob(self, v: bytes) -> None:
        self.u32(len(v))
        self.buf += v

    def ids(self, v: tuple[int, ...]) -> None:
        self.u32(len(v))
        self.buf += struct.pack(f"<{len(v)}I", *v)

    def pairs(self, v: tuple[tuple[int, bytes], ...]) -> None:
        self.u32(len(v))
        for i, b in v:
            self.u32(i)
            self.blob(b)

    def adverts(self, v: tuple[AdvertiseKeys, ...]) -> None:
        """Advertisements of one round (the round id is the enclosing message's)."""
        self.u32(len(v))
        for k in v:
            self.u32(k.site)
            self.blob(k.enc_key)
            self.blob(k.mask_key)
            self.blob(k.credential)
            self.blob(k.signature)


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview, type_id: int, name: str) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 4
        self.name = name
        if len(self.data) < 4 or bytes(self.data[:2]) != _MAGIC:
            raise SecAggError(f"not a secure-aggregation message (expected {name})")
        if self.data[2] != _VERSION:
            raise SecAggError(f"{name}: unsupported message version {self.data[2]}")
        if self.data[3] != type_id:
            raise SecAggError(f"expected {name} (type {type_id}), got message type {self.data[3]}")

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise SecAggError(f"{self.name}: truncated message")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def f64(self) -> float:
        return struct.unpack("<d", self._take(8))[0]

    def blob(self) -> bytes:
        return bytes(self._take(self.u32()))

    def ids(self) -> tuple[int, ...]:
        n = self.u32()
        return struct.unpack(f"<{n}I", self._take(4 * n))

    def pairs(self) -> tuple[tuple[int, bytes], ...]:
        n = self.u32()
        if n > len(self.data):
            raise SecAggError(f"{self.name}: truncated message")
        return tuple((self.u32(), self.blob()) for _ in range(n))

    def adverts(self, round_id: int) -> tuple[AdvertiseKeys, ...]:
        n = self.u32()
        if n > len(self.data):
            raise SecAggError(f"{self.name}: truncated message")
        return tuple(
            AdvertiseKeys(round_id, self.u32(), self.blob(), self.blob(), self.blob(), self.blob())
            for _ in range(n)
        )

    def end(self) -> None:
        if self.pos != len(self.data):
            raise SecAggError(f"{self.name}: {len(self.data) - self.pos} trailing bytes")


def _flag(v: int, name: str) -> bool:
    if v not in (0, 1):
        raise SecAggError(f"RoundParams.{name} must be 0 or 1, got {v}")
    return bool(v)


@dataclass(frozen=True)
class RoundParams:
    """Everything a site needs to run one round; sent in :class:`SetupRequest`.

    A site re-validates all of it (threshold vs degree, no wrap-around) instead of
    trusting the server.
    """

    round_id: int
    sites: tuple[int, ...]
    vector_length: int
    k: int
    t: int
    graph_seed: bytes
    clip: float
    bits: int
    max_clients: int
    max_weight: float
    weight_resolution: float
    #: Distributed DP (`fedtrain.privacy.distributed`), all 0 when off: the noise
    #: multiplier every site calibrates its noise for, the L2 norm it clips its update
    #: to, and the fewest survivors the server may unmask a sum of.
    dp_noise_multiplier: float = 0.0
    dp_clip_norm: float = 0.0
    dp_min_survivors: int = 0
    #: The fewest masked inputs whose sum the server may unmask: the round's acceptance
    #: minimum (the strategy's `min_results`). Checked *before* any share is revealed,
    #: so a round too small to use is abandoned with its sum still masked, never
    #: unmasked and thrown away (a retry would then unmask a second sum over a
    #: different subset of the same sites, and the difference is one site's update).
    min_included: int = 0
    #: Run the consistency check (stage 3): sites sign the survivor set before any of
    #: them reveals a share (`fedtrain.secagg.consistency`). Needs site identities.
    consistency_check: bool = False

    def digest(self) -> bytes:
        """SHA-256 of the encoded parameters: what two sites compare to agree on them."""
        w = _Writer(0)
        self._write(w)
        return hashlib.sha256(bytes(w.buf)).digest()

    def quantizer(self) -> Quantizer:
        return Quantizer(
            clip=self.clip,
            bits=self.bits,
            max_clients=self.max_clients,
            max_weight=self.max_weight,
            weight_resolution=self.weight_resolution,
        )

    def _write(self, w: _Writer) -> None:
        w.u64(self.round_id)
        w.ids(self.sites)
        w.u64(self.vector_length)
        w.u32(self.k)
        w.u32(self.t)
        w.blob(self.graph_seed)
        w.f64(self.clip)
        w.u8(self.bits)
        w.u32(self.max_clients)
        w.f64(self.max_weight)
        w.f64(self.weight_resolution)
        w.f64(self.dp_noise_multiplier)
        w.f64(self.dp_clip_norm)
        w.u32(self.dp_min_survivors)
        w.u32(self.min_included)
        w.u8(int(self.consistency_check))

    @classmethod
    def _read(cls, r: _Reader) -> RoundParams:
        return cls(
            round_id=r.u64(),
            sites=r.ids(),
            vector_length=r.u64(),
            k=r.u32(),
            t=r.u32(),
            graph_seed=r.blob(),
            clip=r.f64(),
            bits=r.u8(),
            max_clients=r.u32(),
            max_weight=r.f64(),
            weight_resolution=r.f64(),
            dp_noise_multiplier=r.f64(),
            dp_clip_norm=r.f64(),
            dp_min_survivors=r.u32(),
            min_included=r.u32(),
            consistency_check=_flag(r.u8(), "consistency_check"),
        )


@dataclass(frozen=True)
class SetupRequest:
    """Stage 0, server -> site: the round's parameters; reply :class:`AdvertiseKeys`."""

    TYPE: ClassVar[int] = 1
    site: int
    params: RoundParams

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u32(self.site)
        self.params._write(w)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> SetupRequest:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u32(), RoundParams._read(r))
        r.end()
        return msg


@dataclass(frozen=True)
class AdvertiseKeys:
    """Stage 0, site -> server: two fresh X25519 public keys (share encryption, masks).

    With site identities (`fedtrain.secagg.identity`), ``credential`` certifies the
    site's signing key and ``signature`` signs ``(round, site, enc_key, mask_key)``
    with it, so neither the server nor anyone else can substitute the keys. Both are
    empty without identities.
    """

    TYPE: ClassVar[int] = 2
    round_id: int
    site: int
    enc_key: bytes
    mask_key: bytes
    credential: bytes = b""
    signature: bytes = b""

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.blob(self.enc_key)
        w.blob(self.mask_key)
        w.blob(self.credential)
        w.blob(self.signature)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> AdvertiseKeys:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.blob(), r.blob(), r.blob(), r.blob())
        r.end()
        return msg


@dataclass(frozen=True)
class KeysBroadcast:
    """Stage 1, server -> site: who advertised keys, and the keys of my neighbours.

    ``keys`` holds ``AdvertiseKeys`` of the site's graph neighbours among ``sites``.
    """

    TYPE: ClassVar[int] = 3
    round_id: int
    site: int
    sites: tuple[int, ...]
    keys: tuple[AdvertiseKeys, ...]

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.ids(self.sites)
        w.adverts(self.keys)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> KeysBroadcast:
        r = _Reader(data, cls.TYPE, cls.__name__)
        round_id, site, sites = r.u64(), r.u32(), r.ids()
        keys = r.adverts(round_id)
        if len(keys) > len(sites):
            raise SecAggError(f"{cls.__name__}: {len(keys)} keys for {len(sites)} sites")
        r.end()
        return cls(round_id, site, sites, keys)


@dataclass(frozen=True)
class ShareKeys:
    """Stage 1, site -> server: ``(receiver, AES-GCM ciphertext of my shares for it)``."""

    TYPE: ClassVar[int] = 4
    round_id: int
    site: int
    ciphertexts: tuple[tuple[int, bytes], ...]

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.pairs(self.ciphertexts)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareKeys:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.pairs())
        r.end()
        return msg


@dataclass(frozen=True)
class RoutedShares:
    """Stage 2, server -> site: ``(sender, ciphertext)`` of every neighbour that shared."""

    TYPE: ClassVar[int] = 5
    round_id: int
    site: int
    ciphertexts: tuple[tuple[int, bytes], ...]

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.pairs(self.ciphertexts)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> RoutedShares:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.pairs())
        r.end()
        return msg


@dataclass(frozen=True)
class MaskedInput:
    """Stage 2, site -> server: the masked uint32 vector (update, then the weight)."""

    TYPE: ClassVar[int] = 6
    round_id: int
    site: int
    vector: np.ndarray = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        v = self.vector
        if not isinstance(v, np.ndarray) or v.dtype != np.uint32 or v.ndim != 1:
            raise SecAggError("MaskedInput.vector must be a 1-D numpy uint32 array")

    def header_bytes(self) -> bytes:
        """Everything but the vector; ``header_bytes() + payload() == to_bytes()``."""
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.u64(self.vector.shape[0])
        return bytes(w.buf)

    def payload(self) -> memoryview:
        """The vector's little-endian bytes, without a copy when it is contiguous."""
        v = np.ascontiguousarray(self.vector, dtype="<u4")
        return memoryview(v).cast("B")

    def to_bytes(self) -> bytes:
        return self.header_bytes() + self.payload().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> MaskedInput:
        """Decode; the vector is a read-only view of ``data`` (no copy)."""
        r = _Reader(data, cls.TYPE, cls.__name__)
        round_id, site, n = r.u64(), r.u32(), r.u64()
        raw = r._take(4 * n)
        r.end()
        vector = np.frombuffer(raw, dtype="<u4").astype(np.uint32, copy=False)
        return cls(round_id, site, vector)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MaskedInput):
            return NotImplemented
        return (
            self.round_id == other.round_id
            and self.site == other.site
            and np.array_equal(self.vector, other.vector)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class ConsistencyRequest:
    """Stage 3, server -> site: ``U3``, every site whose masked input is in the sum.

    The whole set, not the site's neighbourhood: the site signs exactly this set
    (:class:`ConsistencySignature`) and later reveals shares only as it dictates.
    """

    TYPE: ClassVar[int] = 9
    round_id: int
    site: int
    survivors: tuple[int, ...]

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.ids(self.survivors)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> ConsistencyRequest:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.ids())
        r.end()
        return msg


@dataclass(frozen=True)
class ConsistencySignature:
    """Stage 3, site -> server: my signature of the survivor set I was sent.

    ``macs``: ``(neighbour, MAC)`` of the same statement for each neighbour, under the
    key we share (`crypto.attestation_key`): what a neighbour checks instead of the
    signature, much faster; the signature serves everyone else.
    """

    TYPE: ClassVar[int] = 10
    round_id: int
    site: int
    signature: bytes
    macs: tuple[tuple[int, bytes], ...] = ()

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.blob(self.signature)
        w.pairs(self.macs)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> ConsistencySignature:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.blob(), r.pairs())
        r.end()
        return msg


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4, server -> site: which of my share owners survived, which dropped.

    The site reveals seed shares (b) for ``survivors`` and mask-key shares (s^sk) for
    ``dropped``, and refuses if any site appears in both (or was seen before). With the
    consistency check, ``signatures`` carries the survivor-set signatures of the share
    holders of my share owners, ``macs`` my neighbours' attestations of their survivor
    sets addressed to me, and ``keys`` the advertisements of those holders that are not
    my neighbours (the ones I have already); all are empty without it.
    """

    TYPE: ClassVar[int] = 7
    round_id: int
    site: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: tuple[tuple[int, bytes], ...] = ()
    keys: tuple[AdvertiseKeys, ...] = ()
    macs: tuple[tuple[int, bytes], ...] = ()

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.ids(self.survivors)
        w.ids(self.dropped)
        w.pairs(self.signatures)
        w.adverts(self.keys)
        w.pairs(self.macs)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        r = _Reader(data, cls.TYPE, cls.__name__)
        round_id, site = r.u64(), r.u32()
        survivors, dropped, signatures = r.ids(), r.ids(), r.pairs()
        msg = cls(round_id, site, survivors, dropped, signatures, r.adverts(round_id), r.pairs())
        r.end()
        return msg


@dataclass(frozen=True)
class UnmaskShares:
    """Stage 4, site -> server: ``(owner, Share bytes)`` of seeds and of mask keys."""

    TYPE: ClassVar[int] = 8
    round_id: int
    site: int
    seed_shares: tuple[tuple[int, bytes], ...]
    key_shares: tuple[tuple[int, bytes], ...]

    def to_bytes(self) -> bytes:
        w = _Writer(self.TYPE)
        w.u64(self.round_id)
        w.u32(self.site)
        w.pairs(self.seed_shares)
        w.pairs(self.key_shares)
        return bytes(w.buf)

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskShares:
        r = _Reader(data, cls.TYPE, cls.__name__)
        msg = cls(r.u64(), r.u32(), r.pairs(), r.pairs())
        r.end()
        return msg


ServerMessage = SetupRequest | KeysBroadcast | RoutedShares | ConsistencyRequest | UnmaskRequest
ClientMessage = AdvertiseKeys | ShareKeys | MaskedInput | ConsistencySignature | UnmaskShares
Message = ServerMessage | ClientMessage

_TYPES: dict[int, type] = {
    cls.TYPE: cls
    for cls in (
        SetupRequest,
        AdvertiseKeys,
        KeysBroadcast,
        ShareKeys,
        RoutedShares,
        MaskedInput,
        UnmaskRequest,
        UnmaskShares,
        ConsistencyRequest,
        ConsistencySignature,
    )
}


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """Decode any protocol message by its type byte."""
    view = memoryview(data).cast("B")
    if len(view) < 4 or bytes(view[:2]) != _MAGIC:
        raise SecAggError("not a secure-aggregation message")
    cls = _TYPES.get(view[3])
    if cls is None:
        raise SecAggError(f"unknown secure-aggregation message type {view[3]}")
    return cls.from_bytes(data)  # type: ignore[no-any-return, attr-defined]
