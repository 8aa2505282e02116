"""Run Flower 1.42's deployment engine on loopback as fedtrain's benchmark peer.

One call starts a SuperLink and ``num_sites`` SuperNodes as real processes on free
127.0.0.1 ports, submits the FedAvg app in ``app/`` with ``flwr run``, and returns
per-round wall times (stamped by the ServerApp itself) and the peak RSS of every
process tree. It runs fully offline; see /work/shared/FLOWER_PEER.md for why each
environment variable and flag is needed.

Flower's processes do not all stay in the process groups we create: the SuperLink
starts its SuperExec with ``start_new_session=True``, and SuperExecs spawn one
``flwr-serverapp``/``flwr-clientapp`` per run/message. Cleanup therefore kills (1) our
process groups, (2) every process the RSS sampler ever saw under our roots, and (3)
any process whose environment carries this run's private ``FLWR_HOME``, then checks
that none of them survived.

CLI::

    python -m benchmarks.flower_peer.run --params 1000000 --sites 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks.procstats import TreeRssSampler, stop_processes

__all__ = [
    "APP_TEMPLATE",
    "flower_env",
    "free_ports",
    "kill_all",
    "read_results",
    "run_flower_deployment",
    "wait_for_port",
    "wait_for_run",
    "write_flwr_config",
]

APP_TEMPLATE = Path(__file__).resolve().parent / "app"
"""Flower App copied into each run's workdir (a FAB is built from that copy)."""

FEDERATION = "bench"
"""Name of the SuperLink connection written to ``$FLWR_HOME/config.toml``."""

_STOP_GRACE_S = 5.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CLI_EXIT_GRACE_S = 10.0


def free_ports(count: int) -> list[int]:
    """Ask the OS for ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets are held open until every port is chosen so the OS cannot hand
    out the same port twice; there is still a small race until Flower binds them.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process: offline, no telemetry, private home."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_HOME": str(flwr_home),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def write_flwr_config(flwr_home: Path, port: int, host: str = "127.0.0.1") -> None:
    """Point the ``bench`` connection of ``flwr run`` at our SuperLink."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{FEDERATION}"\n\n'
        f'[superlink.{FEDERATION}]\naddress = "{host}:{port}"\ninsecure = true\n'
    )


def _write_run_config(path: Path, values: dict[str, Any]) -> None:
    """Write run-config overrides as TOML (a file avoids shell-quoting string values)."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")


def listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in the network namespace of process ``pid``.

    Read from ``/proc/PID/net/tcp`` (state 0A = LISTEN), so it also sees a SuperLink
    started inside another network namespace, which a connect from here cannot reach.
    """
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
            return True
    return False


def wait_for_port(port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    """Block until ``proc``'s network namespace listens on TCP ``port`` (or fail)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"superlink exited with code {proc.returncode} before listening")
        if listening(proc.pid, port):
            return
        time.sleep(0.1)
    raise TimeoutError(f"superlink did not listen on port {port} in time")


def read_results(path: Path) -> dict[str, Any] | None:
    """Read the ServerApp's timing JSON; ``None`` while it does not exist yet."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _tail(path: Path, lines: int = 15) -> str:
    """Last lines of a log file, for error messages that explain themselves."""
    try:
        text = _ANSI.sub("", path.read_text(errors="replace"))
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def kill_all(
    popens: Iterable[subprocess.Popen[bytes]],
    extra: Iterable[psutil.Process],
    flwr_home: Path,
) -> list[str]:
    """Terminate, then kill, everything this run started; return survivors' descriptions.

    Each run gets a fresh FLWR_HOME and every Flower process inherits it, so that finds
    stragglers even if they were re-parented to init (the SuperExec leaves its group).
    """
    return stop_processes(popens, extra, "FLWR_HOME", str(flwr_home), _STOP_GRACE_S)


def run_flower_deployment(
    num_params: int,
    num_sites: int,
    rounds: int,
    workdir: Path,
    timeout_s: float,
    *,
    client_torch: bool = False,
    host: str = "127.0.0.1",
    wrap: Callable[[str, list[str]], list[str]] | None = None,
    extra_env: Mapping[str, str] | None = None,
    round_timeout_s: float | None = None,
    incompressible: bool = False,
) -> dict[str, Any]:
    """Run ``rounds`` FedAvg rounds of a ``num_params`` float32 model on Flower's deployment engine.

    Starts one SuperLink and ``num_sites`` SuperNodes on loopback, runs the app in
    ``app/`` via ``flwr run``, and always kills every process it started, even on
    error or timeout. ``host`` is the address the SuperLink listens on and the
    SuperNodes dial; ``wrap(name, argv)`` returns the command that runs process
    ``name`` (``superlink``, ``site-i``, ``flwr-cli``), e.g. inside a network namespace
    (it must exec, keeping the PID); ``extra_env`` is added to every process's
    environment; ``round_timeout_s`` is the ServerApp's per-round timeout (default:
    the whole run's); ``incompressible`` starts from seeded random values and gives
    each site its own delta, so no chunk is deduplicated. ``workdir`` receives the app
    copy, ``FLWR_HOME``, logs and the ServerApp's timing file; it is emptied first.
    ``client_torch`` makes each ``flwr-clientapp`` do its add through torch (and so
    import torch every message).

    Returns a dict with ``s_per_round`` (wall seconds per round, round 1 timed from
    the moment enough SuperNodes were sampled), ``median_s_per_round``, ``peak_rss``
    (bytes per process tree: ``superlink`` includes SuperExec and ``flwr-serverapp``;
    ``site-i`` includes its SuperExec and ``flwr-clientapp`` children),
    ``peak_rss_total`` (peak of the instantaneous sum; the ``flwr`` CLI is excluded),
    ``ok``, ``error``, plus ``peak_rss_hwm_bound`` (per-tree sum of kernel per-process
    peaks, an upper bound that checks the sampling), ``rss_samples``, ``wall_s``,
    ``checksum`` (should be ``rounds * 0.001``), ``leftover_processes`` and ``workdir``.
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
    flwr_home = workdir / "flwr_home"
    app_dir = workdir / "app"
    shutil.copytree(APP_TEMPLATE, app_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    results_path = workdir / "rounds.json"
    run_config_path = workdir / "run_config.toml"

    link_port, *node_ports = free_ports(1 + num_sites)
    write_flwr_config(flwr_home, link_port, host)
    _write_run_config(
        run_config_path,
        {
            "num-server-rounds": rounds,
            "num-params": num_params,
            "num-sites": num_sites,
            "round-timeout": float(round_timeout_s or timeout_s),
            "client-torch": client_torch,
            "incompressible": incompressible,
            "results-path": str(results_path),
        },
    )
    env = {**flower_env(flwr_home), **(extra_env or {})}

    popens: list[subprocess.Popen[bytes]] = []
    log_files: list[IO[bytes]] = []
    sampler: TreeRssSampler | None = None
    error: str | None = None

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log_file = (logs / f"{name}.log").open("wb")
        log_files.append(log_file)
        popen = subprocess.Popen(
            wrap(name, cmd) if wrap else cmd,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        popens.append(popen)
        return popen

    try:
        link = spawn(
            "superlink",
            [
                "flower-superlink",
                "--insecure",
                "--host",
                host,
                "--port",
                str(link_port),
                "--disable-runtime-dependency-installation",
            ],
        )
        sampler = TreeRssSampler({"superlink": link.pid}).start()
        wait_for_port(link_port, deadline, link)
        nodes = []
        for i, port in enumerate(node_ports):
            node = spawn(
                f"site-{i}",
                [
                    "flower-supernode",
                    "--insecure",
                    "--superlink",
                    f"{host}:{link_port}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--node-config",
                    f"partition-id={i} num-partitions={num_sites}",
                ],
            )
            sampler.add(f"site-{i}", node.pid)
            nodes.append(node)
        cli = spawn(
            "flwr-cli",
            [
                "flwr",
                "run",
                str(app_dir),
                FEDERATION,
                "--stream",
                "--run-config",
                str(run_config_path),
            ],
        )
        error = wait_for_run(cli, [link, *nodes], results_path, deadline, logs)
    except Exception as exc:  # report, never leak processes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None:
            sampler.stop()
        leftovers = kill_all(popens, sampler.seen() if sampler else [], flwr_home)
        for log_file in log_files:
            log_file.close()

    results = read_results(results_path) or {}
    s_per_round = [float(s) for s in results.get("s_per_round", [])]
    if error is None and not results.get("ok"):
        error = f"ServerApp reported failure: {results}"
    if error is None and len(s_per_round) != rounds:
        error = f"expected {rounds} rounds, got {len(s_per_round)}"
    if leftovers:
        error = (error + "; " if error else "") + f"leftover processes: {leftovers}"
    return {
        "num_params": num_params,
        "num_sites": num_sites,
        "rounds": rounds,
        "client_torch": client_torch,
        "s_per_round": s_per_round,
        "median_s_per_round": statistics.median(s_per_round) if s_per_round else None,
        "peak_rss": sampler.peaks() if sampler else {},
        "peak_rss_total": sampler.peak_total() if sampler else 0,
        "peak_rss_hwm_bound": sampler.hwm_bound() if sampler else {},
        "rss_samples": sampler.samples if sampler else 0,
        "ok": error is None,
        "error": error,
        "wall_s": time.monotonic() - t_begin,
        "checksum": results.get("checksum"),
        "results_per_round": results.get("results_per_round", []),
        "leftover_processes": leftovers,
        "workdir": str(workdir),
    }


def wait_for_run(
    cli: subprocess.Popen[bytes],
    daemons: list[subprocess.Popen[bytes]],
    results_path: Path,
    deadline: float,
    logs: Path,
) -> str | None:
    """Wait until the ServerApp marks the run done; return an error string or ``None``.

    Completion is read from the ServerApp's own results file rather than from the
    ``flwr run`` exit: the CLI only streams logs and may lag or exit early.
    """
    cli_exit_error: str | None = None
    while time.monotonic() < deadline:
        results = read_results(results_path)
        if results is not None and results.get("done"):
            # Let `flwr run --stream` finish on its own, briefly.
            with contextlib.suppress(subprocess.TimeoutExpired):
                cli.wait(timeout=min(_CLI_EXIT_GRACE_S, max(0.0, deadline - time.monotonic())))
            return None
        for daemon in daemons:
            if daemon.poll() is not None:
                name = Path(daemon.args[0]).name if isinstance(daemon.args, list) else "daemon"
                return f"{name} (pid {daemon.pid}) exited with code {daemon.returncode}"
        if cli.poll() is not None and cli_exit_error is None:
            if cli.returncode != 0:
                return f"flwr run exited with code {cli.returncode}:\n" + _tail(
                    logs / "flwr-cli.log"
                )
            # exit 0 without a done file: give the ServerApp a moment to write it
            cli_exit_error = "flwr run exited before the ServerApp finished"
            deadline = min(deadline, time.monotonic() + _CLI_EXIT_GRACE_S)
        time.sleep(0.2)
    return (cli_exit_error or "timed out") + ":\n" + _tail(logs / "flwr-cli.log")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: run once and print the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000, help="float32 parameters")
    parser.add_argument("--sites", type=int, default=2, help="number of SuperNodes")
    parser.add_argument("--rounds", type=int, default=3, help="FedAvg rounds")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument(
        "--client-torch", action="store_true", help="ClientApp imports torch and adds with it"
    )
    parser.add_argument("--keep", action="store_true", help="keep the workdir (logs) on success")
    args = parser.parse_args(argv)
    own_tmp = args.workdir is None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="flower_peer_"))
    result = run_flower_deployment(
        args.params, args.sites, args.rounds, workdir, args.timeout, client_torch=args.client_torch
    )
    if result["ok"] and own_tmp and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        result["workdir"] = None
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
