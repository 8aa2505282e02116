"""One secure federated evaluation: the chosen sites' evaluations summed under masks.

Under secure aggregation the server asks the chosen sites to evaluate a model version
exactly as without it (an EVALUATE instruction, now with `secagg` set), but no site
sends an EvalReport: each masks its evaluation vector (`fedtrain.secagg.evaluation`:
loss, accuracy, whether it reported one, weighted by its example count) and the
server runs the SecAgg+ protocol over them through a `MaskedSum`, the same stage loop
as a secure training round. The masked vectors are a few values, so they come on
the control stream with the other stage messages. The server learns the federation's
totals and who dropped out, nothing per site; a plain EvalReport is refused.

Dropouts behave as in a training round: a site that leaves or fails at a stage is a
dropout there, the protocol absorbs it down to its threshold and the acceptance
minimum (`max(2, strategy.min_evaluate_clients)`), and below that the evaluation
fails with its sum still masked. An evaluation is never retried: one id per round
(`fedtrain.secagg.round_ids.evaluation_id`), one unmasked sum at most, so two sums
over different subsets of the same evaluations are never revealed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from fedtrain.errors import ProtocolError, SecAggError
from fedtrain.runtime.config import SecAggServerSettings
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.masked_sum import MaskedSum, stage_deadline
from fedtrain.runtime.server.sessions import Session, instruct
from fedtrain.secagg import Stage
from fedtrain.secagg.evaluation import EVAL_VALUES, EvalTotals, eval_totals
from fedtrain.secagg.round_ids import evaluation_id
from fedtrain.secagg.round_ids import round_id as secagg_round_id
from fedtrain.strategy import RoundConfig

log = logging.getLogger(__name__)


class SecureEvaluation:
    """The sites asked to evaluate one model version under secure aggregation."""

    def __init__(
        self,
        server_round: int,
        model_version: str,
        plan: Mapping[str, RoundConfig],
        deadline: float,
        *,
        settings: SecAggServerSettings,
        sessions: Mapping[str, Session | None],
        audit: AuditLog,
        min_included: int,
        verifier: CertificateVerifier | None = None,
    ) -> None:
        """`deadline`: time.monotonic() by which the masked inputs must be in."""
        self.round = server_round
        self.model_version = model_version
        self.plan = dict(plan)
        self.deadline = deadline
        self.settings = settings
        self.sessions = dict(sessions)
        self.tokens = {s: session.token for s, session in self.sessions.items() if session}
        self._cond = threading.Condition()
        #: site -> why it is out of the evaluation (left, failed)
        self._left: dict[str, str] = {}
        self.totals: EvalTotals | None = None
        self._included: set[str] = set()
        #: Why the evaluation produced no totals (None while it may, or when it did).
        self.failed: str | None = None
        self.masked = MaskedSum(
            label=f"round {server_round}'s evaluation",
            server_round=server_round,
            protocol=settings.evaluation_protocol(),
            round_id=evaluation_id(secagg_round_id(server_round, 1)),
            sites=self.plan,
            vector_length=len(EVAL_VALUES),
            min_included=min_included,
            sessions=self.sessions,
            audit=audit,
            cond=self._cond,
            verifier=verifier,
            masked_on_control=True,
            audit_fields={"round": server_round, "evaluation": True},
        )

    def start(self, deadline_unix: float) -> None:
        """Send every chosen site its EVALUATE (secure), then its SetupRequest."""
        with self._cond:
            for site, config in self.plan.items():
                session = self.sessions.get(site)
                if session is None or session.closed:
                    self._left[site] = "not connected"
                    continue
                instruct(
                    session,
                    self.round,
                    self.model_version,
                    config,
                    deadline_unix,
                    secagg=True,
                    kind=pb.EVALUATE,
                )
            self.masked.start(set(self._left))

    def receive(self, session: Session, message: pb.SecAggMessage) -> None:
        """One stage message (the masked input included) from a chosen site."""
        with self._cond:
            if self.tokens.get(session.site) != session.token:
                raise ProtocolError(
                    f"{self.masked.where(session.site)}: this session was not asked to evaluate"
                )
            self.masked.receive(session.site, message)

    def settle(self, site: str, why: str) -> bool:
        """`site` is gone (left, failed): a dropout at the current stage."""
        with self._cond:
            over = self.masked.server.stage in (Stage.DONE, Stage.FAILED)
            if over or site not in self.plan or site in self._left:
                return False
            self._left[site] = why
            self._cond.notify_all()
            return True

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, stopped: Callable[[], bool]) -> None:
        """Run the protocol to its end (or `stopped()`); then `totals` or `failed` is set."""
        with self._cond:
            try:
                result = self.masked.run(stopped, lambda: set(self._left), self._stage_deadline)
                if result is None:
                    self.failed = "the server is stopping"
                    return
                self.totals = eval_totals(result)
                self._included = {self.masked.names[i] for i in result.included}
            except SecAggError as exc:
                self.failed = f"secure evaluation failed: {exc}"
                log.warning("round %d: %s", self.round, self.failed)

    def missing(self) -> list[str]:
        """The chosen sites whose evaluation is not in the totals."""
        with self._cond:
            return sorted(set(self.plan) - self._included)

    def _stage_deadline(self, stage: Stage) -> float:
        return stage_deadline(self.settings, stage, self.deadline)
