"""Fixed-point encoding of weighted float updates into Z_{2^32} (uint32).

Masking works in a finite group, so every float update is first clipped and mapped to
integers. The encoding is chosen so that the *integer* sum of all contributions is
below 2^32: the modular sum the server unmasks is then the true integer sum, and
decoding it is exact up to the rounding of each contribution.

Encoding of one site's update ``x`` (length m) with weight ``w``:

* the weight is rounded to the grid ``weight_resolution`` (default 1.0, so example
  counts are exact): ``q_w = round(w / weight_resolution)``, effective weight
  ``w' = q_w * weight_resolution``, at most ``max_weight``;
* each value is clipped to ``[-clip, clip]`` and multiplied by ``w'``, giving
  ``v`` in ``[-clip * max_weight, clip * max_weight]``;
* ``v`` is mapped affinely onto ``[0, L]`` with ``L = 2^bits - 1`` and stochastically
  rounded to an integer (unbiased: ``E[q] = scaled value``, to within 2^-32 of a
  step); the quantization step is
  ``step = 2 * clip * max_weight / L``;
* the weight ``q_w`` is appended as element ``m``, so the vector has ``m + 1`` elements.

The server only ever sees the sum over ``n`` contributors: ``sum(w' * x)`` (decoded) and
``sum(w')``, hence the weighted mean, never one site's weight.

Error bound (clipping aside): each stochastically rounded value is off by less than one
``step``, so per element
``|decoded_sum - sum_i w'_i * clip(x_i)| < n * step`` and
``|decoded_mean - sum_i w'_i * clip(x_i) / sum_i w'_i| < n * step / sum_i w'_i``.
The error is zero-mean, so in practice it is ~``sqrt(n) * step / 2`` rather than
``n * step``. ``w' == w`` whenever ``w`` is a multiple of ``weight_resolution``.

No wrap-around: the server refuses more than ``max_clients`` contributors, and a
configuration is refused unless ``max_clients * L < 2^32`` and
``max_clients * (max_weight / weight_resolution) < 2^32``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.secagg.crypto import MASK_KEY_BYTES, keystream

MODULUS_BITS = 32
MODULUS = 1 << MODULUS_BITS
ENCODE_CHUNK = 1 << 15  # values encoded per step: the buffers stay in the CPU's cache


def max_bits_for(max_clients: int) -> int:
    """Largest bits per value such that ``max_clients`` contributions cannot wrap."""
    if max_clients < 1:
        raise SecAggError(f"max_clients must be >= 1, got {max_clients}")
    bits = MODULUS_BITS
    while bits > 0 and max_clients * ((1 << bits) - 1) >= MODULUS:
        bits -= 1
    if bits == 0:
        raise SecAggError(f"max_clients={max_clients} leaves no bits per value in Z_2^32")
    return bits


@dataclass(frozen=True)
class Quantizer:
    """Encode (update, weight) as uint32 and decode sums; validated at construction.

    Attributes:
        clip: values are clipped to ``[-clip, clip]`` before weighting.
        bits: bits per weighted value (``L = 2^bits - 1`` levels).
        max_clients: most contributors a sum may have; sizes the wrap-around check.
        max_weight: largest weight one site may declare (e.g. its example count).
        weight_resolution: weights are rounded to multiples of this (1.0: counts exact).
    """

    clip: float
    bits: int
    max_clients: int
    max_weight: float
    weight_resolution: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"clip must be a positive finite number, got {self.clip}")
        if not (1 <= self.bits <= MODULUS_BITS):
            raise SecAggError(f"bits must be in [1, {MODULUS_BITS}], got {self.bits}")
        if self.max_clients < 1:
            raise SecAggError(f"max_clients must be >= 1, got {self.max_clients}")
        if not (math.isfinite(self.weight_resolution) and self.weight_resolution > 0):
            raise SecAggError(
                f"weight_resolution must be a positive finite number, got {self.weight_resolution}"
            )
        if not (math.isfinite(self.max_weight) and self.max_weight >= self.weight_resolution):
            raise SecAggError(
                f"max_weight must be finite and >= weight_resolution "
                f"({self.weight_resolution}), got {self.max_weight}"
            )
        levels = self.levels
        if self.max_clients * levels >= MODULUS:
            raise SecAggError(
                f"sum of {self.max_clients} updates at {self.bits} bits per value can wrap: "
                f"{self.max_clients} * (2^{self.bits} - 1) = {self.max_clients * levels} "
                f">= 2^{MODULUS_BITS}; lower bits to at most "
                f"{max_bits_for(self.max_clients)} or lower max_clients"
            )
        weight_units = self.max_weight_units
        if self.max_clients * weight_units >= MODULUS:
            raise SecAggError(
                f"sum of {self.max_clients} weights can wrap: {self.max_clients} * "
                f"(max_weight {self.max_weight} / weight_resolution "
                f"{self.weight_resolution}) = {self.max_clients * weight_units} "
                f">= 2^{MODULUS_BITS}; lower max_weight or raise weight_resolution"
            )

    @property
    def levels(self) -> int:
        """``L = 2^bits - 1``: the largest encoded value of one contribution."""
        return (1 << self.bits) - 1

    @property
    def max_weight_units(self) -> int:
        """Largest encoded weight of one contribution."""
        return math.floor(self.max_weight / self.weight_resolution + 1e-9)

    @property
    def step(self) -> float:
        """Quantization step of one weighted value (see the module's error bound)."""
        return 2.0 * self.clip * self.max_weight / self.levels

    def encode_weight(self, weight: float) -> int:
        """Round ``weight`` to the grid; the site multiplies its update by the result."""
        if not (math.isfinite(weight) and weight >= 0):
            raise SecAggError(f"weight must be a finite number >= 0, got {weight}")
        units = round(weight / self.weight_resolution)
        if units > self.max_weight_units:
            raise SecAggError(
                f"weight {weight} exceeds max_weight {self.max_weight}; raise max_weight in "
                f"the secure-aggregation config (and keep max_clients * max_weight < 2^32)"
            )
        return units

    def effective_weight(self, weight: float) -> float:
        """The weight actually applied and summed (``weight`` rounded to the grid)."""
        return self.encode_weight(weight) * self.weight_resolution

    def encode(self, update: np.ndarray, weight: float, rng: np.random.Generator) -> np.ndarray:
        """Encode ``update`` (any float array, flattened) and ``weight`` into uint32.

        Returns a fresh array of ``update.size + 1`` elements (the last is the weight).
        ``rng`` drives stochastic rounding only (it is not a secret: the result is
        masked before it leaves the site): it keys an AES-128 keystream (as the masks'
        PRG, :func:`~fedtrain.secagg.crypto.keystream`) whose 32-bit words are the
        rounding uniforms, several times cheaper than numpy's generator and as
        reproducible. The work runs chunk by chunk through small buffers, so a
        1M-value update makes no model-sized temporaries.
        """
        x = np.asarray(update).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
            raise SecAggError(f"update must be numeric, got dtype {x.dtype}")
        # Sum first: NaN and Inf propagate, so one cheap reduction clears the usual case.
        if x.dtype.kind == "f" and not np.isfinite(x.sum()) and not np.all(np.isfinite(x)):
            raise SecAggError("update contains NaN or Inf; refuse to encode it")
        units = self.encode_weight(weight)
        factor = units * self.weight_resolution * self.levels / (2.0 * self.clip * self.max_weight)
        half = self.levels / 2.0
        # Clipping x to [-clip, clip] is clipping x * factor + half to [low, high], a
        # sub-range of [0, L]; then + u < 1 stays below L + 1, so the floor is in [0, L].
        low = max(0.0, half - self.clip * factor)
        high = min(float(self.levels), half + self.clip * factor)
        n = x.shape[0]
        out = np.empty(n + 1, dtype=np.uint32)
        size = min(n, ENCODE_CHUNK)
        scaled = np.empty(size, dtype=np.float64)
        uniform = np.empty(size, dtype=np.float64)
        raw = bytearray(size * 4 + 15)  # update_into wants a block of room
        words = np.frombuffer(raw, dtype="<u4", count=size)
        zeros = memoryview(bytes(size * 4))
        stream = keystream(rng.bytes(MASK_KEY_BYTES))
        for start in range(0, n, ENCODE_CHUNK):
            stop = min(start + ENCODE_CHUNK, n)
            v, u = scaled[: stop - start], uniform[: stop - start]
            np.multiply(x[start:stop], factor, out=v, dtype=np.float64)
            v += half
            np.clip(v, low, high, out=v)
            stream.update_into(zeros[: 4 * v.shape[0]], raw)
            np.multiply(words[: v.shape[0]], 2.0**-32, out=u)  # uniform in [0, 1)
            v += u
            out[start:stop] = v  # the cast truncates, i.e. floors (v >= 0)
        out[-1] = units
        return out

    def decode_sum(self, total: np.ndarray, contributors: int) -> tuple[np.ndarray, float]:
        """Decode an unmasked modular sum of ``contributors`` encodings.

        Returns ``(sum of w'_i * clip(x_i) as float64, sum of w'_i)``.
        """
        total = np.asarray(total)
        if total.dtype != np.uint32 or total.ndim != 1 or total.size < 1:
            raise SecAggError(
                f"expected a 1-D uint32 sum with the weight appended, got {total.dtype} "
                f"shape {total.shape}"
            )
        if not (0 <= contributors <= self.max_clients):
            raise SecAggError(
                f"{contributors} contributors is outside [0, max_clients={self.max_clients}]; "
                f"the sum may have wrapped"
            )
        values = total[:-1].astype(np.float64)
        values -= contributors * (self.levels / 2.0)
        values *= self.step
        return values, int(total[-1]) * self.weight_resolution

    def decode_mean(self, total: np.ndarray, contributors: int) -> np.ndarray:
        """Weighted mean ``sum(w' x) / sum(w')`` from an unmasked sum."""
        values, weight = self.decode_sum(total, contributors)
        if weight <= 0:
            raise SecAggError(
                f"total weight of the {contributors} included sites is 0; no mean exists"
            )
        values /= weight
        return values

    def mean_error_bound(self, contributors: int, total_weight: float) -> float:
        """Documented per-element bound on |decoded mean - float weighted mean|."""
        if total_weight <= 0:
            raise SecAggError("total_weight must be > 0 for a mean error bound")
        return contributors * self.step / total_weight
