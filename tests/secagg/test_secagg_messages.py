"""Every protocol message round-trips through its explicit binary format."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedtrain.errors import SecAggError
from fedtrain.secagg import (
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    KeysBroadcast,
    MaskedInput,
    RoundParams,
    RoutedShares,
    SetupRequest,
    ShareKeys,
    UnmaskRequest,
    UnmaskShares,
    decode_message,
)

PARAMS = RoundParams(
    round_id=2**40 + 3,
    sites=(1, 2, 7, 2**32 - 1),
    vector_length=1000,
    k=12,
    t=7,
    graph_seed=bytes(range(32)),
    clip=0.25,
    bits=25,
    max_clients=100,
    max_weight=12345.5,
    weight_resolution=0.5,
)

MESSAGES = [
    SetupRequest(7, PARAMS),
    SetupRequest(
        7,
        dataclasses.replace(
            PARAMS, dp_noise_multiplier=1.1, dp_clip_norm=0.75, dp_min_survivors=2**32 - 2
        ),
    ),
    SetupRequest(7, dataclasses.replace(PARAMS, consistency_check=True)),
    AdvertiseKeys(5, 7, b"e" * 32, b"m" * 32),
    AdvertiseKeys(5, 7, b"e" * 32, b"m" * 32, b"certificate", b"s" * 64),
    KeysBroadcast(5, 7, (1, 2, 7), (AdvertiseKeys(5, 1, b"a" * 32, b"b" * 32, b"c", b"s"),)),
    KeysBroadcast(5, 7, (7,), ()),
    ShareKeys(5, 7, ((1, b"ct1"), (2, b""))),
    RoutedShares(5, 7, ((1, b"\x00" * 200),)),
    MaskedInput(5, 7, np.arange(10, dtype=np.uint32) * 0x1FFFFFFF),
    MaskedInput(5, 7, np.zeros(0, dtype=np.uint32)),
    ConsistencyRequest(5, 7, (1, 2, 7)),
    ConsistencySignature(5, 7, b"s" * 64),
    ConsistencySignature(5, 7, b"s" * 64, ((1, b"m" * 32), (2, b"n" * 32))),
    UnmaskRequest(5, 7, (1, 7), (2,)),
    UnmaskRequest(
        5,
        7,
        (1, 7),
        (2,),
        ((1, b"s" * 64), (7, b"t" * 64)),
        (AdvertiseKeys(5, 9, b"a", b"b"),),
        ((1, b"m" * 32),),
    ),
    UnmaskShares(5, 7, ((1, b"s1"), (7, b"s7")), ((2, b"k2"),)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = msg.to_bytes()  # type: ignore[attr-defined]
    assert type(msg).from_bytes(data) == msg
    assert decode_message(data) == msg
    with pytest.raises(SecAggError):
        decode_message(data[:-1] if len(data) > 4 else data[:3])
    with pytest.raises(SecAggError, match="trailing"):
        type(msg).from_bytes(data + b"\x00")


def test_a_flag_is_zero_or_one() -> None:
    data = bytearray(SetupRequest(7, PARAMS).to_bytes())
    data[-1] = 2  # consistency_check, the last field
    with pytest.raises(SecAggError, match="consistency_check must be 0 or 1"):
        SetupRequest.from_bytes(bytes(data))


def test_masked_input_is_zero_copy() -> None:
    msg = MaskedInput(1, 2, np.arange(1000, dtype=np.uint32))
    assert msg.header_bytes() + bytes(msg.payload()) == msg.to_bytes()
    assert np.shares_memory(np.frombuffer(msg.payload(), dtype=np.uint32), msg.vector)
    buf = bytearray(msg.to_bytes())
    decoded = MaskedInput.from_bytes(buf)
    assert np.shares_memory(decoded.vector, np.frombuffer(buf, dtype=np.uint8))
    with pytest.raises(SecAggError, match="uint32"):
        MaskedInput(1, 2, np.zeros(3, dtype=np.int64))


def test_wrong_type_and_garbage_are_refused() -> None:
    data = AdvertiseKeys(1, 2, b"e" * 32, b"m" * 32).to_bytes()
    with pytest.raises(SecAggError, match="expected ShareKeys"):
        ShareKeys.from_bytes(data)
    with pytest.raises(SecAggError, match="unknown"):
        decode_message(data[:3] + b"\x63" + data[4:])
    with pytest.raises(SecAggError, match="version"):
        decode_message(data[:2] + b"\x09" + data[3:])
    with pytest.raises(SecAggError, match="unsupported message version 1"):  # before signing
        decode_message(data[:2] + b"\x01" + data[3:])
    with pytest.raises(SecAggError, match="not a secure-aggregation"):
        decode_message(b"\x80\x04garbage")  # e.g. a pickle
