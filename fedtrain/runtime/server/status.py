"""Where a running federation stands, read from the coordinator for the Status RPC and
the Prometheus collector, so `fedtrain status` and a dashboard never disagree.

`server_state` reads the coordinator's live objects without taking its locks: every
field it reads is replaced as a whole (the global model, the round state), so a
snapshot may be a moment stale but is never torn. Its wire form and the client that
asks for it are in `fedtrain.runtime.status`.
"""

from __future__ import annotations

import time

from fedtrain.observability.status import (
    ServerState,
    SiteState,
    TransferState,
    numbers,
    site_figures,
)
from fedtrain.runtime.server.coordinator import Coordinator
from fedtrain.runtime.server.links import LinkEstimates
from fedtrain.runtime.server.sessions import SessionRegistry
from fedtrain.runtime.status import SitePage


def phase(coordinator: Coordinator, connected: int) -> str:
    """One of `fedtrain.observability.status.PHASES`."""
    if coordinator.finished.is_set():
        if coordinator.error is not None:
            return "failed"
        done = coordinator.global_model.round >= coordinator.config.rounds
        return "finished" if done else "stopped"
    state = coordinator.current
    if state is not None:
        return "aggregating" if state.closed else "training"
    if connected < coordinator.strategy.min_available_clients:
        return "waiting"
    return "between_rounds"


def server_state(
    coordinator: Coordinator, registry: SessionRegistry, page: SitePage | None = None
) -> ServerState:
    """A snapshot of the federation (see the module docstring); `page` picks the sites
    it lists (default: every one)."""
    now = time.monotonic()
    page = page or SitePage(limit=None)
    listed, connected = registry.listed(page.offset, page.limit)
    state = coordinator.current
    model = coordinator.global_model
    evaluated = coordinator.last_evaluation
    return ServerState(
        run_id=coordinator.run_id,
        task=coordinator.config.task,
        phase=phase(coordinator, connected),
        round=state.round if state is not None else model.round,
        attempt=state.attempt if state is not None else 0,
        total_rounds=coordinator.config.rounds,
        rounds_completed=model.round,
        min_sites=coordinator.strategy.min_available_clients,
        secagg=coordinator.secagg is not None,
        model_version=model.version,
        finished=coordinator.finished.is_set(),
        sites=tuple(
            SiteState(
                session.site,
                now - session.joined_at,
                now - session.last_seen,
                *coordinator.links.rates(session.site),
                *site_figures(evaluated, session.site),
                in_flight(coordinator.links, session.site, now),
            )
            for session in listed
        ),
        last_metrics=numbers(coordinator.last_metrics),
        connected_sites=connected,
        last_evaluation=numbers(evaluated),
        worst_site=str(evaluated.get("worst_site") or ""),
        bytes=coordinator.transfers.totals(),
    )


def in_flight(links: LinkEstimates, site: str, now: float) -> tuple[TransferState, ...]:
    """`site`'s transfers under way, as the transfer watch last sampled them."""
    states = []
    for direction in ("down", "up"):
        meter = links.live(site, direction)
        if meter is None:
            continue
        watched = meter.watched
        states.append(
            TransferState(
                direction,
                meter.done,
                meter.total,
                watched.bps if watched is not None else None,
                watched.idle_s(now) if watched is not None else 0.0,
            )
        )
    return tuple(states)
