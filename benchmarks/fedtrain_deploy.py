"""Run fedtrain's deployment runtime on loopback exactly as an operator would, and measure it.

One call writes ``server.toml`` and one ``site-i.toml`` per site, starts a real
``fedtrain server --progress-jsonl`` process and ``num_sites`` ``fedtrain client``
processes on 127.0.0.1 (``--insecure`` on both sides, or mutual TLS with a fresh
federation CA), waits for the run to finish, and returns per-round times, the peak
RSS of every process tree and a per-round breakdown read from the processes' logs.
It is the fedtrain counterpart of ``benchmarks.flower_peer.run.run_flower_deployment``
and returns a dict of the same shape, so the two can be tabulated side by side.

What is timed: the server's own ``seconds`` per round (``metrics.jsonl``, also on the
``--progress-jsonl`` stream): from just before the instructions are pushed to the
chosen sites, through every site's download, training, upload (validated, journaled
and folded into the aggregate as it arrives), to the new global model being
finalized and logged; its checkpoint (fsync) is written while the next round runs,
which waits for it before finalizing. Flower's figure is stamped inside its
ServerApp from the push to each aggregate, with no checkpoint at all.

Cleanup: every process is started in its own session (process group) with a private
marker in its environment, so ``stop_processes`` can find and kill anything this run
started, even a process that escaped its group, and report survivors.

CLI::

    python -m benchmarks.fedtrain_deploy --params 1000000 --sites 2 --rounds 3 [--tls]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks import procstats
from benchmarks.procstats import TreeRssSampler, processes_with_env

__all__ = [
    "MARKER_ENV",
    "REPO_ROOT",
    "TASK",
    "marked_processes",
    "parse_breakdown",
    "run_fedtrain_deployment",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""Put on the children's PYTHONPATH so they import this checkout and ``benchmarks``."""

TASK = "benchmarks.flat_task:FlatTask"
"""The task both server and sites load (one flat float32 tensor, training adds 0.001)."""

MARKER_ENV = "FEDTRAIN_BENCH_RUN"
"""Environment variable carrying a per-run id into every process the run starts."""

_STOP_GRACE_S = 5.0
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ROUND_START = re.compile(r"round (\d+) \(attempt \d+\): \d+ site\(s\) train")
# "update of N bytes aggregated", possibly qualified ("plain update ...") by newer servers.
_FOLDED = re.compile(r"site '([^']+)', round (\d+): [\w ]*update of \d+ bytes aggregated")
_ROUND_DONE = re.compile(r"fedtrain\.cli: round (\d+) \|")
_SITE_PHASES = re.compile(
    r"round (\d+): trained on \d+ examples, uploaded \d+ bytes "
    r"\(model ([\d.]+)s, train ([\d.]+)s, upload ([\d.]+)s\)"
)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 the OS considers free now (the server binds it next)."""
    from benchmarks.flower_peer.run import free_ports

    return free_ports(1)[0]


def _write_configs(
    workdir: Path,
    num_params: int,
    num_sites: int,
    rounds: int,
    port: int,
    tls: bool,
    timeout: float,
    server_options: Mapping[str, Any],
    host: str = "127.0.0.1",
    task_options: Mapping[str, Any] | None = None,
    site_options: Mapping[str, Any] | None = None,
) -> tuple[Path, list[Path]]:
    """server.toml (``server_options`` on top) and site-i.toml (``site_options`` on top;
    plus a CA and certificates when ``tls``)."""
    from fedtrain.runtime import tls as fedtls
    from fedtrain.runtime.demo import dump_toml

    names = [f"site-{i}" for i in range(num_sites)]
    address = f"{host}:{port}"
    options = {"num_params": num_params, **(task_options or {})}
    server: dict[str, Any] = {
        "task": TASK,
        "task_options": options,
        "address": address,
        "run_dir": str(workdir / "run"),
        "rounds": rounds,
        "round_timeout_s": float(timeout),
        "max_round_attempts": 1,  # a failed round is a failed benchmark, not a retry
        "strategy": {"min_fit_clients": num_sites, "min_available_clients": num_sites},
        "client": {"epochs": 1},
        **server_options,
    }
    site_tls: dict[str, dict[str, Any]] = {}
    if tls:
        ca_dir = workdir / "pki" / "ca"
        fedtls.init_ca(ca_dir, name="fedtrain-bench-ca", days=2)
        cert, key = fedtls.issue_server(ca_dir, workdir / "pki" / "server", [host], days=1)
        ca = ca_dir / fedtls.CA_CERT
        server["allowed_sites"] = names
        server["tls"] = {"ca": ca, "cert": cert, "key": key}
        for name in names:
            cert, key = fedtls.issue_site(ca_dir, workdir / "pki" / name, name, days=1)
            site_tls[name] = {"ca": ca, "cert": cert, "key": key}
    server_toml = workdir / "server.toml"
    server_toml.write_text(dump_toml(server))
    site_tomls = []
    for i, name in enumerate(names):
        site: dict[str, Any] = {
            "task": TASK,
            "task_options": options,
            "server": address,
            "name": name,
            "data": {"partition": i, "num_partitions": num_sites},
            # Sites start before the server listens; retry quickly instead of backing off.
            "reconnect": {"min_s": 0.1, "max_s": 0.5},
            **(site_options or {}),
        }
        if tls:
            site["tls"] = site_tls[name]
        path = workdir / f"{name}.toml"
        path.write_text(dump_toml(site))
        site_tomls.append(path)
    return server_toml, site_tomls


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``MARKER_ENV=marker``."""
    return processes_with_env(MARKER_ENV, marker)


def stop_processes(
    popens: Iterable[subprocess.Popen[bytes]], extra: Iterable[psutil.Process], marker: str
) -> list[str]:
    """Stop everything this run started (see `benchmarks.procstats.stop_processes`)."""
    return procstats.stop_processes(popens, extra, MARKER_ENV, marker, _STOP_GRACE_S)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stamped_lines(path: Path) -> Iterable[tuple[float, str]]:
    """(unix time, line) for each log line that starts with logging's asctime."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        match = _LOG_TIME.match(line)
        if match:
            stamp = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp, line))
    return out


def parse_breakdown(logs: Path, num_sites: int) -> list[dict[str, float]]:
    """Where each round's time went, from the server's and sites' own log lines.

    Per round: ``download``/``train``/``upload`` are the slowest site's phases as the
    site daemon logs them (its upload phase ends when the server has validated,
    journaled and folded the update), ``after_last_fold`` is the server's time from
    the last fold to the round's metrics line (waiting for the previous round's
    background checkpoint, FedAvg finalize, evaluation and logging), and
    ``push_to_last_fold`` the server's view of
    the distributed part. Log stamps have millisecond resolution.
    """
    starts: dict[int, float] = {}
    folds: dict[int, float] = {}
    done: dict[int, float] = {}
    for stamp, line in _stamped_lines(logs / "server.log"):
        if m := _ROUND_START.search(line):
            starts.setdefault(int(m.group(1)), stamp)
        elif m := _FOLDED.search(line):
            folds[int(m.group(2))] = max(folds.get(int(m.group(2)), 0.0), stamp)
        elif m := _ROUND_DONE.search(line):
            done[int(m.group(1))] = stamp
    phases: dict[int, dict[str, float]] = {}
    for i in range(num_sites):
        for _, line in _stamped_lines(logs / f"site-{i}.log"):
            if m := _SITE_PHASES.search(line):
                row = phases.setdefault(int(m.group(1)), {})
                for key, value in zip(("download", "train", "upload"), m.groups()[1:], strict=True):
                    row[key] = max(row.get(key, 0.0), float(value))
    rounds = []
    for server_round in sorted(done):
        row: dict[str, float] = {"round": server_round, **phases.get(server_round, {})}
        if server_round in folds:
            row["after_last_fold"] = done[server_round] - folds[server_round]
            if server_round in starts:
                row["push_to_last_fold"] = folds[server_round] - starts[server_round]
        rounds.append(row)
    return rounds


def run_fedtrain_deployment(
    num_params: int,
    num_sites: int,
    rounds: int,
    workdir: Path,
    timeout_s: float,
    *,
    tls: bool = False,
    server_options: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    wrap: Callable[[str, list[str]], list[str]] | None = None,
    extra_env: Mapping[str, str] | None = None,
    all_sites_required: bool = True,
    task_options: Mapping[str, Any] | None = None,
    site_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``rounds`` FedAvg rounds of a ``num_params`` float32 model on fedtrain's runtime.

    ``server_options`` are server.toml keys set on top of the benchmark's own;
    ``task_options`` are FlatTask options besides ``num_params``; ``site_options`` are
    site.toml keys set on top of the benchmark's own.
    ``host`` is the address the server listens on and the sites dial; ``wrap(name,
    argv)`` returns the command that runs process ``name`` (``server``, ``site-i``),
    e.g. inside a network namespace (it must exec, keeping the PID); ``extra_env`` is
    added to every process's environment. With ``all_sites_required=False`` a round
    that aggregated fewer than ``num_sites`` updates is an outcome
    (``clients_per_round``), not an error.

    ``workdir`` (emptied first) receives the TOML files, PKI, logs and the run
    directory. Every process started is stopped before returning, even on error or
    timeout. Returns ``s_per_round`` (the server's ``seconds`` per round),
    ``median_s_per_round``, ``peak_rss`` (bytes per tree: ``server``, ``site-i``),
    ``peak_rss_total``, ``peak_rss_hwm_bound``, ``rss_samples``, ``breakdown`` (see
    ``parse_breakdown``), ``arrivals`` (unix time each round's progress line reached
    us), ``checksum`` (mean of the first 1024 final weights; ``rounds * 0.001``),
    ``ok``, ``error``, ``wall_s``, ``leftover_processes`` and ``workdir``.
    """
    if num_params < 1 or num_sites < 1 or rounds < 1:
        raise ValueError("num_params, num_sites and rounds must all be >= 1")
    t_begin = time.monotonic()
    deadline = t_begin + timeout_s
    workdir = Path(workdir).resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    server_toml, site_tomls = _write_configs(
        workdir,
        num_params,
        num_sites,
        rounds,
        _free_port(),
        tls,
        timeout_s,
        server_options or {},
        host,
        task_options,
        site_options,
    )
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    env.update(
        {
            MARKER_ENV: marker,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
    )
    secure_flag = [] if tls else ["--insecure"]
    popens: list[subprocess.Popen[bytes]] = []
    log_files: list[IO[bytes]] = []
    records: list[dict[str, Any]] = []
    arrivals: list[float] = []
    sampler: TreeRssSampler | None = None
    error: str | None = None

    def spawn(name: str, args: list[str], stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
        log_file = (logs / f"{name}.log").open("wb")
        log_files.append(log_file)
        argv = [sys.executable, "-m", "fedtrain.cli", *args]
        popen = subprocess.Popen(
            wrap(name, argv) if wrap else argv,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else log_file,
            stderr=log_file,
            start_new_session=True,
        )
        popens.append(popen)
        return popen

    def read_progress(stream: IO[bytes]) -> None:
        for raw in stream:
            arrivals.append(time.time())
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(raw))

    try:
        server = spawn(
            "server",
            ["server", "--config", str(server_toml), "--progress-jsonl", *secure_flag],
            stdout_pipe=True,
        )
        sampler = TreeRssSampler({"server": server.pid}).start()
        assert server.stdout is not None
        reader = threading.Thread(target=read_progress, args=(server.stdout,), daemon=True)
        reader.start()
        sites = []
        for path in site_tomls:
            site = spawn(path.stem, ["client", "--config", str(path), *secure_flag])
            sampler.add(path.stem, site.pid)
            sites.append(site)
        error = _wait_for_server(server, sites, deadline, logs, lambda: len(records) >= rounds)
        reader.join(timeout=_STOP_GRACE_S)
    except Exception as exc:  # report, never leak processes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None:
            sampler.stop()
        leftovers = stop_processes(popens, sampler.seen() if sampler else [], marker)
        for popen in popens:
            if popen.stdout is not None:
                popen.stdout.close()
        for log_file in log_files:
            log_file.close()

    s_per_round = [float(r["seconds"]) for r in records if "seconds" in r]
    checksum = _checksum(workdir / "run" / "model.pt") if error is None else None
    if error is None and len(s_per_round) != rounds:
        error = f"expected {rounds} rounds, got {len(s_per_round)}"
    if all_sites_required and error is None and any(r.get("clients") != num_sites for r in records):
        error = f"a round aggregated fewer than {num_sites} sites: {records}"
    if leftovers:
        error = (error + "; " if error else "") + f"leftover processes: {leftovers}"
    return {
        "system": "fedtrain",
        "tls": tls,
        "num_params": num_params,
        "num_sites": num_sites,
        "rounds": rounds,
        "s_per_round": s_per_round,
        "median_s_per_round": statistics.median(s_per_round) if s_per_round else None,
        "peak_rss": sampler.peaks() if sampler else {},
        "peak_rss_total": sampler.peak_total() if sampler else 0,
        "peak_rss_hwm_bound": sampler.hwm_bound() if sampler else {},
        "rss_samples": sampler.samples if sampler else 0,
        "breakdown": parse_breakdown(logs, num_sites),
        "arrivals": arrivals,
        "bytes_per_round": [r.get("bytes") for r in records],
        "clients_per_round": [r.get("clients") for r in records],
        "checksum": checksum,
        "ok": error is None,
        "error": error,
        "wall_s": time.monotonic() - t_begin,
        "leftover_processes": leftovers,
        "workdir": str(workdir),
    }


def _wait_for_server(
    server: subprocess.Popen[bytes],
    sites: list[subprocess.Popen[bytes]],
    deadline: float,
    logs: Path,
    all_rounds_done: Callable[[], bool],
) -> str | None:
    """Wait for the server to exit (it does after the last round); an error string or None.

    Sites never exit on their own (a daemon reconnects forever), so one that exits
    before the last round is a failure. Once every round has been reported they have
    nothing left to do, so they are sent SIGTERM then, while the server writes its
    final model and shuts down: that overlaps two shutdowns and keeps the
    benchmark short; the caller still waits for (and if need be kills) them.
    """
    stopping_sites = False
    while time.monotonic() < deadline:
        code = server.poll()
        if code is not None:
            if code != 0:
                return f"fedtrain server exited with {code}:\n{_tail(logs / 'server.log')}"
            return None
        if not stopping_sites and all_rounds_done():
            stopping_sites = True
            for site in sites:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(site.pid, signal.SIGTERM)
        for i, site in enumerate(sites):
            if not stopping_sites and site.poll() is not None:
                return (
                    f"site-{i} exited early with {site.returncode}:\n"
                    f"{_tail(logs / f'site-{i}.log')}"
                )
        time.sleep(0.1)
    return f"timed out:\n{_tail(logs / 'server.log')}"


def _checksum(model_path: Path) -> float | None:
    """Mean of the first 1024 final weights (every site adds 0.001 a round)."""
    import torch

    try:
        state = torch.load(model_path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError):
        return None
    (weights,) = state.values()
    return float(weights[:1024].mean())


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: run once and print the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000, help="float32 parameters")
    parser.add_argument("--sites", type=int, default=2, help="number of site daemons")
    parser.add_argument("--rounds", type=int, default=3, help="FedAvg rounds")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--tls", action="store_true", help="mutual TLS instead of --insecure")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (logs) on success")
    parser.add_argument(
        "--upload-memory-mb",
        type=int,
        default=None,
        help="server.toml upload_memory_mb (default: the server's default)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help="sites' site.toml transfer_streams (default: the site's default, automatic)",
    )
    args = parser.parse_args(argv)
    own_tmp = args.workdir is None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedtrain_deploy_"))
    result = run_fedtrain_deployment(
        args.params,
        args.sites,
        args.rounds,
        workdir,
        args.timeout,
        tls=args.tls,
        server_options={}
        if args.upload_memory_mb is None
        else {"upload_memory_mb": args.upload_memory_mb},
        site_options=None if args.streams is None else {"transfer_streams": args.streams},
    )
    if result["ok"] and own_tmp and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        result["workdir"] = None
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
