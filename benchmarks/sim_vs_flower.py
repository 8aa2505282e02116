"""fedtrain's simulation against Flower 1.42's simulation engine, on the same workload.

Workload (both sides): logistic regression (`fedtrain.examples.SyntheticTask`, 20
features, 2 classes) over `--clients` virtual clients holding `--examples` examples
each (fedtrain's IID partitioner, same seed, so client i has the same data on both
sides); `--per-round` of them train each round, one local epoch of SGD (batch 32,
lr 0.1) with fedtrain's own `TorchTask.train` loop; FedAvg; no evaluation.

- fedtrain: `fedtrain simulate` run as a user runs it (a subprocess), `process`
  backend with one worker per core; seconds per round from its `metrics.jsonl`.
- Flower: `flower-superlink --simulation` plus `flwr run --federation-config
  "num-supernodes=N ..."` (Ray backend, one CPU per ClientApp actor, as
  `../shared/FLOWER_PEER.md` describes); seconds per round stamped by the ServerApp.

Peak RSS is sampled over each side's whole process tree (`TreeRssSampler`): the
fedtrain CLI and its workers; Flower's SuperLink with its SuperExec, the simulation
process, Ray's daemons and actors (the `flwr run` CLI, a log streamer, is excluded).
Every process a side started is killed afterwards and leftovers are reported.

CLI::

    python -m benchmarks.sim_vs_flower --clients 1000 --per-round 1000 --rounds 3
    python -m benchmarks.sim_vs_flower --clients 10000 --per-round 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks.flower_peer.run import (
    APP_TEMPLATE as PEER_APP,
)
from benchmarks.flower_peer.run import (
    FEDERATION,
    flower_env,
    free_ports,
    kill_all,
    read_results,
    wait_for_port,
    wait_for_run,
    write_flwr_config,
)
from benchmarks.procstats import TreeRssSampler

SIM_APP = Path(__file__).resolve().parent / "flower_sim" / "app"
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Workload:
    clients: int
    per_round: int
    examples: int
    rounds: int
    features: int = 20
    classes: int = 2
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0


def summarize(s_per_round: list[float], per_round: int) -> dict[str, Any]:
    """Seconds per round after warm-up (round 1 dropped when there are more) and clients/s."""
    steady = s_per_round[1:] if len(s_per_round) > 1 else s_per_round
    seconds = statistics.mean(steady) if steady else None
    return {
        "s_per_round": s_per_round,
        "s_per_round_after_warmup": seconds,
        "clients_per_s": per_round / seconds if seconds else None,
    }


# -- fedtrain ---------------------------------------------------------------------------
def fedtrain_config(work: Workload, run_dir: Path, backend: str, workers: int) -> str:
    return (
        'task = "fedtrain.examples:SyntheticTask"\n'
        f"rounds = {work.rounds}\nnum_clients = {work.clients}\nseed = {work.seed}\n"
        f'backend = "{backend}"\nworkers = {workers}\nrun_dir = "{run_dir}"\n'
        f"[task_options]\nnum_train = {work.clients * work.examples}\nnum_test = 0\n"
        f"num_features = {work.features}\nnum_classes = {work.classes}\n"
        f"[strategy]\nfraction_fit = {work.per_round / work.clients}\n"
        "min_fit_clients = 1\nmin_available_clients = 1\n"
        f"[client]\nepochs = {work.epochs}\nbatch_size = {work.batch_size}\nlr = {work.lr}\n"
    )


def run_fedtrain(
    work: Workload, workdir: Path, timeout_s: float, backend: str = "process", workers: int = 0
) -> dict[str, Any]:
    """`fedtrain simulate` in a subprocess; its whole tree's RSS is sampled."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "sim.toml"
    run_dir = workdir / "run"
    config.write_text(fedtrain_config(work, run_dir, backend, workers))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    error = None
    with (workdir / "fedtrain.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedtrain.cli", "simulate", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        sampler = TreeRssSampler({"fedtrain": proc.pid}).start()
        try:
            code = proc.wait(timeout=timeout_s)
            if code != 0:
                error = f"fedtrain simulate exited with {code}: {tail(workdir / 'fedtrain.log')}"
        except subprocess.TimeoutExpired:
            error = "timed out"
        finally:
            sampler.stop()
            leftovers = stop_tree(proc, sampler.seen())
    wall = time.monotonic() - started
    records = []
    if (run_dir / "metrics.jsonl").exists():
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if leftovers:
        error = (error + "; " if error else "") + f"leftover processes: {leftovers}"
    return {
        "system": f"fedtrain ({backend})",
        **summarize([r["seconds"] for r in records], work.per_round),
        "peak_rss_total": sampler.peak_total(),
        "wall_s": wall,
        "startup_s": wall - sum(r["seconds"] for r in records),
        "ok": error is None and len(records) == work.rounds,
        "error": error,
        "load_avg_1min_after": os.getloadavg()[0],  # a busy machine slows both sides
    }


def stop_tree(proc: subprocess.Popen[bytes], seen: list[psutil.Process]) -> list[str]:
    """Kill what is left of a run (its process group, then anything the sampler saw)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    alive = [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    return [str(p.pid) for p in alive]


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- Flower -----------------------------------------------------------------------------
def flower_run_config(work: Workload, results: Path, timeout_s: float) -> str:
    values = {
        "num-server-rounds": work.rounds,
        "num-clients": work.clients,
        "clients-per-round": work.per_round,
        "examples-per-client": work.examples,
        "num-features": work.features,
        "num-classes": work.classes,
        "seed": work.seed,
        "epochs": work.epochs,
        "batch-size": work.batch_size,
        "lr": work.lr,
        "round-timeout": float(timeout_s),
        "results-path": str(results),
    }
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + "\n"


def run_flower(work: Workload, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Flower's simulation engine on loopback, offline; everything it starts is killed."""
    started = time.monotonic()
    deadline = started + timeout_s
    if workdir.exists():
        shutil.rmtree(workdir)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    app = workdir / "app"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(SIM_APP, app, ignore=ignore)
    shutil.copytree(PEER_APP / "flowerpeer_app", app / "flowerpeer_app", ignore=ignore)
    flwr_home = workdir / "flwr_home"
    results = workdir / "rounds.json"
    run_config = workdir / "run_config.toml"
    run_config.write_text(flower_run_config(work, results, timeout_s))
    (port,) = free_ports(1)
    write_flwr_config(flwr_home, port)
    env = flower_env(flwr_home)
    popens: list[subprocess.Popen[bytes]] = []
    files: list[IO[bytes]] = []
    sampler: TreeRssSampler | None = None
    error: str | None = None

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (logs / f"{name}.log").open("wb")
        files.append(log)
        popen = subprocess.Popen(
            cmd,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        popens.append(popen)
        return popen

    try:
        link = spawn(
            "superlink",
            [
                *("flower-superlink", "--insecure", "--simulation", "--host", "127.0.0.1"),
                *("--port", str(port), "--disable-runtime-dependency-installation"),
            ],
        )
        sampler = TreeRssSampler({"flower": link.pid}).start()
        wait_for_port(port, deadline, link)
        federation = (
            f"num-supernodes={work.clients} client-resources-num-cpus=1 "
            "client-resources-num-gpus=0.0"
        )
        cli = spawn(
            "flwr-cli",
            [
                *("flwr", "run", str(app), FEDERATION, "--stream"),
                *("--run-config", str(run_config), "--federation-config", federation),
            ],
        )
        error = wait_for_run(cli, [link], results, deadline, logs)
    except Exception as exc:  # report, never leak processes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None:
            sampler.stop()
        leftovers = kill_all(popens, sampler.seen() if sampler else [], flwr_home)
        for log in files:
            log.close()
    outcome = read_results(results) or {}
    s_per_round = [float(s) for s in outcome.get("s_per_round", [])]
    if error is None and not outcome.get("ok"):
        error = f"ServerApp reported failure: {outcome}"
    if leftovers:
        error = (error + "; " if error else "") + f"leftover processes: {leftovers}"
    wall = time.monotonic() - started
    return {
        "system": "Flower 1.42 simulation (Ray)",
        **summarize(s_per_round, work.per_round),
        "peak_rss_total": sampler.peak_total() if sampler else 0,
        "wall_s": wall,
        "startup_s": wall - sum(s_per_round),
        "ok": error is None and len(s_per_round) == work.rounds,
        "error": error,
        "load_avg_1min_after": os.getloadavg()[0],
    }


# -- report -----------------------------------------------------------------------------
def table(work: Workload, results: list[dict[str, Any]]) -> str:
    """Markdown rows: the figures RESULTS.md records."""
    head = (
        "| system | s/round after warm-up | clients/s | peak RSS, all processes | "
        "wall incl. start-up | load avg |\n|---|---|---|---|---|---|"
    )
    rows = []
    for r in results:
        seconds = r["s_per_round_after_warmup"]
        rate = r["clients_per_s"]
        rows.append(
            f"| {r['system']} | {seconds:.2f} | {rate:,.0f} | "
            f"{r['peak_rss_total'] / 2**30:.2f} GiB | {r['wall_s']:.1f} s | "
            f"{r['load_avg_1min_after']:.1f} |"
            if seconds
            else f"| {r['system']} | failed: {r['error']} | | | | |"
        )
    title = (
        f"{work.clients} clients x {work.examples} examples, {work.per_round} per round, "
        f"{work.rounds} rounds"
    )
    return "\n".join([title, "", head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=None, help="default: all clients")
    parser.add_argument("--examples", type=int, default=20, help="examples per client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="fedtrain workers (0: per core)")
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=1, help="alternate the systems this many times each"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    args = parser.parse_args(argv)
    work = Workload(args.clients, args.per_round or args.clients, args.examples, args.rounds)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sim_vs_flower_"))
    results = []
    for i in range(args.repeat):  # alternating, so a busy spell hits both sides alike
        results.append(
            run_fedtrain(work, workdir / f"fedtrain-{i}", args.timeout, workers=args.workers)
        )
        if not args.skip_flower:
            results.append(run_flower(work, workdir / f"flower-{i}", args.timeout))
    json.dump({"workload": asdict(work), "results": results}, sys.stdout, indent=2)
    print("\n\n" + table(work, results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
