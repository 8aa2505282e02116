"""The status port (`status_address`): Status on a TCP address of its own, answered from
its own thread with exactly the sites' port's security, for operators and probes on
other hosts; nothing but Status there; off by default; a bad one stops the server."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from cryptography.hazmat.primitives import serialization
from runtime_support import Deployment, Pki, TinyTask, inprocess_server, join_message, wait_for

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.runtime import rpc, tls
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.demo import fedtrain_command, free_port
from fedtrain.runtime.peer_auth import ClientIdentity, client_identity
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.status import ServerUnreachable, fetch_status

pytestmark = pytest.mark.integration


def operator(pki: Pki, tmp_path: Path) -> ClientIdentity:
    """A certificate the federation CA issued to someone not on allowed_sites."""
    cert, key = tls.issue_site(pki.ca_dir, tmp_path / "operator", "operator")
    return client_identity(cert, key, pki.ca_cert)


def serving(
    tmp_path: Path, stop_after: list[Any], pki: Pki | None, **extra: Any
) -> tuple[AggregationServer, str]:
    """A started server with a status port (stopped after the test), and its address."""
    server = inprocess_server(tmp_path, TinyTask(), pki=pki, status_address="127.0.0.1:0", **extra)
    stop_after.append(server)
    assert server.status_port and server.status_port != server.port  # a port of its own
    return server, f"127.0.0.1:{server.status_port}"


def site_rpc_codes(channel: grpc.Channel) -> list[grpc.StatusCode]:
    """What a site's Join, model download and update upload get on `channel`."""
    join = join_message("hospital-a", "f").SerializeToString()
    request, chunk = pb.ModelRequest(version="v").SerializeToString(), b""
    calls = [
        lambda: list(channel.stream_stream(rpc.method_path("Control"))(iter([join]), timeout=10)),
        lambda: list(channel.unary_stream(rpc.method_path("DownloadModel"))(request, timeout=10)),
        lambda: channel.stream_unary(rpc.method_path("UploadUpdate"))(iter([chunk]), timeout=10),
    ]
    codes = []
    for call in calls:
        try:
            call()
        except grpc.RpcError as exc:
            codes.append(exc.code())
        else:
            codes.append(grpc.StatusCode.OK)
    return codes


def test_an_operator_is_answered_on_the_status_port_and_a_site_cannot_join_there(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    server, address = serving(tmp_path, stop_after, pki)
    state = fetch_status(address, operator(pki, tmp_path), timeout_s=10)
    assert (state.run_id, state.phase) == (server.coordinator.run_id, "waiting")
    with pytest.raises(ServerUnreachable):  # plaintext on a TLS port: no answer
        fetch_status(address, None, timeout_s=5)
    # A site of the federation, on the allow-list, with its valid certificate: the
    # status port has no Join, no download and no upload for it.
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    with grpc.secure_channel(address, site.credentials) as channel:
        assert site_rpc_codes(channel) == [grpc.StatusCode.UNIMPLEMENTED] * 3
    assert len(server.registry) == 0


def test_the_status_port_refuses_and_audits_another_cas_certificate_and_a_missing_proof(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    server, address = serving(tmp_path, stop_after, pki)
    tls.init_ca(tmp_path / "rogue-ca")  # the federation CA's name, another key
    cert, key = tls.issue_site(tmp_path / "rogue-ca", tmp_path / "rogue", "operator")
    foreign = ClientIdentity(  # a rogue client, without the start-up check of its files
        grpc.ssl_channel_credentials(pki.ca_cert.read_bytes()),  # it trusts the real server
        cert.read_bytes(),
        serialization.load_pem_private_key(key.read_bytes(), password=None),
    )
    with pytest.raises(ServerUnreachable, match="refused to answer") as info:
        fetch_status(address, foreign, timeout_s=10)
    assert "not signed by the federation CA" in str(info.value)

    anonymous = grpc.ssl_channel_credentials(pki.ca_cert.read_bytes())
    with grpc.secure_channel(address, anonymous) as channel:
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        call = channel.stream_stream(
            rpc.method_path("Status"), response_deserializer=pb.StatusMessage.FromString
        )(iter(requests.get, None), timeout=10)
        assert next(call).WhichOneof("kind") == "challenge"
        requests.put(pb.StatusRequest().SerializeToString())  # no proof
        with pytest.raises(grpc.RpcError) as denied:
            next(call)
        requests.put(None)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "no site certificate was presented" in (denied.value.details() or "")

    audit = server.run_dir.path / "audit.jsonl"
    refused = wait_for(
        lambda: (r := read_audit(audit, "status_refused")) and len(r) == 2 and r, 10, "audit"
    )
    assert [r["cause"] for r in refused] == ["foreign_ca", "no_certificate"]
    assert all(r["peer"].startswith("ipv4:127.0.0.1:") for r in refused)
    assert refused[0]["subject"] == "CN=operator" and refused[0]["cert_sha256"]


def test_the_status_port_demands_a_certificate_in_the_handshake_when_the_sites_port_does(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    server, address = serving(tmp_path, stop_after, pki, tls={"verify_sites_in_handshake": True})
    who = operator(pki, tmp_path)
    assert fetch_status(address, who, timeout_s=10).run_id == server.coordinator.run_id
    anonymous = ClientIdentity(
        grpc.ssl_channel_credentials(pki.ca_cert.read_bytes()), who.certificate, who.key
    )
    with pytest.raises(ServerUnreachable, match="UNAVAILABLE"):  # refused by BoringSSL
        fetch_status(address, anonymous, timeout_s=10)


@pytest.mark.timeout(120)
def test_the_status_port_answers_while_the_main_loop_is_busy_and_fails_once_it_hangs(
    pki: Pki, tmp_path: Path, stop_after: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedtrain.runtime.server import app

    monkeypatch.setattr(app, "LOOP_STALL_S", 4.0)
    server, address = serving(tmp_path, stop_after, pki)
    who = operator(pki, tmp_path)
    assert server._loop is not None
    blocked = threading.Event()
    server._loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(9.0)))
    assert blocked.wait(10)
    with pytest.raises(ServerUnreachable):  # the sites' port waits on that loop
        fetch_status(f"127.0.0.1:{server.port}", who, timeout_s=1.0)
    start = time.monotonic()
    state = fetch_status(address, who, timeout_s=5.0)
    assert time.monotonic() - start < 2.0  # answered long before the loop is free
    assert state.run_id == server.coordinator.run_id
    time.sleep(4.0)  # busy past LOOP_STALL_S: hung, which a liveness probe restarts
    with pytest.raises(ServerUnreachable, match="has not run for"):
        fetch_status(address, who, timeout_s=5.0)
    wait_for(lambda: answers(address, who), 20, "the loop to run again")


def answers(address: str, who: ClientIdentity) -> bool:
    try:
        return fetch_status(address, who, timeout_s=5.0).phase == "waiting"
    except ServerUnreachable:
        return False


def test_with_insecure_the_status_port_is_plaintext_and_still_serves_only_status(
    tmp_path: Path, stop_after: list[Any]
) -> None:
    server, address = serving(tmp_path, stop_after, pki=None)
    assert fetch_status(address, None, timeout_s=10).run_id == server.coordinator.run_id
    with grpc.insecure_channel(address) as channel:
        assert site_rpc_codes(channel) == [grpc.StatusCode.UNIMPLEMENTED] * 3
    assert len(server.registry) == 0


def listening_ports() -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_there_is_no_status_port_by_default(tmp_path: Path, stop_after: list[Any]) -> None:
    assert from_dict(ServerConfig, {"task": "t"}).status_address == ""
    before = listening_ports()
    server = inprocess_server(tmp_path, TinyTask())
    stop_after.append(server)
    assert server.status_port is None
    assert listening_ports() - before == {server.port}


#: What each mistake's message says: what is wrong, and what to do.
SAYS = {
    "not host:port": r"is not host:port \(e\.g\. '0\.0\.0\.0:50052'.*leave it empty",
    "sites' port": r"is the sites' port \(address = .*give the status port a port of its own",
}


@pytest.mark.parametrize(
    ("status", "address", "mistake"),
    [
        ("50052", "127.0.0.1:50051", "not host:port"),
        ("0.0.0.0:65536", "127.0.0.1:50051", "not host:port"),
        ("unix:/tmp/status.sock", "127.0.0.1:50051", "not host:port"),
        (":50052", "127.0.0.1:50051", "not host:port"),
        ("127.0.0.1:50051", "127.0.0.1:50051", "sites' port"),
        ("127.0.0.1:50051", "0.0.0.0:50051", "sites' port"),
        ("[::]:50051", "10.0.0.7:50051", "sites' port"),
    ],
)
def test_a_status_address_that_cannot_be_is_refused_naming_the_key(
    status: str, address: str, mistake: str
) -> None:
    with pytest.raises(ConfigError, match=SAYS[mistake]) as info:
        from_dict(ServerConfig, {"task": "t", "address": address, "status_address": status})
    assert str(info.value).startswith(f"status_address = {status!r}")


def test_a_status_port_beside_the_sites_port_is_fine() -> None:
    config = {"task": "t", "address": "0.0.0.0:50051", "status_address": "0.0.0.0:50052"}
    assert from_dict(ServerConfig, config).status_address == "0.0.0.0:50052"


def test_a_status_port_in_use_stops_the_server_from_starting(tmp_path: Path) -> None:
    """Unlike the socket: an operator who asked for a status port expects it."""
    main, before = free_port(), set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError, match="is the port free") as info:
            inprocess_server(tmp_path, TinyTask(), address=f"127.0.0.1:{main}", status_address=busy)
    assert f"status_address = {busy!r}" in str(info.value)
    assert "Set status_address in server.toml to a free host:port" in str(info.value)
    # nothing of the server is left: its sites' port is closed, its threads ended
    assert main not in listening_ports()
    left = set(threading.enumerate()) - before
    assert not [t.name for t in left if t.is_alive() and t.name.startswith("fedtrain-")]


def test_a_second_server_on_a_running_servers_port_refuses_to_start(
    tmp_path: Path, stop_after: list[Any]
) -> None:
    """gRPC's default SO_REUSEPORT let a second server bind the same address; the kernel
    then handed each new site connection to either process (sites split between runs)."""
    first = inprocess_server(tmp_path / "first", TinyTask())
    stop_after.append(first)
    address = f"127.0.0.1:{first.port}"
    with pytest.raises(ConfigError, match="is the port free") as info:
        inprocess_server(tmp_path / "second", TinyTask(), address=address)
    assert f"address = {address!r}" in str(info.value)
    assert fetch_status(address, None, timeout_s=10).phase  # the first one still serves


@pytest.mark.timeout(180)
def test_fedtrain_status_server_asks_a_server_process_on_its_status_port(tmp_path: Path) -> None:
    port = free_port()
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["a"],
        status_address=f"127.0.0.1:{port}",
        rounds=1,
    ) as dep:
        dep.start_server()
        wait_for(lambda: "answering Status on" in dep.log("server"), 60, "the status port")
        cert, key = tls.issue_site(dep.ca_dir, tmp_path / "operator", "operator", days=1)
        answer = subprocess.run(
            fedtrain_command(
                "status", "--server", f"127.0.0.1:{port}", "--json",
                "--ca", str(dep.ca_dir / tls.CA_CERT), "--cert", str(cert), "--key", str(key),
            ),
            capture_output=True, text=True, timeout=60, env=dep.env,
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout)["phase"] == "waiting"
