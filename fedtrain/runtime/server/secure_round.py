"""The server's side of secure aggregation: one attempt of one round, stage by stage.

A `SecureRoundState` is a `RoundState` whose updates arrive masked. It keeps the
same admission rules for uploads, the same lock and the same summary, and adds the
SecAgg+ protocol (`fedtrain.secagg.SecAggServer`, a pure state machine) on top:

* after the coordinator has pushed the round's instructions, `start()` sends every
  participant its `SetupRequest` on its control stream, so key agreement runs while
  the sites download and train;
* stage replies arrive on the sites' control-stream threads (`receive`), chunks of
  masked vectors on their upload threads (`fold_masked`), folded into the protocol's
  modular sum at once;
* `wait()`, on the coordinator's thread, closes each stage (four, five with the
  consistency check) when every
  site still expected has replied or is gone (its control stream broke, it reported
  an error), or at the stage's deadline; whoever is missing then is a dropout at that
  stage, which the protocol absorbs. Then it unmasks the sum and hands it to the
  strategy's aggregate as the `WeightedSum` it would have built from plain updates.

Everything that touches the protocol object happens under the round's lock, so a
chunk can never race a stage closing, and nothing waits on a timer: every wait is
on the round's condition, with the stage's deadline as its bound.

Sites are secure-aggregation ids 1..n: their index in the sorted list of the round's
participants, plus one (deterministic, and nothing else about a site is revealed).

With TLS (a `verifier`), each id's advertised keys must carry a credential of the site
the server gave that id (`fedtrain.runtime.secagg_identity`), and the round runs the
consistency check when `secagg.consistency_check` asks for it; without TLS the sites
have nothing to sign with, and the check is off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np

from fedtrain.errors import ProtocolError, SecAggError, UpdateRejected
from fedtrain.runtime.config import SecAggServerSettings
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.rounds import Outcome, RoundState, UploadRefused
from fedtrain.runtime.server.sessions import Session, summarize_sites
from fedtrain.runtime.server.uploads import UpdateSpool
from fedtrain.secagg import (
    AdvertiseKeys,
    ConsistencySignature,
    MaskedInput,
    SecAggResult,
    SecAggServer,
    ServerMessage,
    ShareKeys,
    Stage,
    UnmaskShares,
    decode_message,
)
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
    ids: dict[str, int] = field(init=False)
    _names: dict[int, str] = field(init=False, repr=False)
    _server: SecAggServer = field(init=False, repr=False)
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
        self.ids = {name: i + 1 for i, name in enumerate(sorted(self.plan))}
        self._names = {i: name for name, i in self.ids.items()}
        protocol = self.settings.protocol()
        verifier = None
        if self.verifier is not None:
            verifier = self.verifier.expecting(self._names)
        elif protocol.consistency_check:
            protocol = dataclasses.replace(protocol, consistency_check=False)
        try:
            self._server = SecAggServer.from_config(
                protocol,
                secagg_round_id(self.round, self.attempt),
                self.ids.values(),
                self.layout.length,
                min_included=self.min_included,
                verifier=verifier,
            )
        except SecAggError as exc:
            raise SecAggError(
                f"round {self.round}: cannot set up secure aggregation for "
                f"{len(self.plan)} sites: {exc}"
            ) from None
        params = self._server.params
        log.info(
            "round %d (attempt %d): secure aggregation over %d sites, k=%d, t=%d, %d values, "
            "consistency check %s",
            self.round,
            self.attempt,
            len(params.sites),
            params.k,
            params.t,
            params.vector_length,
            "on" if params.consistency_check else "off",
        )

    def _where(self, site: str) -> str:
        return f"site {site!r}, round {self.round}, stage {self._server.stage.name}"

    # -- sending ---------------------------------------------------------------------------
    def start(self) -> None:
        """Send every reachable participant its SetupRequest (after its Instruction)."""
        with self._cond:
            self._send(self._server.start())

    def _send(self, messages: Mapping[int, ServerMessage]) -> None:
        gone = self._gone()
        stage = int(self._server.stage)
        for secagg_id, message in messages.items():
            name = self._names[secagg_id]
            session = self.sessions.get(name)
            if session is None or name in gone:
                continue
            payload = message.to_bytes()
            session.send(
                pb.ServerMessage(
                    secagg=pb.SecAggMessage(round=self.round, stage=stage, payload=payload)
                )
            )

    # -- from the servicer's threads --------------------------------------------------------
    def receive(self, session: Session, message: pb.SecAggMessage) -> None:
        """One stage reply from a site's control stream; raises (naming site, round and
        stage) when it is refused, and the site then counts as not having replied."""
        with self._cond:
            where = self._where(session.site)
            if self.tokens.get(session.site) != session.token:
                raise ProtocolError(f"{where}: this session was not chosen for this round")
            if message.round != self.round:
                raise ProtocolError(
                    f"{where}: a secure-aggregation message for round {message.round}; ignored"
                )
            try:
                msg = decode_message(message.payload)
            except SecAggError as exc:
                raise ProtocolError(
                    f"{where}: undecodable secure-aggregation message: {exc}"
                ) from None
            if isinstance(msg, MaskedInput):
                raise ProtocolError(f"{where}: masked inputs go up the upload stream")
            if not isinstance(msg, AdvertiseKeys | ShareKeys | ConsistencySignature | UnmaskShares):
                raise ProtocolError(f"{where}: a site cannot send {type(msg).__name__}")
            if msg.site != self.ids[session.site]:
                raise ProtocolError(
                    f"{where}: the message claims secure-aggregation id {msg.site}, but this "
                    f"site is {self.ids[session.site]} this round"
                )
            try:
                self._server.receive(msg)
            except SecAggError as exc:
                raise SecAggError(f"{where}: {exc}") from None
            self._cond.notify_all()

    def fold_masked(self, session: Session, offset: int, values: np.ndarray) -> bool:
        """Fold one chunk of a site's masked vector into the sum; True once it is whole."""
        with self._cond:
            site = session.site
            if site in self._left:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self._where(site)}: the site's control session ended, so it was dropped "
                    "from this round; masked update discarded",
                )
            try:
                complete = self._server.receive_masked_chunk(self.ids[site], offset, values)
            except SecAggError as exc:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{self._where(site)}: {exc}"
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
            if site in self.ids and self._server.stage is Stage.MASKED_INPUT:
                self._server.abort_masked_input(self.ids[site])

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
        of one attempt's updates, nor a sum it will not use: the acceptance minimum is
        part of the protocol's masked-input stage, and once `result` is set the
        attempt is the round's (an audit record `secagg_unmasked` names the sites).
        """
        with self._cond:
            stages = [Stage.SETUP, Stage.SHARE_KEYS, Stage.MASKED_INPUT]
            if self._server.params.consistency_check:
                stages.append(Stage.CONSISTENCY)
            try:
                for stage in stages:
                    if not self._await(stage, stopped):
                        return
                    self._send(self._server.advance())
                if not self._await(Stage.UNMASK, stopped):
                    return
                self.result = self._server.finish()
                self.audit.record(
                    "secagg_unmasked",
                    round=self.round,
                    attempt=self.attempt,
                    included=sorted(self._names[i] for i in self.result.included),
                    dropped=sorted(self._names[i] for i in self.result.dropped),
                )
                assert isinstance(self.aggregate, WeightedSum)  # checked in __post_init__
                self.aggregate.merge(self.layout.weighted_sum(self.result))
            except (SecAggError, UpdateRejected) as exc:
                self.poisoned = f"secure aggregation failed: {exc}"
                log.warning("round %d (attempt %d): %s", self.round, self.attempt, self.poisoned)

    def _gone(self) -> set[str]:
        failed = {s for s, o in self.outcomes.items() if o in (Outcome.DROPPED, Outcome.FAILED)}
        return failed | self._left

    def _deadline(self, stage: Stage) -> float:
        now = time.monotonic()
        s = self.settings
        if stage is Stage.SETUP:
            return min(now + s.setup_timeout_s, self.deadline)
        if stage is Stage.SHARE_KEYS:
            return min(now + s.share_keys_timeout_s, self.deadline)
        if stage is Stage.MASKED_INPUT:
            if s.masked_input_timeout_s:
                return min(now + s.masked_input_timeout_s, self.deadline)
            return self.deadline
        # Signing and unmasking are short and come after the updates are in: they may
        # outlast the round.
        if stage is Stage.CONSISTENCY:
            return now + s.consistency_timeout_s
        return now + s.unmask_timeout_s

    def _await(self, stage: Stage, stopped: Callable[[], bool]) -> bool:
        """Block (lock held, released while waiting) until `stage` may close; False if stopped."""
        deadline = self._deadline(stage)
        while True:
            if stopped():
                return False
            waiting = {self._names[i] for i in self._server.pending} - self._gone()
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                log.warning(
                    "round %d: secure-aggregation stage %s reached its deadline without %s",
                    self.round,
                    stage.name,
                    summarize_sites(sorted(waiting)),
                )
                break
            self._cond.wait(left)
        missing = sorted(self._names[i] for i in self._server.pending)
        self.audit.record(
            "secagg_stage",
            round=self.round,
            attempt=self.attempt,
            stage=stage.name,
            missing=missing,
        )
        if missing:
            log.info(
                "round %d: %s dropped at secure-aggregation stage %s",
                self.round,
                summarize_sites(missing),
                stage.name,
            )
        return True
