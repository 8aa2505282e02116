"""Shamir secret sharing over GF(2^521 - 1) with Python ints.

The Mersenne prime 2^521 - 1 holds a 32-byte secret (a mask seed or an X25519 private
key) in one field element, so each secret is one polynomial: sharing a secret among
k + 1 holders costs (k + 1) * (t - 1) big-int multiplications, microseconds in total.
Coefficients come from ``secrets`` (the OS CSPRNG). Fewer than ``t`` shares reveal
nothing about the secret (information-theoretically).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from fedtrain.errors import SecAggError

PRIME = (1 << 521) - 1
_Y_BYTES = 66  # ceil(521 / 8)
_HEADER = struct.Struct("<IHH")  # x, threshold, secret length
SHARE_BYTES = _HEADER.size + _Y_BYTES
MAX_SECRET_BYTES = 64  # 512 bits < 521 bits


@dataclass(frozen=True)
class Share:
    """One point (x, y) of the sharing polynomial, with the parameters to combine it.

    ``x`` is the holder's site id (never 0: the secret lives at x = 0).
    """

    x: int
    y: int
    threshold: int
    secret_len: int

    def to_bytes(self) -> bytes:
        return _HEADER.pack(self.x, self.threshold, self.secret_len) + self.y.to_bytes(
            _Y_BYTES, "little"
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        if len(data) != SHARE_BYTES:
            raise SecAggError(f"a Shamir share is {SHARE_BYTES} bytes, got {len(data)}")
        x, threshold, secret_len = _HEADER.unpack_from(data)
        y = int.from_bytes(data[_HEADER.size :], "little")
        if not (x > 0 and threshold >= 1 and 0 < secret_len <= MAX_SECRET_BYTES and y < PRIME):
            raise SecAggError(
                f"malformed Shamir share (x={x}, threshold={threshold}, length={secret_len})"
            )
        return cls(x, y, threshold, secret_len)


def split(secret: bytes, threshold: int, share_ids: Iterable[int]) -> dict[int, Share]:
    """Share ``secret`` so that any ``threshold`` of the returned shares recover it.

    Returns ``{share_id: Share}``. ``share_ids`` must be distinct positive ints.
    """
    ids = list(share_ids)
    if not (0 < len(secret) <= MAX_SECRET_BYTES):
        raise SecAggError(f"secret must be 1..{MAX_SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(ids)) != len(ids) or any(not (0 < i < PRIME) for i in ids):
        raise SecAggError(f"share ids must be distinct positive ints, got {sorted(ids)}")
    if not (1 <= threshold <= len(ids)):
        raise SecAggError(f"threshold {threshold} must be in [1, number of shares = {len(ids)}]")
    coeffs = [int.from_bytes(secret, "little")]
    coeffs.extend(secrets.randbelow(PRIME) for _ in range(threshold - 1))
    coeffs.reverse()  # highest degree first, for Horner
    shares: dict[int, Share] = {}
    for x in ids:
        y = 0
        for c in coeffs:
            y = (y * x + c) % PRIME
        shares[x] = Share(x, y, threshold, len(secret))
    return shares


@lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange basis values at 0 for the points ``xs`` (cached: holder sets repeat)."""
    out = []
    for j, xj in enumerate(xs):
        num = 1
        den = 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def combine(shares: Iterable[Share]) -> bytes:
    """Recover the secret from at least ``threshold`` shares (extra shares are ignored).

    Raises SecAggError when fewer than ``threshold`` distinct shares are given, or the
    shares disagree on their parameters.
    """
    by_x: dict[int, Share] = {}
    for s in shares:
        if s.x in by_x and by_x[s.x] != s:
            raise SecAggError(f"two different shares for holder {s.x}")
        by_x[s.x] = s
    if not by_x:
        raise SecAggError("no shares to combine")
    params = {(s.threshold, s.secret_len) for s in by_x.values()}
    if len(params) != 1:
        raise SecAggError(f"shares disagree on (threshold, secret length): {sorted(params)}")
    ((threshold, secret_len),) = params
    if len(by_x) < threshold:
        raise SecAggError(f"only {len(by_x)} shares, {threshold} needed to reconstruct the secret")
    xs = tuple(sorted(by_x)[:threshold])
    secret = 0
    for x, lam in zip(xs, _lagrange_at_zero(xs), strict=True):
        secret = (secret + by_x[x].y * lam) % PRIME
    if secret.bit_length() > 8 * secret_len:
        raise SecAggError("shares are inconsistent: the recovered value does not fit the secret")
    return secret.to_bytes(secret_len, "little")
