"""Which processes train a site: site.toml's devices/nproc, the CLI flags that override
them, and torchrun's environment (rank 0 the daemon, other ranks followers)."""

from __future__ import annotations

import functools
import queue
import time
from pathlib import Path

import pytest
from runtime_support import TinyTask

from fedtrain import cli
from fedtrain.config import from_dict
from fedtrain.errors import ConfigError, WorkerGroupError
from fedtrain.parallel import TorchrunGroup, WorkerGroup
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.site import workers
from fedtrain.runtime.site.daemon import Link, SiteDaemon
from fedtrain.runtime.site.data import site_dataset
from fedtrain.runtime.site.workers import (
    MIN_TRAIN_TIMEOUT_S,
    train_timeout_s,
    with_workers,
    worker_group,
)
from fedtrain.tensors import ModelState

BASE = {"task": "runtime_support:TinyTask", "name": "site-a"}
TORCHRUN = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests may themselves run under torchrun; the site must not see it."""
    for name in ("RANK", *TORCHRUN):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def torchrun_rank(monkeypatch: pytest.MonkeyPatch):
    def set_rank(rank: int) -> None:
        for name, value in {**TORCHRUN, "RANK": str(rank)}.items():
            monkeypatch.setenv(name, value)

    return set_rank


def site(**keys: object) -> SiteConfig:
    return from_dict(SiteConfig, {**BASE, **keys})


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"nproc": 0}, "nproc must be >= 1, got 0"),
        ({"nproc": 2, "devices": ["cuda:0", "cuda:1"]}, "set devices .* or nproc .*, not both"),
        ({"device": "cuda:0", "devices": ["cuda:0"]}, "set device .* or devices .*, not both"),
        ({"devices": "cuda:0"}, "devices should be a list, got 'cuda:0'"),
    ],
)
def test_bad_worker_settings_name_the_keys(keys: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        site(**keys)


def test_world_size_and_flag_overrides() -> None:
    assert site().world_size == 1
    assert site(nproc=3).world_size == 3
    gpus = site(devices=["cuda:0", "cuda:1"])
    assert gpus.world_size == 2
    # Either flag replaces both keys, so it never trips over the "not both" rule.
    assert with_workers(gpus, nproc=4).world_size == 4
    assert with_workers(gpus, nproc=4).devices == []
    assert with_workers(site(nproc=4), devices=["cuda:1"]).devices == ["cuda:1"]
    assert with_workers(site(nproc=4), devices=["cuda:1"]).nproc == 1
    assert with_workers(gpus) is gpus
    with pytest.raises(ConfigError, match="nproc must be >= 1"):
        with_workers(gpus, nproc=0)


def test_client_flags_parse_and_exclude_each_other(capsys: pytest.CaptureFixture) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["client", "--config", "s.toml", "--devices", "cuda:0, cuda:1"])
    assert args.devices == ["cuda:0", "cuda:1"] and args.nproc is None
    assert parser.parse_args(["client", "--config", "s.toml", "--nproc", "2"]).nproc == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["client", "--config", "s.toml", "--nproc", "2", "--devices", "cuda:0"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["client", "--config", "s.toml", "--devices", ","])


def test_train_timeout_runs_to_the_deadline_with_a_floor() -> None:
    assert train_timeout_s(0.0) is None  # no deadline sent
    assert train_timeout_s(1000.0 + 600, now=1000.0) == 600
    # A deadline already past (or a site clock running ahead) still leaves the floor.
    assert train_timeout_s(1000.0 - 5, now=1000.0) == MIN_TRAIN_TIMEOUT_S


@pytest.mark.usefixtures("no_torchrun")
def test_worker_group_only_when_asked_for() -> None:
    assert worker_group(site(), "site-a") is None
    group = worker_group(site(nproc=2, seed=5, data={"partition": 1, "num_partitions": 2}), "a")
    assert isinstance(group, WorkerGroup) and group.world_size == 2  # not started
    assert (group.spec.task_ref, group.spec.seed, group.spec.client_id) == (BASE["task"], 5, "a")
    # Every rank builds the site's data exactly as the single-process daemon does.
    data = group.spec.data
    assert isinstance(data, functools.partial) and data.func is site_dataset
    assert (
        data(TinyTask()).indices
        == site_dataset(  # type: ignore[attr-defined]
            TinyTask(), site(data={"partition": 1, "num_partitions": 2}).data, "a"
        ).indices
    )


@pytest.mark.usefixtures("no_torchrun")
def test_a_daemon_with_workers_builds_no_model_and_takes_no_injected_task() -> None:
    daemon = SiteDaemon(site(nproc=2), insecure=True)
    assert isinstance(daemon.group, WorkerGroup)
    assert daemon.model is None and daemon.data is None  # the ranks hold them
    assert SiteDaemon(site(), insecure=True).group is None
    with pytest.raises(ConfigError, match="pass neither task= nor data="):
        SiteDaemon(site(nproc=2), insecure=True, task=TinyTask())


def test_torchrun_rank_0_drives_the_group_from_the_environment(torchrun_rank) -> None:
    torchrun_rank(0)
    assert not workers.torchrun_follower()
    group = worker_group(site(), "site-a")
    assert isinstance(group, TorchrunGroup) and group.world_size == 2
    assert group.spec.client_id == "site-a"
    with pytest.raises(ConfigError, match=r"launched by torchrun .* remove devices and nproc"):
        worker_group(site(nproc=2), "site-a")


def test_torchrun_other_ranks_follow_before_any_daemon_exists(
    tmp_path: Path, torchrun_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedtrain client` on rank 1 runs follower_main with rank 0's task, data, seed and
    site name (the same site.toml), and never builds a daemon."""
    calls = []

    def follower(task_ref: str, task_options: dict, **kwargs: object) -> int:
        calls.append((task_ref, task_options, kwargs))
        return 7

    def no_daemon(*args: object, **kwargs: object) -> None:
        raise AssertionError("a follower rank must not build a site daemon")

    monkeypatch.setattr(workers, "follower_main", follower)
    monkeypatch.setattr("fedtrain.runtime.site.daemon.SiteDaemon", no_daemon)
    toml = tmp_path / "site.toml"
    toml.write_text(
        'task = "runtime_support:TinyTask"\nname = "site-a"\nseed = 4\n'
        "task_options = { delay_s = 0.5 }\n"
    )
    torchrun_rank(1)
    assert cli.main(["client", "--config", str(toml), "--insecure"]) == 7
    [(task_ref, options, kwargs)] = calls
    assert (task_ref, options) == ("runtime_support:TinyTask", {"delay_s": 0.5})
    assert kwargs["seed"] == 4 and kwargs["client_id"] == "site-a"
    assert kwargs["data"].keywords["site_name"] == "site-a"  # type: ignore[attr-defined]

    # devices/nproc make no sense under torchrun: every rank refuses, with exit code 2.
    assert cli.main(["client", "--config", str(toml), "--insecure", "--nproc", "2"]) == 2
    assert len(calls) == 1


class _FailingGroup(WorkerGroup):
    """A local group whose round fails the way a crashed rank fails it."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def train_round(self, global_state, config, timeout_s=None, seed=None):
        self.timeouts.append(timeout_s)
        raise WorkerGroupError(
            "DDP round failed on the site's 2 worker(s): rank 1 exited with code 3; the "
            "worker group is being restarted",
            {1: "exited with code 3"},
            restarting=True,
        )

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class _BrokenTorchrunGroup(TorchrunGroup):
    """A torchrun group after a rank died: it cannot restart its ranks itself."""

    def __init__(self) -> None:
        pass

    def train_round(self, global_state, config, timeout_s=None, seed=None):
        raise WorkerGroupError("the torchrun group broke", {1: "gone"}, restarting=False)

    def close(self) -> None:
        pass


@pytest.mark.usefixtures("no_torchrun")
@pytest.mark.parametrize("group_type", [_FailingGroup, _BrokenTorchrunGroup])
def test_a_failed_group_round_is_reported_to_the_server(group_type: type) -> None:
    """The round fails for this site with a clear error on the control stream; a local
    group's site keeps serving, a torchrun site stops so torchrun can restart it."""
    daemon = SiteDaemon(site(nproc=2), insecure=True)
    daemon.group = group_type()
    daemon.fetch_model = lambda link, version, deadline_unix=0.0, inline=(): ModelState.from_module(  # type: ignore[method-assign]
        TinyTask().model()
    )
    link = Link(
        channel=None, token="t", run_id="r", chunk_bytes=1 << 20, outbox=queue.SimpleQueue()
    )  # type: ignore[arg-type]
    instruction = pb.Instruction(round=2, kind=pb.TRAIN, deadline_unix=time.time() + 600)
    daemon._run_instruction(link, instruction)

    error = link.outbox.get_nowait().error
    assert error.round == 2 and error.message.startswith("WorkerGroupError: ")
    assert daemon.rounds_trained == 0
    if group_type is _FailingGroup:
        assert "rank 1 exited with code 3" in error.message
        assert 500 < daemon.group.timeouts[0] <= 600  # the server's deadline bounds the round
        assert daemon.fatal is None and not daemon._stop.is_set()
    else:
        assert daemon.fatal is not None and "torchrun group broke" in daemon.fatal
        assert daemon._stop.is_set()
