"""Wire conversions: hand-encoded chunks equal protobuf's encoding; configs round-trip."""

from __future__ import annotations

import pytest
import torch

from fedtrain.errors import ProtocolError
from fedtrain.runtime import wire
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.tensors import Chunk, ModelState, TensorSpec


@pytest.mark.parametrize(
    "chunk",
    [
        Chunk("w", "float32", (3, 2), 0, memoryview(torch.arange(6.0).numpy()).cast("B")),
        Chunk("layer.bias", "bfloat16", (300,), 200, bytes(range(200)) * 2),
        Chunk("empty", "int64", (0,), 0, b""),
        Chunk("big", "uint8", (1 << 20,), 1 << 19, bytes(1 << 19)),
    ],
)
def test_hand_encoded_chunk_is_protobufs_encoding(chunk: Chunk) -> None:
    expected_piece = pb.ModelPiece(chunk=wire.chunk_to_proto(chunk)).SerializeToString()
    expected_update = pb.UpdateChunk(chunk=wire.chunk_to_proto(chunk)).SerializeToString()
    assert wire.encode_chunk_message(chunk) == expected_piece == expected_update
    decoded = wire.chunk_from_proto(pb.ModelPiece.FromString(expected_piece).chunk)
    assert decoded.spec == chunk.spec
    assert decoded.offset == chunk.offset
    assert bytes(decoded.data) == bytes(chunk.data)


@pytest.mark.parametrize("message_class", [pb.ModelPiece, pb.UpdateChunk])
@pytest.mark.parametrize(
    "chunk",
    [
        Chunk("w", "float32", (3, 2), 8, memoryview(torch.arange(6.0).numpy()).cast("B")),
        Chunk("layer.bias", "bfloat16", (300,), 0, bytes(range(200)) * 2),
        Chunk("empty", "int64", (0,), 0, b""),
    ],
)
def test_chunks_are_decoded_without_copying_like_protobuf_would(chunk, message_class) -> None:
    data = message_class(chunk=wire.chunk_to_proto(chunk)).SerializeToString()
    got = wire.chunk_stream_deserializer(message_class)(data)
    want = wire.chunk_from_proto(message_class.FromString(data).chunk)
    got_chunk = wire.stream_chunk(got)
    assert got_chunk is not None
    assert (got_chunk.spec, got_chunk.offset) == (want.spec, want.offset)
    assert bytes(got_chunk.data) == bytes(want.data)
    if chunk.data:  # a view into gRPC's buffer, not a copy
        assert isinstance(got, Chunk) and isinstance(got.data, memoryview)
        assert got.data.obj is data


def test_other_messages_and_unusual_layouts_go_to_protobuf() -> None:
    header = pb.UpdateChunk(header=pb.UploadHeader(round=3, num_examples=7)).SerializeToString()
    decode = wire.chunk_stream_deserializer(pb.UpdateChunk)
    assert decode(header).header.num_examples == 7
    # The payload before the other fields (valid protobuf, not how anyone writes it).
    inner = pb.TensorChunk(data=b"abcd").SerializeToString()
    inner += pb.TensorChunk(name="x", dtype="uint8", shape=[4]).SerializeToString()
    reordered = pb.UpdateChunk(chunk=pb.TensorChunk.FromString(inner)).SerializeToString()
    raw = wire._CHUNK_KEY + wire._varint(len(inner)) + inner
    assert wire.decode_chunk_message(raw) is None
    parsed = wire.stream_chunk(decode(raw))
    assert parsed is not None and (parsed.name, bytes(parsed.data)) == ("x", b"abcd")
    assert wire.stream_chunk(decode(reordered)).name == "x"
    with pytest.raises(ProtocolError, match="varint"):
        wire.decode_chunk_message(wire._CHUNK_KEY + b"\xff")


def test_serialize_stream_item_accepts_messages_and_chunks() -> None:
    header = pb.UpdateChunk(header=pb.UploadHeader(round=3, num_examples=7))
    assert wire.serialize_stream_item(header) == header.SerializeToString()
    state = ModelState({"x": torch.ones(4)})
    (chunk,) = state.chunks()
    assert pb.UpdateChunk.FromString(wire.serialize_stream_item(chunk)).chunk.name == "x"


def test_round_config_round_trips_with_types() -> None:
    config = {"epochs": 2, "lr": 0.05, "nesterov": True, "optimizer": "sgd", "round": 4}
    msg = pb.Instruction()
    wire.config_to_proto(config, msg.config)
    back = wire.config_from_proto(pb.Instruction.FromString(msg.SerializeToString()).config)
    assert back == config
    assert type(back["nesterov"]) is bool and type(back["epochs"]) is int


def test_round_config_refuses_non_scalars() -> None:
    with pytest.raises(ProtocolError, match="only bool, int, float and str"):
        wire.config_to_proto({"layers": [1, 2]}, pb.Instruction().config)


def test_manifest_describes_every_tensor() -> None:
    specs = (TensorSpec("a", "float16", (2, 3)), TensorSpec("b", "int64", ()))
    m = wire.manifest("v1", specs)
    assert m.total_bytes == 2 * 3 * 2 + 8
    assert tuple(wire.spec_from_proto(s) for s in m.specs) == specs


def test_a_resumed_upload_sends_exactly_the_chunks_after_the_servers_offset() -> None:
    state = ModelState({"w": torch.arange(10, dtype=torch.float32), "b": torch.zeros(3)})
    chunks = list(state.chunks(16))  # w: 16 + 16 + 8 bytes, b: 12 bytes
    for held, expected in ((0, chunks), (32, chunks[2:]), (40, chunks[3:]), (52, [])):
        assert list(wire.chunks_after(state.chunks(16), held)) == expected
    with pytest.raises(ProtocolError, match="not a chunk boundary"):
        list(wire.chunks_after(state.chunks(16), 20))
    with pytest.raises(ProtocolError, match="only 52"):
        list(wire.chunks_after(state.chunks(16), 60))
