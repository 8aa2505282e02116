"""Streaming aggregation: fold one client update at a time, O(model) memory.

The server never holds N client updates at once: each update (or each chunk of one,
as it arrives off the wire) is multiplied by its weight and added into one
accumulator per tensor, in float32 or wider whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedtrain.errors import UpdateRejected
from fedtrain.tensors import ModelState, TensorSpec, torch_dtype


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower floats; float64 for float64 and integers."""
    if dtype.is_floating_point and dtype.itemsize <= 4:
        return torch.float32
    return torch.float64


def compute_delta(local: ModelState, global_state: ModelState) -> ModelState:
    """The update a site sends: local - global, in the model's dtypes.

    The subtraction runs in the accumulator dtype so narrow floats lose nothing
    before the final cast.
    """
    out = {}
    for name, g in global_state.items():
        t = local[name]
        acc = accumulator_dtype(g.dtype)
        if g.dtype == torch.bool:
            out[name] = torch.zeros_like(g)
        else:
            out[name] = (t.to(acc) - g.to(acc)).to(g.dtype)
    return ModelState(out)


def check_finite(name: str, values: torch.Tensor) -> None:
    """Refuse NaN/Inf before they can reach the accumulator."""
    if values.dtype.is_floating_point and not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise UpdateRejected(
            f"update for {name!r} holds {bad} NaN/Inf values; the site's training "
            "diverged (lower the learning rate or clip gradients) and the update was dropped"
        )


class Aggregator:
    """What a strategy hands the drivers each round: fold updates chunk by chunk.

    `add_chunk` takes a slice of a flat tensor so the runtime can fold bytes as they
    arrive, then `commit(weight)` counts the update; `add` does both for a whole
    update. Values are validated (known tensor, dtype, range, finite) before use.
    """

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.specs = {s.name: s for s in specs}
        self.total_weight = 0.0
        self.count = 0

    def _check_chunk(self, name: str, start: int, values: torch.Tensor) -> int:
        """Validate a chunk against the model; returns its end element."""
        spec = self.specs.get(name)
        if spec is None:
            raise UpdateRejected(f"update names tensor {name!r}, which the model does not have")
        if values.dtype != torch_dtype(spec.dtype):
            raise UpdateRejected(f"{name!r}: update has {values.dtype}, model has {spec.dtype}")
        end = start + values.numel()
        if start < 0 or end > spec.numel:
            raise UpdateRejected(f"{name!r}: elements [{start}, {end}) outside {spec.numel}")
        check_finite(name, values)
        return end

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        raise NotImplementedError

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        """Add a whole update; validated completely before any of it is added."""
        validate_update(delta, tuple(self.specs.values()))
        for name, t in delta.items():
            self.add_chunk(name, 0, t.reshape(-1), weight)
        self.commit(weight)

    def commit(self, weight: float) -> None:
        """Count one complete update of this weight (after all its chunks were added)."""
        if not weight > 0:
            raise UpdateRejected(f"update weight must be positive, got {weight}")
        self.total_weight += weight
        self.count += 1


class WeightedSum(Aggregator):
    """Accumulates sum_i w_i * delta_i tensor by tensor: O(model) memory for any N."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        super().__init__(specs)
        self._sums = {
            s.name: torch.zeros(s.numel, dtype=accumulator_dtype(torch_dtype(s.dtype)))
            for s in specs
        }

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        """Add `weight * values` into elements [start, start+len) of tensor `name`."""
        end = self._check_chunk(name, start, values)
        acc = self._sums[name][start:end]
        acc.add_(values.reshape(-1).to(acc.dtype), alpha=weight)

    def mean(self, *, in_place: bool = False) -> dict[str, torch.Tensor]:
        """The weighted mean delta, shaped like the model, in the accumulator dtype.

        `in_place=True` divides the accumulators themselves and hands them out, so
        finalizing a 2 GB model needs no third 2 GB buffer; the sum is consumed.
        """
        if self.count == 0:
            raise UpdateRejected("no updates were aggregated this round")
        if in_place:
            sums, self._sums = self._sums, {}
            return {
                n: s.div_(self.total_weight).reshape(self.specs[n].shape) for n, s in sums.items()
            }
        return {
            n: (s / self.total_weight).reshape(self.specs[n].shape) for n, s in self._sums.items()
        }


class UpdateCollector(Aggregator):
    """Keeps every update (flat, accumulator dtype) for strategies that need them all.

    Median, trimmed mean and Krum cannot be computed from a running sum: memory is
    O(clients x model), and such strategies cannot run under secure aggregation.
    """

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        super().__init__(specs)
        self.updates: list[tuple[dict[str, torch.Tensor], float]] = []
        self._current: dict[str, torch.Tensor] | None = None

    def add_chunk(self, name: str, start: int, values: torch.Tensor, weight: float) -> None:
        end = self._check_chunk(name, start, values)
        if self._current is None:
            self._current = {
                s.name: torch.zeros(s.numel, dtype=accumulator_dtype(torch_dtype(s.dtype)))
                for s in self.specs.values()
            }
        target = self._current[name][start:end]
        target.copy_(values.reshape(-1))

    def commit(self, weight: float) -> None:
        super().commit(weight)
        if self._current is None:  # an update of empty tensors only
            self._current = {s.name: torch.zeros(0) for s in self.specs.values()}
        self.updates.append((self._current, weight))
        self._current = None

    def stacked(self, name: str) -> torch.Tensor:
        """All updates of one tensor as a (clients, numel) matrix."""
        if not self.updates:
            raise UpdateRejected("no updates were aggregated this round")
        return torch.stack([u[name] for u, _ in self.updates])


def validate_update(delta: Mapping[str, torch.Tensor], specs: tuple[TensorSpec, ...]) -> None:
    """Names, dtypes, shapes and finiteness of a whole update, against the model."""
    expected = {s.name: s for s in specs}
    if set(delta) != set(expected):
        missing = sorted(set(expected) - set(delta))
        extra = sorted(set(delta) - set(expected))
        raise UpdateRejected(f"update does not match the model: missing {missing}, extra {extra}")
    for name, t in delta.items():
        spec = expected[name]
        if t.dtype != torch_dtype(spec.dtype) or tuple(t.shape) != spec.shape:
            raise UpdateRejected(
                f"{name!r}: update has {t.dtype} {tuple(t.shape)}, "
                f"model has {spec.dtype} {spec.shape}"
            )
        check_finite(name, t)


def apply_mean_delta(
    global_state: ModelState, mean: Mapping[str, torch.Tensor], *, consume: bool = False
) -> ModelState:
    """global + mean delta, computed wide and written back in each tensor's dtype.

    With `consume=True` the mean's tensors may be overwritten and reused as the result.
    """
    out = {}
    for name, g in global_state.items():
        d = mean[name]
        if g.dtype == torch.bool:
            out[name] = g.clone()
        elif g.dtype == d.dtype:
            out[name] = d.add_(g) if consume else d + g  # reuse the mean's buffer: no extra copy
        elif g.dtype.is_floating_point:
            out[name] = (g.to(d.dtype) + d).to(g.dtype)
        else:
            out[name] = (g.to(torch.float64) + d.to(torch.float64)).round().to(g.dtype)
    return ModelState(out)
