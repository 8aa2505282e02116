"""The live state of a federation, as `fedtrain status` shows it and Prometheus scrapes it.

`ServerState` is a plain snapshot (no locks, no gRPC types), built on the server from
its coordinator (`fedtrain.runtime.server.status`), sent in the Status RPC and rebuilt
on the other side (`fedtrain.runtime.status`). The renderers here turn it into a rich
table for a terminal, plain `key: value` lines for logs and scripts, or JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from fedtrain.round_record import describe_evaluation

#: What the server is doing. Prometheus exports one `fedtrain_phase{phase=...}` per value.
PHASES = ("waiting", "training", "aggregating", "between_rounds", "finished", "stopped", "failed")

#: `ServerState.bytes`: received = accepted + discarded + resent + still in flight.
BYTE_KEYS = ("received", "sent", "accepted", "discarded", "resent")

PHASE_TEXT = {
    "waiting": "waiting for sites to connect",
    "training": "round in progress (sites train and upload)",
    "aggregating": "aggregating, checkpointing and evaluating",
    "between_rounds": "starting the next round",
    "finished": "run complete",
    "stopped": "stopped before the last round (resume with --resume)",
    "failed": "the round loop failed (see the server's log)",
}


@dataclass(frozen=True)
class TransferState:
    """A transfer in flight: `direction` "down" (model) or "up" (update)."""

    direction: str
    done_bytes: int
    total_bytes: int  # 0: not known yet
    bps: float | None  # over the last few seconds (None: too early to say)
    idle_s: float  # since its last byte

    def describe(self) -> str:
        """ "up 12.5/40.0 MB 9.8 Mbit/s", with "idle 21s" once it has been quiet a while."""
        size = amount(self.done_bytes, self.total_bytes, "/")
        idle = f", idle {self.idle_s:.0f}s" if self.idle_s >= 2 else ""
        return f"{self.direction} {size} {mbit(self.bps)} Mbit/s{idle}"


@dataclass(frozen=True)
class SiteState:
    name: str
    connected_for_s: float
    last_heartbeat_age_s: float
    #: The site's link as the server measured it (bytes/s; None until measured).
    down_bps: float | None = None
    up_bps: float | None = None
    #: Its figures at the last plain federated evaluation (None: not evaluated there,
    #: secure evaluation, or `site_metrics = false`).
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    transfers: tuple[TransferState, ...] = ()

    def link(self) -> str:
        """ "down 12.3 / up 4.5 Mbit/s", or "" before any transfer was measured."""
        if self.down_bps is None and self.up_bps is None:
            return ""
        return f"down {mbit(self.down_bps)} / up {mbit(self.up_bps)} Mbit/s"

    def evaluation(self) -> str:
        """ "accuracy 0.9312" (else "loss 0.2100"), or "" when it has no figure."""
        if self.eval_accuracy is not None:
            return f"accuracy {self.eval_accuracy:.4f}"
        return "" if self.eval_loss is None else f"loss {self.eval_loss:.4f}"


def mbit(bps: float | None) -> str:
    """Bytes per second as Mbit/s ("?" while unknown)."""
    return "?" if bps is None else f"{bps * 8 / 1e6:.1f}"


def amount(done: int, total: int, of: str = " of ") -> str:
    """ "12.5 of 40.0 MB" (the unit suits the total), or "12.5 MB" while it is unknown."""
    largest = max(done, total)
    scale, unit = next(
        ((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if largest >= s), (1, "B")
    )
    digits = 0 if scale == 1 else 1
    part = f"{done / scale:.{digits}f}"
    return f"{part}{of}{total / scale:.{digits}f} {unit}" if total else f"{part} {unit}"


@dataclass(frozen=True)
class ServerState:
    """A federation at one instant; `round` is the round in progress, else the last done."""

    run_id: str
    task: str
    phase: str
    round: int
    attempt: int
    total_rounds: int
    rounds_completed: int
    min_sites: int
    secagg: bool
    model_version: str
    finished: bool
    sites: tuple[SiteState, ...] = ()
    last_metrics: Mapping[str, float] = field(default_factory=dict)
    #: Sites connected; `sites` may list only a page of them (large federations).
    connected_sites: int = 0
    #: The numbers of the last evaluated round's record (`round`, `accuracy`, `loss`,
    #: `eval_sites`, `worst_accuracy`, `site_spread`, ...); empty before one.
    last_evaluation: Mapping[str, float] = field(default_factory=dict)
    #: The worst site of the last plain federated evaluation ("" otherwise).
    worst_site: str = ""
    #: Tensor bytes since the server started (`BYTE_KEYS`).
    bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def connected(self) -> int:
        return max(self.connected_sites, len(self.sites))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record: what a Status reply carries of it (not the
    record's format version, which says nothing about the run)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "record_version"
    }


def site_figures(record: Mapping[str, Any], site: str) -> tuple[float | None, float | None]:
    """(accuracy, loss) of `site` in an evaluated record's `site_metrics` (None, None
    when it has none: not asked, secure evaluation, or the privacy opt-out)."""
    figures = (record.get("site_metrics") or {}).get(site) or {}
    return figures.get("accuracy"), figures.get("loss")


def _round_line(state: ServerState) -> str:
    if state.phase not in ("training", "aggregating"):
        return f"{state.rounds_completed} of {state.total_rounds} completed"
    line = f"{state.round} of {state.total_rounds} in progress ({state.rounds_completed} completed)"
    return line + (f", attempt {state.attempt}" if state.attempt > 1 else "")


def _summary(state: ServerState) -> list[tuple[str, str]]:
    return [
        ("run", state.run_id),
        ("task", state.task),
        ("phase", f"{state.phase}: {PHASE_TEXT.get(state.phase, '')}"),
        ("round", _round_line(state)),
        ("sites", _sites_line(state)),
        ("secure aggregation", "on" if state.secagg else "off"),
        ("model", state.model_version[:12]),
        *([("bytes", _bytes_line(state.bytes))] if state.bytes else []),
    ]


def evaluation_line(state: ServerState) -> str:
    """The last evaluation in one line: the mean, the worst site and its figure, the
    spread; "" before the first. No site is named under secure evaluation."""
    ev = state.last_evaluation
    if not ev:
        return ""
    summary = describe_evaluation(ev, state.worst_site, secure=state.secagg)
    return f"round {_value(ev.get('round', 0))}, {summary}"


def _bytes_line(split: Mapping[str, int]) -> str:
    """ "in 120.0 MB (accepted 80.0, discarded 38.0, resent 2.0), out 160.0 MB"."""

    def mb(key: str) -> str:
        return f"{split.get(key, 0) / 1e6:.1f}"

    kept = ", ".join(f"{key} {mb(key)}" for key in ("accepted", "discarded", "resent"))
    return f"in {mb('received')} MB ({kept}), out {mb('sent')} MB"


def _sites_line(state: ServerState) -> str:
    line = f"{state.connected} connected, {state.min_sites} needed to start a round"
    if len(state.sites) < state.connected:
        line += f" (listing {len(state.sites)}; `fedtrain status --sites N` lists more)"
    return line


def _value(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.4g}"


def render_text(state: ServerState) -> str:
    """Plain lines: for logs, pipes and scripts that grep."""
    lines = [f"{key}: {value}" for key, value in _summary(state)]
    if evaluation_line(state):
        lines.append(f"last evaluation: {evaluation_line(state)}")
    for site in state.sites:
        link = f", link {site.link()}" if site.link() else ""
        evaluated = f", evaluated {site.evaluation()}" if site.evaluation() else ""
        moving = "".join(f", {t.describe()}" for t in site.transfers)
        lines.append(
            f"site {site.name}: connected {site.connected_for_s:.0f}s, last heard "
            f"{site.last_heartbeat_age_s:.1f}s ago{link}{moving}{evaluated}"
        )
    if state.last_metrics:
        done = _value(state.last_metrics.get("round", state.rounds_completed))
        metrics = ", ".join(
            f"{k} {_value(v)}" for k, v in sorted(state.last_metrics.items()) if k != "round"
        )
        lines.append(f"last round ({done}): {metrics}")
    return "\n".join(lines)


def render_rich(state: ServerState, console: Console) -> None:
    """Tables for an interactive terminal."""
    overview = Table.grid(padding=(0, 2))
    overview.add_column(style="bold")
    overview.add_column()
    for key, value in _summary(state):
        overview.add_row(key, value)
    if evaluation_line(state):
        overview.add_row("last evaluation", evaluation_line(state))
    sites = Table(title="connected sites", title_justify="left")
    sites.add_column("site")
    sites.add_column("connected for", justify="right")
    sites.add_column("last heard", justify="right")
    sites.add_column("link (measured)", justify="right")
    sites.add_column("last evaluation", justify="right")
    sites.add_column("transfer", justify="right")
    for site in state.sites:
        sites.add_row(
            site.name,
            f"{site.connected_for_s:.0f} s",
            f"{site.last_heartbeat_age_s:.1f} s ago",
            site.link() or "-",
            site.evaluation() or "-",
            "; ".join(t.describe() for t in site.transfers) or "-",
        )
    parts: list[Table] = [overview, sites]
    if state.last_metrics:
        done = _value(state.last_metrics.get("round", state.rounds_completed))
        metrics = Table(title=f"last round ({done})", title_justify="left")
        metrics.add_column("metric")
        metrics.add_column("value", justify="right")
        for key, value in sorted(state.last_metrics.items()):
            if key != "round":
                metrics.add_row(key, _value(value))
        parts.append(metrics)
    console.print(Group(*parts))
