"""Model updates <-> the flat vectors SecAgg+ masks, and the sum back into a strategy.

The protocol aggregates one vector of reals per site. :class:`UpdateLayout` fixes,
from the global model's tensor specs alone (so the server and every site agree
without exchanging anything), which values go into that vector and in what order:

* **floating tensors** (float16, bfloat16, float32, float64) in model order,
  flattened, as float32. The delta is taken in float32 (float64 for float64
  tensors, then narrowed): a bfloat16 model's update is not rounded to bfloat16
  first, and float32's precision is far below the quantization step anyway.
* **integer and bool tensors** (BatchNorm's ``num_batches_tracked``, step counters)
  are left out. Their delta is a count of local steps, i.e. a function of the site's
  example count, which secure aggregation exists to hide; and through the quantizer
  they would be clipped to ``[-clip, clip]`` anyway. The server keeps its own value
  for them: their mean delta is taken as zero.

:meth:`UpdateLayout.weighted_sum` turns an unmasked :class:`SecAggResult` into the
:class:`WeightedSum` a sum-only strategy finalizes, so FedAvg, FedProx and the FedOpt
family run unchanged: they see ``sum_i w_i * delta_i`` and ``sum_i w_i`` exactly as
without secure aggregation, up to the quantization bound of
:mod:`fedtrain.secagg.quantize`. :func:`secure_round` (and :func:`secure_weighted_sum`,
its sum alone) is the in-memory driver for the simulation: one round over given deltas
and weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtrain.errors import SecAggError
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.inmemory import Dropouts, run_in_memory
from fedtrain.secagg.protocol import EncodedNoise, SecAggResult
from fedtrain.secagg.round_ids import describe
from fedtrain.strategy.aggregate import WeightedSum, accumulator_dtype
from fedtrain.tensors import ModelState, TensorSpec, torch_dtype


@dataclass(frozen=True)
class UpdateLayout:
    """Where each floating tensor of a model lives in the masked vector (see module doc)."""

    specs: tuple[TensorSpec, ...]
    #: (tensor name, start, end) in the vector, for the floating tensors only.
    slots: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> UpdateLayout:
        specs = tuple(specs)
        slots = []
        start = 0
        for spec in specs:
            if torch_dtype(spec.dtype).is_floating_point:
                slots.append((spec.name, start, start + spec.numel))
                start += spec.numel
        if start == 0:
            raise SecAggError(
                "the model has no floating-point values to aggregate securely (only integer "
                "or bool tensors, which secure aggregation leaves out)"
            )
        return cls(specs, tuple(slots))

    @property
    def length(self) -> int:
        """Values per site (the masked vector has one more: the weight)."""
        return self.slots[-1][2]

    @property
    def excluded(self) -> tuple[str, ...]:
        """Tensors left out of the vector (integer/bool): the server keeps its own."""
        inside = {name for name, _, _ in self.slots}
        return tuple(s.name for s in self.specs if s.name not in inside)

    def flatten(self, delta: Mapping[str, torch.Tensor]) -> np.ndarray:
        """A delta shaped like the model -> one float32 vector."""
        out = np.empty(self.length, dtype=np.float32)
        for name, start, end in self.slots:
            view = torch.from_numpy(out[start:end])
            view.copy_(_flat(delta, name, end - start))
        return out

    def flatten_delta(self, local: ModelState, global_state: ModelState) -> np.ndarray:
        """``local - global`` as one float32 vector, without a model-sized delta in between."""
        out = np.empty(self.length, dtype=np.float32)
        for name, start, end in self.slots:
            mine, base = _flat(local, name, end - start), _flat(global_state, name, end - start)
            view = torch.from_numpy(out[start:end])
            if base.dtype == torch.float32 and mine.dtype == torch.float32:
                torch.sub(mine, base, out=view)
            else:  # narrow floats lose nothing, float64 is narrowed once at the end
                view.copy_(mine.to(torch.float64) - base.to(torch.float64))
        return out

    def unflatten(self, vector: np.ndarray) -> ModelState:
        """A vector -> tensors shaped and typed like the model; excluded tensors are zero."""
        vector = np.asarray(vector)
        if vector.shape != (self.length,):
            raise SecAggError(f"expected a vector of {self.length} values, got {vector.shape}")
        slots = {name: (start, end) for name, start, end in self.slots}
        out = {}
        for spec in self.specs:
            dtype = torch_dtype(spec.dtype)
            if spec.name in slots:
                start, end = slots[spec.name]
                values = torch.from_numpy(np.ascontiguousarray(vector[start:end]))
                out[spec.name] = values.to(dtype).reshape(spec.shape)
            else:
                out[spec.name] = torch.zeros(spec.shape, dtype=dtype)
        return ModelState(out)

    def weighted_sum(self, result: SecAggResult) -> WeightedSum:
        """The unmasked round as the partial sum a sum-only strategy finalizes.

        ``count`` is the number of included sites; ``total_weight`` their (rounded)
        weights' sum. Excluded tensors get a zero sum, so their mean delta is zero.
        """
        values, total_weight = result.weighted_sum()
        if values.shape != (self.length,):
            raise SecAggError(
                f"{describe(result.round_id)}: the unmasked sum has {values.shape[0]} values, the "
                f"model has {self.length} floating-point values"
            )
        slots = {name: (start, end) for name, start, end in self.slots}
        sums = {}
        for spec in self.specs:
            acc = accumulator_dtype(torch_dtype(spec.dtype))
            if spec.name in slots:
                start, end = slots[spec.name]
                sums[spec.name] = torch.from_numpy(values[start:end]).to(acc)
            else:
                sums[spec.name] = torch.zeros(spec.numel, dtype=acc)
        return WeightedSum.from_sums(self.specs, sums, total_weight, len(result.included))


def _flat(state: Mapping[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
    tensor = state.get(name)
    if tensor is None or tensor.numel() != numel:
        got = "nothing" if tensor is None else f"{tensor.numel()} values"
        raise SecAggError(f"update tensor {name!r}: expected {numel} values, got {got}")
    return tensor.detach().reshape(-1)


def secure_round(
    deltas: Sequence[Mapping[str, torch.Tensor] | np.ndarray],
    weights: Sequence[float],
    specs: Sequence[TensorSpec],
    config: SecAggConfig,
    *,
    dropouts: Dropouts | None = None,
    round_id: int = 0,
    rng: np.random.Generator | int | None = None,
    graph_seed: bytes | None = None,
    noise: EncodedNoise | None = None,
    min_included: int = 0,
) -> tuple[WeightedSum, SecAggResult]:
    """One SecAgg+ round in memory over ``deltas``: the simulation's entry point.

    A delta is shaped like the model, or already flattened by
    :meth:`UpdateLayout.flatten` (a driver that collects many updates flattens each as
    it arrives and drops the original). Site ``i`` (0-based) takes part as secagg id
    ``i + 1``; ``dropouts`` uses those ids (see :func:`run_in_memory`). Returns what a
    deployment's server would hand the strategy, the weighted sum over the sites that
    were included, and the protocol's result (who was included, who dropped). Every
    delta is held as a float32 vector for the round, so memory is O(sites x model).
    ``noise`` is each site's distributed-DP noise (`fedtrain.privacy.distributed`).
    ``min_included`` is the fewest included sites the sum may be unmasked for (the
    driver's acceptance minimum): below it the round fails before anything is unmasked.
    """
    if len(deltas) != len(weights):
        raise SecAggError(f"{len(deltas)} deltas but {len(weights)} weights")
    layout = UpdateLayout.of(specs)
    vectors = [d if isinstance(d, np.ndarray) else layout.flatten(d) for d in deltas]
    result = run_in_memory(
        vectors,
        list(weights),
        config,
        dropouts,
        round_id=round_id,
        rng=rng,
        graph_seed=graph_seed,
        noise=noise,
        min_included=min_included,
    )
    return layout.weighted_sum(result), result


def secure_weighted_sum(
    deltas: Sequence[Mapping[str, torch.Tensor] | np.ndarray],
    weights: Sequence[float],
    specs: Sequence[TensorSpec],
    config: SecAggConfig,
    **options: Any,
) -> WeightedSum:
    """:func:`secure_round`'s weighted sum alone (same keyword options)."""
    return secure_round(deltas, weights, specs, config, **options)[0]
