"""The run directory's local status socket: answered from a thread of its own (however
busy the main loop is), owner-only, gone when the server stops, replaced after a kill."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from runtime_support import Deployment, TinyTask, inprocess_server, wait_for

from fedtrain.observability.status import ServerState
from fedtrain.runtime import wire
from fedtrain.runtime.demo import fedtrain_command
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.local_status import SOCKET_NAME, socket_address
from fedtrain.runtime.status import ServerUnreachable, fetch_status, to_proto

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_the_local_socket_answers_while_the_main_loop_is_blocked(tmp_path: Path) -> None:
    server = inprocess_server(tmp_path, TinyTask(), sites=2)
    sock = tmp_path / "run" / SOCKET_NAME
    try:
        mode = sock.lstat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600  # owner-only
        assert server._loop is not None
        server._loop.call_soon_threadsafe(time.sleep, 8.0)  # busy, not hung (< LOOP_STALL_S)
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


def test_a_file_in_the_sockets_place_is_never_removed_and_the_server_still_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "run").mkdir()
    precious = tmp_path / "run" / SOCKET_NAME
    precious.write_text("not a socket")
    server = inprocess_server(tmp_path, TinyTask())
    try:
        assert fetch_status(f"127.0.0.1:{server.port}", None).phase == "waiting"
    finally:
        server.stop()
    assert precious.read_text() == "not a socket"
    assert "no local status socket" in caplog.text and "not a socket" in caplog.text


def test_a_socket_that_cannot_be_bound_leaves_the_server_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run dir on a file system without Unix sockets (some network shares, bind
    mounts): gRPC cannot bind; the server starts without the socket and says why."""
    from fedtrain.runtime.server import local_status

    bind = grpc._server._Server.add_insecure_port

    def cannot_bind(self: grpc.Server, address: str) -> int:
        if address.startswith("unix:"):
            raise RuntimeError(f"Failed to bind to address {address}")
        return bind(self, address)

    monkeypatch.setattr(grpc._server._Server, "add_insecure_port", cannot_bind)
    server = inprocess_server(tmp_path, TinyTask(), status_socket=True)
    server.stop()
    assert not (tmp_path / "run" / local_status.SOCKET_NAME).exists()
    assert "no local status socket" in caplog.text and "could not be opened" in caplog.text


@pytest.mark.timeout(60)
def test_a_second_server_on_the_run_dir_neither_takes_nor_removes_the_first_ones_socket(
    tmp_path: Path,
) -> None:
    """A replacement pod starting (same volume) while the old one still terminates."""
    first = inprocess_server(tmp_path, TinyTask(), sites=2)
    try:
        second = inprocess_server(tmp_path, TinyTask(), sites=2)
        second.stop()  # it found the first one answering: it opened none, removes none
        state = fetch_status(socket_address(tmp_path / "run"), None, timeout_s=5.0)
        assert state.run_id == first.coordinator.run_id
    finally:
        first.stop()
    # the old server is terminating (its socket no longer answers, not yet removed)
    # when the new one starts: the new one takes the path, and the old one's stop
    # leaves the new socket in place
    old = inprocess_server(tmp_path, TinyTask(), sites=2)
    local = old._local_status
    assert local is not None and local._server is not None
    local._server.stop(0).wait(10)
    new = inprocess_server(tmp_path, TinyTask(), sites=2)
    try:
        old.stop()
        state = fetch_status(socket_address(tmp_path / "run"), None, timeout_s=5.0)
        assert state.run_id == new.coordinator.run_id
    finally:
        new.stop()
    assert not (tmp_path / "run" / SOCKET_NAME).exists()


@pytest.mark.timeout(60)
def test_a_hung_main_loop_fails_the_local_status_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Busy is not hung: the socket answers while the loop is busy, and fails (which a
    liveness probe turns into a restart) once the loop has not run for LOOP_STALL_S."""
    from fedtrain.runtime.server import app

    monkeypatch.setattr(app, "LOOP_STALL_S", 2.0)
    server = inprocess_server(tmp_path, TinyTask(), sites=2)
    try:
        assert server._loop is not None
        server._loop.call_soon_threadsafe(time.sleep, 6.0)
        time.sleep(3.5)
        with pytest.raises(ServerUnreachable, match="has not run for"):
            fetch_status(socket_address(tmp_path / "run"), None, timeout_s=5.0)
        time.sleep(3.5)  # the loop runs again
        assert fetch_status(socket_address(tmp_path / "run"), None).phase == "waiting"
    finally:
        server.stop()


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
        # a socket owned by someone other than the run dir's owner is not asked
        os.chown(sock, 12345, 12345, follow_symlinks=False)
        planted = status(dep, "--run-dir", str(dep.run_dir))
        assert planted.returncode == 2 and "not a socket owned by" in planted.stderr
        os.chown(sock, os.getuid(), os.getgid(), follow_symlinks=False)

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


def test_fetch_status_reads_the_call_to_its_end_instead_of_hanging_up_on_the_reply() -> None:
    """A client that hung up on the reply made the server's gRPC log an ERROR with a
    traceback ("ExecuteBatchError ... SendStatusFromServerOperation") for many
    `fedtrain status` calls on a busy server: operators read it as a failure. Here the
    server ends its call a moment after the reply; the client must still be there."""
    ended: list[bool] = []

    def answer(requests, context):  # type: ignore[no-untyped-def]
        next(requests)
        state = ServerState(run_id="r", task="t", phase="waiting", round=0, attempt=0,
                            total_rounds=1, rounds_completed=0, min_sites=1, secagg=False,
                            model_version="", finished=False, sites=())  # fmt: skip
        yield pb.StatusMessage(reply=to_proto(state))
        time.sleep(0.3)
        ended.append(context.is_active())  # False: the client hung up

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.stream_stream_rpc_method_handler(
        answer,
        request_deserializer=pb.StatusRequest.FromString,
        response_serializer=pb.StatusMessage.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(wire.SERVICE, {"Status": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert fetch_status(f"127.0.0.1:{port}", None, timeout_s=5.0).run_id == "r"
        wait_for(lambda: ended, 5.0, "the server's Status handler ends")
        assert ended == [True]
    finally:
        server.stop(0)
