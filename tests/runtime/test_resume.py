"""Restarting a real server: after kill -9 at each point of a round's end, from a damaged
checkpoint, and the way the systemd unit and the container start it.

The crash tests start `fedtrain server` with the unit's own flags, make it stop at a
named point (`fedtrain.runtime.server.faults`: FEDTRAIN_FAULT_POINT), kill it with SIGKILL
there, restart it the same way, and at the end read the run's record: every round
exactly once in metrics.jsonl, and a `round_completed` audit record for each.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from runtime_support import Deployment, wait_for

from fedtrain.cli import build_parser, cmd_server
from fedtrain.runtime.demo import fedtrain_command
from fedtrain.runtime.server import faults
from fedtrain.tensor_file import load_tensor_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
CLIENT = {"epochs": 1, "batch_size": 32, "lr": 0.1}
ROUNDS = {"min_fit_clients": 2, "min_available_clients": 2}
FEDBUFF = {
    "name": "fedbuff",
    "min_fit_clients": 1,
    "min_available_clients": 2,
    "options": {"buffer_size": 2},
}
#: Points where the checkpoint of the round has been handed to the writer: the test
#: kills once it is on disk (the window in which a crash used to lose the round's line).
ON_DISK = {"checkpoint_saved", "checkpoint_submitted", "metrics_logged", "round_recorded"}


# -- the unit and the container ----------------------------------------------------------------
def _unit_command() -> list[str]:
    text = (ROOT / "server" / "fedtrain-server.service").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def _restart_flags() -> tuple[str, ...]:
    """What the unit adds to `fedtrain server --config FILE`: the tests start servers so."""
    argv = _unit_command()
    assert argv[1:4] == ["server", "--config", "/etc/fedtrain/server.toml"]
    return tuple(argv[4:])


def test_the_service_unit_and_the_container_restart_by_the_run_dirs_own_rule() -> None:
    argv = _unit_command()
    assert Path(argv[0]).name == "fedtrain"  # no shell test of a file name: fedtrain decides
    args = build_parser().parse_args(argv[1:])
    assert args.func is cmd_server and args.resume_if_present and args.resume is None
    container = (ROOT / "server" / "Containerfile").read_text()
    # ENTRYPOINT fedtrain + CMD: what `podman run IMAGE` runs (Kubernetes' args replace CMD)
    entry_argv = [
        *json.loads(_instruction(container, "ENTRYPOINT")),
        *json.loads(_instruction(container, "CMD")),
    ]
    assert entry_argv[0] == "fedtrain"
    assert build_parser().parse_args(entry_argv[1:]).resume_if_present
    unit = (ROOT / "server" / "fedtrain-server.service").read_text()
    assert "\nLimitNOFILE=65536\n" in unit  # one socket per site; 1024 is too few


def _instruction(containerfile: str, name: str) -> str:
    (line,) = [x for x in containerfile.splitlines() if x.startswith(f"{name} ")]
    return line.removeprefix(f"{name} ")


# -- crashes around the checkpoint ---------------------------------------------------------------
def _deployment(tmp_path: Path, rounds: int, strategy: dict) -> Deployment:
    """Insecure TinyTask runs: what is tested here is the run directory, not TLS."""
    return Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        rounds=rounds,
        strategy=strategy,
        client=CLIENT,
    )


def _checkpointed(run_dir: Path) -> int:
    try:
        return int(load_tensor_file(run_dir / "checkpoint.ft")["round"])
    except FileNotFoundError:
        return 0


def _crash_at(dep: Deployment, name: str, point: str, server_round: int) -> None:
    """Wait until server `name` stopped at `point` of `server_round`, then SIGKILL it."""
    marker = f"fault point {point}@{server_round} reached"

    def reached() -> bool:
        assert dep.proc(name).poll() is None, f"{name} exited:\n{dep.log(name)[-3000:]}"
        return marker in dep.log(name)

    wait_for(reached, 90, f"{name} to reach {point}@{server_round}")
    if point in ON_DISK:
        wait_for(lambda: _checkpointed(dep.run_dir) == server_round, 30, "the checkpoint")
    dep.procs.stop(name, signal.SIGKILL)


def _to_legacy(run_dir: Path) -> None:
    """Replace checkpoint.ft by the `torch.save` checkpoint.pt older fedtrain wrote."""
    torch.save(load_tensor_file(run_dir / "checkpoint.ft"), run_dir / "checkpoint.pt")
    (run_dir / "checkpoint.ft").unlink()


def _run_with_crashes(
    dep: Deployment, kills: list[tuple[str, int]], *, legacy_after: int | None = None
) -> str:
    """Start the server as the unit does, kill it at each of `kills` and start it again
    the same way, until the run completes; returns the last server's name."""
    flags = _restart_flags()
    for number, (point, server_round) in enumerate(kills):
        name = f"server-{number}"
        dep.start_server(name=name, flags=flags, env={faults.ENV: f"{point}@{server_round}"})
        if number == 0:
            for site in ("a", "b"):
                dep.start_site(site)
        _crash_at(dep, name, point, server_round)
        if number == legacy_after:
            _to_legacy(dep.run_dir)
    last = f"server-{len(kills)}"
    dep.start_server(name=last, flags=flags)
    assert dep.wait_server(120, name=last) == 0, dep.log(last)
    return last


def _assert_every_round_recorded_once(dep: Deployment, rounds: int) -> None:
    assert [r["round"] for r in dep.metrics()] == list(range(1, rounds + 1))
    completed = {r["round"] for r in dep.audit("round_completed")}
    assert completed == set(range(1, rounds + 1))
    assert _checkpointed(dep.run_dir) == rounds and (dep.run_dir / "model.pt").exists()
    # A server killed before the first checkpoint starts the run anew (a new id).
    started, resumed = dep.audit("run_started"), dep.audit("run_resumed")
    assert {r["run_id"] for r in resumed} == {started[-1]["run_id"]}


def test_a_run_killed_between_checkpoint_and_metrics_line_records_every_round_once(
    tmp_path: Path,
) -> None:
    """The issue's drill: killed after round 1's checkpoint reached the disk but before
    its metrics line; then after round 2's line but before its audit record; restarted
    each time as the unit does (the first restart from a legacy checkpoint.pt)."""
    with _deployment(tmp_path, 3, ROUNDS) as dep:
        kills = [("checkpoint_submitted", 1), ("metrics_logged", 2)]
        last = _run_with_crashes(dep, kills, legacy_after=0)
        metrics = (dep.run_dir / "metrics.jsonl").read_bytes()
        # Started again once complete, the unit's command exits at once and touches nothing.
        dep.start_server(name="server-again", flags=_restart_flags())
        assert dep.wait_server(60, name="server-again") == 0
        codes = dep.close()
    assert codes["a"] == codes["b"] == 0
    _assert_every_round_recorded_once(dep, 3)
    assert len(dep.audit("run_started")) == 1  # a fresh start, nothing dropped
    assert "loaded unverified" in dep.log("server-1") and "resuming run" in dep.log("server-1")
    assert "round 1's metrics line was lost in the crash" in dep.log("server-1")
    recovered = [r["round"] for r in dep.audit("round_completed") if r.get("recovered")]
    assert recovered == [1, 2]
    assert "resuming run" in dep.log(last)
    assert "is complete (3 rounds" in dep.log("server-again")
    assert (dep.run_dir / "metrics.jsonl").read_bytes() == metrics
    assert "serving run" not in dep.log("server-again")


def test_a_fedbuff_run_killed_after_a_versions_checkpoint_records_every_version_once(
    tmp_path: Path,
) -> None:
    with _deployment(tmp_path, 3, FEDBUFF) as dep:
        _run_with_crashes(dep, [("checkpoint_submitted", 2)])
        dep.close()
    _assert_every_round_recorded_once(dep, 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", [ROUNDS, FEDBUFF], ids=["rounds", "fedbuff"])
def test_kills_at_every_point_of_a_rounds_end_record_every_round_once(
    tmp_path: Path, strategy: dict
) -> None:
    """One kill at each fault point, one round after the other."""
    rounds = len(faults.POINTS) + 1
    with _deployment(tmp_path, rounds, strategy) as dep:
        kills = [(point, number + 1) for number, point in enumerate(faults.POINTS)]
        _run_with_crashes(dep, kills)
        dep.close()
    _assert_every_round_recorded_once(dep, rounds)


# -- damaged checkpoints --------------------------------------------------------------------------
def test_resume_refuses_a_checkpoint_with_flipped_bytes_and_says_which_tensor(
    tmp_path: Path,
) -> None:
    with _deployment(tmp_path, 1, {"min_fit_clients": 1, "min_available_clients": 1}) as dep:
        dep.start_server()
        dep.start_site("a")
        assert dep.wait_server(60) == 0, dep.log("server")
        dep.close()
    checkpoint = dep.run_dir / "checkpoint.ft"
    good = checkpoint.read_bytes()
    weight = load_tensor_file(checkpoint)["model"]["weight"]  # nn.Linear(8, 2): 64 bytes
    at = good.find(weight.numpy().tobytes())
    assert at > 0
    damages = {
        "tensor 'model/weight' (float32 (2, 8)) fails its checksum": at,
        "its header fails its checksum": 100,
    }
    for expected, offset in damages.items():
        flipped = bytearray(good)
        flipped[offset : offset + 64] = bytes(b ^ 0xFF for b in good[offset : offset + 64])
        checkpoint.write_bytes(bytes(flipped))
        metrics = (dep.run_dir / "metrics.jsonl").read_bytes()
        out = subprocess.run(
            fedtrain_command(
                "server",
                "--config",
                str(dep.server_toml),
                "--resume",
                str(dep.run_dir),
                "--insecure",
            ),
            capture_output=True,
            text=True,
            env=dep.env,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert expected in out.stderr and f"{checkpoint} is damaged" in out.stderr
        assert "Restore an older copy" in out.stderr and "Traceback" not in out.stderr
        assert checkpoint.read_bytes() == bytes(flipped)  # refused, nothing rewritten
        assert (dep.run_dir / "metrics.jsonl").read_bytes() == metrics
