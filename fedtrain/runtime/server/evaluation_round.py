"""One federated evaluation at the server: ask chosen sites, collect their reports.

After a round's model is published, the coordinator (when evaluation is due and
happens at the sites) sends each chosen site an EVALUATE instruction for that model
version and waits, on a condition, until every chosen site has answered, failed or
left, or `eval_timeout_s` passes. A site that vanishes or fails is *missing* from
the evaluation, never a failure of the round: the round's model is already final.
The sites download the model they will train from next round anyway, so evaluating
it costs them no extra transfer (the version is cached for the next TRAIN). Under
FedBuff the sites evaluate between their jobs, and `server_round` is then a fresh job
number (`BufferedRounds.instruction_number`), so a site's error report names one job
or this evaluation.

A report is checked before it counts: from a site that was asked, for this round
and model version, once, with at least one example, an example count under the
weight policy's cap, and finite numbers. A report that fails a check is logged and
audited, and the site is missing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from fedtrain.errors import ProtocolError
from fedtrain.evaluation import check_eval_result
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.sessions import Session, instruct
from fedtrain.strategy import RoundConfig
from fedtrain.task import EvalResult

log = logging.getLogger(__name__)


class EvaluationRound:
    """The sites asked to evaluate one model version, and what each one answered."""

    def __init__(
        self,
        server_round: int,
        model_version: str,
        plan: Mapping[str, RoundConfig],
        deadline: float,
        max_examples: Callable[[str], int],
    ) -> None:
        """`deadline`: time.monotonic() after which the missing stay missing;
        `max_examples(site)`: the most examples a site may claim (the weight policy's cap)."""
        self.round = server_round
        self.model_version = model_version
        self.plan = dict(plan)
        self.deadline = deadline
        self._max_examples = max_examples
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self.results: dict[str, EvalResult] = {}
        #: site -> why it does not count (gone, failed, refused)
        self.missing: dict[str, str] = {}
        self._closed = False

    def start(self, sessions: Mapping[str, Session | None], deadline_unix: float) -> None:
        """Send every chosen site its EVALUATE; a site already gone is missing."""
        for site, config in self.plan.items():
            session = sessions.get(site)
            if session is None or session.closed:
                self.settle(site, "not connected")
                continue
            instruct(
                session, self.round, self.model_version, config, deadline_unix, kind=pb.EVALUATE
            )

    def receive(self, site: str, report: pb.EvalReport) -> EvalResult:
        """Count a site's report; raises ProtocolError (the caller logs and audits it,
        and the site is then missing) if it was not asked, is late or is implausible."""
        if report.round != self.round or report.model_version != self.model_version:
            raise ProtocolError(
                f"site {site!r} sent an evaluation of round {report.round} (model "
                f"{report.model_version[:12]}), but round {self.round}'s evaluation of model "
                f"{self.model_version[:12]} is in progress; ignored"
            )
        result = EvalResult(int(report.num_examples), float(report.loss), dict(report.metrics))
        with self._lock:
            if site not in self.plan:
                raise ProtocolError(
                    f"site {site!r} was not asked to evaluate round {self.round}; ignored"
                )
            if self._closed or site in self.results or site in self.missing:
                raise ProtocolError(
                    f"site {site!r}: round {self.round}'s evaluation is closed to it "
                    "(answered already, failed, or past the deadline); ignored"
                )
            why = _implausible(result, self._max_examples(site))
            if why is None:
                try:
                    check_eval_result(result, f"site {site!r}, round {self.round}")
                except ValueError as exc:
                    why = str(exc)
            if why is not None:
                self.missing[site] = f"refused: {why}"
                self._settled.notify_all()
                raise ProtocolError(
                    f"site {site!r}: evaluation of round {self.round} refused: {why}"
                )
            self.results[site] = result
            self._settled.notify_all()
        return result

    def settle(self, site: str, why: str) -> bool:
        """`site` will not answer (gone, failed); True if that changed anything."""
        with self._lock:
            if (
                self._closed
                or site not in self.plan
                or site in self.results
                or site in self.missing
            ):
                return False
            self.missing[site] = why
            self._settled.notify_all()
            return True

    def wake(self) -> None:
        with self._lock:
            self._settled.notify_all()

    def wait(self, stopped: Callable[[], bool]) -> None:
        """Until every chosen site has settled, the deadline passes or `stopped()`."""
        with self._lock:
            while len(self.results) + len(self.missing) < len(self.plan) and not stopped():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                self._settled.wait(min(left, 1.0))

    def close(self) -> tuple[dict[str, EvalResult], dict[str, str]]:
        """(results, missing): no report counts after this; who never answered is missing."""
        with self._lock:
            self._closed = True
            for site in self.plan:
                if site not in self.results and site not in self.missing:
                    self.missing[site] = "no answer by the deadline (eval_timeout_s)"
            return dict(self.results), dict(self.missing)


def _implausible(result: EvalResult, max_examples: int) -> str | None:
    if result.num_examples > max_examples:
        return (
            f"claims {result.num_examples} examples, over its cap of {max_examples} "
            "(weights.max_num_examples / weights.sites)"
        )
    return None
