"""Secure aggregation in the simulation: the deployment's SecAgg+ objects, in memory.

With `[secagg]` on, workers cannot pre-fold partial sums: in a deployment the server
only ever sees one masked vector per site, and a partial sum over a worker's clients
is exactly what secure aggregation hides. So every client's update comes back to the
driver (as for median or Krum), is checked like any update, flattened at once into the
float32 vector SecAgg+ masks (the update itself is then dropped), and when the round's
clients have all reported one SecAgg+ round runs over those vectors through
`fedtrain.secagg.updates.secure_round`: the same client and server state machines as
the runtime, with real X25519 keys, AES-GCM-encrypted Shamir shares and AES-CTR masks,
and (``secagg.consistency_check``) the consistency stage, every client signing with an
Ed25519 identity from a fresh in-memory PKI (where a deployment uses certificates).
Its unmasked, dequantized sum is the `WeightedSum` the strategy finalizes.

Memory: the driver holds one float32 vector per reporting client until the protocol
runs, i.e. O(clients per round x model): 10 clients of a 1M-parameter model take
40 MB, 1,000 clients of a 10M-parameter model 40 GB. Sample fewer clients per round
(`strategy.fraction_fit`) for large models. Time: about 12 ms per client per million
parameters on one core (quantization plus k + 1 mask expansions; benchmarks/RESULTS.md),
all in the driver.

Dropouts: `secagg.stage_dropouts` makes a seeded fraction of each round's participants
vanish at each stage. The stochastic rounding and the neighbour graph are seeded from
the run's seed too (the graph seed is public in the protocol, so a seeded one weakens
nothing), hence a run is reproducible; the keys, seeds and masks are fresh OS
randomness every round, as in a deployment, and cancel exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedtrain.errors import ConfigError, SecAggError, UpdateRejected
from fedtrain.secagg.evaluation import EvalTotals, secure_evaluation
from fedtrain.secagg.graph import GRAPH_SEED_BYTES
from fedtrain.secagg.quantize import Quantizer
from fedtrain.secagg.round_ids import evaluation_id
from fedtrain.secagg.settings import require_sum_only
from fedtrain.secagg.updates import UpdateLayout, secure_round
from fedtrain.simulation.config import SECAGG_STAGES, SimConfig
from fedtrain.simulation.fold import RoundFold
from fedtrain.simulation.plan import RoundPlan
from fedtrain.strategy import Strategy, WeightedSum, validate_update
from fedtrain.strategy.aggregate import Aggregator
from fedtrain.task import EvalResult
from fedtrain.tensors import TensorSpec

log = logging.getLogger(__name__)

# Independent random streams under the run's seed (numpy SeedSequence entropy words).
_STAGE_DROPOUT_STREAM = 0x53414744
_ROUNDING_STREAM = 0x53415251
_GRAPH_STREAM = 0x53414747
_EVAL_STREAM = 0x53414556  # xor'ed into the streams above for secure evaluations


class MaskedUploads(Aggregator):
    """Stands in for the strategy's aggregator while a secure round's updates arrive.

    `add` checks an update as the strategy's aggregator would (names, dtypes, shapes,
    NaN/Inf, weight) and its weight against `secagg.max_weight` (a site over it could
    not encode its update: it would drop out), then keeps it only as the float32 vector
    the site would mask.
    """

    def __init__(self, specs: tuple[TensorSpec, ...], quantizer: Quantizer) -> None:
        super().__init__(specs)
        self.layout = UpdateLayout.of(specs)
        self.quantizer = quantizer
        self.vectors: list[np.ndarray] = []
        self.weights: list[float] = []
        self.clipped = 0  # values beyond secagg.clip (a site would warn its operator)

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        validate_update(delta, tuple(self.specs.values()))
        if not weight > 0:
            raise UpdateRejected(f"update weight must be positive, got {weight}")
        try:
            self.quantizer.encode_weight(weight)
        except SecAggError as exc:
            raise UpdateRejected(str(exc)) from None
        vector = self.layout.flatten(delta)
        self.clipped += int(np.count_nonzero(np.abs(vector) > self.quantizer.clip))
        self.vectors.append(vector)
        self.weights.append(weight)
        self.commit(weight)


class SecureAggregation:
    """Runs each simulated round's aggregation through SecAgg+ (see the module doc)."""

    def __init__(self, config: SimConfig) -> None:
        self.settings = config.secagg
        self.protocol = config.secagg.protocol()
        self.seed = config.seed

    def check(self, strategy: Strategy, num_clients: int) -> None:
        """Refuse, before any training, a strategy or round size SecAgg+ cannot serve."""
        require_sum_only(strategy)
        per_round = strategy.num_to_sample(num_clients)
        if per_round > self.protocol.max_clients:
            raise ConfigError(
                f"{per_round} clients train per round (strategy.fraction_fit = "
                f"{strategy.fraction_fit} of {num_clients}), more than secagg.max_clients = "
                f"{self.protocol.max_clients}: their sum could wrap; raise secagg.max_clients "
                "(it lowers the bits per value) or lower strategy.fraction_fit"
            )

    def uploads(self, specs: tuple[TensorSpec, ...]) -> MaskedUploads:
        """A fresh collector for one round's updates."""
        return MaskedUploads(specs, self.protocol.quantizer())

    def stage_dropouts(self, server_round: int, n: int, stream: int = 0) -> dict[int, set[int]]:
        """Secagg ids (1..n) that vanish at each stage: round(rate * n) of those still in."""
        rng = np.random.default_rng([self.seed, _STAGE_DROPOUT_STREAM ^ stream, server_round])
        alive = list(range(1, n + 1))
        out: dict[int, set[int]] = {}
        for stage, rate in enumerate(self.settings.stage_dropouts):
            count = min(int(rate * n + 0.5), len(alive))
            gone = rng.choice(len(alive), size=count, replace=False) if count else []
            out[stage] = {alive[i] for i in gone}
            alive = [s for s in alive if s not in out[stage]]
        return out

    def aggregate(
        self,
        plan: RoundPlan,
        fold: RoundFold,
        uploads: MaskedUploads,
        aggregate: Aggregator,
        min_included: int,
    ) -> dict[str, Any]:
        """Run SecAgg+ over the round's updates into `aggregate`; the round's secagg record.

        Clients the protocol leaves out (dropped before their masked input arrived, or
        every client when the round fails) are removed from `fold.results`, so they
        count as not reported and their training metrics are left out. A round with
        fewer than `min_included` masked inputs (the strategy's minimum) fails before
        anything is unmasked, as in a deployment: the server never unmasks a sum it
        will not use.
        """
        if not isinstance(aggregate, WeightedSum):
            raise TypeError(
                f"secure aggregation needs a WeightedSum to merge into, got "
                f"{type(aggregate).__name__}"
            )
        clients = [c for c in plan.training if c in fold.results]
        if len(clients) != len(uploads.vectors):  # pragma: no cover - RoundFold's order
            raise AssertionError(f"{len(clients)} reports but {len(uploads.vectors)} updates")
        n = len(clients)
        drops = self.stage_dropouts(plan.server_round, n)
        record: dict[str, Any] = {
            "secagg_sites": n,
            "secagg_clipped": uploads.clipped,
            **{f"secagg_dropped_{name}": len(drops[s]) for s, name in enumerate(SECAGG_STAGES)},
        }
        if n >= 2:
            record["secagg_k"], record["secagg_t"] = self.protocol.degree_and_threshold(n)
        start = time.perf_counter()
        try:
            if n < max(2, min_included):
                raise SecAggError(
                    f"round {plan.server_round}: {n} update(s) arrived, SecAgg+ needs 2 and "
                    f"the round {min_included}; nothing is unmasked"
                )
            graph = np.random.default_rng([self.seed, _GRAPH_STREAM, plan.server_round])
            weighted, result = secure_round(
                uploads.vectors,
                uploads.weights,
                tuple(uploads.specs.values()),
                self.protocol,
                dropouts=drops,
                round_id=plan.server_round,
                rng=np.random.default_rng([self.seed, _ROUNDING_STREAM, plan.server_round]),
                graph_seed=graph.bytes(GRAPH_SEED_BYTES),
                min_included=min_included,
            )
        except SecAggError as exc:
            log.warning("round %d: secure aggregation failed: %s", plan.server_round, exc)
            included: set[str] = set()
            record["secagg_error"] = str(exc)
        else:
            aggregate.merge(weighted)
            record["secagg_total_weight"] = weighted.total_weight  # the server learns it too
            included = {clients[i - 1] for i in result.included}
        uploads.vectors.clear()
        for client in clients:
            if client not in included:
                del fold.results[client]
        record["secagg_included"] = len(included)
        record["secagg_seconds"] = time.perf_counter() - start
        return record

    def evaluate(
        self, server_round: int, results: Mapping[str, EvalResult], min_included: int
    ) -> tuple[EvalTotals | None, list[str], dict[str, Any]]:
        """One secure evaluation over the clients' `results` (the same protocol as a
        round's updates, with `secagg.eval_clip` and the same seeded stage dropouts):
        (the federation's totals or None when it failed, the clients left out, the
        record's `eval_secagg_*` keys). Nothing per client leaves this function."""
        clients = sorted(results)
        n = len(clients)
        drops = self.stage_dropouts(server_round, n, _EVAL_STREAM)
        record: dict[str, Any] = {
            f"eval_secagg_dropped_{name}": len(drops[s]) for s, name in enumerate(SECAGG_STAGES)
        }
        try:
            if n < max(2, min_included):
                raise SecAggError(
                    f"round {server_round}: {n} client(s) evaluated, a secure evaluation "
                    f"needs {max(2, min_included)}; nothing is unmasked"
                )
            graph = np.random.default_rng([self.seed, _GRAPH_STREAM ^ _EVAL_STREAM, server_round])
            totals, result = secure_evaluation(
                [results[c] for c in clients],
                self.settings.evaluation_protocol(),
                dropouts=drops,
                round_id=evaluation_id(server_round),
                rng=np.random.default_rng(
                    [self.seed, _ROUNDING_STREAM ^ _EVAL_STREAM, server_round]
                ),
                graph_seed=graph.bytes(GRAPH_SEED_BYTES),
                min_included=min_included,
            )
        except SecAggError as exc:
            log.warning("round %d: secure evaluation failed: %s", server_round, exc)
            record["eval_secagg_error"] = str(exc)
            return None, clients, record
        included = {clients[i - 1] for i in result.included}
        return totals, [c for c in clients if c not in included], record
