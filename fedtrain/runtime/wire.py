"""Conversions between fedtrain's objects and the protobuf messages, and gRPC plumbing.

Tensor chunks cross the wire without protobuf touching their bytes. Outgoing ones are
encoded by hand (`encode_chunk_message`): the protobuf runtime would first copy a
chunk's memoryview into `bytes`, then copy it again while serializing. Writing the
few header bytes ourselves and joining them with the tensor memory costs one copy,
and the result is byte-for-byte what protobuf produces. Incoming ones are decoded by
hand too (`chunk_stream_deserializer`): parsing with the generated class copies the
payload into the message, and reading `.data` copies it again, two fresh buffers per
chunk that cost more than the network itself at 100M+ parameters (measured ~3x the
time of validating and folding the same bytes). The hand decoder parses only the
small header with protobuf and hands out the payload as a view of gRPC's own buffer;
any message it does not recognize goes to the generated class unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from fedtrain.errors import ProtocolError
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.rpc import SERVICE, method_path  # noqa: F401 (part of wire's API)
from fedtrain.strategy import RoundConfig, Scalar
from fedtrain.tensors import Chunk, ModelState, TensorSpec

#: Bumped when server and site can no longer talk; a Join with another one is refused.
#: 3: a site sends an update's bytes only after the server's go-ahead (`UPLOAD_GO_AHEAD`).
#: 4: uploads resume from the offset the server holds (`UPLOAD_ID`, `UPLOAD_OFFSET`,
#: UploadHeader.resume_id) and sessions survive outages (Join.resume_token).
#: 5: a secure evaluation's masked vector carries the personalized figures (7 values).
#: 6: transfers may use parallel streams, each carrying a range (UploadHeader.range_start,
#: range_end, UploadReceipt.partial; ModelRequest.end).
#: 7: a resumed upload range may end sooner than it was opened (a site's plain call cut
#: for parallel streams: `server/resumable.py`); a version-6 server refuses that.
PROTOCOL_VERSION = 7
#: Room for a chunk's header (name, dtype, shape, offset) on top of its raw bytes.
HEADER_ALLOWANCE = 64 * 1024
#: Join capability of a site that speaks secure aggregation (a secagg server requires it).
#: Its version moves whenever masks or stage messages change (2: AES-128 mask keystream),
#: so a site of another version is refused at Join instead of corrupting the sum.
SECAGG_CAPABILITY = "secagg/2"
#: Join capability of a site that takes a small model inside its instruction
#: (`Instruction.model`) instead of downloading it (`server/model_push.py`).
INLINE_MODEL_CAPABILITY = "inline_model"
#: The reason of the Shutdown the server sends when its run is over: a site with
#: `exit_when_done` exits on it, any other site waits for the server's next run.
RUN_COMPLETE = "run complete"


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options shared by the server and site channels: message limits sized for chunks,
    and a connection per channel (gRPC otherwise shares one among a process's channels
    to the same address: sites run in one process, as tests and the swarm do, would be
    streams on one connection and meet its stream cap; a server ignores the option)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
    ]


#: Sites ping the server this often when their connection is quiet (HTTP/2 keepalive),
#: so a site notices a dead server or a cut link without waiting for a message.
SITE_KEEPALIVE_S = 30.0
#: The server accepts a site's pings this often at most (gRPC's default, 5 minutes,
#: would make it close the connection of a site pinging every SITE_KEEPALIVE_S).
MIN_SITE_PING_INTERVAL_S = 10.0
#: A connection with no call for this long is closed by the server (a refused site's,
#: or one that never joined), so idle peers cannot hold its file descriptors.
IDLE_CONNECTION_S = 120.0
#: An upload's bytes wait at the site until the server takes the transfer: the server
#: sends the call's initial metadata when it has a transfer slot for it, and the site
#: sends the chunks after its header only then. Otherwise every site chosen sends its
#: update as soon as it has trained, and gRPC holds each (up to the stream's window,
#: the whole of a small model's) in the server's memory while it waits for a slot:
#: 1.5 GB for a round of 3,000 sites sending 400 KB each, instead of 0.5 GB.
UPLOAD_GO_AHEAD = "fedtrain-go-ahead"
#: Beside the go-ahead: the id the server keeps the upload under (a broken stream is
#: resumed with UploadHeader.resume_id = it) and how many of the update's bytes, in the
#: order the site sends them, the server already holds (0 for a new upload).
UPLOAD_ID = "fedtrain-upload-id"
UPLOAD_OFFSET = "fedtrain-upload-offset"
#: Parallel streams a site may use per transfer (site.toml transfer_streams).
MAX_TRANSFER_STREAMS = 64
#: Chunk size of a download over parallel streams (at most the server's chunk_bytes):
#: a range gets the pieces that start in it, so this is the finest a range can be. Fine
#: enough that 64 streams at 1% loss end together: with 256 KiB pieces (a flow's 1.3 s
#: there) a 40 MB download's last ~1.5 s moved little, as the last ranges' flows
#: finished one by one (64 fixed streams: 65% of line rate -> 69%, RESULTS "Finer
#: download ranges"). A ranged download costs the server 4x the messages of 256 KiB ones.
RANGE_CHUNK_BYTES = 64 * 1024
#: A plain model download at least this large (one the site may cut for parallel
#: streams: site/streams.py PROBE_MIN_BYTES) sends the chunks that start in its first
#: HEAD_BYTES in RANGE_CHUNK_BYTES pieces, the rest in the server's chunk_bytes: a chunk
#: arrives whole, and a lossy link's single flow (~0.4 MB/s at 1% loss and 40 ms) moves
#: no 4 MiB chunk in the second the site judges its call in, so it could only bound the
#: call's rate (RESULTS, "A plain download's first bytes in small pieces").
PROBE_MIN_BYTES = 4 << 20
HEAD_BYTES = 4 << 20


def head_bytes(total: int) -> int:
    """How many of a plain download's first bytes travel in RANGE_CHUNK_BYTES pieces
    (0: a download too small to be cut for parallel streams goes in whole chunks)."""
    return HEAD_BYTES if total >= PROBE_MIN_BYTES else 0


#: Ranges one upload may be cut into (a few per stream, so that fast streams take more):
#: more are refused, so that one site cannot make the server track thousands.
MAX_UPLOAD_RANGES = 256

#: Calls one connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS). A site
#: needs four at most (control stream, download, upload, a retry overlapping its
#: predecessor's end); the cap stops one peer from holding thousands of handlers on one
#: connection, and gRPC's client queues a call over it rather than failing it.
STREAMS_PER_CONNECTION = 16
#: How long a call may wait in gRPC's queue before the server's loop takes it (gRPC's
#: default: 30 s, then it cancels the call without telling the application).
UNREQUESTED_CALL_S = 3600
#: Calls queued in gRPC, per site the server admits, before it cancels new ones (each
#: site has at most a control stream, a download, an upload and a Status call open).
QUEUED_CALLS_PER_SITE = 4


def queued_call_limit(max_sites: int) -> int:
    """How many calls may wait in gRPC's queue for the server's loop to take them.

    gRPC's defaults cancel calls at random once 1,000 wait, all beyond 3,000, and any
    that waited 30 s: a round that chooses thousands of sites starts thousands of
    transfers at once, the loop takes them a little more slowly than they arrive, and a
    quarter of the uploads of a 3,000-site round ended CANCELLED without reaching
    fedtrain (measured: benchmarks/swarm.py). The loop takes every call within seconds;
    `max_transfers` then bounds how many move bytes at once."""
    return max(3000, QUEUED_CALLS_PER_SITE * max_sites)


def server_options(
    max_message_bytes: int, keepalive_s: float, max_sites: int
) -> list[tuple[str, Any]]:
    """The server's options: chunk-sized messages, liveness from HTTP/2 keepalive, and
    room for every site's calls to wait for the loop (`queued_call_limit`).

    The server pings every connection every `keepalive_s` and closes one that does not
    answer within as long again; gRPC does this in C, so liveness costs no Python work
    per site (the control stream then ends and the site is gone)."""
    ms = int(keepalive_s * 1000)
    queued = queued_call_limit(max_sites)
    return [
        *channel_options(max_message_bytes),
        # A second server started on the same address fails to bind, instead of sharing
        # the port through gRPC's default SO_REUSEPORT (the kernel would then hand each
        # new site connection to either process: sites split between two runs).
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_SITE_PING_INTERVAL_S * 1000)),
        ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_S),
        ("grpc.server.max_pending_requests", queued),
        ("grpc.server.max_pending_requests_hard_limit", queued),
    ]


def site_channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """A site's channel options: chunk-sized messages, keepalive pings to the server."""
    ms = int(SITE_KEEPALIVE_S * 1000)
    return [
        *channel_options(max_message_bytes),
        # A second server started on the same address fails to bind, instead of sharing
        # the port through gRPC's default SO_REUSEPORT (the kernel would then hand each
        # new site connection to either process: sites split between two runs).
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def chunks_after(chunks: Iterable[Chunk], offset: int) -> Iterator[Chunk]:
    """The chunks of an upload after its first `offset` bytes (what a resumed stream
    sends). The server holds whole chunks only, so `offset` must fall between two."""
    skipped = 0
    for chunk in chunks:
        if skipped >= offset:
            yield chunk
            continue
        skipped += len(chunk.data)
        if skipped > offset:
            raise ProtocolError(
                f"the server holds {offset} bytes of this upload, which is not a chunk "
                f"boundary ({chunk.name!r} ends at byte {skipped}); the upload restarts"
            )
    if skipped < offset:
        raise ProtocolError(
            f"the server holds {offset} bytes of this upload, but it has only {skipped}"
        )


def chunks_between(chunks: Iterable[Chunk], start: int, end: int) -> Iterator[Chunk]:
    """The chunks in bytes [start, end) of an upload (what one of its parallel streams
    carries; `end` a chunk boundary, `start` one too, as `chunks_after` checks)."""
    position = start
    for chunk in chunks_after(chunks, start):
        if position >= end:
            return
        position += len(chunk.data)
        if position > end:
            raise ProtocolError(f"byte {end} of this upload is not a chunk boundary")
        yield chunk


def cut_chunks(chunks: Iterable[Chunk], size: int, until: int | None = None) -> Iterator[Chunk]:
    """`chunks`, those that start before byte `until` (None: all) cut into pieces of at
    most `size` bytes (whole elements): the same bytes in the same order, and every
    chunk's end is a piece's end, so a transfer cut or resumed at any piece continues
    in ranges or another call (a download's range gets the pieces that start in it)."""
    position = 0
    for chunk in chunks:
        nbytes = len(chunk.data)
        itemsize = chunk.spec.itemsize
        step = max(itemsize, size - size % itemsize)
        if (until is not None and position >= until) or nbytes <= step:
            yield chunk
        else:
            for start in range(0, nbytes, step):
                data = chunk.data[start : start + step]
                yield Chunk(chunk.name, chunk.dtype, chunk.shape, chunk.offset + start, data)
        position += nbytes


def chunk_ranges(sizes: Iterable[int], count: int) -> list[tuple[int, int]]:
    """`count` (or fewer) contiguous byte ranges of about equal size over chunks of
    `sizes`, split at chunk boundaries: how an upload is spread over parallel streams."""
    sizes = list(sizes)
    total = sum(sizes)
    ranges: list[tuple[int, int]] = []
    start = position = 0
    for size in sizes:
        position += size
        if position * count >= total * (len(ranges) + 1) and position > start:
            ranges.append((start, position))
            start = position
    if position > start or not ranges:
        ranges.append((start, position))
    return ranges


# -- scalars (round config) ---------------------------------------------------------------
def scalar_to_proto(value: Scalar, out: pb.Scalar) -> None:
    # bool before int: bool is an int subclass in Python.
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.float_value = value
    elif isinstance(value, str):
        out.string_value = value
    else:
        raise ProtocolError(
            f"round config value {value!r} is a {type(value).__name__}; only bool, int, "
            "float and str can travel"
        )


def scalar_from_proto(msg: pb.Scalar) -> Scalar:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ProtocolError("round config holds an empty value")
    return getattr(msg, kind)


def config_to_proto(config: Mapping[str, Scalar], out: Any) -> None:
    """Fill a protobuf `map<string, Scalar>` field from a round config."""
    for key, value in config.items():
        scalar_to_proto(value, out[key])


def config_from_proto(field: Mapping[str, pb.Scalar]) -> RoundConfig:
    return {key: scalar_from_proto(value) for key, value in field.items()}


# -- tensors --------------------------------------------------------------------------------
def spec_to_proto(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, dtype=spec.dtype, shape=spec.shape)


def spec_from_proto(msg: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(msg.name, msg.dtype, tuple(msg.shape))


def manifest(version: str, specs: Iterable[TensorSpec]) -> pb.Manifest:
    specs = tuple(specs)
    return pb.Manifest(
        model_version=version,
        specs=[spec_to_proto(s) for s in specs],
        total_bytes=sum(s.nbytes for s in specs),
    )


# -- secure aggregation's masked vector -------------------------------------------------------
#: The one tensor of a masked upload. Its uint32 bits travel as int32 elements: the wire
#: has no unsigned 32-bit dtype, and only the bits matter (they are summed mod 2^32).
MASKED_TENSOR = "secagg.masked"


def masked_spec(length: int) -> TensorSpec:
    """The spec a masked upload of `length` elements (update values + weight) must match."""
    return TensorSpec(MASKED_TENSOR, "int32", (length,))


def masked_chunks(vector: np.ndarray, chunk_bytes: int) -> Iterator[Chunk]:
    """A masked uint32 vector as upload chunks (zero-copy views, like a model's)."""
    if vector.dtype != np.uint32 or vector.ndim != 1:
        raise ProtocolError(f"a masked vector is 1-D uint32, got {vector.dtype} {vector.shape}")
    bits = torch.from_numpy(np.ascontiguousarray(vector).view(np.int32))
    return ModelState({MASKED_TENSOR: bits}).chunks(chunk_bytes)


def chunk_from_proto(msg: pb.TensorChunk) -> Chunk:
    return Chunk(msg.name, msg.dtype, tuple(msg.shape), msg.offset, msg.data)


def chunk_to_proto(chunk: Chunk) -> pb.TensorChunk:
    """A TensorChunk message (copies the data; the hot paths use encode_chunk_message)."""
    return pb.TensorChunk(
        name=chunk.name,
        dtype=chunk.dtype,
        shape=chunk.shape,
        offset=chunk.offset,
        data=bytes(chunk.data),
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


_LEN = 2  # protobuf wire type of length-delimited fields
_DATA_KEY = _varint(pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].number << 3 | _LEN)
#: ModelPiece.chunk and UpdateChunk.chunk share this field number (checked below).
_CHUNK_FIELD = pb.ModelPiece.DESCRIPTOR.fields_by_name["chunk"].number
assert pb.UpdateChunk.DESCRIPTOR.fields_by_name["chunk"].number == _CHUNK_FIELD
_CHUNK_KEY = _varint(_CHUNK_FIELD << 3 | _LEN)


def encode_chunk_message(chunk: Chunk) -> bytes:
    """A serialized ModelPiece / UpdateChunk holding `chunk`, with one copy of the data.

    `data` is the TensorChunk's last field, so appending it after the protobuf-encoded
    header is exactly the canonical encoding.
    """
    header = pb.TensorChunk(
        name=chunk.name, dtype=chunk.dtype, shape=chunk.shape, offset=chunk.offset
    ).SerializeToString()
    size = len(chunk.data)
    data_prefix = _DATA_KEY + _varint(size) if size else b""
    inner_len = len(header) + len(data_prefix) + size
    return b"".join((_CHUNK_KEY, _varint(inner_len), header, data_prefix, chunk.data))


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the protobuf varint at `pos`."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProtocolError("truncated or malformed varint in a chunk message")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


_DATA_FIELD = pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].number


def decode_chunk_message(data: bytes) -> Chunk | None:
    """The chunk a serialized ModelPiece / UpdateChunk holds, its payload a zero-copy
    view of `data`; None when `data` is not a chunk laid out as protobuf writes it
    (one chunk field whose payload is its last field), which the caller then parses
    with the generated class."""
    if not data.startswith(_CHUNK_KEY):
        return None
    inner_len, start = _read_varint(data, len(_CHUNK_KEY))
    end = start + inner_len
    if end != len(data):
        return None
    pos = start
    while pos < end:  # walk the TensorChunk's fields up to its payload
        key, after_key = _read_varint(data, pos)
        if key >> 3 == _DATA_FIELD and key & 7 == _LEN:
            size, payload = _read_varint(data, after_key)
            if payload + size != end:
                return None  # fields after the payload: leave it to protobuf
            header = pb.TensorChunk.FromString(data[start:pos])
            view = memoryview(data)[payload:end]
            return Chunk(header.name, header.dtype, tuple(header.shape), header.offset, view)
        if key & 7 == 0:
            _, pos = _read_varint(data, after_key)
        elif key & 7 == _LEN:
            size, pos = _read_varint(data, after_key)
            pos += size
        else:
            return None
    return None  # no payload field: an empty chunk, protobuf decodes it


def chunk_stream_deserializer(message_class: Any) -> Callable[[bytes], Any]:
    """gRPC deserializer for ModelPiece / UpdateChunk streams: a Chunk (zero-copy) for
    chunk messages, else a `message_class` message."""

    def deserialize(data: bytes) -> Any:
        chunk = decode_chunk_message(data)
        return chunk if chunk is not None else message_class.FromString(data)

    return deserialize


def stream_chunk(item: Any) -> Chunk | None:
    """The Chunk a deserialized stream item carries (decoded by hand or by protobuf), or
    None if it is not a chunk message."""
    if isinstance(item, Chunk):
        return item
    if item.WhichOneof("kind") == "chunk":
        return chunk_from_proto(item.chunk)
    return None


def serialize_stream_item(item: Chunk | bytes | Any) -> bytes:
    """gRPC serializer for ModelPiece / UpdateChunk streams (and the control stream's
    ServerMessages): a Chunk, a message, or one already encoded (`encode_chunk_message`,
    shared by many streams; an instruction with its model, `server/model_push.py`)."""
    if isinstance(item, Chunk):
        return encode_chunk_message(item)
    if isinstance(item, bytes):
        return item
    return item.SerializeToString()
