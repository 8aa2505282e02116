"""Each chosen site's own deadline, sized from its measured link and compute.

`round_timeout_s` must suit the slowest site a federation accepts, so a site that
stalls (or whose link fell far below what it measured) would hold every round until
then. Each chosen site with a complete estimate (`links.py`: download, compute and
upload all measured) gets its own deadline when an attempt starts:

    estimate (model down + update up at its rates, plus its compute) x slack + floor

(`[transfers]` deadline_slack, deadline_floor_s), kept only when it falls before the
round's. A site past it is judged, once a second (the loop's tick asks `due`, the
CPU pool runs `enforce`):

* still moving bytes at no less than its measured rate / slack, with a byte in the
  last `stall_s`: kept (a slow moment is not a stalled link; checked again later);
* in an outage (its session away, or silent past two heartbeats, while an outage
  grace is configured): not judged, `heartbeat.timeout_s` and `grace_s` decide its
  fate; the outage's length is added to its deadline when it comes back. The outage
  grace promises that a cut link shorter than it drops nobody, and resumable
  transfers make such a cut cost only its length, so it is not held against the
  site's link. Outages are forgiven up to `grace_s` per attempt in all: a link so
  congested that its heartbeats keep getting stuck behind its own upload (silent,
  away, rejoin, again) is then judged like any other;
* with no transfer in flight while every one of the server's transfer slots is taken
  (thousands training at once): kept, checked again later; the server is what the
  site waits for then (a connection not yet accepted, a call not yet taken), and the
  round cannot end before the queue drains anyway;
* otherwise (stalled, crawling, or computing far longer than measured) dropped from
  the attempt, audited `site_dropped` with the numbers; its transfers are cut
  (`on_drop` listeners), so it spends no more bytes on the round.

A site is never dropped when the attempt could then no longer gather the updates it
needs (the round would fail for a site that may still finish). Under secure
aggregation a site can only upload once the masked-input stage opened, so it is judged
only during that stage, with at least its upload's allowance from the stage's
opening; a dropped site is then a dropout of that stage, which the protocol absorbs.
(Secure rounds never measure a site's compute, its upload waits for the others' keys,
so only compute measured in plain rounds sizes a deadline there.) FedBuff has no round
deadline and no per-site one. An estimate only ever shortens a wait; a failure to
judge one leaves the site in the round.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fedtrain.observability.status import mbit
from fedtrain.runtime.config import TransfersConfig
from fedtrain.runtime.server.audit import AuditLog
from fedtrain.runtime.server.links import Estimate, LinkEstimates
from fedtrain.runtime.server.rounds import Outcome, RoundState
from fedtrain.runtime.server.secure_round import SecureRoundState
from fedtrain.runtime.server.sessions import Session, SessionRegistry
from fedtrain.runtime.server.transfer_watch import describe
from fedtrain.secagg import Stage

log = logging.getLogger(__name__)

#: A site kept past its deadline (still moving bytes at its rate) is judged again this soon.
RECHECK_S = 1.0

DropListener = Callable[[Session, str], None]


@dataclass(frozen=True)
class SiteDeadline:
    """One site's allowance in one attempt."""

    allowed_s: float  # seconds from the attempt's start
    estimate: Estimate
    outage_s: float  # the session's `outage_s` when the attempt started


@dataclass
class _Attempt:
    state: RoundState
    started: float
    needed: int
    deadlines: dict[str, SiteDeadline]
    due: list[tuple[float, str]]  # (when to judge, site): a heap


class SiteDeadlines:
    """The per-site deadlines of the attempt in progress (see the module docstring)."""

    def __init__(
        self,
        links: LinkEstimates,
        registry: SessionRegistry,
        audit: AuditLog,
        config: TransfersConfig,
        grace_s: float,
    ) -> None:
        self.links, self.registry, self.audit = links, registry, audit
        self.config, self.grace_s = config, grace_s
        self._attempt: _Attempt | None = None
        self._listeners: list[DropListener] = []
        self._lock = threading.Lock()  # one `enforce` at a time
        #: Whether every one of the server's transfer slots is taken (the servicer sets
        #: it; called from the CPU pool): then the server, not a site, sets the pace.
        self.server_saturated: Callable[[], bool] = lambda: False

    def on_drop(self, listener: DropListener) -> None:
        """Call `listener(session, reason)` when a site is dropped at its deadline."""
        self._listeners.append(listener)

    # -- the coordinator's thread -----------------------------------------------------------
    def begin(
        self,
        state: RoundState,
        started: float,
        round_deadline: float,
        needed: int,
        model_bytes: int,
        update_bytes: int | None,
    ) -> dict[str, SiteDeadline]:
        """Size the deadlines of an attempt that started at `started` (monotonic);
        the sites that got one, with it."""
        self._attempt = None
        slack, floor = self.config.deadline_slack, self.config.deadline_floor_s
        if not slack:
            return {}
        deadlines: dict[str, SiteDeadline] = {}
        try:
            for site in state.plan:
                estimate = self.links.estimate(site, model_bytes, update_bytes)
                if estimate is None or not estimate.complete:
                    continue  # not measured yet: the round's deadline applies
                allowed = estimate.seconds * slack + floor
                session = self.registry.get(site)
                if started + allowed < round_deadline and session is not None:
                    deadlines[site] = SiteDeadline(allowed, estimate, session.outage_s)
        except Exception:  # an estimate only ever shortens a wait: never stop a round
            log.exception("round %d: per-site deadlines failed; none set", state.round)
            return {}
        due = [(started + d.allowed_s, site) for site, d in deadlines.items()]
        heapq.heapify(due)
        self._attempt = _Attempt(state, started, needed, deadlines, due)
        return deadlines

    def end(self) -> None:
        self._attempt = None

    # -- the loop's tick, then the CPU pool -------------------------------------------------
    def due(self, now: float | None = None) -> bool:
        """Whether a site's deadline passed and it waits to be judged (cheap: the loop asks)."""
        attempt = self._attempt
        if attempt is None or attempt.state.closed:
            return False
        try:  # `enforce` may empty the heap on the pool meanwhile
            return attempt.due[0][0] <= (time.monotonic() if now is None else now)
        except IndexError:
            return False

    def enforce(self, now: float | None = None) -> list[str]:
        """Judge every site whose deadline passed; the sites dropped."""
        with self._lock:
            attempt = self._attempt
            if attempt is None:
                return []
            now = time.monotonic() if now is None else now
            dropped = []
            while attempt.due and attempt.due[0][0] <= now and not attempt.state.closed:
                _, site = heapq.heappop(attempt.due)
                try:
                    later = self._judge(attempt, site, now)
                except Exception:  # never let a judgement stop the others, or the run
                    log.exception(
                        "round %d: judging site %r's deadline failed", attempt.state.round, site
                    )
                    continue
                if later is None:
                    dropped.append(site)
                elif later > 0:
                    heapq.heappush(attempt.due, (later, site))
            return dropped

    def _judge(self, attempt: _Attempt, site: str, now: float) -> float | None:
        """When to judge `site` again (0: never), or None once it was dropped."""
        state = attempt.state
        session = self.registry.get(site)
        if state.outcomes.get(site) is not Outcome.PENDING or session is None:
            return 0  # settled already (a leave settles it too)
        if state.tokens.get(site) != session.token:
            return 0
        deadline = attempt.deadlines[site]
        outage = self._outage(session, now)
        forgiven = min(self.grace_s, session.outage_s - deadline.outage_s + outage)
        if outage and forgiven < self.grace_s:
            return now + RECHECK_S  # in an outage: heartbeat.grace_s judges it
        at = attempt.started + deadline.allowed_s + forgiven
        if isinstance(state, SecureRoundState):
            stage, opened = state.masked.server.stage, state.masked.stage_opened
            if stage is not Stage.MASKED_INPUT:
                return now + RECHECK_S if stage < Stage.MASKED_INPUT else 0
            upload = deadline.estimate.up_s * self.config.deadline_slack
            at = max(at, opened + upload + self.config.deadline_floor_s)
        if session.queued:
            return now + RECHECK_S  # waiting for one of the server's transfer slots
        if at > now:  # an outage under way may yet end shorter: look again soon
            return min(at, now + RECHECK_S) if outage else at
        why = self._why_late(site, deadline.estimate, now)
        if why is None:
            return now + RECHECK_S
        live = (Outcome.DONE, Outcome.PENDING)
        viable = sum(1 for s, o in state.outcomes.items() if o in live and s != site)
        if viable < attempt.needed:
            return now + RECHECK_S  # dropping it would fail the round: wait for it
        elapsed = now - attempt.started
        reason = (
            f"{elapsed:.0f}s into round {state.round}, past its deadline "
            f"{at - attempt.started:.0f}s (estimated {deadline.estimate.seconds:.0f}s at "
            f"{mbit(deadline.estimate.slowest_bps)} Mbit/s x slack "
            f"{self.config.deadline_slack:g} + {self.config.deadline_floor_s:g}s"
            + (f", + {forgiven:.0f}s in outages" if forgiven else "")
            + f"): {why}"
        )
        if not state.settle(session, Outcome.DROPPED):
            return 0
        log.warning("site %r dropped: %s", site, reason)
        self.audit.record(
            "site_dropped",
            site=site,
            round=state.round,
            attempt=state.attempt,
            reason=reason,
            elapsed_s=round(elapsed, 1),
            deadline_s=round(at - attempt.started, 1),
            estimate_s=round(deadline.estimate.seconds, 1),
        )
        for listener in self._listeners:
            listener(session, reason)
        return None

    def _outage(self, session: Session, now: float) -> float:
        """Seconds of the outage `session` is in now (away, or quiet past two heartbeats,
        while an outage grace is configured); 0: none."""
        if not self.grace_s:
            return 0.0
        if session.detached_at is not None:
            return now - min(session.last_seen, session.detached_at)
        quiet = now - session.last_seen
        return quiet if quiet > 2 * session.heartbeat_interval_s else 0.0

    def _why_late(self, site: str, estimate: Estimate, now: float) -> str | None:
        """Why a site past its deadline is dropped, or None: it still moves bytes at its
        measured rate / slack (with a byte in the last `stall_s`)."""
        slack, stall_s = self.config.deadline_slack, self.config.stall_s
        whys = []
        for direction, measured in (("down", estimate.down_bps), ("up", estimate.up_bps)):
            meter = self.links.live(site, direction)
            if meter is None:
                continue
            watched = meter.watched
            if watched is None or watched.bps is None:
                return None  # just started: too early to say
            idle = watched.idle_s(now)
            if idle >= stall_s:
                whys.append(f"stalled, no bytes for {idle:.0f}s ({describe(meter)})")
            elif not meter.nbytes:
                # Nothing moved yet is no rate: the go-ahead's round trip, and with a busy
                # server its pool and loop, come before a first byte (an all-10,000 round
                # dropped 13 sites a second after their slot came). A stall once it lasts.
                return None
            elif measured is not None and watched.bps * slack < measured:
                whys.append(
                    f"{describe(meter)} at {mbit(watched.bps)} Mbit/s, its link measured "
                    f"{mbit(measured)} Mbit/s"
                )
            else:
                return None
        if whys:
            return "; ".join(whys)
        if self.server_saturated():
            # Every transfer slot is taken: the site may be on its way to the queue (its
            # connection not yet accepted, its call not yet taken by the busy loop); the
            # round cannot end before the queue drains, so waiting costs nothing.
            return None
        return f"no transfer in flight (its compute was measured at {estimate.compute_s:.0f}s)"
