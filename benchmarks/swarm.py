"""A site swarm: thousands of sites impersonated through the real protocol.

One real `fedtrain server` process; a few swarm processes each hold many sites on one
asyncio loop (`grpc.aio`, one channel and so one TCP connection per site, as real
sites have). Every site joins on its control stream, sends heartbeats at the interval
the server asks for, and when instructed downloads the global model and uploads a
known delta (a constant value per site, in the project's own chunk encoding) with a
known weight, on a connection of its own when the instruction says so. After the run
the benchmark rebuilds the expected model from the uploads the server acknowledged
(FedAvg: the weighted mean of the deltas, per round) and compares it with the server's
`model.pt`, so the figures come with a check of the aggregate.

Measured per swarm size: sites joined and joins refused, round times, the server's
CPU per round and per site per round, its threads (idle and peak), peak RSS, its CPU
while all sites but one are connected and no round runs (idle), and how long
`Status` takes to answer during rounds: on the sites' port (the main event loop), on
the run dir's socket and on the status port (`status_address`; both on threads of
their own), asked by an operator's process in a session of its own
(`status_probe.py`). Threads, RSS and CPU are the server's process tree's.

    python -m benchmarks.swarm --sites 100,1000 --rounds 10 --fraction-fit 0.1
    python -m benchmarks.swarm --sites 3000 --server-option max_sites=2000

Only 127.0.0.1; every process the benchmark starts is stopped at the end. A swarm of
N sites needs about N file descriptors in the server and in the swarm processes
together (`ulimit -n`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import torch

from benchmarks.procstats import tree_processes, tree_rss
from benchmarks.status_probe import status_seconds
from fedtrain.runtime import wire
from fedtrain.runtime.allocator import tune_allocator
from fedtrain.runtime.demo import dump_toml, free_port
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.proto import fedtrain_pb2_grpc as pb_grpc
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.server.local_status import socket_address
from fedtrain.runtime.status import ServerUnreachable
from fedtrain.tensors import ModelState

ROOT = Path(__file__).resolve().parents[1]
TASK = "benchmarks.flat_task:FlatTask"
MESSAGE_BYTES = 16 << 20
#: A site that was refused (e.g. "at capacity") tries again after this long, as a
#: daemon's reconnect back-off would (min_s..max_s, doubling).
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
#: Seconds between the last join and the idle CPU window (two watchdog passes).
SETTLE_S = 10.0
#: The phases in which Status is timed (a round from its start to the next one's).
ROUND_PHASES = ("training", "aggregating", "between_rounds")
#: How often a swarm process freezes its heap (as the server does, runtime/server/heap.py):
#: thousands of sites in one process made its full garbage collections stall all of them
#: for ~0.5 s, a harness artefact real sites (one process each) do not have.
FREEZE_EVERY_S = 5.0


def site_value(index: int) -> float:
    """The delta site `index` adds to every parameter (13 distinct values)."""
    return ((index % 13) - 6) * 1e-4


def site_weight(index: int) -> int:
    """The example count site `index` declares (10 distinct weights)."""
    return 1 + index % 10


def site_name(index: int) -> str:
    return f"swarm-{index:05d}"


# -- one site ------------------------------------------------------------------------------
@dataclass
class SiteStats:
    """What the sites of one swarm process saw (sent back to the benchmark)."""

    joined: int = 0
    refused: int = 0
    broken: int = 0
    uploads: list[tuple[int, int]] = field(default_factory=list)  # (round, site index)
    upload_errors: list[str] = field(default_factory=list)
    #: Sites in each step of a training job now (downloading, uploading): where a
    #: stalled round's missing uploads are.
    steps: Counter[str] = field(default_factory=Counter)


async def _pieces(pieces: Sequence[pb.ModelPiece]) -> AsyncIterator[pb.ModelPiece]:
    for piece in pieces:
        yield piece


class SwarmSite:
    """One impersonated site: join, heartbeat, download, upload a known delta."""

    def __init__(
        self, index: int, address: str, stats: SiteStats, uploads: dict[int, list[Any]]
    ) -> None:
        self.index = index
        self.name = site_name(index)
        self.address = address
        self.stats = stats
        self._uploads = uploads  # value index -> encoded chunk messages (shared cache)
        self.joined = asyncio.Event()
        self.heartbeat_s = 5.0

    async def run(self, fingerprint: str, stop: asyncio.Event) -> None:
        delay = RETRY_MIN_S
        # A connection per site, as real sites have (wire.channel_options).
        options = wire.channel_options(MESSAGE_BYTES)
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            stub = pb_grpc.FedtrainStub(channel)
            while not stop.is_set():
                outcome, retry_after = await self._session(stub, fingerprint, stop)
                if outcome == "done":
                    return
                if outcome == "refused":  # as a daemon does: its backoff, or the server's hint
                    wait = max(delay, retry_after)
                    await asyncio.sleep(wait * (1 + 0.5 * np.random.random()))
                    delay = min(RETRY_MAX_S, delay * 2)
                else:
                    await asyncio.sleep(RETRY_MIN_S)

    async def _session(
        self, stub: pb_grpc.FedtrainStub, fingerprint: str, stop: Any
    ) -> tuple[str, float]:
        call = stub.Control()
        join = pb.Join(
            site_name=self.name,
            task_fingerprint=fingerprint,
            protocol_version=wire.PROTOCOL_VERSION,
            capabilities=[wire.INLINE_MODEL_CAPABILITY],  # as a daemon of this version
        )
        tasks: list[asyncio.Task[Any]] = []
        try:
            await call.write(pb.SiteMessage(join=join))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
                self.stats.refused += 1
                hint = first.reject.retry_after_s if first is not grpc.aio.EOF else 0.0
                return "refused", hint
            welcome = first.welcome
            self.stats.joined += 1
            self.joined.set()
            self.heartbeat_s = welcome.heartbeat_interval_s
            tasks.append(asyncio.create_task(self._heartbeats(call)))
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    self.stats.broken += 1
                    return "broken", 0.0
                kind = message.WhichOneof("kind")
                if kind == "shutdown":
                    return "done", 0.0
                if kind == "pace":  # a longer heartbeat interval, as a daemon obeys it
                    self.heartbeat_s = message.pace.heartbeat_interval_s
                if kind == "instruction":
                    tasks.append(
                        asyncio.create_task(self._train(stub, welcome, message.instruction))
                    )
        except grpc.aio.AioRpcError:
            if stop.is_set():
                return "done", 0.0
            self.stats.broken += 1
            return "broken", 0.0
        finally:
            for task in tasks:
                task.cancel()
            call.cancel()

    async def _heartbeats(self, call: Any) -> None:
        sequence = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            sequence += 1
            await call.write(pb.SiteMessage(heartbeat=pb.Heartbeat(sequence=sequence)))

    async def _train(
        self, stub: pb_grpc.FedtrainStub, welcome: pb.Welcome, instruction: pb.Instruction
    ) -> None:
        token = welcome.session_token
        step = "downloading"
        self.stats.steps[step] += 1
        try:
            if instruction.model:  # the model came inside the instruction
                pieces: Any = _pieces(instruction.model)
            else:
                pieces = stub.DownloadModel(
                    pb.ModelRequest(version=instruction.model_version, session_token=token)
                )
            specs = []
            async for piece in pieces:
                if piece.WhichOneof("kind") == "manifest":
                    specs = [wire.spec_from_proto(s) for s in piece.manifest.specs]
            self.stats.steps[step] -= 1
            step = "uploading"
            self.stats.steps[step] += 1
            header = pb.UpdateChunk(
                header=pb.UploadHeader(
                    round=instruction.round,
                    session_token=token,
                    num_examples=site_weight(self.index),
                    model_version=instruction.model_version,
                )
            )
            if instruction.own_upload_connection:  # as a daemon obeys it
                async with grpc.aio.insecure_channel(
                    self.address, options=wire.channel_options(MESSAGE_BYTES)
                ) as fresh:
                    await self._upload(pb_grpc.FedtrainStub(fresh), header, specs, welcome)
            else:
                await self._upload(stub, header, specs, welcome)
            self.stats.uploads.append((instruction.round, self.index))
        except grpc.aio.AioRpcError as exc:
            self.stats.upload_errors.append(
                f"{self.name} round {instruction.round}, {step}: {exc.code().name} "
                f"{exc.details()} {exc.debug_error_string()}"
            )
        finally:
            self.stats.steps[step] -= 1

    async def _upload(
        self,
        stub: pb_grpc.FedtrainStub,
        header: pb.UpdateChunk,
        specs: Sequence[Any],
        welcome: pb.Welcome,
    ) -> None:
        call = stub.UploadUpdate()
        await call.write(header)
        await call.initial_metadata()  # the server's go-ahead, as a daemon waits for it
        if not call.done():
            for chunk in self._chunks(specs, welcome.chunk_bytes):
                await call.write(chunk)
            await call.done_writing()
        await call

    def _chunks(self, specs: Sequence[Any], chunk_bytes: int) -> list[pb.UpdateChunk]:
        key = self.index % 13
        if key not in self._uploads:
            value = site_value(self.index)
            state = ModelState(
                {s.name: torch.full(s.shape, value, dtype=torch.float32) for s in specs}
            )
            self._uploads[key] = [
                pb.UpdateChunk(chunk=wire.chunk_to_proto(c)) for c in state.chunks(chunk_bytes)
            ]
        return self._uploads[key]


# -- a swarm process ------------------------------------------------------------------------
def swarm_process(conn: Connection, address: str, fingerprint: str, indices: list[int]) -> None:
    """Hold the sites `indices`; join the first `n` when told ("join", n); report ("stats")."""
    tune_allocator()  # as a site daemon's process does (its 400 KB messages reuse heap pages)
    asyncio.run(_swarm(conn, address, fingerprint, indices))


async def _swarm(conn: Connection, address: str, fingerprint: str, indices: list[int]) -> None:
    loop = asyncio.get_running_loop()
    stats = SiteStats()
    stop = asyncio.Event()
    cache: dict[int, list[Any]] = {}
    sites = [SwarmSite(i, address, stats, cache) for i in indices]
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(_freeze_heap())]
    started = 0
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command[0] == "join":
            for site in sites[started : command[1]]:
                tasks.append(asyncio.create_task(site.run(fingerprint, stop)))
                started += 1
                if started % 100 == 0:
                    await asyncio.sleep(0.05)  # a ramp, not one burst of thousands of joins
            conn.send(("ok",))
        elif command[0] == "joined":
            conn.send(("joined", stats.joined))
        elif command[0] == "steps":
            conn.send(("steps", dict(stats.steps), len(stats.uploads), stats.upload_errors[:3]))
        elif command[0] == "stop":
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            conn.send(("stats", asdict(stats)))
            return


async def _freeze_heap() -> None:
    while True:
        await asyncio.sleep(FREEZE_EVERY_S)
        gc.freeze()


# -- the benchmark --------------------------------------------------------------------------
@dataclass
class SwarmRun:
    sites: int
    joined: int = 0
    refused_joins: int = 0
    rounds_done: int = 0
    round_seconds: list[float] = field(default_factory=list)
    server_cpu_per_round_s: float | None = None  # from the first round's start to the last's end
    swarm_cpu_per_round_s: float | None = None  # the swarm processes', same window
    threads_idle: int = 0
    threads_peak: int = 0
    rss_idle_mb: float = 0.0
    rss_peak_mb: float = 0.0
    idle_cpu_pct: float | None = None
    status_calls: int = 0  # answered, in any phase
    status_max_s: float | None = None  # on the sites' port (the main loop), during rounds
    local_status_max_s: float | None = None  # on the run dir's socket (its own thread)
    status_port_max_s: float | None = None  # on the status port (its own thread)
    dropped: int = 0
    upload_errors: int = 0
    aggregate_max_error: float | None = None
    chosen_per_round: int = 0
    note: str = ""

    def row(self) -> str:
        rounds = self.round_seconds
        times = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        cpu = self.server_cpu_per_round_s
        per_site = f"{1000 * cpu / max(1, self.chosen_per_round):.2f}" if cpu else "-"
        return (
            f"| {self.sites} | {self.joined} | {self.refused_joins} | {self.rounds_done} | {times} "
            f"| {cpu if cpu is None else round(cpu, 2)} | {per_site} "
            f"| {_secs(self.swarm_cpu_per_round_s)} | {self.threads_idle} / "
            f"{self.threads_peak} | {self.rss_idle_mb:.0f} / {self.rss_peak_mb:.0f} | "
            f"{_pct(self.idle_cpu_pct)} | "
            f"{_secs(self.status_max_s)} | {_secs(self.local_status_max_s)} | "
            f"{_secs(self.status_port_max_s)} | {self.dropped} | "
            f"{_err(self.aggregate_max_error)} "
            f"| {self.note} |"
        )


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _err(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


HEADER = (
    "| sites | joined | joins refused | rounds | round s (min-max) | server CPU s/round | "
    "server CPU ms/site/round | swarm CPU s/round | threads idle / peak | RSS idle / peak MB | "
    "idle CPU (one core) | "
    "Status max s in a round (sites' port) | Status max s in a round (socket) | "
    "Status max s in a round (status port) | dropped | aggregate max error | note |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def run_swarm(
    sites: int,
    *,
    rounds: int,
    fraction_fit: float,
    params: int,
    processes: int,
    idle_s: float,
    timeout_s: float,
    server_options: dict[str, Any],
    workdir: Path,
) -> SwarmRun:
    result = SwarmRun(sites)
    port = free_port()
    address = f"127.0.0.1:{port}"
    status_port = f"127.0.0.1:{free_port()}"  # insecure, as the whole server is here
    run_dir = workdir / "run"
    config = {
        "task": TASK,
        "task_options": {"num_params": params},
        "address": address,
        "run_dir": str(run_dir),
        "rounds": rounds,
        "status_address": status_port,
        **server_options,
        "strategy": {
            "fraction_fit": fraction_fit,
            "min_available_clients": sites,
            **server_options.get("strategy", {}),
        },
    }
    (workdir / "server.toml").write_text(dump_toml(config))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = (workdir / "server.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "fedtrain.cli", "server", "--insecure", "--config",
         str(workdir / "server.toml")],
        stdout=log, stderr=log, env=env, start_new_session=True,
    )  # fmt: skip
    probe: subprocess.Popen[bytes] | None = None
    probe_out: Any = None
    ctx = mp.get_context("spawn")
    pipes: list[Connection] = []
    workers = []
    try:
        proc = psutil.Process(server.pid)
        fingerprint = _wait_ready(address, server, params, timeout_s=60)
        shares = np.array_split(np.arange(sites), processes)
        for share in shares:
            parent, child = ctx.Pipe()
            worker = ctx.Process(
                target=swarm_process,
                args=(child, address, fingerprint, [int(i) for i in share]),
                daemon=True,
            )
            worker.start()
            pipes.append(parent)
            workers.append(worker)
        # Every site but the last joins; the server waits for all of them to start.
        for pipe, share in zip(pipes, shares, strict=True):
            pipe.send(("join", len(share) - (1 if share is shares[-1] else 0)))
        for pipe in pipes:
            pipe.recv()
        deadline = time.monotonic() + timeout_s
        want = sites - 1
        while time.monotonic() < deadline and _joined(pipes) < want:
            time.sleep(1.0)
        # Idle means steady: the joins' tail and the watchdog's re-pacing of early
        # sites' heartbeats (every heartbeat.interval_s) are over before the window.
        time.sleep(SETTLE_S)
        servers = tree_processes(proc)
        result.threads_idle = _threads(servers)
        result.rss_idle_mb = tree_rss(proc.pid) / 2**20
        cpu0 = _cpu(servers)
        time.sleep(idle_s)
        result.idle_cpu_pct = 100 * (_cpu(servers) - cpu0) / idle_s
        pipes[-1].send(("join", len(shares[-1])))
        pipes[-1].recv()
        swarm = [psutil.Process(w.pid) for w in workers]
        cpu_start = cpu_last = _cpu(servers)
        swarm_start = swarm_last = _cpu(swarm)
        # Status is timed by an operator's process in a session of its own (status_probe.py)
        asked = {"port": address, "socket": socket_address(run_dir), "status": status_port}
        probe_out = (workdir / "status.jsonl").open("wb")
        probe = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.status_probe",
             *(f"{where}={at}" for where, at in asked.items())],
            stdout=probe_out, env=env, start_new_session=True,
        )  # fmt: skip
        peak_rss = 0
        last_progress = time.monotonic()
        while server.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                result.threads_peak = max(result.threads_peak, _threads(servers))
                peak_rss = max(peak_rss, tree_rss(proc.pid))
                if len(_read_jsonl(run_dir / "metrics.jsonl")) < rounds:  # not the run's end
                    cpu_last, swarm_last = _cpu(servers), _cpu(swarm)
            if time.monotonic() - last_progress > 30.0:  # where the sites are, on stderr
                last_progress = time.monotonic()
                print(f"  {sites} sites: {_steps(pipes)}", file=sys.stderr, flush=True)
            time.sleep(0.25)
        if server.poll() is None:
            result.note = f"timed out after {timeout_s:.0f}s; sites {_steps(pipes)}"
        _stop_probe(probe, probe_out)
        result.rss_peak_mb = peak_rss / 2**20
        calls = _read_jsonl(workdir / "status.jsonl")
        result.status_calls = len(calls)
        # only calls answered during a round count: the issue's bound is "during a
        # round"; the run's end, when every site leaves at once, is not one
        in_round = [c for c in calls if c["phase"] in ROUND_PHASES]
        result.status_max_s, result.local_status_max_s, result.status_port_max_s = (
            max((c["seconds"] for c in in_round if c["where"] == where), default=None)
            for where in asked
        )
        metrics = _read_jsonl(run_dir / "metrics.jsonl")
        result.rounds_done = len(metrics)
        result.round_seconds = [float(m["seconds"]) for m in metrics]
        result.dropped = sum(len(m.get("dropped", [])) for m in metrics)
        if metrics:
            result.chosen_per_round = int(np.mean([m["selected"] for m in metrics]))
        if metrics:
            result.server_cpu_per_round_s = (cpu_last - cpu_start) / len(metrics)
            result.swarm_cpu_per_round_s = (swarm_last - swarm_start) / len(metrics)
    finally:
        if probe is not None:
            _stop_probe(probe, probe_out)
        stats = _stop(pipes, workers)
        _stop_server(server)
        log.close()
    audit = read_audit(run_dir / "audit.jsonl")
    result.joined = len({r["site"] for r in audit if r["event"] == "join"})
    result.refused_joins = sum(1 for r in audit if r["event"] == "join_refused")
    result.upload_errors = sum(len(s["upload_errors"]) for s in stats)
    if (run_dir / "model.pt").exists():
        result.aggregate_max_error = _aggregate_error(run_dir / "model.pt", audit, params)
    return result


def _wait_ready(
    address: str, server: subprocess.Popen[bytes], params: int, timeout_s: float
) -> str:
    """The server's task fingerprint, once it answers Status."""
    from fedtrain.task import load_task, task_fingerprint

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        with contextlib.suppress(ServerUnreachable):
            status_seconds(address)
            break
        time.sleep(0.2)
    return task_fingerprint(load_task(TASK, {"num_params": params}))


def _stop_probe(probe: subprocess.Popen[bytes], out: Any) -> None:
    if probe.poll() is None:
        probe.terminate()
        probe.wait(30)
    out.close()


def _joined(pipes: Iterable[Connection]) -> int:
    total = 0
    for pipe in pipes:
        pipe.send(("joined",))
        total += pipe.recv()[1]
    return total


def _steps(pipes: Iterable[Connection]) -> str:
    """Sites per step of a training job, summed over the swarm processes."""
    steps: Counter[str] = Counter()
    uploads, errors = 0, []
    for pipe in pipes:
        pipe.send(("steps",))
        _, counts, done, failed = pipe.recv()
        steps.update(counts)
        uploads += done
        errors += failed
    counts = ", ".join(f"{n} {c}" for n, c in sorted(steps.items()))
    return f"{counts}, uploads done {uploads}" + (f", errors e.g. {errors[:3]}" if errors else "")


def _stop(pipes: list[Connection], workers: list[Any]) -> list[dict[str, Any]]:
    stats = []
    for pipe in pipes:
        with contextlib.suppress(OSError, EOFError):
            pipe.send(("stop",))
    for pipe in pipes:
        with contextlib.suppress(OSError, EOFError):
            if pipe.poll(60):
                stats.append(pipe.recv()[1])
    for worker in workers:
        worker.join(10)
        if worker.is_alive():
            worker.kill()
    return stats


def _stop_server(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _cpu(processes: Sequence[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def _threads(processes: Sequence[psutil.Process]) -> int:
    return sum(p.num_threads() for p in processes)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _aggregate_error(model_path: Path, audit: list[dict[str, Any]], params: int) -> float:
    """Largest difference between the server's final model and FedAvg over the uploads
    it acknowledged, recomputed here in float64 (each value a constant per site)."""
    expected = 0.0
    for server_round in sorted({r["round"] for r in audit if r["event"] == "upload"}):
        ups = [r for r in audit if r["event"] == "upload" and r["round"] == server_round]
        weights = np.array([r["num_examples"] for r in ups], dtype=np.float64)
        values = np.array([site_value(int(r["site"].split("-")[1])) for r in ups])
        expected += float((weights * values).sum() / weights.sum())
    model = torch.load(model_path, weights_only=True)
    flat = torch.cat([t.reshape(-1).double() for t in model.values()])
    assert flat.numel() == params
    return float((flat - expected).abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--sites", default="100,1000", help="comma-separated swarm sizes")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fraction-fit", type=float, default=1.0)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=4, help="swarm processes")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle CPU window")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per swarm size")
    parser.add_argument(
        "--server-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a server.toml key (JSON value), e.g. max_sites=2000",
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep each size's run dir and server.log under this"
    )
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    for item in args.server_option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    # SIGTERM unwinds like Ctrl-C, so the server and the swarm processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(HEADER, flush=True)
    for n in (int(s) for s in args.sites.split(",")):
        if args.workdir is not None:
            args.workdir.mkdir(parents=True, exist_ok=True)
            kept = tempfile.mkdtemp(prefix=f"swarm-{n}-", dir=args.workdir)
        with (
            contextlib.nullcontext(kept)
            if args.workdir is not None
            else tempfile.TemporaryDirectory(prefix=f"swarm-{n}-")
        ) as tmp:
            run = run_swarm(
                n,
                rounds=args.rounds,
                fraction_fit=args.fraction_fit,
                params=args.params,
                processes=max(1, min(args.processes, n)),
                idle_s=args.idle_s,
                timeout_s=args.timeout_s,
                server_options=options,
                workdir=Path(tmp),
            )
        print(run.row(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
