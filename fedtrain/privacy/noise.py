"""Noise from a cryptographically secure source, continuous and discrete.

Privacy noise must be unpredictable to whoever sees the result, so it never comes from
a seeded PRNG: uniforms are read from an AES-256-CTR keystream keyed by 32 bytes of
`os.urandom` (`cryptography`; several GB/s, far faster than reading `os.urandom`
directly for model-sized vectors), then shaped:

- `gaussian`: Box-Muller over 53-bit uniforms (central DP, added by the server).
- `discrete_gaussian`: the discrete Gaussian N_Z(0, sigma^2) by rejection from the
  discrete Laplace (Canonne, Kamath & Steinke 2020, Algorithm 3), vectorised. Sites
  add it to *integer* (quantized) updates, so it composes with secure aggregation
  (distributed DP): sums of discrete Gaussians stay on the integer grid the masks
  live on. Acceptance probabilities are evaluated in float64, as in TensorFlow
  Privacy's vectorised sampler; the exact big-rational version would be ~1000x slower.

Floating-point Gaussian sampling has known side channels (Mironov 2012): where that
matters, prefer distributed DP with the discrete sampler.
"""

from __future__ import annotations

import math
import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_SEED_BYTES = 32


def _random_uint64(count: int) -> np.ndarray:
    """`count` uniform uint64 from a fresh AES-CTR keystream keyed by os.urandom."""
    enc = Cipher(algorithms.AES(os.urandom(_SEED_BYTES)), modes.CTR(bytes(16))).encryptor()
    raw = enc.update(bytes(8 * count))
    return np.frombuffer(raw, dtype="<u8")


def uniform(count: int) -> np.ndarray:
    """Uniform float64 in the open interval (0, 1) (53 random bits, never 0 or 1)."""
    bits = _random_uint64(count) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) * 2.0**-53


def gaussian(count: int, std: float) -> np.ndarray:
    """`count` samples of N(0, std^2), float64."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    half = (count + 1) // 2
    u1, u2 = uniform(half), uniform(half)
    radius = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])
    return std * z[:count]


def _discrete_laplace(count: int, t: int) -> np.ndarray:
    """Discrete Laplace with scale t: P(y) proportional to exp(-|y|/t), int64."""
    # |y| ~ Geometric(1 - exp(-1/t)) with the sign chosen uniformly; (0, negative) is
    # rejected so that zero is not counted twice.
    out = np.empty(0, dtype=np.int64)
    p = -math.expm1(-1.0 / t)
    while out.size < count:
        n = 2 * (count - out.size) + 16
        magnitude = np.floor(np.log(uniform(n)) / math.log1p(-p)).astype(np.int64)
        negative = uniform(n) < 0.5
        keep = ~(negative & (magnitude == 0))
        out = np.concatenate([out, np.where(negative, -magnitude, magnitude)[keep]])
    return out[:count]


def discrete_gaussian(count: int, sigma: float) -> np.ndarray:
    """`count` samples of the discrete Gaussian N_Z(0, sigma^2), int64."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return np.zeros(count, dtype=np.int64)
    t = math.floor(sigma) + 1
    out = np.empty(0, dtype=np.int64)
    while out.size < count:
        n = 2 * (count - out.size) + 16
        y = _discrete_laplace(n, t)
        accept = uniform(n) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        out = np.concatenate([out, y[accept]])
    return out[:count]
