"""Updates on connections of their own once many sites are connected
(`transfers.own_upload_connection_sites`, Instruction.own_upload_connection).

gRPC keeps each server connection's read buffers sized by the largest message it
carried, so a server of thousands of sites asks each for its update on a connection
closed after it. The server decides from the number of sites connected when it
instructs; a real daemon obeys, over TLS too (the connection joins the session first),
and the run ends with the model of updates sent on the control connection.
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import Any

import pytest
from runtime_support import FakeSite, TinyTask, inprocess_server
from test_parallel_streams import _flat_run

from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.task import task_fingerprint


def _three_sites(tmp_path: Any, stop_after: list[Any], threshold: int) -> tuple[Any, list]:
    """A server waiting for 3 sites (`own_upload_connection_sites = threshold`) and the
    3 sites joined, all stopped after the test."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=3, transfers={"own_upload_connection_sites": threshold}
    )
    stop_after.append(server)
    fingerprint = task_fingerprint(task)
    sites = [FakeSite(server.port, f"s{i}", fingerprint) for i in range(3)]
    stop_after.extend(sites)
    return server, sites


@pytest.mark.parametrize(("threshold", "asked"), [(3, True), (2, True), (4, False), (0, False)])
def test_the_server_asks_for_own_connections_from_the_configured_number_of_sites(
    tmp_path, stop_after, threshold, asked
) -> None:
    _, sites = _three_sites(tmp_path, stop_after, threshold)
    for site in sites:
        instruction = site.expect("instruction").instruction
        assert instruction.kind == pb.TRAIN
        assert instruction.own_upload_connection is asked


def _attached(server: Any, peers: list[str]) -> None:
    """Record every connection that joins a session to carry its transfers."""
    add = server.registry.add_connection

    def recording(session: Any, peer: str) -> bool:
        peers.append(peer)
        return add(session, peer)

    server.registry.add_connection = recording


@pytest.mark.integration
def test_a_daemon_sends_each_update_on_a_fresh_connection_and_ends_with_the_same_model(
    tmp_path, stop_after, caplog
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    own = _flat_run(tmp_path / "own", stop_after, 1, transfers={"own_upload_connection_sites": 1})
    assert caplog.text.count("uploading on a connection of its own") == 2  # both rounds
    caplog.clear()
    control = _flat_run(tmp_path / "control", stop_after, 1)
    assert "uploading on a connection of its own" not in caplog.text
    assert own.equal(control)


@pytest.mark.integration
def test_with_tls_each_update_connection_proves_the_session_first(
    pki, tmp_path, stop_after, caplog
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedtrain.runtime.site.daemon")
    peers: list[str] = []
    own = _flat_run(
        tmp_path / "own",
        stop_after,
        1,
        pki,
        inspect=lambda server: _attached(server, peers),
        transfers={"own_upload_connection_sites": 1},
    )
    assert len(peers) == 2 and len(set(peers)) == 2, peers  # one new connection per update
    assert "shares the control connection" not in caplog.text
    assert own.equal(_flat_run(tmp_path / "control", stop_after, 1, pki))


def test_the_file_limit_decides_how_many_training_sites_get_a_connection_of_their_own(
    monkeypatch,
) -> None:
    from fedtrain.config import from_dict
    from fedtrain.runtime.config import ServerConfig
    from fedtrain.runtime.server import sessions

    config = from_dict(
        ServerConfig,
        {"task": "x:Y", "max_transfers": 8, "transfers": {"own_upload_connection_sites": 100}},
    )
    kept = sessions.FILES_RESERVED + 8  # beside 1,000 connected sites' connections
    for limit, room in (
        (1000 + kept + 300, 300),
        (1000 + kept + 299, 299),
        (1000 + kept - 5, 0),
        (resource.RLIM_INFINITY, sys.maxsize),
    ):
        monkeypatch.setattr(sessions.resource, "getrlimit", lambda _, limit=limit: (limit, limit))
        assert sessions.own_upload_room(config, 1000) == room, limit
    assert sessions.own_upload_room(config, 99) == 0  # below the threshold


def test_where_the_room_is_short_the_first_sites_get_their_own_and_the_rest_share(
    tmp_path, stop_after, monkeypatch, caplog
) -> None:
    """3 sites train, the file limit has room for 2 more connections: 2 are asked for
    a connection of their own, 1 sends on its control connection; a site instructed
    again (it reconnected) is asked the same as before."""
    from fedtrain.runtime.server import coordinator

    monkeypatch.setattr(coordinator, "own_upload_room", lambda config, connected: 2)
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.server.coordinator")
    server, sites = _three_sites(tmp_path, stop_after, 1)
    asked = {
        site.name: site.expect("instruction").instruction.own_upload_connection for site in sites
    }
    assert sorted(asked.values()) == [False, True, True], asked
    state = server.coordinator.current
    assert state.own_uploads == {name for name, own in asked.items() if own}
    assert "2 of 3 site(s) send their update on a connection of their own" in caplog.text
    for site in sites:  # as after a rejoin: the same instruction, the same choice
        server.coordinator.rejoined(server.registry.get(site.name))
        again = site.expect("instruction").instruction
        assert again.own_upload_connection is asked[site.name]
