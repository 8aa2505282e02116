"""A site's local DDP worker group, owned by the daemon and kept across rounds.

All ranks are spawned workers; the daemon itself joins no process group. That
keeps the process that talks to the server out of every collective, so a crashed
or hung rank can never block or kill it: the daemon watches each rank's pipe and
process sentinel, kills the group on the first failure, and restarts it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch.distributed as dist
import torch.multiprocessing as mp

from fedtrain.errors import ConfigError, WorkerGroupError
from fedtrain.parallel.launch import TorchrunGroup
from fedtrain.parallel.rank import DataFactory, GroupSpec
from fedtrain.parallel.shared import SharedState
from fedtrain.parallel.worker import WorkerConfig, worker_main
from fedtrain.strategy.base import RoundConfig
from fedtrain.task import TrainResult, resolve_device
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)

#: After the first failure, how long to keep listening for the other ranks' news,
#: so the error names the rank that crashed, not only the ranks it took down.
FAILURE_GRACE_S = 0.5
#: How long hung ranks get to dump their stacks (faulthandler) before being killed.
STACK_DUMP_S = 0.3

HANG_NOTE = (
    "one rank stuck outside DDP holds the others in its all-reduce; the stacks dumped "
    "to stderr show which"
)

_LIVE: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


class WorkerGroup:
    """DDP workers for one site: `devices=["cuda:0", "cuda:1"]` (NCCL) or `nproc=N` (gloo, CPU).

    `train_round` sends the global model in, every rank trains its shard, and rank 0's
    trained state and `TrainResult` (the site's total example count) come back. A
    failing round raises `WorkerGroupError` and the group restarts; `close()` (or the
    `with` block's end) stops every worker. Rounds run one at a time; `close()` may
    come from another thread (daemon shutdown) and cuts a running round short.
    """

    def __init__(
        self,
        task_ref: str,
        task_options: Mapping[str, Any] | None = None,
        *,
        data: DataFactory | None = None,
        seed: int = 0,
        client_id: str = "local",
        nproc: int | None = None,
        devices: Sequence[str] | None = None,
        threads_per_worker: int | None = None,
        start_timeout_s: float = 120.0,
        collective_timeout_s: float = 1800.0,
        sharding: str = "ddp",
    ) -> None:
        self.spec = GroupSpec(task_ref, dict(task_options or {}), data, seed, client_id, sharding)
        self.spec.check_picklable()
        self.devices = _check_devices(nproc, devices)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.threads = threads_per_worker or max(1, cores // len(self.devices))
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._workers: list[_Worker] = []
        self._shared: SharedState | None = None
        self._store: dist.TCPStore | None = None
        self._closed = False
        self._lock = threading.Lock()  # held by a round, and by close() while stopping
        self._wake_r, self._wake_w = mp.get_context("spawn").Pipe(duplex=False)
        self.generation = 0  # how many times the group was (re)started

    @classmethod
    def from_env(
        cls,
        task_ref: str,
        task_options: Mapping[str, Any] | None = None,
        *,
        data: DataFactory | None = None,
        seed: int = 0,
        client_id: str = "local",
        collective_timeout_s: float = 1800.0,
        sharding: str = "ddp",
    ) -> TorchrunGroup:
        """Rank 0's group when torchrun started this process (see `fedtrain.parallel`)."""
        spec = GroupSpec(task_ref, dict(task_options or {}), data, seed, client_id, sharding)
        return TorchrunGroup(spec, collective_timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def pids(self) -> list[int]:
        """Worker process ids (for monitoring; empty when stopped)."""
        return [w.process.pid for w in self._workers]

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the workers and wait until every rank has built its model."""
        with self._lock:
            self._closed = False
            while self._wake_r.poll():
                self._wake_r.recv()
            self._ensure_started(retry="fix the cause and start the group again")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker: ask nicely, then kill what is left; idempotent.

        A round running in another thread is interrupted first (it raises
        `WorkerGroupError`), so no restart can spawn workers behind our back.
        """
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(None)
        with self._lock:
            for w in self._workers:
                with contextlib.suppress(OSError):
                    w.conn.send(("stop",))
            deadline = time.monotonic() + timeout_s
            for w in self._workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
            self._kill()

    # -- rounds ----------------------------------------------------------------------------
    def train_round(
        self,
        global_state: ModelState,
        config: RoundConfig,
        timeout_s: float | None = None,
        seed: int | None = None,
    ) -> tuple[ModelState, TrainResult]:
        """Train one round on all ranks: (rank 0's trained state, rank 0's TrainResult).

        `timeout_s` bounds the training itself (not a restart's start-up, which
        `start_timeout_s` bounds); `seed`, if given, is every rank's context seed for
        this round. Raises `WorkerGroupError` if any rank fails.
        """
        with self._lock:
            shared = self._ensure_started(retry="the next round tries to start it again")
            shared.write(global_state)
            failures: dict[int, str] = {}
            for w in self._workers:
                try:
                    w.conn.send(("train", dict(config), seed))
                except OSError:
                    failures[w.rank] = _exit_description(w)
            try:
                replies = self._collect(timeout_s, failures, "did not finish the round")
            except _RanksFailed as failed:
                self._restart_after(failed)
            result = replies[0]
            assert isinstance(result, TrainResult)
            return shared.read(), result

    # -- internals -------------------------------------------------------------------------
    def _ensure_started(self, retry: str) -> SharedState:
        """The ready group's shared block, (re)starting the group if needed; under the lock.

        `retry` ends the error when the group cannot start: what the caller does next.
        """
        if self._closed:
            raise WorkerGroupError(
                "the worker group is closed; start() it again to train", {}, restarting=False
            )
        if not self._workers:
            self._spawn()
        if self._shared is None:
            self._await_ready(retry)
        assert self._shared is not None
        return self._shared

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        timeout = timedelta(seconds=self.start_timeout_s)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False
        )
        self.generation += 1
        log.info(
            "starting a DDP group of %d on %s (generation %d, rendezvous 127.0.0.1:%d)",
            self.world_size, ", ".join(self.devices), self.generation, self._store.port,
        )  # fmt: skip
        _LIVE.add(self)
        config = WorkerConfig(
            self.spec, self.world_size, self._store.port, self.threads,
            self.collective_timeout_s, parent_pid=os.getpid(),
        )  # fmt: skip
        for rank, device in enumerate(self.devices):
            parent_end, child_end = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=worker_main,
                args=(rank, device, config, child_end),
                name=f"fedtrain-ddp-rank{rank}",
            )
            process.start()
            child_end.close()
            self._workers.append(_Worker(rank, process, parent_end))

    def _await_ready(self, retry: str) -> None:
        try:
            replies = self._collect(self.start_timeout_s, {}, "did not start")
        except _RanksFailed as failed:
            self._kill()
            raise WorkerGroupError(
                f"the DDP worker group could not start: {failed}; {retry}",
                failed.failures,
                restarting=False,
            ) from None
        shared = replies[0]
        assert isinstance(shared, SharedState)
        self._shared = shared
        log.info("DDP group ready: ranks %s are pids %s", list(range(self.world_size)), self.pids)

    def _collect(
        self, timeout_s: float | None, failures: dict[int, str], silent: str
    ) -> dict[int, object]:
        """Every rank's reply, or `_RanksFailed` naming the ranks that failed and how.

        Each rank is watched on its pipe (answers, errors) and its process sentinel
        (crashes). After the first failure the others get `FAILURE_GRACE_S` to report
        too, so the error names the rank that crashed and the ranks it took down.
        """
        replies: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        grace_until: float | None = None
        while True:
            if failures and grace_until is None:
                grace_until = time.monotonic() + FAILURE_GRACE_S
            pending = [w for w in self._workers if w.rank not in replies | failures.keys()]
            if not pending:
                break
            waitables = [w.conn for w in pending]
            waitables += [w.process.sentinel for w in self._workers if w.rank not in failures]
            limits = [t for t in (deadline, grace_until) if t is not None]
            left = max(0.0, min(limits) - time.monotonic()) if limits else None
            ready = wait([*waitables, self._wake_r], left)
            if self._wake_r in ready:
                raise _RanksFailed({w.rank: "was stopped: the group was closed" for w in pending})
            if not ready:
                break
            for w in self._workers:
                if w.rank in failures:
                    continue
                if w.conn in ready and w.rank not in replies:
                    self._take_message(w, replies, failures)
                elif w.process.sentinel in ready:
                    w.process.join(1.0)
                    failures[w.rank] = _exit_description(w)
        if not failures and len(replies) < len(self._workers):  # a hang
            silent_ranks = [w.rank for w in self._workers if w.rank not in replies]
            for rank in silent_ranks:
                failures[rank] = f"{silent} within {timeout_s:g} s (hung)"
            self._dump_stacks(silent_ranks)
            if len(silent_ranks) > 1:
                raise _RanksFailed(failures, note=HANG_NOTE)
        if failures:
            raise _RanksFailed(failures)
        return replies

    def _take_message(
        self, w: _Worker, replies: dict[int, object], failures: dict[int, str]
    ) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(1.0)
            failures[w.rank] = _exit_description(w)
            return
        if message[0] == "error":
            _, rank, summary, trace = message
            log.error("DDP rank %d failed:\n%s", rank, trace)
            failures[w.rank] = f"raised {summary}"
        else:
            replies[w.rank] = message[2]

    def _dump_stacks(self, ranks: list[int]) -> None:
        for w in self._workers:
            if w.rank in ranks and w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGUSR1)
        log.error("hung DDP ranks %s: their stacks follow on the workers' stderr", ranks)
        time.sleep(STACK_DUMP_S)

    def _restart_after(self, failed: _RanksFailed) -> NoReturn:
        self._kill()
        if self._closed:
            raise WorkerGroupError(
                f"DDP round cut short: {failed}", failed.failures, restarting=False
            )
        try:
            self._spawn()  # the next round waits for these fresh workers to be ready
            restarting, next_step = True, "the worker group is being restarted"
        except Exception as exc:
            log.exception("could not restart the DDP group")
            restarting, next_step = False, f"restarting the worker group failed too ({exc})"
        raise WorkerGroupError(
            f"DDP round failed on the site's {self.world_size} worker(s): {failed}; "
            f"{next_step} and the next round will run on fresh workers",
            failed.failures,
            restarting=restarting,
        )

    def _kill(self) -> None:
        """Kill every worker's whole process tree and reap it; forget the generation."""
        for w in self._workers:
            # The worker leads its own process group (once it got that far): kill the
            # group for its DataLoader workers, the process itself in case it did not.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.process.pid, signal.SIGKILL)
            w.process.kill()
        for w in self._workers:
            w.process.join(5.0)
            w.conn.close()
        self._workers, self._shared, self._store = [], None, None
        _LIVE.discard(self)


class _RanksFailed(Exception):
    """Internal: which ranks failed and how, before it becomes a WorkerGroupError.

    Ranks that died come first: they are usually the cause, and the others' errors
    (a peer's connection reset in the all-reduce) the consequence.
    """

    def __init__(self, failures: dict[int, str], note: str = "") -> None:
        def cause_first(rank: int) -> tuple[bool, int]:
            return (failures[rank].startswith(("raised", "did not")), rank)

        parts = [f"rank {r} {_shorten(failures[r])}" for r in sorted(failures, key=cause_first)]
        super().__init__("; ".join(parts) + (f" ({note})" if note else ""))
        self.failures = failures


def _shorten(text: str, limit: int = 300) -> str:
    """Keep error messages readable; full tracebacks are in the log."""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _check_devices(nproc: int | None, devices: Sequence[str] | None) -> list[str]:
    if (nproc is None) == (devices is None):
        raise ConfigError(
            "a worker group takes exactly one of nproc (CPU processes) or devices (GPUs)"
        )
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {nproc}")
        return ["cpu"] * nproc
    resolved = [resolve_device(d) for d in devices or ()]
    if not resolved:
        raise ConfigError("devices is empty; list GPUs like ['cuda:0', 'cuda:1'] or use nproc")
    if any(d.type != "cuda" for d in resolved):
        raise ConfigError(f"devices = {list(devices or ())} must all be GPUs; use nproc for CPU")
    names = [f"cuda:{d.index or 0}" for d in resolved]
    if len(set(names)) != len(names):
        raise ConfigError(f"devices = {names} names a GPU twice; NCCL needs one rank per GPU")
    return names


def _exit_description(w: _Worker) -> str:
    code = w.process.exitcode
    if code is None:
        return "closed its pipe without answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


@atexit.register
def _close_live_groups() -> None:
    """Stop groups nobody closed, before multiprocessing's own exit hook would wait
    forever for their (non-daemonic) workers."""
    for group in list(_LIVE):
        group.close(timeout_s=2.0)
