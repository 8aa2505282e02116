"""A site's link fails mid-upload (`link_proxy.LinkProxy` pauses it: no FIN, no RST).

Within `heartbeat.grace_s` the site stays in its round, rejoins its session when the
link is back and resumes its upload from the offset the server holds; past the grace
it is dropped, its upload discarded at once, and the round ends without it.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from typing import Any

import grpc
import pytest
from link_proxy import LinkProxy
from runtime_support import FakeSite, TinyTask, chunk_messages, inprocess_server, wait_for

from fedtrain.config import from_dict
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.site.daemon import Link, SiteDaemon
from fedtrain.runtime.site.outage_watch import OutageWatch
from fedtrain.task import task_fingerprint

#: A model of ~800 KB, sent in 64 KiB chunks: the link fails well inside its upload.
FEATURES = 100_000
CHUNK_BYTES = 64 * 1024


def _audit(server: AggregationServer, event: str) -> list[dict[str, Any]]:
    return [r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == event]


def _site(
    name: str,
    address: str,
    task: TinyTask,
    stop_after: list[Any],
    streams: int = 0,
    pki: Any = None,
) -> SiteDaemon:
    raw: dict[str, Any] = {
        "task": "runtime_support:TinyTask",
        "name": name,
        "server": address,
        "reconnect": {"min_s": 0.1, "max_s": 0.5},
        "transfer_streams": streams,
    }
    if pki is not None:  # its certificate's name is the site's
        raw["tls"] = {"ca": str(pki.ca_cert), "cert": str(pki.site_cert), "key": str(pki.site_key)}
    daemon = SiteDaemon(
        from_dict(SiteConfig, raw), insecure=pki is None, task=task, data=task.datasets()[0]
    )
    threading.Thread(target=daemon.run, daemon=True).start()
    stop_after.append(daemon)
    return daemon


def _server(
    tmp_path, stop_after, sites: int, grace_s: float, timeout_s: float = 2.0, **extra: Any
) -> AggregationServer:
    task = TinyTask(features=FEATURES)
    server = inprocess_server(
        tmp_path,
        task,
        sites,
        rounds=1,
        chunk_bytes=CHUNK_BYTES,
        heartbeat={"interval_s": 0.2, "timeout_s": timeout_s, "grace_s": grace_s},
        **extra,
    )
    stop_after.append(server)
    return server


def _proxy(server: AggregationServer, stop_after: list[Any]) -> LinkProxy:
    """A link between sites and `server` that the test can fail."""
    proxy = LinkProxy(f"127.0.0.1:{server.port}")
    stop_after.append(proxy)
    return proxy


@pytest.mark.parametrize("streams", [1, 4], ids=["one-stream", "parallel-streams"])
def test_a_site_whose_link_fails_mid_upload_rejoins_within_the_grace_and_resumes(
    tmp_path, stop_after, streams
) -> None:
    server = _server(tmp_path, stop_after, sites=1, grace_s=30.0)
    proxy = _proxy(server, stop_after)
    update_bytes = server.coordinator.global_model.state.nbytes
    proxy.pause_after_up(update_bytes // 2)  # join, heartbeats, then half the upload
    _site("far", proxy.address, TinyTask(features=FEATURES), stop_after, streams)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-upload")
    wait_for(lambda: _audit(server, "site_away"), 10, "the server to notice the outage")
    paused = wait_for(lambda: _audit(server, "upload_paused"), 10, "the upload to be kept")
    proxy.resume()  # the link is back
    assert server.wait(60) and server.coordinator.error is None
    record = _round(server, 1)
    assert record["dropped"] == [] and record["clients"] == 1
    assert {r["site"] for r in _audit(server, "rejoin")} == {"far"}
    resumed = _audit(server, "upload_resumed")
    # From where it stopped (a chunk still being journaled when the break was noticed
    # may add to what the server holds); parallel streams each resume their own range
    # (ranges of one chunk here: a range is in whole or sent again from its start).
    assert paused[0]["offset"] > 0
    if streams == 1:
        assert resumed and resumed[0]["offset"] >= paused[0]["offset"]
    # Nothing the server held was sent again (the chunk in flight was never received).
    assert server.coordinator.transfers.total_in == update_bytes
    assert not any("grace" in r["reason"] for r in _audit(server, "leave"))  # never dropped


@pytest.mark.parametrize(
    ("streams", "own_connection"),
    [(1, False), (4, False), (1, True)],
    ids=["one-stream", "parallel-streams", "own-connection"],
)
def test_connections_left_silent_after_an_outage_are_replaced_and_the_upload_resumes(
    tmp_path, stop_after, pki, streams, own_connection
) -> None:
    """After an outage TCP waits out a retransmission timer that doubled during it, so
    the connections that were sending stay silent past its end (the proxy: for good),
    and the server, whose heartbeat timeout is longer than the outage, notices nothing.
    The site dials the server while its upload is stalled: the dials fail while the link
    is down; the first that goes through after it replaces the session's connections,
    and the upload continues from where the server holds it. Over TLS: a dial goes
    through once its handshake is done, which takes the server's answer (the proxy
    accepts a connection itself, as a middlebox may). With `own_connection` the upload
    has a connection of its own (as once many sites are connected), replaced too."""
    own = {"own_upload_connection_sites": 1 if own_connection else 0}
    server = _server(
        tmp_path, stop_after, sites=1, grace_s=30.0, timeout_s=30.0, pki=pki, transfers=own
    )
    proxy = _proxy(server, stop_after)
    update_bytes = server.coordinator.global_model.state.nbytes
    proxy.pause_after_up(update_bytes // 2)
    site = _site("hospital-a", proxy.address, TinyTask(features=FEATURES), stop_after, streams, pki)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-upload")
    time.sleep(4.0)  # the site's dials fail meanwhile: the link is down
    assert site.outages.replaced == 0
    proxy.resume(stall_connections=True)
    assert server.wait(20) and server.coordinator.error is None
    record = _round(server, 1)
    assert record["dropped"] == [] and record["clients"] == 1
    assert site.outages.replaced == 1
    assert {r["site"] for r in _audit(server, "rejoin")} == {"hospital-a"}
    assert not _audit(server, "site_away")  # the server never saw the outage
    resumed = _audit(server, "upload_resumed")
    if streams == 1:
        assert resumed and resumed[0]["offset"] > 0
    # Nothing the server held was sent again.
    assert server.coordinator.transfers.total_in == update_bytes


def test_a_site_away_past_the_grace_is_dropped_and_its_upload_discarded_at_once(
    tmp_path, stop_after
) -> None:
    server = _server(tmp_path, stop_after, sites=2, grace_s=1.0, strategy={"min_fit_clients": 1})
    proxy = _proxy(server, stop_after)
    update_bytes = server.coordinator.global_model.state.nbytes
    proxy.pause_after_up(update_bytes // 2)
    far = _site("far", proxy.address, TinyTask(features=FEATURES), stop_after)
    _site("near", f"127.0.0.1:{server.port}", TinyTask(features=FEATURES), stop_after)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-upload")
    left = wait_for(lambda: _audit(server, "leave"), 20, "the grace to pass")
    assert left[0]["site"] == "far" and "heartbeat.grace_s" in left[0]["reason"]
    discarded = _audit(server, "upload_discarded")
    assert discarded[0]["site"] == "far" and discarded[0]["bytes"] > 0
    assert len(server.servicer.held) == 0
    proxy.resume()  # too late: the site joins anew, and its stale upload is not resumed
    assert server.wait(60) and server.coordinator.error is None
    record = _round(server, 1)
    assert record["dropped"] == ["far"] and record["clients"] == 1
    assert not _audit(server, "upload_resumed") and not _audit(server, "rejoin")
    assert far.rounds_trained == 0


def _round(server: AggregationServer, number: int) -> dict[str, Any]:
    lines = (server.run_dir.path / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r.get("round") == number)


def test_a_masked_upload_resumes_the_same_way_and_every_site_is_unmasked(
    tmp_path, stop_after
) -> None:
    """Secure aggregation: the masked vector's chunks already in the secure sum stay
    there while the site is away; it sends the rest, and all three are included."""
    task = TinyTask(features=20_000)
    server = inprocess_server(
        tmp_path,
        task,
        sites=3,
        rounds=1,
        chunk_bytes=16 * 1024,
        round_timeout_s=120.0,
        secagg={"enabled": True, "clip": 4.0, "bits": 28, "max_clients": 8, "max_weight": 1e3},
        heartbeat={"interval_s": 0.2, "timeout_s": 2.0, "grace_s": 30.0},
    )
    stop_after.append(server)
    proxy = _proxy(server, stop_after)
    masked_bytes = server.coordinator.global_model.state.nbytes + 4  # int32 per value + weight
    proxy.pause_after_up(masked_bytes // 2)  # the secagg stages are a few KB before it
    for name, address in (("a", None), ("b", None), ("far", proxy.address)):
        _site(name, address or f"127.0.0.1:{server.port}", TinyTask(features=20_000), stop_after)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-upload")
    paused = wait_for(lambda: _audit(server, "upload_paused"), 10, "the upload to be kept")
    proxy.resume()
    assert server.wait(90) and server.coordinator.error is None
    unmasked = _audit(server, "secagg_unmasked")[0]
    assert unmasked["included"] == ["a", "b", "far"] and unmasked["dropped"] == []
    assert _audit(server, "upload_resumed")[0]["offset"] >= paused[0]["offset"] > 0
    assert _round(server, 1)["dropped"] == []


def test_a_site_that_rejoins_its_session_is_told_its_round_again_and_not_dropped(
    tmp_path, stop_after
) -> None:
    """The instruction may have gone into the dead connection: a rejoined site that still
    owes its update gets it again, byte for byte (the daemon ignores a repeat). Another
    site cannot take the session over with its token."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, rounds=1, heartbeat={"interval_s": 0.2, "timeout_s": 1.0, "grace_s": 20.0}
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    away = FakeSite(server.port, "alpha", fp)  # sends no heartbeat: silent, then away
    stop_after.append(away)
    first = away.expect("instruction").instruction
    wait_for(lambda: _audit(server, "site_away"), 10, "the silent site to be kept away")
    assert away.inbox.get(timeout=10) is None  # its old stream was ended
    rogue = FakeSite(server.port, "mallory", fp, resume_token=away.token)
    stop_after.append(rogue)
    assert not rogue.welcome.resumed and rogue.token != away.token
    assert _audit(server, "rejoin_refused")[0]["cause"] == "other_session"
    back = FakeSite(server.port, "alpha", fp, resume_token=away.token)
    stop_after.append(back)
    assert back.welcome.resumed and back.token == away.token
    again = back.expect("instruction").instruction
    assert again.SerializeToString() == first.SerializeToString()
    delta = server.coordinator.global_model.state.clone()
    back.upload(
        [back.header(1, model_version=first.model_version), *chunk_messages(delta.chunks(16))]
    )
    assert server.wait(20) and server.coordinator.error is None
    assert _round(server, 1)["dropped"] == [] and _round(server, 1)["clients"] == 1
    assert [r["site"] for r in _audit(server, "rejoin")] == ["alpha"]


def test_a_download_broken_off_continues_from_the_bytes_the_site_holds(
    tmp_path, stop_after
) -> None:
    server = _server(tmp_path, stop_after, sites=1, grace_s=30.0)
    proxy = _proxy(server, stop_after)
    model_bytes = server.coordinator.global_model.state.nbytes
    proxy.pause_after_down(model_bytes // 2)  # welcome, instruction, then half the model
    site = _site("far", proxy.address, TinyTask(features=FEATURES), stop_after)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-download")
    wait_for(lambda: _audit(server, "site_away"), 10, "the server to notice the outage")
    # The old connection is gone (else the rest of the model, already in the sockets'
    # buffers, would simply arrive).
    proxy.resume(drop_connections=True)
    assert server.wait(60) and server.coordinator.error is None
    resumed = _audit(server, "download_resumed")
    assert resumed and 0 < resumed[0]["offset"] < model_bytes
    sizes = [len(c.data) for c in server.coordinator.global_model.state.chunks(CHUNK_BYTES)]
    assert resumed[0]["offset"] in itertools.accumulate(sizes)  # whole chunks only
    assert site.downloads == 1 and _round(server, 1)["dropped"] == []
    # What was sent again is what the dead link swallowed, not the part the site held.
    assert server.coordinator.transfers.total_out < 2 * model_bytes


def test_a_download_from_an_offset_sends_only_the_chunks_after_it(tmp_path, stop_after) -> None:
    task = TinyTask()
    server = inprocess_server(tmp_path, task, rounds=1)
    stop_after.append(server)
    site = FakeSite(server.port, "alpha", task_fingerprint(task))
    stop_after.append(site)
    version = site.expect("instruction").instruction.model_version
    _, everything = site.download(version)
    request = pb.ModelRequest(version=version, session_token=site.token, offset=3 * 16)
    rest = list(site.stub.DownloadModel(request))
    assert rest[0].WhichOneof("kind") == "manifest"
    assert [p.chunk for p in rest[1:]] == everything[3:]
    for offset in (3 * 16 + 4, 10**9):  # inside a chunk; past the model
        bad = pb.ModelRequest(version=version, session_token=site.token, offset=offset)
        with pytest.raises(grpc.RpcError) as info:
            list(site.stub.DownloadModel(bad))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _joined(tmp_path, stop_after) -> tuple[AggregationServer, str, FakeSite]:
    """A one-round server that keeps a site away for 20 s (a heartbeat timeout longer
    than a test), its task's fingerprint, and site alpha joined to it."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, rounds=1, heartbeat={"interval_s": 0.2, "timeout_s": 30.0, "grace_s": 20.0}
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    site = FakeSite(server.port, "alpha", fp)
    stop_after.append(site)
    return server, fp, site


def test_a_rejoin_takes_over_a_stream_the_server_still_thought_alive(tmp_path, stop_after) -> None:
    """The server may not have noticed the outage yet when the site comes back on a new
    connection: the rejoin ends the old stream, and its end does not drop the session."""
    server, fp, old = _joined(tmp_path, stop_after)
    first = old.expect("instruction").instruction
    new = FakeSite(server.port, "alpha", fp, resume_token=old.token)
    stop_after.append(new)
    assert new.welcome.resumed and new.token == old.token
    assert old.inbox.get(timeout=10) is None  # the old stream was ended by the server
    again = new.expect("instruction").instruction
    assert again.SerializeToString() == first.SerializeToString()
    session = server.registry.get("alpha")
    assert session is not None and session.detached_at is None and not session.closed
    delta = server.coordinator.global_model.state.clone()
    new.upload(
        [new.header(1, model_version=first.model_version), *chunk_messages(delta.chunks(16))]
    )
    assert server.wait(20) and server.coordinator.error is None
    assert _round(server, 1)["dropped"] == [] and not _audit(server, "site_away")


def test_a_stream_ended_to_reconnect_is_kept_for_the_grace_though_the_site_just_talked(
    tmp_path, stop_after
) -> None:
    """A site that replaces its connections (OutageWatch) ends its control stream saying
    so (Heartbeat.reconnecting): where that reaches the server (the old connection was
    not stalled after all) the end is an outage, not a leave, and the site rejoins."""
    server, fp, old = _joined(tmp_path, stop_after)
    old.expect("instruction")
    old.outbox.put(pb.SiteMessage(heartbeat=pb.Heartbeat(reconnecting=True)))
    old.outbox.put(None)
    [away] = wait_for(lambda: _audit(server, "site_away"), 10, "the server to keep the session")
    assert away["site"] == "alpha" and "to reconnect" in away["reason"]
    assert not _audit(server, "leave")
    new = FakeSite(server.port, "alpha", fp, resume_token=old.token)
    stop_after.append(new)
    assert new.welcome.resumed and new.token == old.token
    new.expect("instruction")  # its round again
    session = server.registry.get("alpha")
    assert session is not None and not session.reconnecting and not session.closed


def test_a_retry_that_meets_the_channel_the_broken_session_closed_waits_for_the_rejoin() -> None:
    """Measured on the emulated WAN (60 s cut mid-upload): the upload broke (sendmsg
    timed out) before the control stream noticed; the retry then met the channel the
    control stream's end had just closed (grpc's ValueError) and the round failed at the
    site instead of continuing on the rejoined session."""
    daemon = SiteDaemon.__new__(SiteDaemon)
    daemon._stop = threading.Event()
    daemon.outages = OutageWatch(lambda timeout_s: True, lambda since: False)
    link = Link(None, "token", "run", 1, queue.SimpleQueue())  # type: ignore[arg-type]
    link.up.set()
    tries: list[int] = []

    def transfer() -> str:
        tries.append(1)
        if len(tries) == 1:  # the control stream broke meanwhile; the rejoin follows
            link.up.clear()
            threading.Timer(0.3, link.up.set).start()
            raise ValueError("Cannot invoke RPC: Channel closed!")
        return "received"

    assert daemon._through_outages(link, time.time() + 30, "upload", transfer) == "received"
    assert len(tries) == 2


def test_a_stream_breaking_after_a_keepalive_period_of_silence_is_an_outage_at_any_pace(
    tmp_path, stop_after
) -> None:
    """At 10,000 sites a site beats every 200 s, but the server's keepalive notices a cut
    link after `keepalive_s` (60 s): a break after that much silence is an outage (kept
    for the grace), not a site that exited (dropped at once), whatever the pace."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=3, heartbeat={"interval_s": 5.0, "timeout_s": 3000.0, "grace_s": 60.0}
    )
    stop_after.append(server)
    fp = task_fingerprint(task)
    for name, quiet_s in (("cut", 70.0), ("killed", 1.0)):
        proxy = _proxy(server, stop_after)
        site = FakeSite(proxy.port, name, fp)
        stop_after.append(site)
        session = server.registry.get(name)
        session.heartbeat_interval_s = 200.0  # as paced at 10,000 sites
        session.last_seen = time.monotonic() - quiet_s
        proxy.resume(drop_connections=True)  # the server's end of the connection closes
    wait_for(lambda: server.registry.get("killed") is None, 10, "the killed site's leave")
    session = server.registry.get("cut")
    assert session is not None and session.detached_at is not None and not session.closed
    assert [r["site"] for r in _audit(server, "site_away")] == ["cut"]


def test_a_daemon_stopped_on_purpose_after_a_silence_leaves_at_once(tmp_path, stop_after) -> None:
    """A stream that ends after a silence is an outage to the server, so a daemon that
    stops says it is leaving: it is dropped at once, not kept for the grace."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=3, heartbeat={"interval_s": 5.0, "timeout_s": 3000.0, "grace_s": 60.0}
    )
    stop_after.append(server)
    daemon = _site("quiet", f"127.0.0.1:{server.port}", task, stop_after)
    wait_for(lambda: server.registry.get("quiet"), 30, "the daemon's join")
    server.registry.get("quiet").last_seen = time.monotonic() - 70.0
    daemon.stop()
    wait_for(lambda: server.registry.get("quiet") is None, 10, "the daemon's leave")
    assert not _audit(server, "site_away")


def test_an_upload_cut_idle_during_a_short_outage_resumes_and_nobody_is_dropped(
    tmp_path, stop_after
) -> None:
    """The link of far fails mid-upload for 6 s (shorter than its heartbeat timeout) on
    the only slot while near waits for it: the idle cut (3 x stall_s) hands the slot to
    near, and far, back on its link, reads the cut's UNAVAILABLE, resumes from the offset
    the server holds and completes: the round has both."""
    server = _server(
        tmp_path,
        stop_after,
        sites=2,
        grace_s=30.0,
        timeout_s=15.0,
        max_transfers=1,
        transfers={"stall_s": 1.0},
    )
    proxy = _proxy(server, stop_after)
    update_bytes = server.coordinator.global_model.state.nbytes
    proxy.pause_after_up(update_bytes // 2)
    _site("far", proxy.address, TinyTask(features=FEATURES), stop_after)
    _site("near", f"127.0.0.1:{server.port}", TinyTask(features=FEATURES, delay_s=1.0), stop_after)
    wait_for(lambda: proxy.paused, 60, "the link to fail mid-upload")
    [cut] = wait_for(lambda: _audit(server, "transfer_cut"), 60, "the idle upload to be cut")
    assert (cut["site"], cut["direction"], cut["waiting"]) == ("far", "up", 1)
    time.sleep(max(0.0, 6.0 - cut["idle_s"]))
    proxy.resume()
    assert server.wait(60) and server.coordinator.error is None
    record = _round(server, 1)
    assert record["dropped"] == [] and record["clients"] == 2
    assert _audit(server, "upload_resumed")[0]["offset"] == cut["bytes"] > 0
    assert not _audit(server, "site_away")  # the outage was shorter than the heartbeat's
    # Each left at the run's end: told by the server, or (a daemon quick to hang up on
    # the server's goodbye) closing its stream first.
    ends = {"run complete", "control stream ended by the site"}
    assert {r["reason"] for r in _audit(server, "leave")} <= ends
