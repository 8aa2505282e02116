"""The server's side of secure aggregation: one attempt of one round, stage by stage.

A `SecureRoundState` is a `RoundState` whose updates arrive masked. It keeps the
same admission rules for uploads, the same lock and the same summary, and runs the
SecAgg+ protocol on top through a `MaskedSum` (`masked_sum.py`, shared with secure
evaluation):

* after the coordinator has pushed the round's instructions, `start()` sends every
  participant its `SetupRequest` on its control stream, so key agreement runs while
  the sites download and train;
* stage replies arrive on the sites' control-stream threads (`receive`), chunks of
  masked vectors on their upload threads (`fold_masked`), folded into the protocol's
  modular sum at once;
* `wait()`, on the coordinator's thread, closes each stage when every site still
  expected has replied or is gone (its control stream broke, it reported an error),
  or at the stage's deadline; then it unmasks the sum and hands it to the strategy's
  aggregate as the `WeightedSum` it would have built from plain updates.

Everything that touches the protocol object happens under the round's lock, so a
chunk can never race a stage closing, and nothing waits on a timer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np

from fedtrain.errors import ProtocolError, SecAggError, UpdateRejected
from fedtrain.runtime.config import SecAggServerSettings
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.masked_sum import MaskedSum, stage_deadline
from fedtrain.runtime.server.rounds import Outcome, RoundState, UploadRefused
from fedtrain.runtime.server.sessions import Session
from fedtrain.runtime.server.uploads import UpdateSpool
from fedtrain.secagg import SecAggResult, Stage
from fedtrain.secagg.round_ids import round_id as secagg_round_id
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.strategy import WeightedSum

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SecureRoundState(RoundState):
    """One attempt of one secure-aggregation round (see the module docstring)."""

    settings: SecAggServerSettings = field(kw_only=True, repr=False)
    layout: UpdateLayout = field(kw_only=True, repr=False)
    sessions: Mapping[str, Session | None] = field(kw_only=True, repr=False)
    audit: AuditLog = field(kw_only=True, repr=False)
    #: The fewest included sites whose sum may be unmasked: the strategy's minimum for
    #: the round, decided before any share is revealed (see `wait`).
    min_included: int = field(kw_only=True)
    #: Checks the sites' credentials (None without TLS: no identities, no consistency check).
    verifier: CertificateVerifier | None = field(kw_only=True, repr=False, default=None)
    #: The unmasked sum, once the protocol finished. Once set, the attempt is spent:
    #: the coordinator must end the round with it, never retry it.
    result: SecAggResult | None = field(init=False, default=None)
    masked: MaskedSum = field(init=False, repr=False)
    #: Participants whose control session ended or who reported an error this attempt.
    _left: set[str] = field(init=False, default_factory=set, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.aggregate, WeightedSum):
            raise SecAggError(
                f"round {self.round}: the strategy's aggregator is a "
                f"{type(self.aggregate).__name__}, not a WeightedSum; secure aggregation "
                "can only hand a strategy the sum of the updates"
            )
        self.masked = MaskedSum(
            label=f"round {self.round} (attempt {self.attempt})",
            server_round=self.round,
            protocol=self.settings.protocol(),
            round_id=secagg_round_id(self.round, self.attempt),
            sites=self.plan,
            vector_length=self.layout.length,
            min_included=self.min_included,
            sessions=self.sessions,
            audit=self.audit,
            cond=self._cond,
            verifier=self.verifier,
            masked_on_control=False,
            audit_fields={"round": self.round, "attempt": self.attempt},
        )

    @property
    def ids(self) -> dict[str, int]:
        """Each participant's secure-aggregation id this attempt."""
        return self.masked.ids

    # -- sending ---------------------------------------------------------------------------
    def start(self) -> None:
        """Send every reachable participant its SetupRequest (after its Instruction)."""
        with self._cond:
            self.masked.start(self._gone())

    # -- from the servicer's threads --------------------------------------------------------
    def receive(self, session: Session, message: pb.SecAggMessage) -> None:
        """One stage reply from a site's control stream; raises (naming site, round and
        stage) when it is refused, and the site then counts as not having replied."""
        with self._cond:
            if self.tokens.get(session.site) != session.token:
                raise ProtocolError(
                    f"{self.masked.where(session.site)}: this session was not chosen for this round"
                )
            self.masked.receive(session.site, message)

    def fold_masked(self, session: Session, offset: int, values: np.ndarray) -> bool:
        """Fold one chunk of a site's masked vector into the sum; True once it is whole."""
        with self._cond:
            site = session.site
            if site in self._left:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.masked.where(site)}: the site's control session ended, so it was "
                    "dropped from this round; masked update discarded",
                )
            try:
                complete = self.masked.server.receive_masked_chunk(self.ids[site], offset, values)
            except SecAggError as exc:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{self.masked.where(site)}: {exc}"
                ) from None
            if complete:
                self.uploading.discard(site)
                self.set_outcome(site, Outcome.DONE)
                self._cond.notify_all()
            return complete

    def abandon(self, site: str) -> None:
        """A masked upload failed or broke: take its chunks back out of the sum."""
        with self._cond:
            super().abandon(site)
            if site in self.ids and self.masked.server.stage is Stage.MASKED_INPUT:
                self.masked.server.abort_masked_input(self.ids[site])

    def commit(
        self, session: Session, spool: UpdateSpool, num_examples: int, metrics: Mapping[str, float]
    ) -> None:
        """Plain updates never reach a secure round's aggregate (the servicer checks first)."""
        raise UploadRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"site {session.site!r}, round {self.round}: this round runs secure aggregation; "
            "a plain update is refused",
        )

    def settle(self, session: Session, outcome: Outcome) -> bool:
        """A participant left or failed: it is gone for every later stage of the round."""
        with self._cond:
            if self.tokens.get(session.site) == session.token and not self.closed:
                self._left.add(session.site)
                self._cond.notify_all()
            return super().settle(session, outcome)

    # -- the coordinator's thread -----------------------------------------------------------
    def wait(self, stopped: Callable[[], bool]) -> None:
        """Run the protocol to its end: every stage, then unmask into the aggregate.

        Returns early if `stopped()`; a round that cannot complete (too many dropouts,
        fewer masked inputs than `min_included`, a corrupt share) sets `poisoned`
        *before* anything is unmasked, so the coordinator retries it with fresh masks
        and fresh training. The server never unmasks two sums over different subsets
        of one attempt's updates, nor a sum it will not use: once `result` is set the
        attempt is the round's.
        """
        with self._cond:
            try:
                self.result = self.masked.run(stopped, self._gone, self._deadline)
                if self.masked.timed_out:
                    self.timed_out = True
                if self.result is None:
                    return
                assert isinstance(self.aggregate, WeightedSum)  # checked in __post_init__
                self.aggregate.merge(self.layout.weighted_sum(self.result))
            except (SecAggError, UpdateRejected) as exc:
                self.poisoned = f"secure aggregation failed: {exc}"
                log.warning("round %d (attempt %d): %s", self.round, self.attempt, self.poisoned)

    def _gone(self) -> set[str]:
        failed = {s for s, o in self.outcomes.items() if o in (Outcome.DROPPED, Outcome.FAILED)}
        return failed | self._left

    def _deadline(self, stage: Stage) -> float:
        return stage_deadline(self.settings, stage, self.deadline)
