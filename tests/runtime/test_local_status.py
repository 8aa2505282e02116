"""The run directory's local status socket: answered from a thread of its own (however
busy the main loop is), owner-only, gone when the server stops, replaced after a kill."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from runtime_support import Deployment, TinyTask, inprocess_server, wait_for

from fedtrain.errors import ConfigError
from fedtrain.runtime.demo import fedtrain_command
from fedtrain.runtime.server.local_status import SOCKET_NAME, socket_address
from fedtrain.runtime.status import ServerUnreachable, fetch_status

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_the_local_socket_answers_while_the_main_loop_is_blocked(tmp_path: Path) -> None:
    server = inprocess_server(tmp_path, TinyTask(), sites=2)
    sock = tmp_path / "run" / SOCKET_NAME
    try:
        mode = sock.lstat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600  # owner-only
        assert server._loop is not None
        server._loop.call_soon_threadsafe(time.sleep, 8.0)  # the main loop does nothing else
        time.sleep(0.2)
        with pytest.raises(ServerUnreachable):  # the sites' port waits on that loop
            fetch_status(f"127.0.0.1:{server.port}", None, timeout_s=1.5)
        start = time.monotonic()
        state = fetch_status(socket_address(tmp_path / "run"), None, timeout_s=5.0)
        assert time.monotonic() - start < 3.0  # answered long before the loop is free
        assert (state.phase, state.total_rounds, state.min_sites) == ("waiting", 3, 2)
        assert state.run_id == server.coordinator.run_id
    finally:
        server.stop()
    assert not sock.exists()


def test_a_file_in_the_sockets_place_is_never_removed(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    precious = tmp_path / "run" / SOCKET_NAME
    precious.write_text("not a socket")
    with pytest.raises(ConfigError, match="is not a socket"):
        inprocess_server(tmp_path, TinyTask())
    assert precious.read_text() == "not a socket"


def test_status_socket_false_opens_none(tmp_path: Path) -> None:
    server = inprocess_server(tmp_path, TinyTask(), status_socket=False)
    try:
        assert not (tmp_path / "run" / SOCKET_NAME).exists()
    finally:
        server.stop()


def status(dep: Deployment, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        fedtrain_command("status", *args),
        capture_output=True,
        text=True,
        timeout=60,
        env=dep.env,
    )


@pytest.mark.timeout(180)
def test_fedtrain_status_run_dir_on_the_servers_host_survives_a_kill(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["a", "b"],
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        rounds=2,
    ) as dep:
        dep.start_server()
        sock = dep.run_dir / SOCKET_NAME
        wait_for(sock.exists, 60, "the server's status socket")
        answer = status(dep, "--run-dir", str(dep.run_dir), "--json")
        assert answer.returncode == 0, answer.stderr
        state = json.loads(answer.stdout)
        assert state["phase"] == "waiting" and state["total_rounds"] == 2

        # TLS flags make no sense for the local socket: said, not ignored.
        mixed = status(dep, "--run-dir", str(dep.run_dir), "--insecure")
        assert mixed.returncode == 2 and "--run-dir" in mixed.stderr

        os.kill(dep.proc("server").pid, signal.SIGKILL)  # leaves the socket file behind
        dep.wait_server(30)
        assert sock.exists()
        gone = status(dep, "--run-dir", str(dep.run_dir))
        assert gone.returncode != 0 and "local status socket" in gone.stderr

        dep.start_server(name="server-again", flags=("--resume-if-present",))
        wait_for(
            lambda: status(dep, "--run-dir", str(dep.run_dir)).returncode == 0,
            60,
            "the restarted server to answer on the socket the killed one left",
        )
