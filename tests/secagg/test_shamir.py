"""Shamir sharing: any t shares recover the secret, fewer cannot."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrain.errors import SecAggError
from fedtrain.secagg import shamir


def test_any_t_shares_recover_the_secret() -> None:
    secret = os.urandom(32)
    shares = shamir.split(secret, 3, [2, 5, 7, 11, 13])
    assert set(shares) == {2, 5, 7, 11, 13}
    for subset in itertools.combinations(shares.values(), 3):
        assert shamir.combine(subset) == secret
    assert shamir.combine(shares.values()) == secret  # extra shares are fine


def test_fewer_than_t_shares_cannot_reconstruct() -> None:
    shares = shamir.split(os.urandom(32), 4, range(1, 8))
    for subset in itertools.combinations(shares.values(), 3):
        with pytest.raises(SecAggError, match="only 3 shares, 4 needed"):
            shamir.combine(subset)
    with pytest.raises(SecAggError, match="no shares"):
        shamir.combine([])


def test_t_minus_one_shares_are_consistent_with_any_secret() -> None:
    # Information-theoretic hiding: with t = 2, one share fits a line through any
    # secret at all, so it says nothing about the real one.
    secret, other = os.urandom(32), os.urandom(32)
    share = shamir.split(secret, 2, [1, 2])[1]
    s_other = int.from_bytes(other, "little")
    forged = shamir.Share(2, (s_other + 2 * (share.y - s_other)) % shamir.PRIME, 2, 32)
    assert shamir.combine([share, forged]) == other


def test_shares_round_trip_and_reject_garbage() -> None:
    share = shamir.split(b"\x00" * 31 + b"\x01", 2, [9, 10])[9]
    data = share.to_bytes()
    assert len(data) == shamir.SHARE_BYTES
    assert shamir.Share.from_bytes(data) == share
    with pytest.raises(SecAggError):
        shamir.Share.from_bytes(data[:-1])
    with pytest.raises(SecAggError):
        shamir.Share.from_bytes(b"\x00" * shamir.SHARE_BYTES)  # x = 0


def test_inconsistent_inputs_are_refused() -> None:
    with pytest.raises(SecAggError, match="threshold"):
        shamir.split(b"s" * 32, 4, [1, 2, 3])
    with pytest.raises(SecAggError, match="distinct"):
        shamir.split(b"s" * 32, 2, [1, 1, 2])
    with pytest.raises(SecAggError, match="distinct"):
        shamir.split(b"s" * 32, 2, [0, 1])
    a = shamir.split(b"s" * 32, 2, [1, 2, 3])
    b = shamir.split(b"t" * 32, 2, [1, 2, 3])
    with pytest.raises(SecAggError, match="two different shares"):
        shamir.combine([a[1], b[1], a[2]])
    c = shamir.split(b"s" * 32, 3, [1, 2, 3])
    with pytest.raises(SecAggError, match="disagree"):
        shamir.combine([a[1], c[2], c[3]])


@settings(max_examples=30, deadline=None)
@given(
    secret=st.binary(min_size=1, max_size=64),
    n=st.integers(1, 12),
    data=st.data(),
)
def test_round_trip_property(secret: bytes, n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n))
    ids = data.draw(st.lists(st.integers(1, 2**32 - 1), min_size=n, max_size=n, unique=True))
    shares = list(shamir.split(secret, t, ids).values())
    picked = data.draw(st.permutations(shares))[:t]
    assert shamir.combine(picked) == secret
