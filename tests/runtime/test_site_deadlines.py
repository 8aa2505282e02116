"""Per-site deadlines: a chosen site whose link was measured gets its own deadline
(estimate x slack + floor); past it, a site that stalls or crawls is dropped from the
round and audited with the numbers, one still moving at its rate is kept; and what
the operator sees of transfers in flight (log, `fedtrain status`, Prometheus)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_support import (
    CHUNK,
    FakeSite,
    TinyTask,
    chunk_messages,
    inprocess_server,
    scrape,
    wait_for,
)
from slow_link import fast_and_slow

from fedtrain.config import from_dict
from fedtrain.observability.status import render_text
from fedtrain.runtime.config import SecAggServerSettings, TransfersConfig
from fedtrain.runtime.demo import free_port
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.audit import AuditLog, read_audit
from fedtrain.runtime.server.links import LinkEstimates, Watched
from fedtrain.runtime.server.rounds import Outcome, RoundState
from fedtrain.runtime.server.secure_round import SecureRoundState
from fedtrain.runtime.server.sessions import Session, SessionRegistry
from fedtrain.runtime.server.site_deadlines import SiteDeadlines
from fedtrain.runtime.status import fetch_status
from fedtrain.secagg import Stage
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.strategy import WeightedSum
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

MB = 1_000_000


def measure(links: LinkEstimates, site: str, down_bps: float, up_bps: float, size: int) -> None:
    """`site`'s link as a round of its own would have measured it (compute ~0)."""
    links.record(site, "down", size, size / down_bps, whole=True)
    links.upload_started(site)
    links.record(site, "up", size, size / up_bps, whole=True)


class Round:
    """A round of `sites` with per-site deadlines, driven by the test's clock."""

    def __init__(
        self,
        tmp_path: Path,
        sites: list[str],
        *,
        grace_s: float = 0.0,
        secure: bool = False,
        **cfg,
    ) -> None:
        self.links = LinkEstimates()
        self.registry = SessionRegistry()
        self.audit_path = tmp_path / "audit.jsonl"
        self.audit = AuditLog(self.audit_path)
        self.sessions = {site: Session(site, "peer-" + site) for site in sites}
        for session in self.sessions.values():
            self.registry.add(session)
        common = {
            "round": 4,
            "attempt": 1,
            "model_version": "v",
            "plan": {site: {} for site in sites},
            "tokens": {site: s.token for site, s in self.sessions.items()},
            "deadline": time.monotonic() + 600,
        }
        if secure:
            specs = ModelState({"w": torch.zeros(8)}).specs
            self.state = SecureRoundState(
                **common,
                aggregate=WeightedSum(tuple(specs)),
                settings=from_dict(SecAggServerSettings, {"enabled": True}),
                layout=UpdateLayout.of(specs),
                sessions=self.sessions,
                audit=self.audit,
                min_included=2,
            )
        else:
            self.state = RoundState(**common, aggregate=WeightedSum(()))
        config = TransfersConfig(**{"deadline_slack": 2.0, "deadline_floor_s": 5.0, **cfg})
        self.deadlines = SiteDeadlines(self.links, self.registry, self.audit, config, grace_s)
        self.cut: list[str] = []
        self.deadlines.on_drop(lambda session, reason: self.cut.append(session.site))
        self.t0 = time.monotonic()

    def begin(self, size: int = 40 * MB) -> dict:
        return self.deadlines.begin(self.state, self.t0, self.state.deadline, 1, size, size)

    def uploading(self, site: str, *, bps: float | None, idle_s: float, at: float) -> None:
        """`site` has an upload in flight, last sampled `at` s into the round."""
        meter = self.links.live(site, "up") or self.links.meter(site, "up")
        meter.expect(40 * MB)
        meter.add(12_500_000 - meter.nbytes)
        meter.watched = Watched(bps, self.t0 + at - idle_s)

    def enforce(self, at: float) -> list[str]:
        return self.deadlines.enforce(self.t0 + at)

    def dropped_records(self) -> list[dict]:
        self.audit.close()
        return [r for r in read_audit(self.audit_path) if r["event"] == "site_dropped"]


def test_a_stalled_site_is_dropped_at_its_own_deadline_with_the_numbers(tmp_path) -> None:
    r = Round(tmp_path, ["fast", "slow", "new"])
    measure(r.links, "fast", 100 * MB, 100 * MB, 40 * MB)  # 0.8 s: 2 x 0.8 + 5 = 6.6 s
    measure(r.links, "slow", 4 * MB, 1 * MB, 40 * MB)  # 10 + 40 = 50 s: 105 s
    deadlines = r.begin()
    assert sorted(deadlines) == ["fast", "slow"]  # "new" is not measured: round deadline
    assert deadlines["slow"].allowed_s == pytest.approx(105.0, rel=0.01)
    r.uploading("slow", bps=None, idle_s=0, at=30)
    for session in r.sessions.values():  # heartbeats arrive: no outage
        session.last_seen = r.t0 + 106
    # the fast site, still without an upload 100 s in, computes far longer than measured
    assert r.enforce(at=100) == ["fast"]  # the slow one is not due yet
    r.uploading("slow", bps=0.0, idle_s=45, at=106)  # no byte for 45 s
    assert r.enforce(at=106) == ["slow"]
    assert r.state.outcomes["slow"] is Outcome.DROPPED and r.cut == ["fast", "slow"]
    fast, record = r.dropped_records()
    assert fast["reason"].endswith("no transfer in flight (its compute was measured at 0s)")
    assert record["site"] == "slow" and record["round"] == 4
    assert record["deadline_s"] == pytest.approx(105, abs=1)
    assert record["reason"].startswith(
        "106s into round 4, past its deadline 105s (estimated 50s at 8.0 Mbit/s x slack 2 + 5s)"
    )
    assert "stalled, no bytes for 45s (upload 12.5 of 40.0 MB)" in record["reason"]
    assert r.enforce(at=700) == []  # "new" has only the round's deadline
    assert r.state.outcomes["new"] is Outcome.PENDING


def test_a_site_still_moving_at_its_measured_rate_is_kept_past_its_deadline(tmp_path) -> None:
    r = Round(tmp_path, ["a", "b"])
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)  # deadline 105 s, upload measured 1 MB/s
    r.begin()
    r.sessions["a"].last_seen = r.t0 + 112  # heartbeats arrive: no outage
    r.uploading("a", bps=0.6 * MB, idle_s=0.5, at=110)  # slower, but above 1 MB/s / 2
    assert r.enforce(at=110) == []
    r.uploading("a", bps=None, idle_s=0.0, at=111)  # a new stream: too early to say
    assert r.enforce(at=111) == []
    r.uploading("a", bps=0.2 * MB, idle_s=0.5, at=112)  # now it crawls
    assert r.enforce(at=112) == ["a"]
    (record,) = r.dropped_records()
    assert "upload 12.5 of 40.0 MB at 1.6 Mbit/s, its link measured 8.0 Mbit/s" in record["reason"]


def test_a_transfer_that_moved_no_byte_yet_is_judged_as_a_stall_not_a_crawl(tmp_path) -> None:
    """A slot just granted: the go-ahead's round trip (and a busy server's pool and loop)
    come before the first byte, which is no rate; once it lasts stall_s it is a stall."""
    r = Round(tmp_path, ["a", "b"], stall_s=20.0)
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)  # deadline 105 s
    r.begin()
    meter = r.links.meter("a", "up")
    meter.expect(40 * MB)
    for at, idle in ((110, 1.0), (125, 16.0)):
        r.sessions["a"].last_seen = r.t0 + at  # heartbeats arrive: no outage
        meter.watched = Watched(0.0, r.t0 + at - idle)
        assert r.enforce(at=at) == [], at
    r.sessions["a"].last_seen = r.t0 + 130
    meter.watched = Watched(0.0, r.t0 + 109)
    assert r.enforce(at=130) == ["a"]
    (record,) = r.dropped_records()
    assert "stalled, no bytes for 21s (upload 0.0 of 40.0 MB)" in record["reason"]


def test_an_outage_is_judged_by_the_grace_and_its_length_added_to_the_deadline(
    tmp_path,
) -> None:
    r = Round(tmp_path, ["a", "b"], grace_s=90.0)
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)
    r.begin()
    session = r.sessions["a"]
    assert r.registry.detach(session)  # its link failed: away, within heartbeat.grace_s
    assert r.enforce(at=150) == []
    session.last_seen -= 60  # it went quiet 60 s before it rejoined
    assert r.registry.rejoin(session.token, "a", b"", "peer-2") is session
    assert session.outage_s >= 60
    session.touch()
    session.last_seen = r.t0 + 160  # heard from again
    r.uploading("a", bps=0.0, idle_s=30, at=160)
    assert r.enforce(at=160) == []  # 105 s + the outage: not due yet
    due = 105 + session.outage_s + 1
    session.last_seen = r.t0 + due
    assert r.enforce(at=due) == ["a"]
    (record,) = r.dropped_records()
    assert f", + {session.outage_s:.0f}s in outages)" in record["reason"]


def test_outages_are_forgiven_up_to_the_grace_in_all(tmp_path) -> None:
    """A link whose heartbeats keep getting stuck (silent, away, rejoin, again) is
    judged once its outages add up to heartbeat.grace_s."""
    r = Round(tmp_path, ["a", "b"], grace_s=20.0)
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)
    r.begin()
    session = r.sessions["a"]
    session.outage_s += 15  # outages it came back from
    session.last_seen = r.t0 + 100  # quiet since: an outage now, at 110 s
    assert r.enforce(at=110) == []  # 15 + 10 > 20: the grace is spent, yet not due
    assert r.enforce(at=126) == ["a"]  # 105 + 20


def test_a_silent_site_is_presumed_in_an_outage_only_when_a_grace_is_configured(
    tmp_path,
) -> None:
    for grace_s, dropped in ((90.0, []), (0.0, ["a"])):
        r = Round(tmp_path / str(grace_s), ["a", "b"], grace_s=grace_s)
        measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)
        r.begin()
        r.sessions["a"].last_seen = r.t0  # nothing heard from it since the round began
        assert r.enforce(at=120) == dropped


def test_a_site_without_a_transfer_waits_while_the_servers_slots_are_all_taken(
    tmp_path,
) -> None:
    """Thousands training at once: a site past its deadline whose upload has not reached
    the server (its connection not yet accepted, its call not yet taken) is not dropped
    while every transfer slot is taken; once one is free it is judged as before. A site
    whose transfer stalls is dropped either way."""
    r = Round(tmp_path, ["late", "stalled", "c"])
    saturated = [True]
    r.deadlines.server_saturated = lambda: saturated[0]
    for site in ("late", "stalled"):
        measure(r.links, site, 100 * MB, 100 * MB, 40 * MB)  # deadline 6.6 s
    r.begin()
    for session in r.sessions.values():  # heartbeats arrive: no outage
        session.last_seen = r.t0 + 60
    r.uploading("stalled", bps=0.0, idle_s=45, at=50)
    assert r.enforce(at=50) == ["stalled"]  # stalled in a slot: not the server's doing
    assert r.enforce(at=55) == []
    assert r.state.outcomes["late"] is Outcome.PENDING
    saturated[0] = False
    assert r.enforce(at=60) == ["late"]
    assert r.dropped_records()[1]["reason"].endswith(
        "no transfer in flight (its compute was measured at 0s)"
    )


def test_the_server_tells_its_deadlines_when_its_transfer_slots_are_all_taken(
    tmp_path, stop_after
) -> None:
    task = TinyTask(features=2_000_000)  # 16 MB: downloaded, not inside the instruction
    server = inprocess_server(tmp_path, task, sites=1, rounds=1, max_transfers=1)
    stop_after.append(server)
    site = FakeSite(server.port, "a", task_fingerprint(task))
    stop_after.append(site)
    version = site.expect("instruction").instruction.model_version
    assert server.coordinator.deadlines.server_saturated() is False
    held = site.stub.DownloadModel(
        pb.ModelRequest(version=version, session_token=site.token), timeout=60
    )
    next(held)  # the manifest: the one slot is granted, then nothing more is read
    wait_for(server.coordinator.deadlines.server_saturated, 10, "the one slot to be taken")
    held.cancel()
    wait_for(lambda: not server.coordinator.deadlines.server_saturated(), 10, "the slot back")


def test_the_slots_are_saturated_when_every_one_is_held_or_waited_for() -> None:
    import asyncio

    from fedtrain.runtime.server.transfer_slots import TransferSlots

    async def scenario() -> list[bool]:
        slots: TransferSlots[int] = TransferSlots(2)
        seen = [slots.saturated]
        release = asyncio.Event()

        async def transfer(key: str) -> None:
            async with slots.hold(key, lambda: 0, lambda _: None):
                await release.wait()

        tasks = [asyncio.create_task(transfer("a"))]
        await asyncio.sleep(0)
        seen.append(slots.saturated)  # one of two held
        tasks.append(asyncio.create_task(transfer("b")))
        await asyncio.sleep(0)
        seen.append(slots.saturated)  # both held
        release.set()
        await asyncio.gather(*tasks)
        seen.append(slots.saturated)
        return seen

    assert asyncio.run(scenario()) == [False, False, True, False]


def test_a_site_is_never_dropped_when_the_round_would_then_fail(tmp_path) -> None:
    r = Round(tmp_path, ["a", "b"])
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)
    r.deadlines.begin(r.state, r.t0, r.state.deadline, 2, 40 * MB, 40 * MB)  # needs both
    r.sessions["a"].last_seen = r.t0 + 200
    assert r.enforce(at=200) == []
    assert r.state.outcomes["a"] is Outcome.PENDING


def test_under_secure_aggregation_a_site_is_judged_only_while_it_may_upload(tmp_path) -> None:
    """A masked update can go up only once the masked-input stage opened (the others'
    keys are in): before, no site is judged; then it has at least its upload's
    allowance from the stage's opening, and a dropped site is a dropout of that stage."""
    r = Round(tmp_path, ["a", "b", "c"], secure=True)
    measure(r.links, "a", 4 * MB, 1 * MB, 40 * MB)  # deadline 105 s; upload 2 x 40 + 5 s
    r.begin()
    assert isinstance(r.state, SecureRoundState)
    r.sessions["a"].last_seen = r.t0 + 300
    assert r.enforce(at=200) == []  # still in key agreement: it cannot upload yet
    masked = r.state.masked
    masked.server._stage = Stage.MASKED_INPUT  # the key stages closed (a test's shortcut)
    masked.stage_opened = r.t0 + 200
    assert r.enforce(at=250) == []  # 200 + 85 s for its upload
    assert r.enforce(at=290) == ["a"]
    assert "a" in r.state._gone()  # a dropout of the masked-input stage


def test_no_deadline_without_a_complete_estimate_or_when_off_or_beyond_the_round(
    tmp_path,
) -> None:
    r = Round(tmp_path, ["a", "b", "c"])
    r.links.record("a", "down", 40 * MB, 10.0, whole=True)  # no upload measured yet
    r.links.record("b", "up", 40 * MB, 10.0, whole=True)  # no download, no compute
    measure(r.links, "c", 0.1 * MB, 0.1 * MB, 40 * MB)  # 800 s x 2: past the round's 600 s
    assert r.begin() == {}
    off = Round(tmp_path / "off", ["a", "b"], deadline_slack=0.0)
    measure(off.links, "a", 4 * MB, 1 * MB, 40 * MB)
    assert off.begin() == {}


# -- the real server ------------------------------------------------------------------------
def _two_sites(
    tmp_path: Path, stop_after: list, links: dict[str, tuple[float, float]], **server_config
) -> tuple:
    """An in-process server (round 1 of 1, 60 s, one update needed) whose links measured
    each site's (down, up) bytes/s in an earlier round, and two FakeSites told to train:
    (server, sites, the round's model version, an update's chunk messages)."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path,
        task,
        sites=2,
        rounds=1,
        round_timeout_s=60.0,
        strategy={"min_fit_clients": 1},
        **server_config,
    )
    stop_after.append(server)
    state = server.coordinator.global_model.state
    for site, (down, up) in links.items():
        measure(server.coordinator.links, site, down, up, state.nbytes)
    sites = tuple(FakeSite(server.port, name, task_fingerprint(task)) for name in links)
    stop_after.extend(sites)
    versions = {site.expect("instruction").instruction.model_version for site in sites}
    delta = ModelState({k: torch.full_like(v, 0.5) for k, v in state.items()})
    return server, sites, versions.pop(), chunk_messages(delta.chunks(CHUNK))


def _dropped(tmp_path: Path) -> list[dict]:
    return [r for r in read_audit(tmp_path / "run" / "audit.jsonl") if r["event"] == "site_dropped"]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_stalled_upload_is_dropped_long_before_the_round_deadline_and_the_round_completes(
    tmp_path, stop_after, caplog
) -> None:
    """The stuck site takes its go-ahead, sends one chunk and nothing more while its
    control stream stays alive: dropped at its own deadline (seconds), audited with the
    numbers, logged as stalled; `fedtrain status` showed the upload's progress;
    Prometheus splits the bytes; the round completes with the honest site."""
    caplog.set_level(logging.INFO, logger="fedtrain")
    port = free_port()
    server, (honest, stuck), version, chunks = _two_sites(
        tmp_path,
        stop_after,
        {"honest": (1000.0, 1000.0), "stuck": (1000.0, 1000.0)},
        metrics_port=port,
        transfers={"deadline_slack": 2.0, "deadline_floor_s": 2.5, "stall_s": 1.0},
    )
    started = time.monotonic()
    nbytes = server.coordinator.global_model.state.nbytes
    release = threading.Event()

    def stalls() -> Iterator[pb.UpdateChunk]:
        yield stuck.header(1, model_version=version)
        yield chunks[0]
        release.wait(50)

    call = stuck.stub.UploadUpdate.future(stalls(), timeout=55)
    try:
        shown = None
        while shown is None and time.monotonic() - started < 10:
            status = fetch_status(f"127.0.0.1:{server.port}", None)  # `fedtrain status`
            site = next(s for s in status.sites if s.name == "stuck")
            shown = next((t for t in site.transfers if t.done_bytes), None)
            time.sleep(0.05)
        assert shown is not None and shown.direction == "up"
        assert (shown.done_bytes, shown.total_bytes) == (CHUNK, nbytes)
        assert f"up {CHUNK}/{nbytes} B" in render_text(status)
        honest.upload([honest.header(1, model_version=version), *chunks])
        assert server.wait(30), "the round waited for the stuck site"
        took = time.monotonic() - started
    finally:
        release.set()
        call.cancel()
    assert took < 20  # round_timeout_s is 60
    (dropped,) = _dropped(tmp_path)
    assert dropped["site"] == "stuck" and dropped["round"] == 1
    assert "past its deadline" in dropped["reason"] and "x slack 2 + 2.5s" in dropped["reason"]
    assert server.coordinator.last_metrics["clients"] == 1
    log = caplog.text
    assert "transfer stalled: no bytes from site 'stuck' for" in log
    assert f"(upload {CHUNK} of {nbytes} B)" in log
    samples = scrape(port)
    assert samples['fedtrain_received_bytes_by_outcome_total{outcome="accepted"}'] == nbytes
    assert samples['fedtrain_received_bytes_by_outcome_total{outcome="discarded"}'] == CHUNK


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_site_late_but_moving_at_its_rate_is_not_dropped(tmp_path, stop_after) -> None:
    """The steady site starts its upload late (past most of its allowance) and sends
    at about its measured rate: past its deadline it is still moving, so it is kept
    and its update counts."""
    nbytes = ModelState.from_module(TinyTask().model()).nbytes  # 5 chunks
    rate = nbytes / 2.5  # measured: the whole update in 2.5 s
    server, (fast, steady), version, chunks = _two_sites(
        tmp_path,
        stop_after,
        {"fast": (1000.0, 1000.0), "steady": (1000.0, rate)},  # 2 x 2.5 + 0.5 = ~5.5 s
        transfers={"deadline_slack": 2.0, "deadline_floor_s": 0.5, "stall_s": 2.5},
    )
    fast.upload([fast.header(1, model_version=version), *chunks])
    time.sleep(4.0)  # "trains" far longer than measured

    def paced() -> Iterator[pb.UpdateChunk]:
        yield steady.header(1, model_version=version)
        for chunk in chunks:
            time.sleep(2.5 / len(chunks) * 0.8)  # a little faster than measured
            yield chunk

    receipt = steady.stub.UploadUpdate(paced(), timeout=30)
    assert receipt.bytes_received == nbytes
    assert server.wait(30)
    assert server.coordinator.last_metrics["clients"] == 2
    assert not [
        r for r in read_audit(tmp_path / "run" / "audit.jsonl") if r["event"] == "site_dropped"
    ]


@pytest.mark.slow  # long scenario (20-33 s): run with -m slow
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_site_whose_link_degrades_is_dropped_at_its_own_deadline_in_a_real_deployment(
    tmp_path: Path,
) -> None:
    """Round 1 measures the slow site's link (1 MB/s) and compute; in round 2 its uplink
    falls to 10 kB/s: its upload (2 MB: over three minutes) is cut at its own deadline
    (seconds), audited with the numbers, and the round completes with the other two long
    before round_timeout_s. Its heartbeats get stuck behind its own upload, so the
    server sees it silent, away and back again: those outages are forgiven only up to
    heartbeat.grace_s."""
    task = {"num_params": 500_000}  # 2 MB each way
    with fast_and_slow(
        tmp_path,
        task,
        1_000_000,
        rounds=2,
        round_timeout_s=120.0,
        heartbeat={"interval_s": 0.5, "timeout_s": 5.0, "grace_s": 8.0},
        transfers={"deadline_slack": 2.0, "deadline_floor_s": 3.0, "stall_s": 5.0},
    ) as (dep, link):
        wait_for(
            lambda: any(r["site"] == "slow" for r in dep.audit("upload")),
            120,
            "the slow site's round-1 upload",
        )
        link.up_rate = 10_000  # its uplink degrades
        assert dep.wait_server(200) == 0, dep.log("server")
        dropped = dep.audit("site_dropped")
        metrics = dep.metrics()
        log = dep.log("server")

    assert [(r["site"], r["round"]) for r in dropped] == [("slow", 2)]
    reason = dropped[0]["reason"]
    assert "past its deadline" in reason and "x slack 2 + 3s, + 8s in outages)" in reason
    assert [m["round"] for m in metrics] == [1, 2]
    assert metrics[1]["clients"] == 2 and metrics[1]["dropped"] == ["slow"]
    assert metrics[1]["seconds"] < 60  # round_timeout_s is 120
    assert "site 'slow' dropped:" in log
