"""The operator's weight policy: how many examples one site's plain update may count for.

A plain update is weighted by the `num_examples` its site declares in the upload
header, and FedAvg (FedBuff too) divides by the sum of the weights. Trusted, that
number lets one authenticated site own a round: a zero update declared with 2^64 - 1
examples leaves the global model where it was and erases every other site's work.
Flower and NVFLARE trust it; fedtrain checks it against `[weights]` in server.toml:

1. A site named in `weights.sites` may declare at most its own cap: the operator
   knows that site's cohort, and nothing else is checked for it.
2. Any other site may declare at most `max_num_examples`, and at most
   `max_weight_ratio` times the median of the *reference weights*: for every other
   site, the weight the policy last let through for it, this round's if it uploaded
   already, else its latest upload's (an earlier round, or its last FedBuff job). A
   site's own history never limits it. Before any other site uploaded (the first
   uploads of a run, and after a restart: the references live in memory) only the
   caps apply.

A declared weight over its limit is refused (`action = "refuse"`) or counted at the
limit (`"clip"`). The decision is made at the upload header, before a byte of the
update is received, so a refused update never reaches the sum. The servicer turns a
decision into the site's gRPC status or receipt notice and an audit record.

Under FedBuff the weight is n x s(staleness); the policy caps the site's part, n,
and compares it with the other sites' n (the staleness factor is the server's own).
Under secure aggregation the weight travels masked inside the update, so the server
cannot see it: there `secagg.max_weight` caps every site, enforced at the site (see
the README's security model).
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from enum import Enum

from fedtrain.errors import UpdateRejected
from fedtrain.runtime.config import WeightsConfig


class Rule(str, Enum):
    """Which limit a declared weight was held to (audit records name it)."""

    SITE_CAP = "site_cap"
    MAX_NUM_EXAMPLES = "max_num_examples"
    MAX_WEIGHT_RATIO = "max_weight_ratio"


@dataclass(frozen=True)
class WeightDecision:
    """What an update's declared example count counts for, and why."""

    declared: int
    weight: int  # what the update counts for: `declared`, else the limit (if clipped)
    limit: int  # the tightest limit that applied to this site
    rule: Rule
    reason: str  # for the site and the audit log; says what to do

    @property
    def over(self) -> bool:
        return self.declared > self.limit


class WeightRefused(UpdateRejected):
    """A declared example count over the site's limit, under `action = "refuse"`."""

    def __init__(self, decision: WeightDecision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class WeightPolicy:
    """Decides each plain upload's weight at its header (see the module docstring).

    Thread-safe: the servicer's upload handlers call `admit` concurrently. An admit
    costs O(log N) comparisons and one memmove, not a sort of every site's weight: with
    10,000 sites and 1,000 uploads a round, sorting for each median cost 0.44 s of
    server CPU per round.
    """

    def __init__(self, config: WeightsConfig) -> None:
        self.config = config
        self._latest: dict[str, int] = {}  # site -> the weight last let through for it
        self._sorted: list[int] = []  # the values of `_latest`, in order
        self._lock = threading.Lock()

    def admit(self, site: str, declared: int) -> WeightDecision:
        """Decide, then remember the weight let through as a reference for the others.

        Raises `WeightRefused` when the declared weight is over its limit and the
        policy refuses; otherwise the decision says what the update counts for."""
        with self._lock:
            previous = self._latest.get(site)
            if previous is not None:  # the others' weights: all but this site's own
                del self._sorted[bisect.bisect_left(self._sorted, previous)]
            decision = self._decide(site, declared, self._sorted)
            refused = decision.over and self.config.action == "refuse"
            kept = previous if refused else decision.weight  # a refused site keeps its own
            if kept is not None:
                bisect.insort(self._sorted, kept)
            if refused:
                raise WeightRefused(decision)
            self._latest[site] = decision.weight
            return decision

    def _decide(self, site: str, declared: int, references: list[int]) -> WeightDecision:
        """`references`: the other sites' latest weights, sorted."""
        cap = self.config.sites.get(site)
        if cap is not None:
            return self._held_to(
                declared,
                cap,
                Rule.SITE_CAP,
                f"this site may declare at most {cap} examples (weights.sites in the "
                "server's server.toml)",
            )
        limit, rule = self.config.max_num_examples, Rule.MAX_NUM_EXAMPLES
        why = f"a site may declare at most {limit} examples (weights.max_num_examples)"
        ratio = self.config.max_weight_ratio
        if ratio and references:
            middle = len(references) // 2  # statistics.median, without its sort
            median = (
                references[middle]
                if len(references) % 2
                else (references[middle - 1] + references[middle]) / 2
            )
            by_ratio = max(1, math.floor(ratio * median))
            if by_ratio < limit:
                limit, rule = by_ratio, Rule.MAX_WEIGHT_RATIO
                why = (
                    f"a site may declare at most {ratio:g} x the median of the other sites' "
                    f"latest weights ({median:g}, over {len(references)} site(s)), i.e. "
                    f"{limit} examples (weights.max_weight_ratio)"
                )
        return self._held_to(declared, limit, rule, why)

    def _held_to(self, declared: int, limit: int, rule: Rule, why: str) -> WeightDecision:
        if declared <= limit:
            return WeightDecision(declared, declared, limit, rule, "")
        if self.config.action == "clip":
            reason = (
                f"num_examples = {declared} was counted as {limit}: {why}. If the site "
                "really trains on that many examples, its operator must ask the server's "
                "operator for a cap in weights.sites"
            )
            return WeightDecision(declared, limit, limit, rule, reason)
        reason = (
            f"num_examples = {declared} refused: {why}; nothing of the update was "
            "aggregated. If the site really trains on that many examples, its operator "
            "must ask the server's operator for a cap in weights.sites; otherwise check "
            "the site's data and task (num_examples is what it trained on)"
        )
        return WeightDecision(declared, limit, limit, rule, reason)
