"""Server-side configuration of secure aggregation, validated when it is built.

A bad configuration fails here, with the numbers that make it bad, rather than as a
silently wrapped sum rounds later.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

from fedtrain.errors import SecAggError
from fedtrain.secagg.graph import (
    GRAPH_SEED_BYTES,
    check_threshold,
    choose_degree,
    effective_degree,
    min_threshold,
)
from fedtrain.secagg.messages import RoundParams
from fedtrain.secagg.quantize import Quantizer, max_bits_for
from fedtrain.secagg.round_ids import describe

MAX_SITE_ID = (1 << 32) - 1


@dataclass(frozen=True)
class SecAggConfig:
    """Secure-aggregation settings.

    Attributes:
        clip: each update value is clipped to ``[-clip, clip]`` (set it to the scale of
            your updates: the quantization step grows with it).
        max_clients: most sites one round may aggregate; sizes the no-wrap budget.
        bits: bits per weighted value; ``None`` picks the most that cannot wrap for
            ``max_clients`` (``max_clients * (2^bits - 1) < 2^32``).
        max_weight: largest weight (e.g. example count) one site may declare. Updates
            are multiplied by their weight before encoding, so a larger ``max_weight``
            coarsens the step: ``step = 2 * clip * max_weight / (2^bits - 1)``.
        weight_resolution: weights are rounded to multiples of this (1.0: integer
            example counts are exact).
        k: neighbours per site; ``None`` sizes it per round with
            :func:`~fedtrain.secagg.graph.choose_degree` from the rates below.
        t: Shamir threshold; ``None`` takes ``choose_degree``'s ``t`` (if ``k`` is None)
            or the smallest secure one, ``(k + 1) // 2 + 1``. Must exceed ``(k + 1) / 2``.
        dropout_rate, corruption_rate, failure_probability, leak_probability: the
            targets ``choose_degree`` sizes ``k`` and ``t`` for.
        dp_noise_multiplier, dp_clip_norm, dp_min_survivors: distributed DP, passed to
            the sites in :class:`RoundParams` (0: off; see ``fedtrain.privacy.distributed``,
            which validates them); the server refuses to unmask a sum of fewer than
            ``dp_min_survivors`` sites.
        consistency_check: sites sign the survivor set before revealing any share
            (`fedtrain.secagg.consistency`), so a server that lies about who dropped
            out gets neither both secrets of a site nor the sum of fewer than ``t``
            sites. Needs site identities.
    """

    clip: float = 1.0
    max_clients: int = 100
    bits: int | None = None
    max_weight: float = 100_000.0
    weight_resolution: float = 1.0
    k: int | None = None
    t: int | None = None
    dropout_rate: float = 0.1
    corruption_rate: float = 0.0
    failure_probability: float = 1e-6
    leak_probability: float = 1e-9
    dp_noise_multiplier: float = 0.0
    dp_clip_norm: float = 0.0
    dp_min_survivors: int = 0
    consistency_check: bool = True

    def __post_init__(self) -> None:
        self.quantizer()  # validates the no-wrap budget
        if min(self.dp_noise_multiplier, self.dp_clip_norm, self.dp_min_survivors) < 0:
            raise SecAggError("distributed-DP parameters must be >= 0 (0: off)")
        if self.dp_min_survivors > self.max_clients:
            raise SecAggError(
                f"dp_min_survivors = {self.dp_min_survivors} exceeds max_clients = "
                f"{self.max_clients}: no round could ever be unmasked"
            )
        if self.t is not None and self.k is None:
            raise SecAggError("secagg config sets t but not k; set both or neither")
        if self.k is not None:
            if self.k < 1:
                raise SecAggError(f"k must be >= 1, got {self.k}")
            if self.t is not None:
                # Against the largest graph this config allows.
                check_threshold(self.t, self.k, max(self.max_clients, self.k + 2))

    def quantizer(self) -> Quantizer:
        bits = self.bits if self.bits is not None else max_bits_for(self.max_clients)
        return Quantizer(
            clip=self.clip,
            bits=bits,
            max_clients=self.max_clients,
            max_weight=self.max_weight,
            weight_resolution=self.weight_resolution,
        )

    def degree_and_threshold(self, n: int) -> tuple[int, int]:
        """``(k, t)`` for a round of ``n`` sites."""
        if self.k is None:
            return choose_degree(
                n,
                self.dropout_rate,
                self.corruption_rate,
                self.failure_probability,
                self.leak_probability,
            )
        t = self.t if self.t is not None else min_threshold(effective_degree(self.k, n))
        return self.k, t

    def round_params(
        self,
        round_id: int,
        sites: Iterable[int],
        vector_length: int,
        graph_seed: bytes | None = None,
        min_included: int = 0,
    ) -> RoundParams:
        """Parameters of one round over ``sites``; ``graph_seed`` defaults to fresh bytes.

        ``min_included``: the fewest masked inputs the round may unmask (the driver's
        acceptance minimum, e.g. the strategy's ``min_results``); fewer and the round
        fails with its sum still masked.
        """
        ids = tuple(sorted(set(sites)))
        if len(ids) < 2:
            raise SecAggError(f"secure aggregation needs at least 2 sites, got {len(ids)}")
        if len(ids) > self.max_clients:
            raise SecAggError(
                f"{describe(round_id)} has {len(ids)} sites but max_clients={self.max_clients}: "
                f"their sum could wrap; raise max_clients (and lower bits) or sample fewer"
            )
        if ids[0] < 1 or ids[-1] > MAX_SITE_ID:
            raise SecAggError(f"site ids must be in [1, 2^32 - 1], got {ids[0]}..{ids[-1]}")
        if not (0 <= round_id < 1 << 64):
            raise SecAggError(f"round id must be in [0, 2^64), got {round_id}")
        if vector_length < 1:
            raise SecAggError(f"vector_length must be >= 1, got {vector_length}")
        if not 0 <= min_included <= len(ids):
            raise SecAggError(
                f"{describe(round_id)}: min_included = {min_included} must be in [0, {len(ids)}] "
                "(the round's sites); no sum of fewer could ever be unmasked"
            )
        k, t = self.degree_and_threshold(len(ids))
        check_threshold(t, k, len(ids))
        seed = os.urandom(GRAPH_SEED_BYTES) if graph_seed is None else graph_seed
        if len(seed) != GRAPH_SEED_BYTES:
            raise SecAggError(f"graph seed must be {GRAPH_SEED_BYTES} bytes, got {len(seed)}")
        q = self.quantizer()
        if not math.isfinite(q.step):
            raise SecAggError("quantization step is not finite; lower clip or max_weight")
        return RoundParams(
            round_id=round_id,
            sites=ids,
            vector_length=vector_length,
            k=k,
            t=t,
            graph_seed=seed,
            clip=q.clip,
            bits=q.bits,
            max_clients=q.max_clients,
            max_weight=q.max_weight,
            weight_resolution=q.weight_resolution,
            dp_noise_multiplier=self.dp_noise_multiplier,
            dp_clip_norm=self.dp_clip_norm,
            dp_min_survivors=self.dp_min_survivors,
            min_included=min_included,
            consistency_check=self.consistency_check,
        )
