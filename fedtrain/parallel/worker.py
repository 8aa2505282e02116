"""The body of one spawned worker process of a local group.

Control (train/stop, results, errors) travels over the worker's own pipe so the
daemon can tell which rank answered, failed or went silent; tensors travel through
torch.distributed (broadcast, DDP's all-reduce) and rank 0's shared block.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from fedtrain.parallel.rank import GroupSpec, RankTrainer, backend_for
from fedtrain.parallel.shared import SharedState
from fedtrain.teardown import leave_now

log = logging.getLogger(__name__)

#: How often a worker checks that the process that started it is still alive.
PARENT_POLL_S = 0.2


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of one generation of a group shares."""

    spec: GroupSpec
    world_size: int
    store_port: int  # the daemon's TCPStore on 127.0.0.1: the group's rendezvous
    threads: int  # torch threads of a CPU worker
    collective_timeout_s: float
    parent_pid: int  # the daemon; the worker dies with it


def worker_main(rank: int, device_name: str, config: WorkerConfig, conn: Connection) -> None:
    """Join the group, build the trainer, then serve train/stop commands until told to stop."""
    _detach_from_terminal()
    _die_with_parent(config.parent_pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the daemon asks on a hang
    world_size = config.world_size
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(config.threads)
        if world_size > 1:
            timeout = timedelta(seconds=config.collective_timeout_s)
            store = dist.TCPStore("127.0.0.1", config.store_port, is_master=False, timeout=timeout)
            dist.init_process_group(
                backend_for(device), store=store, rank=rank, world_size=world_size,
                timeout=timeout,
            )  # fmt: skip
        trainer = RankTrainer(config.spec, rank, world_size, device)
        shared = SharedState.like(trainer.module, trainer.federated) if rank == 0 else None
        conn.send(("ready", rank, shared))
        _serve(trainer, shared, conn)
    except EOFError:  # the daemon closed our pipe: it is gone or closing
        pass
    except BaseException as exc:
        _report(conn, rank, exc)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A stopped worker has nothing left to save; a stopping daemon (and the service
    # manager behind it) would otherwise wait for every worker's interpreter teardown.
    leave_now(0)


def _serve(trainer: RankTrainer, shared: SharedState | None, conn: Connection) -> None:
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        _, config, seed = command
        result = trainer.train(config, shared.as_state() if shared is not None else None, seed)
        trained = trainer.trained_state()  # a collective when the model is sharded
        if shared is not None and trained is not None:
            shared.write(trained)
        conn.send(("done", trainer.rank, result if trainer.rank == 0 else None))


def _report(conn: Connection, rank: int, exc: BaseException) -> None:
    summary = f"{type(exc).__name__}: {exc}".strip()
    with contextlib.suppress(OSError):  # if the daemon is gone, nobody is left to tell
        conn.send(("error", rank, summary, traceback.format_exc()))


def _detach_from_terminal() -> None:
    """Own process group: a terminal's Ctrl-C reaches the daemon, which stops us in
    order, and the daemon can kill our whole tree (DataLoader workers too) at once."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _die_with_parent(parent: int) -> None:
    """Exit (with our process group) when the daemon dies, however it dies.

    A watchdog thread, not PR_SET_PDEATHSIG: that fires when the *thread* that spawned
    us exits, and daemons start groups from short-lived threads.
    """

    def watch() -> None:
        while os.getppid() == parent:  # also ends at once if the daemon died before we started
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="fedtrain-parent-watch", daemon=True).start()
