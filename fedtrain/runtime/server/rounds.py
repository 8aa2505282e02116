"""One attempt of one round: who was chosen, what each of them did, and the aggregate.

The servicer's upload handlers and the coordinator meet here. Everything that
decides whether an update may touch the aggregate happens under one lock: an upload
is admitted only for a chosen site's live session in the current, still-open
attempt; it is folded, whole and from its journal, only if the attempt is still
open when it completes; and the coordinator closes the attempt (deadline, everyone
settled, shutdown) under the same lock, so a late fold can never race the
finalization. An upload refused or broken off on the way was never folded, so the
sum is bit for bit what it would have been without it (`uploads.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum

import grpc
import torch

from fedtrain.errors import UpdateRejected
from fedtrain.runtime.server.sessions import Session
from fedtrain.runtime.server.uploads import UpdateSpool
from fedtrain.strategy import RoundConfig
from fedtrain.strategy.aggregate import Aggregator, WeightedSum

log = logging.getLogger(__name__)


class UploadRefused(UpdateRejected):
    """An upload refused before or while it was received; carries the gRPC status to send."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def refuse_second_upload(uploading: Collection[str], site: str, where: str) -> None:
    """One upload per site at a time, in a round or in an asynchronous job alike."""
    if site in uploading:
        raise UploadRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{where}: another upload from this site is still in progress",
        )


class Outcome(str, Enum):
    PENDING = "pending"
    DONE = "done"  # update folded into the aggregate
    FAILED = "failed"  # the site reported an error for this round
    DROPPED = "dropped"  # the site's session ended before its update arrived


@dataclass
class RoundSummary:
    """How an attempt ended, for the coordinator's decision and the metrics line."""

    round: int
    attempt: int
    selected: list[str]
    contributors: list[str]
    dropped: list[str]
    failed: list[str]
    results: list[tuple[int, dict[str, float]]]
    timed_out: bool
    poisoned: str | None


@dataclass(eq=False)
class RoundState:
    """The live state of one attempt of one round (see the module docstring)."""

    round: int
    attempt: int
    model_version: str
    plan: dict[str, RoundConfig]
    tokens: dict[str, str]  # site -> session token it was instructed on
    aggregate: Aggregator
    deadline: float  # time.monotonic()
    #: The deadline as the sites were told it (Instruction.deadline_unix).
    deadline_unix: float = 0.0
    outcomes: dict[str, Outcome] = field(init=False)
    results: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    uploading: set[str] = field(default_factory=set)
    closed: bool = False
    timed_out: bool = False
    #: Set when folding failed halfway; the aggregate is then unusable and the attempt fails.
    poisoned: str | None = None
    #: Sites whose update is also kept whole (`local_updates`): consenting sites under
    #: cross-site validation of local models (`cross_site_local_models`).
    keep_updates: frozenset[str] = frozenset()
    local_updates: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: Sites asked to send their update on a connection of their own
    #: (`sessions.own_upload_room`); a site instructed again is asked the same.
    own_uploads: frozenset[str] = frozenset()
    #: Chosen sites whose outcome is still PENDING (`wait` checks it on every wake-up:
    #: counting, not rescanning, keeps a round O(sites) however often it wakes).
    _pending: int = field(default=0, init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)

    def __post_init__(self) -> None:
        self.outcomes = {site: Outcome.PENDING for site in self.plan}
        self._pending = len(self.outcomes)

    def set_outcome(self, site: str, outcome: Outcome) -> None:
        """Settle a PENDING site (under the lock, or before the attempt is published)."""
        if self.outcomes[site] is Outcome.PENDING and outcome is not Outcome.PENDING:
            self._pending -= 1
        self.outcomes[site] = outcome

    # -- uploads ------------------------------------------------------------------------
    def admit(self, session: Session, server_round: int, model_version: str) -> None:
        """Check an upload header against this attempt; marks the site as uploading."""
        where = f"site {session.site!r}, round {server_round}"
        with self._cond:
            if server_round != self.round:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: stale round; the server is in round {self.round}, so the "
                    "update was dropped (the site will get the next instruction)",
                )
            if self.closed:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: the round already closed (deadline passed or finished); "
                    "update dropped",
                )
            if self.tokens.get(session.site) != session.token:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: this session was not chosen to train in this round",
                )
            if model_version and model_version != self.model_version:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: update computed against model {model_version[:12]}, but the "
                    f"round's model is {self.model_version[:12]}",
                )
            if self.outcomes[session.site] is not Outcome.PENDING:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: duplicate upload; this site's round already ended as "
                    f"{self.outcomes[session.site].value}",
                )
            refuse_second_upload(self.uploading, session.site, where)
            self.uploading.add(session.site)

    def _poison(self, why: str) -> None:
        self.poisoned = why
        self.closed = True
        self._cond.notify_all()

    def abandon(self, site: str) -> None:
        """An admitted upload failed (nothing of it was folded); the site may try again
        until the deadline."""
        with self._cond:
            self.uploading.discard(site)

    def commit(
        self, session: Session, spool: UpdateSpool, num_examples: int, metrics: Mapping[str, float]
    ) -> None:
        """Count a complete, validated update in the aggregate (if the attempt is open)."""
        with self._cond:
            self.uploading.discard(session.site)
            if self.closed:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"site {session.site!r}, round {self.round}: the round closed while the "
                    "update was being received (deadline passed); update dropped",
                )
            if self.outcomes.get(session.site) is not Outcome.PENDING:
                raise UploadRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"site {session.site!r}, round {self.round}: the site's round already "
                    f"ended as {self.outcomes[session.site].value}; update dropped",
                )
            try:
                spool.fold_into(self.aggregate, float(num_examples))
            except BaseException as exc:
                self._poison(f"folding the update of {session.site!r} failed halfway: {exc}")
                raise
            if session.site in self.keep_updates:
                kept = WeightedSum(tuple(self.aggregate.specs.values()))
                spool.fold_into(kept, 1.0)
                self.local_updates[session.site] = kept.mean(in_place=True)
            self.set_outcome(session.site, Outcome.DONE)
            self.results.append((num_examples, dict(metrics)))
            self._cond.notify_all()

    # -- other ways a chosen site settles -----------------------------------------------------
    def settle(self, session: Session, outcome: Outcome) -> bool:
        """Record that a chosen site failed or dropped out; True if this changed anything."""
        with self._cond:
            if self.tokens.get(session.site) != session.token:
                return False
            if self.outcomes[session.site] is not Outcome.PENDING or self.closed:
                return False
            self.set_outcome(session.site, outcome)
            self._cond.notify_all()
            return True

    # -- the coordinator's side -----------------------------------------------------------
    def wait(self, stopped: Callable[[], bool]) -> None:
        """Block until every chosen site settled, the deadline passes, or `stopped()`."""
        with self._cond:
            while not self.closed and not stopped():
                if not self._pending:
                    return
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.timed_out = True
                    return
                self._cond.wait(left)

    def wake(self) -> None:
        """Let `wait` re-check `stopped()` (shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> RoundSummary:
        """Stop admitting and folding updates; what happened, per site."""
        with self._cond:
            self.closed = True  # uploads still arriving are refused at `commit`
            by = {o: [s for s, v in self.outcomes.items() if v is o] for o in Outcome}
            return RoundSummary(
                round=self.round,
                attempt=self.attempt,
                selected=sorted(self.plan),
                contributors=by[Outcome.DONE],
                # Chosen sites that never delivered before the deadline count as dropouts.
                dropped=sorted(by[Outcome.DROPPED] + by[Outcome.PENDING]),
                failed=by[Outcome.FAILED],
                results=list(self.results),
                timed_out=self.timed_out,
                poisoned=self.poisoned,
            )
