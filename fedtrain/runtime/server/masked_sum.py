"""One SecAgg+ masked sum driven over the sites' control streams, stage by stage.

Both secure exchanges of the server run through this: a secure training round
(`secure_round.SecureRoundState`: the masked updates come up the upload stream, chunk
by chunk) and a secure evaluation (`secure_evaluation.SecureEvaluation`: each site's
few masked evaluation sums come on its control stream). The protocol itself is the
pure state machine `fedtrain.secagg.SecAggServer`; this class moves its messages to
the sites, takes their replies, and closes each stage when every site still expected
has replied or is gone, or at the stage's deadline (whoever is missing then is a
dropout at that stage, which the protocol absorbs).

The owner passes its condition: every method is called with it held (`run` waits on
it), so a reply, a chunk and a stage closing never race. Nothing waits on a timer.

Sites are secure-aggregation ids 1..n: their index in the sorted list of the
exchange's participants, plus one (deterministic, and nothing else about a site is
revealed). With TLS (a `verifier`), each id's advertised keys must carry a credential
of the site the server gave that id (`fedtrain.runtime.secagg_identity`), and the
consistency check runs when the protocol asks for it; without TLS the sites have
nothing to sign with, and the check is off.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fedtrain.errors import ProtocolError, SecAggError
from fedtrain.runtime.config import SecAggServerSettings
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.secagg_identity import CertificateVerifier
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.sessions import Session, summarize_sites
from fedtrain.secagg import (
    AdvertiseKeys,
    ConsistencySignature,
    MaskedInput,
    SecAggConfig,
    SecAggResult,
    SecAggServer,
    ServerMessage,
    ShareKeys,
    Stage,
    UnmaskShares,
    decode_message,
)

log = logging.getLogger(__name__)

#: When a stage may close at the latest (time.monotonic()), asked as it opens.
StageDeadline = Callable[[Stage], float]


def stage_deadline(settings: SecAggServerSettings, stage: Stage, until: float) -> float:
    """When `stage`, opening now, closes at the latest: the key stages and the masked
    input within `until` (the exchange's own deadline); signing and unmasking are short
    and come after the inputs are in, so they may outlast it."""
    now = time.monotonic()
    if stage is Stage.SETUP:
        return min(now + settings.setup_timeout_s, until)
    if stage is Stage.SHARE_KEYS:
        return min(now + settings.share_keys_timeout_s, until)
    if stage is Stage.MASKED_INPUT:
        if settings.masked_input_timeout_s:
            return min(now + settings.masked_input_timeout_s, until)
        return until
    if stage is Stage.CONSISTENCY:
        return now + settings.consistency_timeout_s
    return now + settings.unmask_timeout_s


class MaskedSum:
    """The protocol of one masked sum over `sites` (see the module docstring)."""

    def __init__(
        self,
        *,
        label: str,
        server_round: int,
        protocol: SecAggConfig,
        round_id: int,
        sites: Iterable[str],
        vector_length: int,
        min_included: int,
        sessions: Mapping[str, Session | None],
        audit: AuditLog,
        cond: threading.Condition,
        verifier: CertificateVerifier | None,
        masked_on_control: bool,
        audit_fields: Mapping[str, Any],
    ) -> None:
        """`label` names the exchange in logs ("round 3 (attempt 1)"); `masked_on_control`:
        masked inputs arrive whole on the control stream (else chunked, `receive_chunk`);
        `audit_fields` identify it in every audit record it writes."""
        self.label = label
        self.round = server_round
        self.sessions = sessions
        self.audit = audit
        self.cond = cond
        self.masked_on_control = masked_on_control
        self.audit_fields = dict(audit_fields)
        #: Set when a stage closed at its deadline with sites still missing.
        self.timed_out = False
        #: time.monotonic() when the current stage opened (a site uploads its masked
        #: input only once MASKED_INPUT is open: `site_deadlines.py` counts from it).
        self.stage_opened = time.monotonic()
        self.ids = {name: i + 1 for i, name in enumerate(sorted(sites))}
        self.names = {i: name for name, i in self.ids.items()}
        checker = None
        if verifier is not None:
            checker = verifier.expecting(self.names)
        elif protocol.consistency_check:
            protocol = dataclasses.replace(protocol, consistency_check=False)
        try:
            self.server = SecAggServer.from_config(
                protocol,
                round_id,
                self.ids.values(),
                vector_length,
                min_included=min_included,
                verifier=checker,
            )
        except SecAggError as exc:
            raise SecAggError(
                f"{label}: cannot set up secure aggregation for {len(self.ids)} sites: {exc}"
            ) from None
        params = self.server.params
        log.info(
            "%s: secure aggregation over %d sites, k=%d, t=%d, %d values, consistency check %s",
            label,
            len(params.sites),
            params.k,
            params.t,
            params.vector_length,
            "on" if params.consistency_check else "off",
        )

    def where(self, site: str) -> str:
        return f"site {site!r}, {self.label}, stage {self.server.stage.name}"

    # -- sending (lock held) ------------------------------------------------------------------
    def start(self, gone: set[str]) -> None:
        """Send every reachable participant its SetupRequest."""
        self.send(self.server.start(), gone)

    def send(self, messages: Mapping[int, ServerMessage], gone: set[str]) -> None:
        stage = int(self.server.stage)
        for secagg_id, message in messages.items():
            name = self.names[secagg_id]
            session = self.sessions.get(name)
            if session is None or name in gone:
                continue
            session.send(
                pb.ServerMessage(
                    secagg=pb.SecAggMessage(
                        round=self.round, stage=stage, payload=message.to_bytes()
                    )
                )
            )

    # -- from the servicer's threads (lock held) ----------------------------------------------
    def receive(self, site: str, message: pb.SecAggMessage) -> None:
        """One stage reply from `site`'s control stream; raises (naming site, exchange and
        stage) when it is refused, and the site then counts as not having replied."""
        where = self.where(site)
        if message.round != self.round:
            raise ProtocolError(
                f"{where}: a secure-aggregation message for round {message.round}; ignored"
            )
        try:
            msg = decode_message(message.payload)
        except SecAggError as exc:
            raise ProtocolError(f"{where}: undecodable secure-aggregation message: {exc}") from None
        if isinstance(msg, MaskedInput) and not self.masked_on_control:
            raise ProtocolError(f"{where}: masked inputs go up the upload stream")
        allowed = AdvertiseKeys | ShareKeys | ConsistencySignature | UnmaskShares | MaskedInput
        if not isinstance(msg, allowed):
            raise ProtocolError(f"{where}: a site cannot send {type(msg).__name__}")
        if msg.site != self.ids[site]:
            raise ProtocolError(
                f"{where}: the message claims secure-aggregation id {msg.site}, but this "
                f"site is {self.ids[site]} here"
            )
        try:
            self.server.receive(msg)
        except SecAggError as exc:
            raise SecAggError(f"{where}: {exc}") from None
        self.cond.notify_all()

    # -- the coordinator's thread (lock held) -------------------------------------------------
    def run(
        self,
        stopped: Callable[[], bool],
        gone: Callable[[], set[str]],
        deadline: StageDeadline,
    ) -> SecAggResult | None:
        """Every stage, then unmask: the sum, or None if `stopped()` first.

        Raises SecAggError when the exchange cannot complete (too many dropouts, fewer
        masked inputs than the minimum, a corrupt share), before anything is unmasked.
        The acceptance minimum is part of the protocol's masked-input stage, so the
        server never unmasks a sum it will not use; once unmasked, an audit record
        `secagg_unmasked` names the sites.
        """
        stages = [Stage.SETUP, Stage.SHARE_KEYS, Stage.MASKED_INPUT]
        if self.server.params.consistency_check:
            stages.append(Stage.CONSISTENCY)
        for stage in stages:
            if not self._await(stage, stopped, gone, deadline(stage)):
                return None
            self.send(self.server.advance(), gone())
        if not self._await(Stage.UNMASK, stopped, gone, deadline(Stage.UNMASK)):
            return None
        result = self.server.finish()
        self.audit.record(
            "secagg_unmasked",
            **self.audit_fields,
            included=sorted(self.names[i] for i in result.included),
            dropped=sorted(self.names[i] for i in result.dropped),
        )
        return result

    def _await(
        self,
        stage: Stage,
        stopped: Callable[[], bool],
        gone: Callable[[], set[str]],
        deadline: float,
    ) -> bool:
        """Block (releasing the lock while waiting) until `stage` may close; False if stopped."""
        self.stage_opened = time.monotonic()
        while True:
            if stopped():
                return False
            waiting = {self.names[i] for i in self.server.pending} - gone()
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                log.warning(
                    "%s: secure-aggregation stage %s reached its deadline without %s",
                    self.label,
                    stage.name,
                    summarize_sites(sorted(waiting)),
                )
                break
            self.cond.wait(left)
        missing = sorted(self.names[i] for i in self.server.pending)
        self.audit.record("secagg_stage", **self.audit_fields, stage=stage.name, missing=missing)
        if missing:
            log.info(
                "%s: %s dropped at secure-aggregation stage %s",
                self.label,
                summarize_sites(missing),
                stage.name,
            )
        return True
