"""A site spanning several machines: torchrun's processes, rank 0 being the daemon.

torchrun (torch.distributed.run) starts one process per GPU on every machine and
sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. The process with
RANK 0 runs the site daemon and drives a `TorchrunGroup`; every other rank runs
`follower_main`, which waits for rank 0's commands. Commands are small JSON
documents broadcast over a gloo group with an effectively unbounded timeout, since
rounds may be hours apart; tensors travel as in a local group.

torchrun owns these processes, so a failure cannot be healed in place: a failed
round raises `WorkerGroupError` (restarting=False) and later rounds refuse; the
daemon should exit non-zero and let torchrun (`--max-restarts`) start it again.
A hung rank surfaces as a collective timeout after `collective_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fedtrain.errors import ConfigError, WorkerGroupError
from fedtrain.parallel.rank import DataFactory, GroupSpec, RankTrainer, backend_for
from fedtrain.strategy.base import RoundConfig
from fedtrain.task import TrainResult
from fedtrain.tensors import ModelState

log = logging.getLogger(__name__)

#: The environment variables of torchrun's launch contract.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_IDLE_TIMEOUT = timedelta(days=365)  # followers wait this long for the next command


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when this process was started under torchrun's launch contract."""
    env = os.environ if env is None else env
    return all(name in env for name in LAUNCH_VARS)


def env_rank(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) from the environment, with a clear error."""
    env = os.environ if env is None else env
    missing = [name for name in LAUNCH_VARS if name not in env]
    if missing:
        raise ConfigError(
            f"not launched by torchrun: {', '.join(missing)} unset; start the site with "
            "`torchrun --nnodes N --nproc-per-node G ... fedtrain client ...`"
        )
    try:
        rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as exc:
        raise ConfigError(f"torchrun variables must be integers: {exc}") from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world, local


class _Ranks:
    """This process's place in the torchrun group: process groups and trainer."""

    def __init__(self, spec: GroupSpec, collective_timeout_s: float) -> None:
        self.rank, self.world_size, local_rank = env_rank()
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend_for(device), init_method="env://", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=collective_timeout_s),
        )  # fmt: skip
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        log.info("rank %d of %d on %s joined the site's group", self.rank, self.world_size, device)
        self.trainer = RankTrainer(spec, self.rank, self.world_size, device)

    def send(self, command: dict[str, Any]) -> None:
        """Rank 0: broadcast a JSON command to every rank."""
        payload = torch.frombuffer(bytearray(json.dumps(command).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([len(payload)]), src=0, group=self.control)
        dist.broadcast(payload, src=0, group=self.control)

    def receive(self) -> dict[str, Any]:
        """Other ranks: the next command from rank 0 (blocks between rounds)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return json.loads(bytes(payload.numpy()))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchrunGroup:
    """Rank 0's handle on a torchrun-launched group; the same API as `WorkerGroup`.

    Rank 0 trains in this (the daemon's) process: torchrun placed it on a GPU.
    """

    def __init__(self, spec: GroupSpec, collective_timeout_s: float = 1800.0) -> None:
        spec.check_picklable()
        self.spec, self.collective_timeout_s = spec, collective_timeout_s
        self._ranks: _Ranks | None = None
        self._broken: str | None = None

    @property
    def world_size(self) -> int:
        return env_rank()[1]

    def __enter__(self) -> TorchrunGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Join the group (blocks until every rank of every machine has joined)."""
        if self._ranks is None:
            rank = env_rank()[0]
            if rank != 0:
                raise ConfigError(f"RANK={rank}: only rank 0 drives the group; run follower_main")
            self._ranks = _Ranks(self.spec, self.collective_timeout_s)

    def train_round(
        self,
        global_state: ModelState,
        config: RoundConfig,
        timeout_s: float | None = None,
        seed: int | None = None,
    ) -> tuple[ModelState, TrainResult]:
        """As `WorkerGroup.train_round`; `timeout_s` is not enforced (see module doc)."""
        if self._broken:
            raise WorkerGroupError(
                f"the torchrun group broke in an earlier round ({self._broken}); exit so "
                "torchrun restarts the site",
                {},
                restarting=False,
            )
        self.start()
        assert self._ranks is not None
        try:
            self._ranks.send({"command": "train", "config": dict(config), "seed": seed})
            result = self._ranks.trainer.train(config, global_state, seed)
        except Exception as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise WorkerGroupError(
                f"DDP round failed on the torchrun group of {self.world_size}: rank 0 saw "
                f"{self._broken}; the group cannot restart itself: exit so torchrun "
                "restarts the site",
                {0: self._broken},
                restarting=False,
            ) from exc
        trained = self._ranks.trainer.trained_state()
        assert trained is not None  # rank 0
        return ModelState({k: v.detach().to("cpu", copy=True) for k, v in trained.items()}), result

    def close(self) -> None:
        """Tell the followers to stop and leave the group; idempotent."""
        if self._ranks is None:
            return
        ranks, self._ranks = self._ranks, None
        try:
            if not self._broken:
                ranks.send({"command": "stop"})
        finally:
            ranks.close()


def follower_main(
    task_ref: str,
    task_options: Mapping[str, Any] | None = None,
    *,
    data: DataFactory | None = None,
    seed: int = 0,
    client_id: str = "local",
    collective_timeout_s: float = 1800.0,
    sharding: str = "ddp",
) -> int:
    """Run a non-zero torchrun rank: train whenever rank 0 says so, until it says stop.

    Takes the same task, data, seed and client id as rank 0's group (the same
    site.toml on every machine). Returns the process exit code.
    """
    spec = GroupSpec(task_ref, dict(task_options or {}), data, seed, client_id, sharding)
    ranks = _Ranks(spec, collective_timeout_s)
    if ranks.rank == 0:
        ranks.close()
        raise ConfigError("follower_main runs ranks other than 0; rank 0 is the daemon")
    try:
        rounds = 0
        while (command := ranks.receive())["command"] == "train":
            ranks.trainer.train(command["config"], None, command["seed"])
            ranks.trainer.trained_state()  # rank 0 gathers a sharded model: join in
            rounds += 1
        log.info("rank %d stops after %d round(s)", ranks.rank, rounds)
        return 0
    finally:
        ranks.close()
