"""Sites that train on a DDP worker group, in real deployments on 127.0.0.1.

A site with `nproc = 2` trains each round on two gloo worker processes that live
across rounds; a rank that crashes fails that round for that site only; torchrun can
launch the site as rank 0 (the daemon) plus followers. Every test checks by PID that
no worker outlives its site.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest
import torch
from ddp_support import alive, assert_all_gone, worker_generations
from runtime_support import Deployment, wait_for

from fedtrain.runtime.demo import fedtrain_command, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BREAST_CANCER = "fedtrain.examples:BreastCancerTask"
THREE_ROUNDS = {
    "secure": False,
    "rounds": 3,
    "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
    "round_timeout_s": 120.0,
}
BOTH_SITES = {"min_fit_clients": 2, "min_available_clients": 2}


def stop_together(deployments: Iterable[Deployment], timeout_s: float = 30.0) -> None:
    """SIGTERM every process of every deployment once, then wait for each to exit."""
    deployments = list(deployments)
    for dep in deployments:
        for name in dep.procs.procs:
            dep.procs.send_signal(name)
    for dep in deployments:
        for proc in dep.procs.procs.values():
            proc.wait(timeout_s)


@pytest.mark.slow  # long scenario (22 s): two federations side by side; -m slow
def test_two_process_site_converges_like_single_process_sites(tmp_path: Path) -> None:
    """The same federation twice, side by side: sites a and b in one process each, and
    site a on a 2-rank group. DDP takes twice the batch per step, so the models differ,
    but both runs must land in the same accuracy band."""
    nprocs = {"single": {"a": 1, "b": 1}, "ddp": {"a": 2, "b": 1}}
    with ExitStack() as stack:
        runs: dict[str, Deployment] = {}
        for label, sites in nprocs.items():
            dep = Deployment(tmp_path / label, BREAST_CANCER, strategy=BOTH_SITES, **THREE_ROUNDS)
            runs[label] = stack.enter_context(dep)
            dep.start_server()
            for i, (name, nproc) in enumerate(sites.items()):
                dep.start_site(name, nproc=nproc, data={"partition": i, "num_partitions": 2})
        for dep in runs.values():
            assert dep.wait_server(240) == 0, dep.log("server")
        ddp = runs["ddp"]
        generations = worker_generations(ddp.log("a"))
        assert len(generations) == 1, ddp.log("a")  # one group, kept for all 3 rounds
        workers = generations[0]
        assert len(workers) == 2 and alive(workers) == workers  # alive until the site stops
        stop_together(runs.values())  # before either run checks for leftover processes
        codes = {label: dep.close() for label, dep in runs.items()}
    assert_all_gone(workers)
    assert all(code == 0 for run in codes.values() for code in run.values()), codes
    assert not worker_generations(ddp.log("b"))  # nproc = 1 trains in the daemon
    assert "round 3: trained on" in ddp.log("a")

    final = {label: dep.metrics()[-1] for label, dep in runs.items()}
    for label, dep in runs.items():
        metrics = dep.metrics()
        assert [r["round"] for r in metrics] == [1, 2, 3], label
        assert all(r["clients"] == 2 and not r["failed"] for r in metrics), label
        assert final[label]["accuracy"] > 0.85, (label, final[label])
    assert abs(final["ddp"]["accuracy"] - final["single"]["accuracy"]) <= 0.05, final
    assert final["ddp"]["loss"] == pytest.approx(final["single"]["loss"], abs=0.05), final

    # The 2-rank site reports its whole partition, not one rank's shard.
    def examples(dep: Deployment) -> list[int]:
        return [r["num_examples"] for r in dep.audit("upload") if r["site"] == "a"]

    assert examples(ddp) == examples(runs["single"]) and len(examples(ddp)) == 3


def test_a_crashing_rank_fails_only_that_round_at_that_site(tmp_path: Path) -> None:
    """Rank 1 of site `ddp` dies in round 2: the site reports the round failed (the
    server finishes it with `solo`), restarts its group and trains round 3."""
    with Deployment(
        tmp_path,
        "ddp_support:CrashingTask",
        strategy={"min_fit_clients": 1, "min_available_clients": 2},
        **THREE_ROUNDS,
    ) as dep:
        dep.start_server()
        dep.start_site("ddp", nproc=2)
        dep.start_site("solo")
        assert dep.wait_server(240) == 0, dep.log("server")
        generations = worker_generations(dep.log("ddp"))
        codes = dep.close()
    assert codes["ddp"] == 0  # the daemon survived the crash and stopped cleanly
    assert len(generations) == 2 and set(generations[0]).isdisjoint(generations[1])
    assert_all_gone(generations[0] + generations[1])

    metrics = {r["round"]: r for r in dep.metrics()}
    assert sorted(metrics) == [1, 2, 3]
    assert metrics[2]["failed"] == ["ddp"] and metrics[2]["clients"] == 1
    assert metrics[2]["attempts"] == 1  # the round did not need a retry
    for r in (1, 3):
        assert metrics[r]["clients"] == 2 and not metrics[r]["failed"], metrics[r]
    [error] = dep.audit("site_error")
    assert (error["site"], error["round"]) == ("ddp", 2)
    assert "WorkerGroupError" in error["message"]
    assert "rank 1 exited with code 3" in error["message"]
    assert "being restarted" in error["message"]
    assert "round 2 failed at site 'ddp'" in dep.log("ddp")
    assert "round 3: trained on" in dep.log("ddp")


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_daemon_signal_closes_its_group(tmp_path: Path, ending: signal.Signals) -> None:
    """The group starts before the daemon dials out (no server needed) and dies with it;
    SIGINT reaches only the daemon, as a terminal's Ctrl-C would (workers have their
    own process group), so only the daemon can stop them."""
    with Deployment(tmp_path, BREAST_CANCER, secure=False) as dep:
        toml = dep.site_toml("a")
        dep.start_command("a", fedtrain_command("client", "--config", str(toml), "--insecure",
                                                "--nproc", "2"))  # fmt: skip
        workers = wait_for(lambda: worker_generations(dep.log("a")), 180, "the group")[0]
        assert len(alive(workers)) == 2
        code = dep.procs.stop("a", ending)
        assert code == 0, dep.log("a")
        assert_all_gone(workers)
        dep.close()


def test_site_under_torchrun_trains_as_rank_0_with_a_follower(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m fedtrain.cli client`: rank 0 is the daemon, rank
    1 follows; the site uploads its whole dataset's count, and SIGTERM to torchrun
    leaves no rank behind."""
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        rounds=2,
        strategy={"min_fit_clients": 1, "min_available_clients": 1},
        round_timeout_s=120.0,
    ) as dep:
        toml = dep.site_toml("multi")
        launch = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "fedtrain.cli",
            "client", "--config", str(toml), "--insecure",
        ]  # fmt: skip
        dep.start_command("multi", launch)
        dep.start_server()
        assert dep.wait_server(240) == 0, dep.log("server") + dep.log("multi")
        ranks = [p.pid for p in psutil.Process(dep.proc("multi").pid).children(recursive=True)]
        dep.close()
    assert_all_gone(ranks)
    assert len(ranks) >= 2, ranks
    log = dep.log("multi")
    assert "rank 1 of 2 follows rank 0" in log
    assert "joined run" in log
    uploads = dep.audit("upload")
    assert [r["round"] for r in uploads] == [1, 2]
    assert all(r["site"] == "multi" and r["num_examples"] == 200 for r in uploads)


def test_a_site_whose_workers_cannot_start_exits_with_one_clear_line(tmp_path: Path) -> None:
    """Workers build the site's data; when that fails the site never joins."""
    with Deployment(tmp_path, "runtime_support:TinyTask", secure=False) as dep:
        toml = dep.site_toml("a", nproc=2, data={"source": "task"})  # TinyTask has no hook
        dep.start_command("a", fedtrain_command("client", "--config", str(toml), "--insecure"))
        assert dep.proc("a").wait(180) == 2
        dep.close()
    errors = [line for line in dep.log("a").splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, dep.log("a")
    assert errors[0].startswith("error: site 'a' cannot train: the DDP worker group could not")
    assert "rank 0 raised ConfigError: data.source = 'task'" in errors[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_site_trains_on_one_worker_per_gpu(tmp_path: Path) -> None:
    """The NCCL path end to end: a site on (up to two of) this machine's GPUs."""
    gpus = [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    with Deployment(tmp_path, BREAST_CANCER, strategy=BOTH_SITES, **THREE_ROUNDS) as dep:
        dep.start_server()
        dep.start_site("gpu", devices=gpus, data={"partition": 0, "num_partitions": 2})
        dep.start_site("cpu", data={"partition": 1, "num_partitions": 2})
        assert dep.wait_server(240) == 0, dep.log("server") + dep.log("gpu")
        [workers] = worker_generations(dep.log("gpu"))
        assert len(workers) == len(gpus)
        codes = dep.close()
    assert_all_gone(workers)
    assert codes["gpu"] == 0
    metrics = dep.metrics()
    assert all(r["clients"] == 2 and not r["failed"] for r in metrics)
    assert metrics[-1]["accuracy"] > 0.85
