"""Which processes train a site's rounds: the daemon itself, a local DDP worker group,
or the ranks torchrun started (see `fedtrain.parallel` for the groups themselves).

site.toml decides for one machine: `devices = ["cuda:0", "cuda:1"]` (one NCCL worker
per GPU) or `nproc = N` (N gloo workers on the CPU); neither keeps training in the
daemon's own process. Under torchrun (a site spanning machines), torchrun's
environment decides instead: RANK 0 runs the daemon, which drives every rank through
`WorkerGroup.from_env`, and every other rank runs `run_follower` and never talks to
the server. Every rank must build the same task, data, seed and site name, so all of
them derive those from the same site.toml here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence

from fedtrain.errors import ConfigError
from fedtrain.parallel import (
    DataFactory,
    TorchrunGroup,
    WorkerGroup,
    follower_main,
    launched_by_torchrun,
)
from fedtrain.parallel.launch import env_rank
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.site.data import site_dataset

log = logging.getLogger(__name__)

#: The least time a round's training gets before the group calls its ranks hung. The
#: deadline comes from the server's clock; a site whose clock runs ahead must not kill
#: healthy workers for it (an update past the deadline is refused by the server anyway).
MIN_TRAIN_TIMEOUT_S = 30.0


def with_workers(
    config: SiteConfig, *, devices: Sequence[str] | None = None, nproc: int | None = None
) -> SiteConfig:
    """`config` with the command line's `--devices` / `--nproc` in place of site.toml's.

    Either flag replaces both keys, so `--nproc 2` also drops site.toml's `devices`
    (and the reverse) instead of tripping over the "not both" rule.
    """
    if devices is not None:
        return dataclasses.replace(config, devices=list(devices), nproc=1, device="cpu")
    if nproc is not None:
        return dataclasses.replace(config, devices=[], nproc=nproc)
    return config


def uses_worker_group(config: SiteConfig) -> bool:
    """True when the site trains in worker processes rather than in the daemon."""
    return launched_by_torchrun() or bool(config.devices) or config.nproc > 1


def torchrun_follower() -> bool:
    """True in a non-zero rank that torchrun started: it must run `run_follower`."""
    return launched_by_torchrun() and env_rank()[0] != 0


def site_data_factory(config: SiteConfig, site_name: str) -> DataFactory:
    """The site's training set as every rank builds it (a partial, so it pickles)."""
    return functools.partial(site_dataset, config=config.data, site_name=site_name)


def worker_group(config: SiteConfig, site_name: str) -> WorkerGroup | TorchrunGroup | None:
    """The site's worker group, not started yet; None to train in the daemon's process."""
    if not uses_worker_group(config):
        return None
    data = site_data_factory(config, site_name)
    if launched_by_torchrun():
        _check_torchrun(config)
        return WorkerGroup.from_env(
            config.task, config.task_options, data=data, seed=config.seed, client_id=site_name,
            sharding=config.sharding,
        )  # fmt: skip
    return WorkerGroup(
        config.task,
        config.task_options,
        data=data,
        seed=config.seed,
        client_id=site_name,
        devices=config.devices or None,
        nproc=None if config.devices else config.nproc,
        sharding=config.sharding,
    )


def run_follower(config: SiteConfig, site_name: str) -> int:
    """A non-zero torchrun rank of the site: train whenever rank 0 says, until it stops."""
    _check_torchrun(config)
    rank, world, _ = env_rank()
    log.info("site %r: rank %d of %d follows rank 0 (pid %d)", site_name, rank, world, os.getpid())
    return follower_main(
        config.task,
        config.task_options,
        data=site_data_factory(config, site_name),
        seed=config.seed,
        client_id=site_name,
        sharding=config.sharding,
    )


def train_timeout_s(deadline_unix: float, now: float | None = None) -> float | None:
    """How long a round's training may take: until the server's deadline (at least
    `MIN_TRAIN_TIMEOUT_S`); None when the instruction carries no deadline."""
    if deadline_unix <= 0:
        return None
    left = deadline_unix - (time.time() if now is None else now)
    return max(left, MIN_TRAIN_TIMEOUT_S)


def _check_torchrun(config: SiteConfig) -> None:
    if config.devices or config.nproc > 1:
        raise ConfigError(
            f"launched by torchrun but site.toml (or the command line) also sets devices = "
            f"{config.devices} / nproc = {config.nproc}: torchrun's --nnodes x "
            "--nproc-per-node already decide the site's ranks; remove devices and nproc"
        )
