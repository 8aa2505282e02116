"""Many sites on one server: memory and file descriptors bound them, not threads.

Sites are impersonated through the real protocol by the benchmark's swarm
(`benchmarks/swarm.py`: asyncio, one channel per site, each uploading a known delta),
so the aggregate is checked as well as the server's threads and admissions.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from runtime_support import FakeSite, TinyTask, inprocess_server, join_message, wait_for

from fedtrain.config import from_dict
from fedtrain.runtime import wire
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.demo import dump_toml, free_port
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.proto import fedtrain_pb2_grpc as pb_grpc
from fedtrain.runtime.server import servicer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.server.sessions import AtCapacity, Session, SessionRegistry
from fedtrain.runtime.site.daemon import Backoff, SiteDaemon
from fedtrain.runtime.status import SitePage, fetch_status
from fedtrain.task import task_fingerprint

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.swarm import TASK, SiteStats, SwarmSite, run_swarm  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_three_hundred_sites_train_while_the_server_keeps_a_handful_of_threads(
    tmp_path: Path,
) -> None:
    run = run_swarm(
        300,
        rounds=2,
        fraction_fit=1.0,
        params=1000,
        processes=2,
        idle_s=1.0,
        timeout_s=240,
        server_options={},
        workdir=tmp_path,
    )
    assert (run.joined, run.refused_joins, run.note) == (300, 0, "")
    assert run.rounds_done == 2 and run.dropped == 0 and run.upload_errors == 0
    assert run.chosen_per_round == 300
    # The model is the weighted mean of the sites' known deltas, round after round.
    assert run.aggregate_max_error is not None and run.aggregate_max_error < 1e-6
    assert run.threads_peak <= 64, run.threads_peak
    assert run.status_calls > 0
    # The run's end is one line in the log, not one per site (each is audited).
    log = (tmp_path / "server.log").read_text()
    assert "told 300 connected site(s) that the run is complete" in log
    assert "left: run complete" not in log


class _Swarm:
    """Sites on an asyncio loop in a thread of this process (stopped by `close`)."""

    def __init__(self, address: str, fingerprint: str, count: int) -> None:
        self.stats = SiteStats()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        cache: dict[int, list[Any]] = {}
        self._sites = [SwarmSite(i, address, self.stats, cache) for i in range(count)]
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._run(fingerprint),)
        )
        self._thread.start()

    async def _run(self, fingerprint: str) -> None:
        tasks = [asyncio.create_task(s.run(fingerprint, self._stop)) for s in self._sites]
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()


def _limit_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.mark.timeout(180)
def test_a_server_short_of_file_descriptors_refuses_joins_with_a_retry_hint(
    tmp_path: Path,
) -> None:
    """A file limit of 200 and 8 transfers leave room for 128 sites (64 descriptors kept
    for files): the 129th site is refused, audited, and told when to try again, while
    the 128 stay connected; nothing runs out."""
    address = f"127.0.0.1:{free_port()}"
    config = {
        "task": TASK,
        "task_options": {"num_params": 100},
        "address": address,
        "run_dir": str(tmp_path / "run"),
        "max_transfers": 8,
        "strategy": {"min_available_clients": 1000},  # no round starts: only admissions
    }
    (tmp_path / "server.toml").write_text(dump_toml(config))
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "fedtrain.cli", "server", "--insecure", "--config",
         str(tmp_path / "server.toml")],
        stdout=log, stderr=log, preexec_fn=lambda: _limit_files(200),
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    swarm = None
    try:
        wait_for(lambda: b"up to 128 sites" in (tmp_path / "server.log").read_bytes(), 60, "start")
        from fedtrain.task import load_task

        fingerprint = task_fingerprint(load_task(TASK, {"num_params": 100}))
        swarm = _Swarm(address, fingerprint, 140)
        wait_for(lambda: swarm.stats.joined == 128 and swarm.stats.refused >= 12, 90, "joins")
        time.sleep(2.0)  # refused sites wait out the hint: no second wave of refusals yet
        assert swarm.stats.refused == 12, swarm.stats.refused
        state = fetch_status(address, None, page=SitePage(limit=5))
        assert state.connected == 128 and len(state.sites) == 5
    finally:
        if swarm is not None:
            swarm.close()
        server.terminate()
        server.wait(30)
        log.close()
    refused = [
        r for r in read_audit(tmp_path / "run" / "audit.jsonl") if r["event"] == "join_refused"
    ]
    # All from one address and cause: one record, then one count for the rest (throttled).
    assert sum(r.get("count", 1) for r in refused) == 12
    assert all(r["cause"] == "capacity" for r in refused)
    assert "at capacity (128 sites connected)" in refused[0]["reason"]
    assert b"File descriptor limit" not in (tmp_path / "server.log").read_bytes()


def test_a_site_refused_for_capacity_waits_out_the_servers_hint(tmp_path: Path) -> None:
    """Without the hint a refused daemon reconnects within its backoff (0.1-0.5 s here)
    and hammers a full server; with it, it waits ~30 s."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=2, max_sites=1)
    first = FakeSite(server.port, "first", task_fingerprint(task))
    raw = {
        "task": "runtime_support:TinyTask",
        "name": "second",
        "server": f"127.0.0.1:{server.port}",
        "reconnect": {"min_s": 0.1, "max_s": 0.5},
    }
    daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True, task=task)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        audit = server.run_dir.path / "audit.jsonl"

        def refusals() -> list[dict[str, Any]]:
            return [r for r in read_audit(audit) if r["event"] == "join_refused"]

        wait_for(refusals, 30, "the second site's refusal")
        time.sleep(3.0)
        assert len(refusals()) == 1
        assert "at capacity" in refusals()[0]["reason"]
    finally:
        daemon.stop()
        thread.join(10)
        first.close()
        server.stop()


def test_backoff_honours_a_retry_hint_with_jitter() -> None:
    backoff = Backoff(0.1, 0.5)
    delays = [backoff.next(30.0) for _ in range(200)]
    assert min(delays) >= 30.0 and max(delays) <= 45.0
    assert len(set(delays)) > 150  # jittered: refused sites do not return in lockstep
    assert backoff.next() <= 0.5  # no hint: the usual backoff


@pytest.mark.timeout(60)
def test_one_connection_holds_at_most_sixteen_calls_and_the_next_waits_its_turn(
    tmp_path: Path,
) -> None:
    """A peer that opens calls on one connection and says nothing holds at most
    STREAMS_PER_CONNECTION server handlers; its next call waits in its own client, not
    in the server, and runs once one closes. Other connections are not affected."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=2)
    address = f"127.0.0.1:{server.port}"
    fingerprint = task_fingerprint(task)
    silent = threading.Event()

    def nothing() -> Iterator[pb.SiteMessage]:
        silent.wait()
        return
        yield

    hog = grpc.insecure_channel(address, options=wire.channel_options(1 << 20))
    fresh = grpc.insecure_channel(address, options=wire.channel_options(1 << 20))
    try:
        stub = pb_grpc.FedtrainStub(hog)
        held = [stub.Control(nothing()) for _ in range(wire.STREAMS_PER_CONNECTION)]
        late = stub.Control(iter([join_message("late", fingerprint)]), timeout=2.0)
        with pytest.raises(grpc.RpcError) as waited:
            next(late)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        queued = stub.Control(iter([join_message("queued", fingerprint)]))
        # Another connection joins at once.
        other = pb_grpc.FedtrainStub(fresh).Control(iter([join_message("other", fingerprint)]))
        assert next(other).WhichOneof("kind") == "welcome"
        other.cancel()
        # The held calls end: the queued call reaches the server and is answered.
        silent.set()
        for call in held:
            call.cancel()
        assert next(queued).WhichOneof("kind") == "welcome"
        queued.cancel()
    finally:
        silent.set()
        hog.close()
        fresh.close()
        server.stop()


@pytest.mark.slow  # long scenario (20-33 s): run with -m slow
@pytest.mark.timeout(180)
def test_calls_that_queue_long_for_a_busy_server_are_all_served_not_cancelled(
    tmp_path: Path,
) -> None:
    """gRPC cancels, without telling the server, calls its loop has not taken: at
    random once 1,000 wait, all beyond 3,000, and any that waited 30 s (a round that
    chose 3,000 sites lost a quarter of its uploads so). The server's loop is blocked
    for 31 s while 1,200 sites join: every one is answered once it is free."""
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=2)
    assert server._loop is not None
    server._loop.call_soon_threadsafe(time.sleep, 31.0)  # the loop does nothing else
    fingerprint = task_fingerprint(task)

    async def join_all(connections: int, per_connection: int) -> list[str]:
        channels = [
            grpc.aio.insecure_channel(
                f"127.0.0.1:{server.port}", options=wire.channel_options(1 << 20)
            )
            for _ in range(connections)
        ]

        async def join(channel: grpc.aio.Channel, name: str) -> str:
            call = pb_grpc.FedtrainStub(channel).Control(timeout=120)
            await call.write(join_message(name, fingerprint))
            try:
                first = await call.read()
                return first.WhichOneof("kind")
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            finally:
                call.cancel()

        try:
            return await asyncio.gather(
                *(
                    join(channel, f"queued-{c}-{i}")
                    for c, channel in enumerate(channels)
                    for i in range(per_connection)
                )
            )
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))

    try:
        answers = asyncio.run(join_all(80, 15))
    finally:
        server.stop()
    assert len(answers) == 1200
    assert {a: answers.count(a) for a in set(answers)} == {"welcome": 1200}


def test_sites_joining_at_once_never_overfill_the_server() -> None:
    """The capacity check and the registration are one step: 64 sites admitted at the
    same moment into room for 10 leave exactly 10 registered (the check used to run
    before registering, and joins racing on the CPU pool went past max_sites)."""
    registry = SessionRegistry()
    start = threading.Barrier(64)
    refused: list[str] = []

    def join(i: int) -> None:
        session = Session(f"site-{i}", f"ipv4:127.0.0.1:{10000 + i}")
        start.wait()
        try:
            registry.add(session, capacity=10)
        except AtCapacity:
            refused.append(session.site)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(registry) == 10 and len(refused) == 54
    # A registered site reconnecting replaces its session even at capacity; a new one
    # is still refused.
    registered = next(f"site-{i}" for i in range(64) if f"site-{i}" not in refused)
    assert registry.add(Session(registered, "ipv4:127.0.0.1:9"), capacity=10) is not None
    with pytest.raises(AtCapacity):
        registry.add(Session(refused[0], "ipv4:127.0.0.1:8"), capacity=10)


def test_status_pages_list_sites_by_name_as_they_join_reconnect_and_leave() -> None:
    """A page of the registry's sessions, in name order, without sorting every name per
    Status call: joins in any order, a reconnect (its name once, its new session), a
    departure, and a replaced session's late removal (which leaves its successor)."""
    registry = SessionRegistry()
    joined = {f"site-{i:02d}": Session(f"site-{i:02d}", f"p{i}") for i in (7, 3, 11, 0, 5)}
    for session in joined.values():
        registry.add(session)
    listed, total = registry.listed(0, 3)
    assert [s.site for s in listed] == ["site-00", "site-03", "site-05"] and total == 5
    again = Session("site-03", "p99")
    old = registry.add(again)  # reconnected before its old stream was noticed dead
    assert old is joined["site-03"]
    registry.remove(old, "replaced")  # the old session ends: the new one stays listed
    registry.remove(joined["site-07"], "left")
    listed, total = registry.listed(1, None)
    assert [s.site for s in listed] == ["site-03", "site-05", "site-11"] and total == 4
    assert listed[0] is again
    assert registry.listed(10, 5) == ([], 4)


def test_sites_that_joined_a_smaller_federation_are_told_a_longer_heartbeat_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interval grows with the number of sites, but a site keeps the one it was told
    at join: the first thousand kept 5 s and 10,000 sites sent 660 heartbeats a second
    instead of 200. As the federation grows the server tells the early ones again."""
    monkeypatch.setattr(servicer, "HEARTBEATS_PER_S", 1.0)  # 4 sites: 4 s apart
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=5)  # no round: 4 never reach 5
    fp = task_fingerprint(task)
    sites = []
    try:
        for name in ("a", "b", "c", "d"):  # each registered once its Welcome is read
            sites.append(FakeSite(server.port, name, fp))
        for site in sites[:3]:  # joined with 1, 2 and 3 connected: intervals 1, 2, 3 s
            told = [0.0]  # paced again each time the federation grew by a quarter
            while told[-1] < 4.0:
                told.append(site.expect("pace", timeout=10).pace.heartbeat_interval_s)
            assert told[-1] == 4.0 and told == sorted(told), (site.name, told)
        assert sites[3].inbox.empty()  # d joined with 4 connected: 4 s already
        for session in server.registry.sessions():
            assert session.heartbeat_interval_s == 4.0
            assert session.timeout_s == pytest.approx(10.0 * 4.0 / 0.2)  # scaled with it
    finally:
        for site in sites:
            site.close()
        server.stop()


def test_a_daemon_told_a_longer_interval_sends_its_heartbeats_that_far_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servicer, "HEARTBEATS_PER_S", 1.0)
    task = TinyTask()
    server = inprocess_server(tmp_path, task, sites=9)  # no round starts
    raw = {
        "task": "runtime_support:TinyTask",
        "name": "daemon",
        "server": f"127.0.0.1:{server.port}",
    }
    daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True, task=task)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    others = []
    try:
        wait_for(lambda: server.registry.get("daemon"), 30, "the daemon's join")
        session = server.registry.get("daemon")
        assert session.heartbeat_interval_s == 1.0  # alone: one heartbeat a second
        fp = task_fingerprint(task)
        others = [FakeSite(server.port, f"other-{i}", fp) for i in range(5)]  # 6: 6 s apart
        wait_for(lambda: session.heartbeat_interval_s == 6.0, 10, "the daemon's re-pacing")
        time.sleep(1.5)  # a heartbeat sent under the old interval may still arrive
        seen = {session.last_seen}
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            seen.add(session.last_seen)
            time.sleep(0.05)
        assert len(seen) <= 2, f"{len(seen) - 1} heartbeats in 4 s from a site told 6 s"
    finally:
        daemon.stop()
        thread.join(10)
        for site in others:
            site.close()
        server.stop()
