"""The round loop of the aggregation server, on its own thread.

Each round: wait (on a condition, not a timer) until the strategy has enough
connected sites, let it choose participants, push an instruction onto each chosen
site's control stream, and wait until every chosen site has settled (update folded,
error reported, or gone) or the deadline passes. If the strategy's minimum number
of results arrived, the new global model is finalized and evaluated, its checkpoint
(carrying the round's metrics record, so a crash cannot lose it) is written while
the next round runs (`checkpoints.py`), and the record is logged; otherwise
the round is tried again with whoever is connected. Nothing here
blocks without a bound except waiting for sites to exist at all.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from fedtrain.errors import ConfigError, FedtrainError, ProtocolError
from fedtrain.evaluation import (
    EVALUATE_CAPABILITY,
    eval_metrics,
    evaluation_now,
    federated_record,
    secure_record,
    server_record,
    where_to_evaluate,
)
from fedtrain.export import save_final_model
from fedtrain.personalize import ask_to_personalize
from fedtrain.privacy.accounting import PrivacyAccountant
from fedtrain.round_record import RoundRecord, describe_evaluation, finished
from fedtrain.run_dir import RunDir
from fedtrain.runtime import wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.buffered import BufferedRounds
from fedtrain.runtime.server.checkpoints import CheckpointWriter, settle_run_record
from fedtrain.runtime.server.cross_site import LocalModels, cross_site_validation
from fedtrain.runtime.server.evaluation_round import EvaluationRound
from fedtrain.runtime.server.faults import fault_point
from fedtrain.runtime.server.global_model import GlobalModel, new_model_version
from fedtrain.runtime.server.links import SKIPS_BEFORE_WARNING, LinkEstimates
from fedtrain.runtime.server.rounds import Outcome, RoundState, RoundSummary
from fedtrain.runtime.server.secure_evaluation import SecureEvaluation
from fedtrain.runtime.server.secure_round import SecureRoundState
from fedtrain.runtime.server.sessions import (
    Session,
    SessionRegistry,
    instruct,
    own_upload_room,
    summarize_sites,
)
from fedtrain.runtime.server.site_deadlines import SiteDeadlines
from fedtrain.secagg.settings import require_sum_only
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.strategy import RoundConfig, Strategy
from fedtrain.strategy.aggregate import Aggregator
from fedtrain.task import (
    EvalResult,
    Task,
    TaskContext,
    federated_names,
    model_for,
    resolve_device,
    task_fingerprint,
)
from fedtrain.tensors import ModelState, select

log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]
RETRY_DELAY_S = 0.5
RETRY_DELAY_MAX_S = 30.0
#: Why a site left when the run ended: one line in the log for all of them (10,000 lines
#: at the end of a run with 10,000 sites told an operator nothing); each is audited.
RUN_COMPLETE_LEAVE = "run complete"


class RoundFailed(FedtrainError):
    """A round could not gather enough updates in `max_round_attempts` attempts."""


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as JSON gives them back: plain types a checkpoint loads without pickle
    (numpy scalars become floats, tuples lists), equal to what metrics.jsonl holds."""
    return json.loads(json.dumps(values))


class TransferCounter:
    """Tensor bytes that crossed the wire, summed across the servicer's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in = 0
        self._out = 0
        #: Of the bytes in: those of updates the round took, those thrown away (refused,
        #: broken off and not resumed, too late), counted when settled; and those a site
        #: sent again after the server had thrown its earlier upload away.
        self._settled = {"accepted": 0, "discarded": 0, "resent": 0}
        #: Since the server started, never reset (Prometheus counters read these).
        self.total_in = 0
        self.total_out = 0
        self.total_settled = dict.fromkeys(self._settled, 0)

    def add(self, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            self._in += received
            self._out += sent
            self.total_in += received
            self.total_out += sent

    def settle(self, accepted: int = 0, discarded: int = 0, resent: int = 0) -> None:
        """An upload's bytes ended up in the round (`accepted`), were thrown away, or
        arrived a second time (`resent`)."""
        with self._lock:
            for split in (self._settled, self.total_settled):
                split["accepted"] += accepted
                split["discarded"] += discarded
                split["resent"] += resent

    def totals(self) -> dict[str, int]:
        """Bytes since the server started (`observability.status.BYTE_KEYS`)."""
        with self._lock:
            return {"received": self.total_in, "sent": self.total_out, **self.total_settled}

    def take(self) -> tuple[int, int]:
        """(bytes in, bytes out) since the last call."""
        with self._lock:
            out = self._in, self._out
            self._in = self._out = 0
            return out

    def take_settled(self) -> dict[str, int]:
        """Bytes in accepted, discarded and re-sent since the last call."""
        with self._lock:
            out = dict(self._settled)
            self._settled = dict.fromkeys(self._settled, 0)
            return out


class Coordinator:
    """Owns the global model, the strategy, the round state and the run directory's files."""

    def __init__(
        self,
        config: ServerConfig,
        task: Task,
        strategy: Strategy,
        run_dir: RunDir,
        registry: SessionRegistry,
        audit: AuditLog,
        *,
        resume: bool = False,
        on_round: RoundCallback | None = None,
        secagg_verifier: CertificateVerifier | None = None,
    ) -> None:
        self.config = config
        #: Checks the sites' secure-aggregation credentials (None without TLS: the
        #: consistency check is then off, for the sites cannot sign).
        self.secagg_verifier = secagg_verifier
        self.task = task
        self.strategy = strategy
        self.run_dir = run_dir
        self.registry = registry
        self.audit = audit
        self.on_round = on_round
        self.device = resolve_device(config.device)
        self._eval_model = model_for(task, config.seed).to(self.device)
        self.fingerprint = task_fingerprint(task, self._eval_model)
        #: The tensors that travel (None: all); a frozen base stays out of the global model.
        self.federated = federated_names(task, self._eval_model)
        #: The task's test set, loaded only where the server may evaluate on it.
        self.test_data = task.datasets()[1] if config.evaluate in ("auto", "server") else None
        self.evaluate_at = self._where_to_evaluate(config)
        #: The federated evaluation in progress (reports from sites go to it), or None.
        self.evaluation: EvaluationRound | None = None
        #: The secure federated evaluation in progress (stage messages go to it), or None.
        self.secure_evaluation: SecureEvaluation | None = None
        #: Each consenting site's last local model (`cross_site_local_models`).
        self.local_models = LocalModels(config.cross_site_local_models)
        self.rng = np.random.default_rng(config.seed)
        self.transfers = TransferCounter()
        #: Each site's measured link, to leave out sites that cannot finish in time.
        self.links = LinkEstimates()
        #: Each chosen site's own deadline from its link, within the round's.
        self.deadlines = SiteDeadlines(
            self.links, registry, audit, config.transfers, config.heartbeat.grace_s
        )
        self._plain_uploads = config.compression.build().name == "none"
        self.last_metrics: dict[str, Any] = {}
        #: The last record with an evaluation (`fedtrain status`: worst site, spread).
        self.last_evaluation: dict[str, Any] = {}
        self.finished = threading.Event()
        self.checkpoints = CheckpointWriter(run_dir, audit)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.resumed = resume
        if resume:
            self.global_model, self.run_id = self._load_checkpoint()
        else:
            state = ModelState.from_module(self._eval_model, self.federated)
            self.global_model = GlobalModel(0, new_model_version(), state)
            self.run_id = uuid.uuid4().hex[:12]  # an identifier, not a secret
        self._bind_eval_model(self.global_model.state)
        self.secagg = config.secagg if config.secagg.enabled else None
        self.layout: UpdateLayout | None = None
        if self.secagg is not None:
            require_sum_only(strategy)
            self.layout = UpdateLayout.of(self.global_model.state.specs)
            q = self.secagg.protocol().quantizer()
            log.info(
                "secure aggregation on: clip %g, %d bits per value, step %.3g, %d values per "
                "site%s",
                q.clip,
                q.bits,
                q.step,
                self.layout.length,
                f"; the server keeps its own {', '.join(self.layout.excluded)}"
                if self.layout.excluded
                else "",
            )
        self.dp_accountant = self._distributed_dp(resume)
        self._sampling_rate = 1.0
        registry.on_leave(self._on_leave)
        #: The attempt in progress, or FedBuff's buffer for the whole run (which also
        #: takes uploads between versions).
        self.current: RoundState | BufferedRounds | None = None
        if strategy.asynchronous:
            self.current = BufferedRounds(self)

    def _where_to_evaluate(self, config: ServerConfig) -> str:
        """`evaluate` resolved: "server", "sites" or "off", with why when it is off.

        Under secure aggregation the sites evaluate securely (`secure_evaluation.py`);
        under FedBuff (never secure) between their jobs (`buffered.py`)."""
        where = where_to_evaluate(config.evaluate, self.test_data is not None)
        if where != "sites":
            if config.evaluate == "server" and where == "off":
                log.warning("evaluate = 'server' but the task has no test set: no evaluation")
            return where
        log.info(
            "the global model is evaluated at the sites (federated evaluation%s) every %d "
            "round(s), on their held-out sets",
            ", secure: the server learns only the federation's totals"
            if config.secagg.enabled
            else "",
            config.eval_every,
        )
        return "sites"

    def _distributed_dp(self, resume: bool) -> PrivacyAccountant | None:
        """Distributed DP's accountant (None when off), checked against the real model.

        The sites add the noise (they get its parameters in each round's SetupRequest);
        the server checks that the quantization range holds it, refuses rounds that
        could have fewer survivors than the noise is calibrated for, and accounts.
        """
        if self.secagg is None or self.layout is None or not self.secagg.privacy.enabled:
            return None
        dp = self.secagg.privacy.build()
        quantizer = self.secagg.protocol().quantizer()
        dp.check(quantizer, self.layout.length)
        inflation = dp.sensitivity(quantizer, self.layout.length) * quantizer.step / dp.clip_norm
        if inflation > 1.05:
            log.warning(
                "distributed DP: stochastic rounding on a grid of step %.3g adds %.0f%% to "
                "the sensitivity, and so to the noise; a finer grid removes it (weights are "
                "1 under DP: set secagg.max_weight = 1, or lower secagg.clip)",
                quantizer.step,
                100 * (inflation - 1),
            )
        if dp.min_survivors > self.strategy.min_fit_clients:
            raise ConfigError(
                f"secagg.privacy.min_survivors = {dp.min_survivors} exceeds "
                f"strategy.min_fit_clients = {self.strategy.min_fit_clients}: rounds the "
                "strategy accepts could never be unmasked; lower it or raise min_fit_clients"
            )
        accountant = dp.accountant()
        if resume:
            accountant.replay(self._checkpoint_extra.get("dp_sampling_rates", []))
        log.info(
            "distributed DP on: sites clip to %g and add discrete Gaussian noise for noise "
            "multiplier %g over >= %d survivors; epsilon reported at delta %g",
            dp.clip_norm,
            dp.noise_multiplier,
            dp.min_survivors,
            dp.delta,
        )
        return accountant

    # -- resume ---------------------------------------------------------------------------
    def _load_checkpoint(self) -> tuple[GlobalModel, str]:
        done, state, strategy_state, extra = self.run_dir.load_checkpoint()
        fingerprint = extra.get("fingerprint")
        if fingerprint != self.fingerprint:
            raise ConfigError(
                f"cannot resume {self.run_dir.path}: its checkpoint was made with task "
                f"fingerprint {fingerprint}, but task = {self.config.task!r} here has "
                f"{self.fingerprint}; resume with the task the run started with"
            )
        # no copy on the CPU
        expected = ModelState(select(self._eval_model.state_dict(), self.federated)).specs
        if state.specs != expected:
            raise ConfigError(
                f"cannot resume {self.run_dir.path}: the checkpointed model's tensors differ "
                "from the task's model"
            )
        self.strategy.load_state_dict(strategy_state)
        self.rng.bit_generator.state = extra["rng"]
        self._checkpoint_extra = extra
        log.info("resuming run %s after round %d from %s", extra["run_id"], done, self.run_dir.path)
        self.last_metrics = settle_run_record(self.run_dir, self.audit, done, extra)
        if self.last_metrics.get("eval_source"):
            self.last_evaluation = self.last_metrics
        return GlobalModel(done, str(extra["model_version"]), state), str(extra["run_id"])

    def _bind_eval_model(self, state: ModelState) -> None:
        """Point the evaluation model at `state`.

        On the CPU the module's parameters become the state's own tensors (no copy):
        the server then holds one copy of the global model, not two, which is what
        keeps its memory near 2x the model (global + accumulator) for large models.
        Evaluation must not write to the model (the Task contract).
        """
        if self.device.type == "cpu":
            self._eval_model.load_state_dict(
                dict(state.items()), assign=True, strict=self.federated is None
            )
        else:
            state.load_into(self._eval_model, self.federated)

    # -- thread ---------------------------------------------------------------------------
    def run(self) -> None:
        """Thread body: every remaining round, then the final model; errors end the run."""
        try:
            self.audit.record(
                "run_resumed" if self.resumed else "run_started",
                run_id=self.run_id,
                round=self.global_model.round,
                rounds=self.config.rounds,
                task=self.config.task,
                fingerprint=self.fingerprint,
                model_version=self.global_model.version,
            )
            if isinstance(self.current, BufferedRounds):  # asynchronous: FedBuff
                if not self.current.run():
                    return
            else:
                for server_round in range(self.global_model.round + 1, self.config.rounds + 1):
                    if not self._run_round(server_round):
                        return
            self._complete()
        except Exception as exc:  # the thread's boundary: record it, end the run, never hang
            log.exception("the round loop failed; the server stops")
            self.error = exc
            self.audit.record("run_failed", run_id=self.run_id, error=str(exc))
        finally:
            try:
                self.checkpoints.wait()  # the last round's checkpoint is on disk before exit
            except Exception as exc:
                self.error = self.error or exc
            self.finished.set()

    def stop(self) -> None:
        """Ask the round loop to end as soon as possible (shutdown)."""
        self._stop.set()
        self.registry.stop()
        state = self.current
        if state is not None:
            state.wake()
        evaluation = self.evaluation
        if evaluation is not None:
            evaluation.wake()
        secure = self.secure_evaluation
        if secure is not None:
            secure.wake()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- rounds ---------------------------------------------------------------------------
    def _run_round(self, server_round: int) -> bool:
        """Run attempts of one round until one succeeds; False if stopped first."""
        attempt = 0
        while not self.stopped:
            available = self.registry.wait_for(self.strategy.min_available_clients)
            if available is None:
                return False
            plan = self.strategy.configure_round(server_round, available, self.rng)
            if not plan:
                self.registry.wait_for_change()
                continue
            # The privacy accountant's rate is the strategy's choice: a site the links
            # leave out was still chosen with this probability.
            self._sampling_rate = len(plan) / len(available)
            skipped = self._too_slow(server_round, plan)
            for site in skipped:
                del plan[site]
            attempt += 1
            started = time.perf_counter()
            state = self._start_attempt(server_round, attempt, plan)
            state.wait(lambda: self.stopped)
            summary = state.close()
            self.deadlines.end()
            if self.stopped:
                return False
            if self._finish(state, summary, started, skipped):
                return True
            self._retry(summary)
        return False

    def _start_attempt(
        self, server_round: int, attempt: int, plan: dict[str, RoundConfig]
    ) -> RoundState:
        model = self.global_model
        sessions = {site: self.registry.get(site) for site in plan}
        common: dict[str, Any] = {
            "round": server_round,
            "attempt": attempt,
            "model_version": model.version,
            "plan": plan,
            "tokens": {site: s.token for site, s in sessions.items() if s is not None},
            "aggregate": self.strategy.begin_round(server_round, model.state),
            "deadline": time.monotonic() + self.config.round_timeout_s,
        }
        state: RoundState
        if self.secagg is None or self.layout is None:
            state = RoundState(**common, keep_updates=self.local_models.consenting(sessions))
        else:
            state = SecureRoundState(
                **common,
                settings=self.secagg,
                layout=self.layout,
                sessions=sessions,
                audit=self.audit,
                min_included=self._needed(len(plan)),
                verifier=self.secagg_verifier,
            )
        for site, session in sessions.items():
            if session is None:
                state.set_outcome(site, Outcome.DROPPED)
        deadline_unix = time.time() + self.config.round_timeout_s
        state.deadline_unix = deadline_unix
        self.current = state
        self._size_deadlines(state)
        log.info(
            "round %d (attempt %d): %d site(s) train from model %s: %s",
            server_round,
            attempt,
            len(plan),
            model.version[:12],
            summarize_sites(sorted(plan)),
        )
        self.audit.record(
            "round_started",
            round=server_round,
            attempt=attempt,
            participants=sorted(plan),
            model_version=model.version,
        )
        room = own_upload_room(self.config, len(self.registry))
        state.own_uploads = frozenset(itertools.islice(plan, room))
        if 0 < len(state.own_uploads) < len(plan):
            log.info(
                "round %d: %d of %d site(s) send their update on a connection of their "
                "own, the rest on their control connection: the file limit has room for "
                "no more (raise LimitNOFILE for all of them)",
                server_round,
                len(state.own_uploads),
                len(plan),
            )
        for session in sessions.values():
            if session is None:
                continue
            if session.closed:
                # It ended before `current` was published, so the leave hook missed it.
                state.settle(session, Outcome.DROPPED)
                continue
            instruct(
                session,
                server_round,
                model.version,
                plan[session.site],
                deadline_unix,
                secagg=isinstance(state, SecureRoundState),
                own_upload_connection=session.site in state.own_uploads,
            )
        if isinstance(state, SecureRoundState):
            state.start()  # key agreement runs while the sites download and train
        return state

    def _size_deadlines(self, state: RoundState) -> None:
        """Give each measured site of the attempt its own deadline (`site_deadlines.py`)."""
        nbytes = self.global_model.state.nbytes
        timeout = self.config.round_timeout_s
        own = self.deadlines.begin(
            state,
            state.deadline - timeout,
            state.deadline,
            self._needed(len(state.plan)),
            nbytes,
            nbytes if self._plain_uploads else None,
        )
        if own:
            seconds = sorted(d.allowed_s for d in own.values())
            log.info(
                "round %d: %d site(s) have their own deadline, %.0f-%.0fs from their "
                "measured links (round deadline %.0fs)",
                state.round,
                len(own),
                seconds[0],
                seconds[-1],
                timeout,
            )

    def _too_slow(self, server_round: int, plan: dict[str, RoundConfig]) -> list[str]:
        """Sites of `plan` whose measured links cannot finish a round before its deadline
        (`links.py`): audited with the estimate, so no byte is spent on them."""
        nbytes = self.global_model.state.nbytes
        update_bytes = nbytes if self._plain_uploads else None
        deadline = self.config.round_timeout_s
        try:
            skipped = self.links.plan_round(
                sorted(plan), deadline, nbytes, update_bytes, self._needed(len(plan))
            )
        except Exception:  # an estimate only ever leaves sites out: never stop a run
            log.exception("round %d: link estimates failed; no site left out", server_round)
            return []
        for site, estimate in skipped.items():
            reason = estimate.describe(deadline)
            log.warning("round %d: site %r skipped: %s", server_round, site, reason)
            self.audit.record("site_skipped", site=site, round=server_round, reason=reason)
            if self.links.skipped_in_a_row(site) % SKIPS_BEFORE_WARNING == 0:
                log.warning(
                    "site %r has been skipped %d rounds in a row: its link cannot move a "
                    "round's bytes within round_timeout_s = %.0f. Raise the deadline, shrink "
                    "the transfers ([download] codecs, [compression] for uploads), or let "
                    'slow sites contribute when they can (strategy.name = "fedbuff")',
                    site,
                    self.links.skipped_in_a_row(site),
                    deadline,
                )
        return list(skipped)

    def _needed(self, selected: int) -> int:
        """Updates a round of `selected` sites needs to count."""
        return max(1, self.strategy.min_results(selected))

    def _finish(
        self, state: RoundState, summary: RoundSummary, started: float, skipped: list[str]
    ) -> bool:
        """Finalize a successful attempt (model, checkpoint, metrics); False if it failed.

        A secure attempt whose sum was unmasked is never retried, even if the sum turns
        out unusable (a site can make the masked weight sum wrap to 0): a retry would
        unmask a second sum over the same sites. Its round ends with the model unchanged.
        """
        usable = not summary.poisoned and len(summary.contributors) >= self._needed(
            len(summary.selected)
        )
        spent = isinstance(state, SecureRoundState) and state.result is not None
        if not (usable or spent):
            return False
        server_round = state.round
        outcome: dict[str, Any]
        if usable:
            self.local_models.keep(self.global_model.state, state)
            new_state = self.finalize(server_round, state.aggregate)
            outcome = {
                **self.strategy.aggregate_metrics(summary.results),
                **self.strategy.round_metrics(),
            }
        else:
            log.error(
                "round %d: the unmasked sum cannot be used (%s); the round ends with the "
                "global model unchanged",
                server_round,
                summary.poisoned,
            )
            outcome = {"error": summary.poisoned}
        if self.dp_accountant is not None:  # an unmasked sum spent privacy, used or not
            outcome["epsilon"] = self.dp_accountant.step(self._sampling_rate)
            outcome["delta"] = self.dp_accountant.delta
        self.current = None  # releases the accumulator once in-flight handlers let go
        if usable:
            model = self.publish(server_round, new_state)
        else:
            model = self.global_model = replace(self.global_model, round=server_round)
        record = RoundRecord(
            round=server_round,
            attempts=state.attempt,
            selected=len(summary.selected),
            contributors=summary.contributors,
            dropped=summary.dropped,
            failed=summary.failed,
            skipped=skipped,
            aggregated=usable,
            measurements={
                **self.transfer_metrics(),
                **outcome,  # e.g. DP's epsilon, as in a simulation
            },
        ).to_json()
        if summary.dropped or summary.failed:
            log.warning(
                "round %d finished without %s",
                server_round,
                summarize_sites(summary.dropped + summary.failed),
            )
        self.record_round(
            record,
            started,
            model,
            attempt=state.attempt,
            contributors=summary.contributors,
            dropped=summary.dropped,
            failed=summary.failed,
        )
        return True

    # -- what every new global model goes through (rounds and FedBuff versions) ------------
    def finalize(self, server_round: int, aggregate: Aggregator) -> ModelState:
        """The strategy's next global model from `aggregate`, once the previous
        checkpoint (which still reads the strategy's state) is on disk."""
        fault_point("finalize", server_round)
        self.checkpoints.wait()
        return self.strategy.finalize_round(server_round, self.global_model.state, aggregate)

    def publish(self, server_round: int, state: ModelState) -> GlobalModel:
        """Make `state` the global model that downloads and evaluation see."""
        model = GlobalModel(server_round, new_model_version(), state)
        self.global_model = model
        self._bind_eval_model(state)
        fault_point("published", server_round)
        return model

    def checkpoint(
        self, model: GlobalModel, record: dict[str, Any], round_audit: dict[str, Any]
    ) -> None:
        """Start writing the atomic checkpoint `--resume` continues from (in the
        background: `checkpoints.wait()` before the strategy's state changes again),
        with the round's metrics record and audit summary (`settle_run_record`)."""
        self.checkpoints.submit(
            model.round,
            model.state,
            self.strategy.state_dict(),
            extra={
                "rng": self.rng.bit_generator.state,
                "run_id": self.run_id,
                "fingerprint": self.fingerprint,
                "model_version": model.version,
                "record": record,
                "round_audit": round_audit,
                **(
                    {"dp_sampling_rates": list(self.dp_accountant.sampling_rates)}
                    if self.dp_accountant is not None
                    else {}
                ),
            },
        )

    def transfer_metrics(self) -> dict[str, int]:
        """Tensor bytes in and out since the last record."""
        bytes_in, bytes_out = self.transfers.take()
        settled = self.transfers.take_settled()
        return {
            "bytes": bytes_in + bytes_out,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "bytes_in_accepted": settled["accepted"],
            "bytes_in_discarded": settled["discarded"],
            "bytes_in_resent": settled["resent"],
        }

    def evaluate_into(self, record: dict[str, Any]) -> None:
        """Set the record's loss and accuracy (and the keys of `fedtrain.evaluation`):
        evaluated every `eval_every` and at the end, on the server's test set or at the
        sites (`evaluate`)."""
        server_round = record["round"]
        where = evaluation_now(
            server_round,
            self.config.eval_every,
            self.config.rounds,
            self.evaluate_at,
            self.test_data is not None,
        )
        if where == "server":
            context = TaskContext(device=self.device, client_id="server", seed=self.config.seed)
            ev = self.task.evaluate(self._eval_model, self.test_data, self.config.client, context)
            record.update(server_record(ev))
        elif where == "sites":
            record.update(self.federated_evaluation(server_round))

    def federated_evaluation(self, server_round: int) -> dict[str, Any]:
        """Ask the sites the strategy chooses (among those able to) to evaluate the
        current global model; the record keys of what came back. A site that does not
        answer is missing, never a failure of the round."""
        model = self.global_model
        able = [s.site for s in self.registry.sessions() if EVALUATE_CAPABILITY in s.capabilities]
        plan = ask_to_personalize(
            self.strategy.configure_evaluate(server_round, able, self.rng),
            self.config.personalize_epochs,
        )
        if not plan:
            log.warning(
                "round %d: no evaluation: %d connected site(s) hold a held-out set, "
                "strategy.min_evaluate_clients = %d (a site evaluates with data.eval_fraction "
                "or data.eval_path in its site.toml)",
                server_round,
                len(able),
                self.strategy.min_evaluate_clients,
            )
            return federated_record({}, {}, [], per_site=False)
        if self.secagg is not None:
            return self._secure_evaluation(server_round, plan)
        results, missing = self._collect_evaluations(server_round, model, plan)
        ordered = sorted(results.items())
        aggregated = (
            self.strategy.aggregate_evaluate(
                server_round, [(r.num_examples, eval_metrics(r)) for _, r in ordered]
            )
            if results
            else {}
        )
        record = federated_record(
            aggregated, results, list(missing), per_site=self.config.site_metrics
        )
        log.info(
            "round %d: %d of %d site(s) evaluated model %s: %s",
            server_round,
            len(results),
            len(plan),
            model.version[:12],
            describe_evaluation(record, record.get("worst_site", ""), secure=False),
        )
        return record

    def _collect_evaluations(
        self, server_round: int, model: GlobalModel, plan: dict[str, RoundConfig]
    ) -> tuple[dict[str, EvalResult], dict[str, str]]:
        """Ask `plan`'s sites to evaluate `model` and wait for them (plain evaluation):
        (each counted site's result, why each other site is missing)."""
        weights = self.config.weights
        state = EvaluationRound(
            self._evaluation_number(server_round),
            model.version,
            plan,
            time.monotonic() + self.config.eval_timeout_s,
            lambda site: weights.sites.get(site, weights.max_num_examples),
        )
        self.evaluation = state
        try:
            state.start(
                {site: self.registry.get(site) for site in plan},
                time.time() + self.config.eval_timeout_s,
            )
            state.wait(lambda: self.stopped)
        finally:
            self.evaluation = None
        results, missing = state.close()
        for site, why in sorted(missing.items()):
            log.warning(
                "round %d: site %r is left out of the evaluation: %s", server_round, site, why
            )
        return results, missing

    def _evaluation_number(self, server_round: int) -> int:
        """The `round` an EVALUATE carries: the round, or under FedBuff (whose TRAIN
        instructions carry job numbers) a fresh job number."""
        state = self.current
        return state.instruction_number() if isinstance(state, BufferedRounds) else server_round

    def _cross_site_validation(self) -> None:
        """`cross_site.py` after the last round (`cross_site_validation`; never under
        secure aggregation, the config refuses it)."""
        if not self.config.cross_site_validation or self.secagg is not None:
            return
        model = self.global_model
        sessions = self.registry.sessions()
        able = sorted(s.site for s in sessions if EVALUATE_CAPABILITY in s.capabilities)
        cross_site_validation(
            model,
            {site: self.strategy.base_config(model.round) for site in able},
            self.local_models,
            lambda candidate, plan: self._collect_evaluations(model.round, candidate, plan),
            connected={s.site for s in sessions},
            audit=self.audit,
            run_dir=self.run_dir,
        )

    def _secure_evaluation(self, server_round: int, plan: dict[str, RoundConfig]) -> dict[str, Any]:
        """`federated_evaluation` under secure aggregation: the record keys of the
        federation's totals (`secure_evaluation.py`); nothing per site."""
        assert self.secagg is not None
        model = self.global_model
        minimum = max(2, self.strategy.min_evaluate_clients)
        if len(plan) < minimum:
            log.warning(
                "round %d: no evaluation: a secure evaluation needs at least %d sites "
                "(max(2, strategy.min_evaluate_clients)), %d can evaluate",
                server_round,
                minimum,
                len(plan),
            )
            return secure_record({}, None, sorted(plan))
        state = SecureEvaluation(
            server_round,
            model.version,
            plan,
            time.monotonic() + self.config.eval_timeout_s,
            settings=self.secagg,
            sessions={site: self.registry.get(site) for site in plan},
            audit=self.audit,
            min_included=minimum,
            verifier=self.secagg_verifier,
        )
        self.secure_evaluation = state
        try:
            state.start(time.time() + self.config.eval_timeout_s)
            state.wait(lambda: self.stopped)
        finally:
            self.secure_evaluation = None
        totals = state.totals
        aggregated = (
            self.strategy.aggregate_evaluate(
                server_round, [(totals.num_examples, totals.metrics())]
            )
            if totals is not None
            else {}
        )
        log.info(
            "round %d: %s of %d site(s) evaluated model %s securely: %s",
            server_round,
            totals.sites if totals is not None else "none",
            len(plan),
            model.version[:12],
            ", ".join(f"{k} {v:.4f}" for k, v in sorted(aggregated.items()))
            or (state.failed or "no result"),
        )
        return secure_record(aggregated, totals, state.missing())

    def secagg_exchange(self) -> SecureRoundState | SecureEvaluation | None:
        """Where a site's secure-aggregation message goes: the secure evaluation in
        progress, else the secure round in progress (None: neither)."""
        if self.secure_evaluation is not None:
            return self.secure_evaluation
        state = self.current
        return state if isinstance(state, SecureRoundState) else None

    def evaluation_received(self, session: Session, report: pb.EvalReport) -> None:
        """A site's EvalReport: counted by the evaluation in progress, or refused (logged
        and audited; the site is then missing from it)."""
        state = self.evaluation
        try:
            if self.secure_evaluation is not None or self.secagg is not None:
                raise ProtocolError(
                    f"site {session.site!r} sent a plain evaluation report for round "
                    f"{report.round}, but this federation evaluates under secure aggregation "
                    "(a site's evaluation reaches the server only masked); ignored"
                )
            if state is None:
                raise ProtocolError(
                    f"site {session.site!r} sent an evaluation of round {report.round}, but no "
                    "evaluation is in progress (late, or never asked); ignored"
                )
            state.receive(session.site, report)
        except ProtocolError as exc:
            log.warning("%s", exc)
            self.audit.record(
                "evaluation_refused", site=session.site, round=report.round, reason=str(exc)
            )

    def record_round(
        self, record: dict[str, Any], started: float, model: GlobalModel, **audit: Any
    ) -> None:
        """Evaluate (when due), start the checkpoint of `model` carrying the round's
        record, then write the metrics line and the audit record, and tell `on_round`.

        In this order a crash at any point leaves each round exactly once in
        metrics.jsonl after `--resume` (see `checkpoints.py`)."""
        server_round = record["round"]
        self.evaluate_into(record)
        finished(record, time.perf_counter() - started)
        record, audit = _plain(record), _plain(audit)  # as the line and the resume see them
        fault_point("evaluated", server_round)
        self.checkpoint(model, record, audit)
        fault_point("checkpoint_submitted", server_round)
        self.run_dir.log_metrics(record)
        fault_point("metrics_logged", server_round)
        self.last_metrics = record
        if record.get("eval_source"):
            self.last_evaluation = record
        self.audit.record(
            "round_completed", round=server_round, model_version=model.version, **audit
        )
        if self.on_round is not None:
            self.on_round(record)
        fault_point("round_recorded", server_round)

    def _retry(self, summary: RoundSummary) -> None:
        needed = self._needed(len(summary.selected))
        why = summary.poisoned or (
            f"{len(summary.contributors)} of {len(summary.selected)} update(s) arrived, "
            f"{needed} needed (dropped: {summary.dropped or 'none'}, failed: "
            f"{summary.failed or 'none'}{', deadline passed' if summary.timed_out else ''})"
        )
        # Back off between attempts so sites that fail at once cannot make the server spin.
        delay = min(RETRY_DELAY_MAX_S, RETRY_DELAY_S * 2 ** (summary.attempt - 1))
        log.warning(
            "round %d attempt %d failed: %s; retrying in %.1fs",
            summary.round,
            summary.attempt,
            why,
            delay,
        )
        self.audit.record(
            "round_failed",
            round=summary.round,
            attempt=summary.attempt,
            reason=why,
            contributors=summary.contributors,
            dropped=summary.dropped,
            failed=summary.failed,
        )
        limit = self.config.max_round_attempts
        if limit and summary.attempt >= limit:
            raise RoundFailed(
                f"round {summary.round} failed {summary.attempt} attempt(s) (last: {why}); "
                "check the sites' logs, or raise max_round_attempts / round_timeout_s"
            )
        self._stop.wait(delay)

    def _complete(self) -> None:
        self.checkpoints.wait()
        self._cross_site_validation()
        save_final_model(  # safetensors with the task's names + its card, then model.pt
            self.run_dir,
            self.task,
            self.global_model.state,
            task_ref=self.config.task,
            server_round=self.global_model.round,
            run_id=self.run_id,
            metrics=self.last_metrics,
            fingerprint=self.fingerprint,
        )
        self.audit.record(
            "run_completed",
            run_id=self.run_id,
            rounds=self.global_model.round,
            model_version=self.global_model.version,
            model_sha256=self.global_model.state.digest(),
        )
        log.info(
            "run %s complete: %d rounds, final model %s in %s",
            self.run_id,
            self.global_model.round,
            self.global_model.version[:12],
            self.run_dir.model_path,
        )
        bye = pb.ServerMessage(shutdown=pb.Shutdown(reason=wire.RUN_COMPLETE))
        sessions = self.registry.sessions()
        for session in sessions:
            session.send(bye)
            self.registry.remove(session, RUN_COMPLETE_LEAVE)
        log.info("told %d connected site(s) that the run is complete", len(sessions))

    # -- events from the servicer ----------------------------------------------------------
    def _on_leave(self, session: Session, reason: str) -> None:
        for evaluation in (self.secure_evaluation, self.evaluation):
            if evaluation is not None and evaluation.settle(session.site, f"left ({reason})"):
                log.warning(
                    "site %r left during round %d's evaluation (%s)",
                    session.site,
                    evaluation.round,
                    reason,
                )
        state = self.current
        if state is not None and state.settle(session, Outcome.DROPPED):
            log.warning("site %r dropped out of round %d (%s)", session.site, state.round, reason)

    def rejoined(self, session: Session) -> None:
        """A site rejoined its session after an outage: if it still owes the plain round
        in progress its update and is not uploading, tell it the round's instruction
        again (the first may have been written into the dead connection; the daemon
        ignores one it already has). A secure round's stage messages cannot be replayed:
        a site that missed one is a dropout at that stage."""
        state = self.current
        if not isinstance(state, RoundState) or isinstance(state, SecureRoundState):
            return
        if state.closed or state.tokens.get(session.site) != session.token:
            return
        if state.outcomes.get(session.site) is not Outcome.PENDING:
            return
        if session.site in state.uploading:
            return
        instruct(
            session,
            state.round,
            state.model_version,
            state.plan[session.site],
            state.deadline_unix,  # the same instruction, its connection choice too
            own_upload_connection=session.site in state.own_uploads,
        )

    def site_failed(self, session: Session, server_round: int, message: str) -> None:
        """A site reported that it cannot deliver this round's update (or evaluation)."""
        for evaluation in (self.secure_evaluation, self.evaluation):
            if evaluation is not None and evaluation.round == server_round:
                evaluation.settle(session.site, f"failed: {message}")
        state = self.current
        if isinstance(state, BufferedRounds):
            state.job_failed(session, server_round)
        elif state is not None and state.round == server_round:
            state.settle(session, Outcome.FAILED)

    def model_for_download(self, session: Session, version: str) -> GlobalModel | None:
        """The model a site asks for: the current one, or under FedBuff an older version
        a site was told to train from before the model moved on; None if gone."""
        state = self.current
        if isinstance(state, BufferedRounds):
            return state.model_for(session, version)
        model = self.global_model
        local = self.local_models.for_download(version)
        if local is not None:
            return local
        return model if not version or version == model.version else None
