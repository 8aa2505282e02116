"""fedtrain and Flower 1.42 side by side over emulated WAN links (issue 15's scenarios).

    sudo python -m benchmarks.wan.run --scenario baseline            # ~3 min
    sudo python -m benchmarks.wan.run --scenario all --markdown out.md

Each scenario brings up its own emulated WAN (``benchmarks/wan/emulator.py``: one
network namespace per node, the ``shaper.c`` router between them), then runs, on the
same links one after the other, a real ``fedtrain server`` in the server's namespace
with one ``fedtrain client`` per site namespace (``--insecure``), and Flower 1.42's
SuperLink + SuperNodes likewise (``flwr run`` from the server's namespace). Model:
one flat float32 tensor (10M parameters = 40 MB), each site adds 0.001
(``benchmarks/flat_task.py``, ``benchmarks/flower_peer/app``). Every TCP socket uses
the scenario's congestion control (cubic) through an ``LD_PRELOAD`` shim.

A scenario with a cut takes a link down when the shaper has counted the given bytes
for a node (e.g. site-0 has sent 1.5 models: mid-way through its round-2 upload) and
restores it after the given seconds, the same way for both systems.

Printed per scenario: each system's seconds per round (every round, and the median),
the line-rate bound (bytes a round moves / link rate, ``links.line_rate_bound``), the
share of line rate reached (bound / median round) and the outcome (rounds finished,
sites aggregated, retries and drops, bytes each site sent when the deadline hit).
A run that misses its deadline is stopped and reported as "did not finish in N s".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fedtrain_deploy import run_fedtrain_deployment
from benchmarks.flower_peer.run import run_flower_deployment
from benchmarks.runtime_vs_flower import round_walls
from benchmarks.wan.emulator import Counters, EmulatedWan
from benchmarks.wan.links import MODEL_PARAMS, NUM_SITES, Scenario, nodes_for, select

__all__ = ["SystemRun", "main", "outcome", "percent_of_line_rate", "render_markdown"]

SYSTEMS = ("fedtrain", "flower")
_ATTEMPT = re.compile(r"round (\d+) \(attempt (\d+)\)")
_DROPPED = re.compile(r"site '([^']+)' dropped out of round (\d+) \(([^)]*)\)")
# one line per upload the server threw away (a site's own report of it is not counted)
_DISCARDED = re.compile(r"upload refused: .*update dropped|partial update discarded")


def log(message: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {message}", flush=True)


@dataclass
class SystemRun:
    """One system's run of one scenario, as the tables need it."""

    system: str
    rounds_wanted: int
    deadline_s: float
    walls: list[float] = field(default_factory=list)
    ok: bool = False
    error: str | None = None
    wall_s: float = 0.0
    sent_mb: dict[str, float] = field(default_factory=dict)  # per site, since the run began
    received_mb: dict[str, float] = field(default_factory=dict)
    clients_per_round: list[int | None] = field(default_factory=list)
    retries: int = 0
    drops: list[str] = field(default_factory=list)
    discarded: int = 0  # uploads the server threw away (broken off, or the round closed)
    cut_at_s: float | None = None  # since the run began
    skipped: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.walls) if self.walls else None

    def line_rate_pct(self, bound_s: float, num_sites: int = NUM_SITES) -> float | None:
        """Bound / median round; none when a round closed without every site's update
        (it did not move the bytes the bound counts)."""
        if any(c is not None and c < num_sites for c in self.clients_per_round):
            return None
        return percent_of_line_rate(bound_s, self.median)


def percent_of_line_rate(bound_s: float, seconds: float | None) -> float | None:
    """The share of line rate a round reached: bound / measured (100% = at line rate)."""
    if seconds is None or seconds <= 0:
        return None
    return 100.0 * bound_s / seconds


def outcome(run: SystemRun, num_sites: int = NUM_SITES) -> str:
    """What happened, in words, for the table's last column."""
    if run.skipped:
        return run.skipped
    parts = []
    done = len(run.walls)
    if run.ok:
        parts.append(f"{done}/{run.rounds_wanted} rounds")
    elif run.error and run.error.startswith("timed out"):
        parts.append(
            f"did not finish in {run.deadline_s:.0f} s: {done}/{run.rounds_wanted} rounds; "
            "sites had received "
            + "/".join(f"{mb:.0f}" for mb in run.received_mb.values())
            + " MB and sent "
            + "/".join(f"{mb:.0f}" for mb in run.sent_mb.values())
            + " MB"
        )
    else:
        parts.append(f"failed after {done}/{run.rounds_wanted} rounds: {(run.error or '')[:120]}")
    short = [c for c in run.clients_per_round if c is not None and c < num_sites]
    if short:
        parts.append(f"{len(short)} round(s) closed with fewer than {num_sites} sites ({short})")
    if run.retries:
        parts.append(f"{run.retries} round retry(ies)")
    if run.discarded:
        parts.append(f"{run.discarded} upload(s) discarded")
    if run.drops:
        parts.append(f"{len(run.drops)} drop(s): {'; '.join(sorted(set(run.drops)))[:160]}")
    if run.cut_at_s is not None:
        parts.append(f"cut at {run.cut_at_s:.1f} s")
    return "; ".join(parts)


def _fmt_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}%"


def _pct(scenario: Scenario, run: SystemRun | None, bound: float) -> str:
    """The share of line rate, or a dash where a median over rounds means nothing: a
    scenario with a cut (one round holds the outage; read the rounds instead)."""
    if run is None or scenario.cut is not None:
        return "—"
    return _fmt_pct(run.line_rate_pct(bound))


def render_markdown(results: Sequence[tuple[Scenario, float, Sequence[SystemRun]]]) -> str:
    """A summary table (one row per scenario) and one detail table per scenario."""
    lines = [
        "| scenario | fedtrain s/round | Flower 1.42 s/round | line-rate bound "
        "| fedtrain % of line rate | Flower % of line rate |",
        "|---|---|---|---|---|---|",
    ]
    for scenario, bound, runs in results:
        by = {r.system: r for r in runs}
        cells = []
        for system in SYSTEMS:
            run = by.get(system)
            if run is None or run.skipped:
                cells.append("—")
            elif not run.walls:
                cells.append(f"did not finish ({run.deadline_s:.0f} s)" if not run.ok else "—")
            else:
                cells.append(" / ".join(_fmt_s(w) for w in run.walls))
        pcts = [_pct(scenario, by.get(s), bound) for s in SYSTEMS]
        lines.append(
            f"| {scenario.title} | {cells[0]} | {cells[1]} | {bound:.1f} s "
            f"| {pcts[0]} | {pcts[1]} |"
        )
    lines.append("")
    for scenario, bound, runs in results:
        lines += [
            f"**{scenario.name}**: {scenario.title} ({scenario.rounds} round(s), deadline "
            f"{scenario.deadline_s:.0f} s, line-rate bound {bound:.1f} s/round)",
            "",
            "| system | s/round (each round) | median | line-rate bound | % of line rate "
            "| run wall | outcome |",
            "|---|---|---|---|---|---|---|",
        ]
        for run in runs:
            each = ", ".join(_fmt_s(w) for w in run.walls) or "—"
            lines.append(
                f"| {run.system} | {each} | {_fmt_s(run.median)} | {bound:.1f} s "
                f"| {_pct(scenario, run, bound)} "
                f"| {run.wall_s:.0f} s | {outcome(run)} |"
            )
        lines.append("")
    return "\n".join(lines)


class CutWatcher:
    """Takes a link down when the shaper's byte count crosses the scenario's mark, then
    restores it; one per system run (counts are taken relative to its start)."""

    def __init__(self, wan: EmulatedWan, scenario: Scenario) -> None:
        self.wan = wan
        self.scenario = scenario
        self.base = wan.counters()
        self.t0 = time.monotonic()
        self.cut_at_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> CutWatcher:
        if self.scenario.cut is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.wan.set_links(self.scenario.links)  # whatever happened, links as configured

    def moved(self, node: str) -> Counters:
        now, base = self.wan.counters()[node], self.base.get(node)
        if base is None:
            return now
        return Counters(
            *(a - b for a, b in zip(asdict(now).values(), asdict(base).values(), strict=True))
        )

    def _watch(self) -> None:
        cut = self.scenario.cut
        assert cut is not None
        while not self._stop.wait(0.05):
            if getattr(self.moved(cut.watch), cut.direction) >= cut.at_bytes:
                break
        else:
            return
        link = self.scenario.links[cut.node]
        self.wan.set_link(cut.node, replace(link, up=False))
        self.cut_at_s = time.monotonic() - self.t0
        log(f"  cut {cut.node}'s link at {self.cut_at_s:.1f} s for {cut.seconds:g} s")
        self._stop.wait(cut.seconds)
        self.wan.set_link(cut.node, link)
        log(f"  restored {cut.node}'s link")


def _log_events(path: Path) -> tuple[int, list[str], int]:
    """Round retries, site drops and discarded uploads from a fedtrain server log."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return 0, [], 0
    # several lines name one attempt: count distinct (round, attempt > 1) pairs
    retries = len(
        {(m.group(1), m.group(2)) for m in _ATTEMPT.finditer(text) if int(m.group(2)) > 1}
    )
    drops = [f"{m.group(1)} r{m.group(2)}: {m.group(3)}" for m in _DROPPED.finditer(text)]
    return retries, drops, len(_DISCARDED.findall(text))


def run_system(
    system: str,
    scenario: Scenario,
    wan: EmulatedWan,
    num_params: int,
    workdir: Path,
    site_options: dict[str, Any] | None = None,
) -> SystemRun:
    """Run one system over the WAN as it stands; links are reset afterwards.
    `site_options`: fedtrain site.toml keys (e.g. transfer_streams)."""
    run = SystemRun(system, scenario.rounds, scenario.deadline_s)
    if system == "flower" and not scenario.flower:
        run.skipped = f"not run: {scenario.flower_note}"
        return run

    def wrap(name: str, argv: list[str]) -> list[str]:
        node = "server" if name in ("server", "superlink", "flwr-cli") else name
        return wan.command(node, argv)

    common: dict[str, Any] = {
        "host": wan.address("server"),
        "wrap": wrap,
        "extra_env": wan.env(scenario.cc),
    }
    log(
        f"{scenario.name}: {system} "
        f"({scenario.rounds} rounds, deadline {scenario.deadline_s:.0f} s)"
    )
    with CutWatcher(wan, scenario) as watcher:
        if system == "fedtrain":
            options: dict[str, Any] = {
                # a round may close with the updates it has (as Flower's FedAvg does
                # at its timeout); the server retries a failed round, as deployed
                "strategy": {"min_fit_clients": 2, "min_available_clients": NUM_SITES},
                "max_round_attempts": 0,
                **scenario.fedtrain_options,
            }
            if scenario.round_timeout_s is not None:
                options["round_timeout_s"] = scenario.round_timeout_s
            result = run_fedtrain_deployment(
                num_params,
                NUM_SITES,
                scenario.rounds,
                workdir / system,
                scenario.deadline_s,
                server_options=options,
                task_options={"incompressible": True},
                site_options=site_options,
                all_sites_required=False,
                **common,
            )
            run.walls = round_walls(result)
            run.clients_per_round = result.get("clients_per_round") or []
            run.retries, run.drops, run.discarded = _log_events(
                workdir / system / "logs" / "server.log"
            )
        else:
            result = run_flower_deployment(
                num_params,
                NUM_SITES,
                scenario.rounds,
                workdir / system,
                scenario.deadline_s,
                round_timeout_s=scenario.round_timeout_s,
                incompressible=True,
                **common,
            )
            run.walls = list(result.get("s_per_round") or [])
            run.clients_per_round = list(result.get("results_per_round") or [])
        run.sent_mb = {f"site-{i}": watcher.moved(f"site-{i}").sent / 1e6 for i in range(NUM_SITES)}
        run.received_mb = {
            f"site-{i}": watcher.moved(f"site-{i}").received / 1e6 for i in range(NUM_SITES)
        }
        run.cut_at_s = watcher.cut_at_s
    run.ok = bool(result.get("ok"))
    run.error = result.get("error")
    run.wall_s = float(result.get("wall_s") or 0.0)
    log(f"  {system}: rounds {', '.join(_fmt_s(w) for w in run.walls) or '—'}; {outcome(run)}")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", nargs="+", default=["baseline"], help="scenario names, or 'all'"
    )
    parser.add_argument("--systems", default="fedtrain,flower", help="comma-separated")
    parser.add_argument("--params", type=int, default=MODEL_PARAMS, help="float32 parameters")
    parser.add_argument("--rounds", type=int, default=None, help="override every scenario's")
    parser.add_argument("--deadline", type=float, default=None, help="seconds per system run")
    parser.add_argument("--cc", default=None, help="TCP congestion control (default: cubic)")
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help="fedtrain sites' transfer_streams (default: the site's own default, automatic)",
    )
    parser.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kernel setting for every namespace, e.g. net.ipv4.tcp_slow_start_after_idle=0",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    try:
        scenarios = select(
            args.scenario,
            num_params=args.params,
            rounds=args.rounds,
            deadline_s=args.deadline,
            cc=args.cc,
        )
        systems = parse_systems(args.systems)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        for s in scenarios:
            print(f"{s.name:20} {s.title} (bound {s.bound_s(args.params):.1f} s/round)")
        return 0
    # SIGTERM (and SIGINT, which a shell ignores in background jobs) unwind through
    # the runners' and the emulator's cleanup instead of leaving processes and namespaces
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    sysctls = dict(item.split("=", 1) for item in args.sysctl)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedtrain_wan_"))
    prefix = "ftw" + uuid.uuid4().hex[:4]
    command = "python -m benchmarks.wan.run " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    log(f"workdir {workdir}; namespaces {prefix}*; load average {os.getloadavg()[0]:.1f}")
    results: list[tuple[Scenario, float, list[SystemRun]]] = []
    t_begin = time.monotonic()
    for scenario in scenarios:
        bound = scenario.bound_s(args.params)
        runs = []
        with EmulatedWan(
            nodes_for(prefix), scenario.links, workdir / scenario.name, sysctls
        ) as wan:
            for system in systems:
                site_options = None if args.streams is None else {"transfer_streams": args.streams}
                runs.append(
                    run_system(
                        system, scenario, wan, args.params, workdir / scenario.name, site_options
                    )
                )
        results.append((scenario, bound, runs))
        if args.json:
            write_json(args.json, results)
    text = render_markdown(results)
    header = (
        f"```\n{command}\n```\n\nMeasured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end), {(time.monotonic() - t_begin) / 60:.1f} min.\n\n"
    )
    print(header + text)
    if args.markdown:
        args.markdown.write_text(header + text)
    return 0 if all(r.ok or r.skipped for _, _, runs in results for r in runs) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_systems(text: str) -> list[str]:
    """``fedtrain,flower`` -> the systems to run, in that order; unknown names refused."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(
            f"--systems takes a comma-separated subset of {', '.join(SYSTEMS)}; got {text!r}"
        )
    return systems


def write_json(path: Path, results: Sequence[tuple[Scenario, float, Sequence[SystemRun]]]) -> None:
    payload = [
        {"scenario": s.name, "title": s.title, "bound_s": b, "runs": [asdict(r) for r in runs]}
        for s, b, runs in results
    ]
    path.write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
