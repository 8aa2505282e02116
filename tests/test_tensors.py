"""Chunking and reassembly: bit-exact for every dtype, every malformed stream refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrain.errors import TensorStreamError
from fedtrain.tensors import (
    DTYPES,
    Chunk,
    ModelState,
    StateAssembler,
    assemble,
    chunk_values,
)

ALL_DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "uint8", "bool"]


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads included for floats): the hardest round trip."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=DTYPES[dtype])
    raw = t.reshape(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
    if dtype == "bool":  # only 0/1 are valid bools
        t = t.view(torch.uint8).remainder(2).to(torch.bool) if t.numel() else t
    return t


states = st.lists(
    st.tuples(
        st.sampled_from(ALL_DTYPES),
        st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(spec=states, chunk_bytes=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_chunk_roundtrip_is_bit_exact(spec, chunk_bytes, seed):
    state = ModelState({f"t{i}": random_tensor(d, s, seed + i) for i, (d, s) in enumerate(spec)})
    chunks = [
        Chunk(c.name, c.dtype, c.shape, c.offset, bytes(c.data))  # as if off the wire
        for c in state.chunks(chunk_bytes)
    ]
    assert all(len(c.data) <= max(chunk_bytes, 8) for c in chunks)
    out = assemble(chunks, state.specs)
    assert out.specs == state.specs
    assert out.equal(state)
    assert out.digest() == state.digest()


@settings(max_examples=50, deadline=None)
@given(spec=states, chunk_bytes=st.integers(1, 64), seed=st.integers(0, 1000))
def test_reassembly_order_does_not_matter(spec, chunk_bytes, seed):
    state = ModelState({f"t{i}": random_tensor(d, s, i) for i, (d, s) in enumerate(spec)})
    chunks = list(state.chunks(chunk_bytes))
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))
    assert assemble([chunks[i] for i in order], state.specs).equal(state)


def test_chunks_are_zero_copy_views():
    t = torch.arange(1000, dtype=torch.float32)
    state = ModelState({"w": t})
    first = next(state.chunks(400))
    t[0] = 42.0
    assert chunk_values(first)[0].item() == 42.0


def test_module_roundtrip_with_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(8, 4))  # moves running stats and num_batches_tracked
    state = ModelState.from_module(model)
    assert "1.num_batches_tracked" in state and state["1.num_batches_tracked"].dtype == torch.int64
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    assemble(list(state.chunks(7)), state.specs).load_into(other)
    assert ModelState.from_module(other).equal(state)


def test_load_into_refuses_a_mismatched_model():
    state = ModelState.from_module(torch.nn.Linear(4, 3))
    with pytest.raises(TensorStreamError, match=r"state has torch.float32 \(3, 4\), model has"):
        state.load_into(torch.nn.Linear(4, 2))
    with pytest.raises(TensorStreamError, match="missing"):
        state.load_into(torch.nn.Sequential(torch.nn.Linear(4, 3)))


@pytest.fixture
def state() -> ModelState:
    return ModelState(
        {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    )


def chunk(name="a", dtype="float32", shape=(10,), offset=0, data=b"\0" * 8) -> Chunk:
    return Chunk(name, dtype, shape, offset, data)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (chunk(name="c"), "unexpected tensor 'c'"),
        (chunk(dtype="float16"), "expected float32"),
        (chunk(shape=(5, 2)), r"expected float32 \(10,\)"),
        (chunk(offset=2), "not aligned"),
        (chunk(data=b"\0" * 6), "not aligned"),
        (chunk(offset=36), "runs past"),
        (chunk(offset=-4), "not aligned"),
        (chunk(data=b"\0" * 44), "runs past"),
        (chunk(data=b""), "empty chunk"),
    ],
)
def test_malformed_chunk_is_refused(state, bad, message):
    asm = StateAssembler(state.specs)
    with pytest.raises(TensorStreamError, match=message):
        asm.add(bad)


def test_duplicate_chunk_is_refused(state):
    asm = StateAssembler(state.specs)
    asm.add(chunk(offset=0, data=b"\0" * 8))
    with pytest.raises(TensorStreamError, match="duplicate"):
        asm.add(chunk(offset=4, data=b"\0" * 8))


def test_truncated_stream_is_refused(state):
    chunks = list(state.chunks(8))
    asm = StateAssembler(state.specs)
    for c in chunks[:-1]:
        asm.add(c)
    with pytest.raises(TensorStreamError, match=r"stream ended early: missing 'b' \(4 bytes\)"):
        asm.finish()


def test_missing_tensor_is_refused(state):
    asm = StateAssembler(state.specs)
    for c in state.chunks():
        if c.name == "a":
            asm.add(c)
    with pytest.raises(TensorStreamError, match="missing 'b'"):
        asm.finish()


def test_unsupported_dtype_is_refused():
    with pytest.raises(TensorStreamError, match="cannot travel"):
        ModelState({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TensorStreamError, match="unknown dtype"):
        StateAssembler((chunk(dtype="complex64").spec,))


def test_empty_tensor_travels():
    state = ModelState({"e": torch.empty(0, 3), "x": torch.ones(1)})
    chunks = list(state.chunks())
    assert [c.name for c in chunks] == ["e", "x"]
    assert assemble(chunks, state.specs).equal(state)


def test_assembling_into_a_reused_state_overwrites_its_memory():
    old = ModelState({"w": torch.zeros(5, 3), "step": torch.zeros((), dtype=torch.int64)})
    new = ModelState({"w": torch.randn(5, 3), "step": torch.tensor(7)})
    asm = StateAssembler(new.specs, reuse=old)
    for c in new.chunks(8):
        asm.add(c)
    out = asm.finish()
    assert out.equal(new)
    assert out["w"].data_ptr() == old["w"].data_ptr()  # no fresh buffer
    other = StateAssembler(ModelState({"w": torch.zeros(4)}).specs, reuse=old)
    for c in ModelState({"w": torch.ones(4)}).chunks():
        other.add(c)
    assert other.finish()["w"].data_ptr() != old["w"].data_ptr()  # other specs: fresh
