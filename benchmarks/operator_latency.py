"""How long the operator's everyday commands make them wait (issue 17, item 5).

    python benchmarks/operator_latency.py [--repeat 3]

Measures, with real processes on 127.0.0.1 and the fedtrain importable here (to
measure another checkout, put it first on PYTHONPATH and run from a directory outside
both: `python -m` puts the working directory first on the children's path):

- a site's exit: SIGTERM to a `fedtrain client` until the process is gone, once while
  it waits for a round (joined, the server waits for a second site) and once in the
  middle of a long round (digits, 50 epochs);
- a site's start: `fedtrain client` started until it has joined;
- `fedtrain status --config site.toml` against an address where nothing listens
  (the answer is immediate: what is timed is the command's own start);
- `fedtrain report` on a 50-round run directory with an audit log.

Prints one line per figure (median of `--repeat` runs); a shared machine's load is
printed with them, since every figure grows with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fedtrain.runtime.demo import dump_toml, fedtrain_command, free_port
from fedtrain.runtime.lifecycle import ProcessGroup

DIGITS = "fedtrain.examples:DigitsTask"


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def site_exit(root: Path, *, mid_round: bool) -> tuple[float, float]:
    """(seconds from start to joined, seconds from SIGTERM to gone) of one site."""
    port = free_port()
    epochs = 50 if mid_round else 1
    sites = 1 if mid_round else 2  # idle: the server waits for a second site forever
    (root / "server.toml").write_text(
        dump_toml(
            {
                "task": DIGITS,
                "address": f"127.0.0.1:{port}",
                "run_dir": str(root / "run"),
                "rounds": 5,
                "client": {"epochs": epochs, "batch_size": 16, "lr": 0.05},
                "strategy": {"min_fit_clients": sites, "min_available_clients": sites},
            }
        )
    )
    site_toml = root / "site.toml"
    site_toml.write_text(
        dump_toml({"task": DIGITS, "server": f"127.0.0.1:{port}", "name": "site-a"})
    )
    log = root / "site.log"
    with ProcessGroup(term_timeout_s=60) as group:
        group.start(
            "server",
            fedtrain_command("server", "--config", str(root / "server.toml"), "--insecure"),
            log_path=root / "server.log",
        )
        started = time.monotonic()
        site = group.start(
            "site",
            fedtrain_command("client", "--config", str(site_toml), "--insecure"),
            log_path=log,
        )
        _wait(lambda: "joined run" in log.read_text(), 300, "the site to join")
        joined = time.monotonic() - started
        if mid_round:
            _wait(lambda: "round_started" in _audit(root), 120, "round 1 to start")
            time.sleep(2.0)
        sent = time.monotonic()
        site.send_signal(signal.SIGTERM)
        site.wait(120)
        return joined, time.monotonic() - sent


def _audit(root: Path) -> str:
    path = root / "run" / "audit.jsonl"
    return path.read_text() if path.exists() else ""


def status_seconds(root: Path) -> float:
    toml = root / "status-site.toml"
    toml.write_text(dump_toml({"task": DIGITS, "server": f"127.0.0.1:{free_port()}"}))
    return _timed(["status", "--config", str(toml), "--insecure", "--timeout", "5"], 2)


def report_seconds(root: Path) -> float:
    run = root / "report-run"
    run.mkdir(exist_ok=True)
    rounds = range(1, 51)
    metrics = [
        {"round": r, "accuracy": 1 - 1 / (r + 1), "loss": 1 / r, "clients": 3, "bytes": 10**6}
        for r in rounds
    ]
    audit = [
        {"event": "round_completed", "round": r, "contributors": ["a", "b", "c"]} for r in rounds
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "audit.jsonl").write_text("".join(json.dumps(a) + "\n" for a in audit))
    return _timed(["report", str(run)], 0)


def _timed(args: list[str], expected: int) -> float:
    started = time.monotonic()
    out = subprocess.run(fedtrain_command(*args), capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    if out.returncode != expected:
        raise SystemExit(f"fedtrain {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="operator_latency_") as tmp:
        for i in range(args.repeat):
            root = Path(tmp) / str(i)
            for mid_round in (False, True):
                case = root / ("mid" if mid_round else "idle")
                case.mkdir(parents=True)
                joined, gone = site_exit(case, mid_round=mid_round)
                figures.setdefault("site start to joined", []).append(joined)
                name = "mid-round" if mid_round else "idle"
                figures.setdefault(f"site SIGTERM to exit ({name})", []).append(gone)
            figures.setdefault("fedtrain status --config", []).append(status_seconds(root))
            figures.setdefault("fedtrain report (50 rounds)", []).append(report_seconds(root))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {sys.executable}, load average {load}, {os.cpu_count()} CPUs")
    for name, values in figures.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name}: median {statistics.median(values):.2f} s ({runs})")


if __name__ == "__main__":
    main()
