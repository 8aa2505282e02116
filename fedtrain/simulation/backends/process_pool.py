"""The `process` backend: long-lived worker processes on this machine.

Each worker is a spawned process holding one `ClientRunner`: it builds the task,
its data and the client partition once, then trains many virtual clients per round.
Per round the driver writes the global model once into a shared-memory buffer that
every worker reads (never a copy per client or per worker) and sends each worker
only its share (client ids and configs). A worker writes its partial sum into a
shared buffer of its own and reports a few floats; single updates, for strategies
that need every one, come back through the worker's pipe as one flat buffer each.

Workers are spawned, not forked: forking a process that already runs torch's
thread pools (or any thread) can deadlock the child. They ignore SIGINT, because
Ctrl-C reaches the whole process group and the driver, not each worker, decides how
to stop; the driver owns their lifetime through `with` and kills what does not exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp

from fedtrain.errors import ConfigError, SimulationError
from fedtrain.simulation.backends.pool import WorkerPool
from fedtrain.simulation.events import ShareDone, WorkerEvent, WorkerFailed
from fedtrain.simulation.plan import ClientWork, RoundPlan
from fedtrain.simulation.transport import EventTransport
from fedtrain.simulation.worker import ClientRunner, WorkerSetup
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # how long idle workers get to exit after being asked to
KILL_GRACE_S = 5.0  # after SIGTERM, before SIGKILL

#: (round, clients, fold in worker, evaluate instead of train)
Share = tuple[int, tuple[ClientWork, ...], bool, bool]


class ProcessPoolBackend(WorkerPool):
    """`num_workers` spawned worker processes, started on `__enter__`, gone after `__exit__`."""

    def __init__(self, setup: WorkerSetup, num_workers: int, cpus: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        cpus = cpus or os.cpu_count() or 1
        # Workers share the machine: give each its slice of the cores so that torch's
        # thread pools do not oversubscribe them (spinning threads starve each other).
        self.setup = dataclasses.replace(setup, torch_threads=max(1, cpus // num_workers))
        self.num_workers = num_workers
        self.transport = EventTransport(setup.specs)
        self._processes: list[Any] = []
        self._conns: list[Connection] = []
        self._model_buffer: torch.Tensor | None = None
        self._sum_buffers: list[torch.Tensor] = []
        self._busy = False  # workers mid-work would not read a polite stop request

    # -- lifetime -----------------------------------------------------------------------
    def _start(self) -> None:
        self._busy = True
        context = mp.get_context("spawn")
        self._model_buffer = self.transport.model.empty(shared=True)
        for worker in range(self.num_workers):
            sums = self.transport.sums.empty(shared=True)
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(worker, self.setup, child, self._model_buffer, sums),
                name=f"fedtrain-sim-worker-{worker}",
                daemon=True,  # never outlive the driver, even if it dies without cleanup
            )
            try:
                process.start()  # pickles the setup: the task object travels once
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                parent.close()
                raise ConfigError(
                    f"the task object cannot be sent to worker processes ({exc}); build it "
                    "from `task` and `task_options`, or keep unpicklable state out of it"
                ) from exc
            finally:
                child.close()
            self._sum_buffers.append(sums)
            self._conns.append(parent)
            self._processes.append(process)
        for worker in range(self.num_workers):
            message = self._receive_from(worker, "starting")
            if isinstance(message, WorkerFailed):
                raise self._failure(message, "while starting")
        self._busy = False
        log.info("started %d simulation worker processes", self.num_workers)

    def close(self) -> None:
        """Stop every worker: ask idle ones to exit, terminate the rest, kill stragglers."""
        if not self._busy:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):  # that worker is gone
                    conn.send(None)
            for process in self._processes:
                process.join(STOP_GRACE_S)
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(KILL_GRACE_S)
            if process.is_alive():
                log.warning("worker pid %s ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._sum_buffers = [], [], []
        self._model_buffer = None
        self._busy = False

    # -- rounds -------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan, global_state: ModelState) -> Iterator[WorkerEvent]:
        if self._model_buffer is None:
            raise RuntimeError("ProcessPoolBackend used outside its `with` block")
        # Workers are idle between rounds, so nobody reads the buffer while it changes.
        self.transport.model.pack(global_state, out=self._model_buffer)
        busy = [w for w, share in enumerate(plan.shares) if share]
        self._busy = True
        for worker in busy:
            share: Share = (
                plan.server_round,
                plan.shares[worker],
                plan.fold_in_workers,
                plan.evaluate,
            )
            self._conns[worker].send(share)
        while busy:
            for worker in self._ready(busy):
                message = self._receive_from(worker, f"in round {plan.server_round}")
                if isinstance(message, WorkerFailed):
                    raise self._failure(message, f"in round {plan.server_round}")
                event, payload = message
                sums_in = self._sum_buffers[worker] if plan.fold_in_workers else None
                event = self.transport.attach(event, payload, sums_in=sums_in)
                if isinstance(event, ShareDone):
                    busy.remove(worker)
                yield event
        self._busy = False

    def _ready(self, workers: list[int]) -> list[int]:
        """Workers with a message waiting, or whose process died (then receiving fails)."""
        handles: dict[Any, int] = {}
        for worker in workers:
            handles[self._conns[worker]] = worker
            handles[self._processes[worker].sentinel] = worker
        return sorted({handles[h] for h in wait(list(handles))})

    def _receive_from(self, worker: int, when: str) -> Any:
        conn, process = self._conns[worker], self._processes[worker]
        try:
            if conn.poll() or process.is_alive():
                return conn.recv()
        except (EOFError, OSError):
            pass
        process.join(1.0)
        hint = (
            "; its stderr says why. Running a script? Spawned workers re-import it, so its "
            "entry point must sit under `if __name__ == '__main__':`"
            if when == "starting"
            else "; a negative code is the signal that killed it (-9: often the kernel's "
            "out-of-memory killer: use fewer workers or a smaller task)"
        )
        raise SimulationError(
            f"simulation worker {worker} (pid {process.pid}) died {when} with exit code "
            f"{process.exitcode}{hint}"
        )

    def _failure(self, failed: WorkerFailed, when: str) -> SimulationError:
        where = f" training {failed.client_id}" if failed.client_id else ""
        return SimulationError(
            f"simulation worker {failed.worker} failed{where} {when}: {failed.message}\n"
            f"--- worker traceback ---\n{failed.traceback}"
        )


def worker_main(
    worker: int,
    setup: WorkerSetup,
    conn: Connection,
    model_buffer: torch.Tensor,
    sums_buffer: torch.Tensor,
) -> None:
    """A worker process: build the clients once, then train shares until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    transport = EventTransport(setup.specs)
    try:
        runner = ClientRunner(setup, worker=worker)
    except Exception as exc:
        conn.send(WorkerFailed(worker, None, repr(exc), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    # Views into the driver's shared buffer: the driver refreshes it before each round.
    global_state = transport.model.unpack(model_buffer)
    while True:
        try:
            share: Share | None = conn.recv()
        except (EOFError, OSError):
            share = None  # the driver is gone
        if share is None:
            exit_now()
        _, clients, fold, evaluate = share
        try:
            for event in runner.run_share(worker, clients, global_state, fold, evaluate):
                conn.send(transport.detach(event, sums_out=sums_buffer))
        except Exception as exc:
            conn.send(
                WorkerFailed(worker, runner.current_client, repr(exc), traceback.format_exc())
            )


def exit_with_parent() -> None:
    """End this worker the moment the driver dies, even in the middle of a share: a
    driver killed outright (SIGKILL, OOM) gets no chance to stop its workers."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="fedtrain-parent-watch", daemon=True).start()


def exit_now() -> NoReturn:
    """End a worker without interpreter teardown, which after importing torch takes
    about a second per process; a worker holds nothing that needs finalizing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
