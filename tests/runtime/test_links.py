"""Bandwidth-aware rounds: each site's link measured from its own transfers, and a site
that cannot finish before the deadline left out, audited with the estimate."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_clock import FakeClock
from runtime_support import FakeSite, TinyTask, inprocess_server
from slow_link import fast_and_slow

from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.links import (
    FORGET_AFTER_S,
    LIVE_MEASURED_S,
    MIN_MEASURED_S,
    LinkEstimates,
)
from fedtrain.task import task_fingerprint

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the sites and the server import benchmarks.flat_task

MB = 1_000_000


def test_an_estimate_adds_download_compute_and_upload_at_the_measured_rates() -> None:
    links = LinkEstimates()
    assert links.estimate("a", 40 * MB, 40 * MB) is None  # never measured: no estimate
    links.record("a", "down", 10 * MB, 8.0, whole=False)  # cut off part way: 1.25 MB/s
    links.record("a", "up", 2 * MB, 4.0, whole=False)  # 0.5 MB/s
    estimate = links.estimate("a", 40 * MB, 40 * MB)
    assert estimate is not None
    assert estimate.seconds == pytest.approx(40 / 1.25 + 40 / 0.5)
    assert estimate.slowest_bps == pytest.approx(0.5 * MB)
    assert "at 4.0 Mbit/s > deadline 45s" in estimate.describe(45.0)
    # a whole upload teaches its real (compressed) size; compute time counts too
    links.upload_started("a")
    links.record("a", "up", 1 * MB, 2.0, whole=True)
    estimate = links.estimate("a", 40 * MB, None)
    assert estimate is not None and estimate.seconds == pytest.approx(32.0 + 1 / 0.5, rel=0.01)


def test_figures_are_forgotten_so_a_skipped_site_tries_again_one_day() -> None:
    links = LinkEstimates()
    links.record("a", "down", 10 * MB, 10.0, whole=True)
    assert links.plan_round(["a", "b"], 5.0, 10 * MB, None, enough=1) != {}
    link = links.link("a")
    assert link is not None
    link.measured_at -= FORGET_AFTER_S + 1  # no transfer since: it was always skipped
    assert links.estimate("a", 10 * MB, None) is None
    assert links.plan_round(["a", "b"], 5.0, 10 * MB, None, enough=1) == {}


def test_a_transfer_that_moved_nothing_or_no_size_gives_no_estimate_and_no_crash() -> None:
    links = LinkEstimates()
    meter = links.meter("rogue", "up", counted=lambda: 0)  # go-ahead taken, no byte sent
    meter.started -= LIVE_MEASURED_S + 1
    assert links.estimate("rogue", 10 * MB, 10 * MB) is None
    links.record("a", "up", 2 * MB, 4.0, whole=False)  # cut off: no size learnt
    assert links.estimate("a", 10 * MB, None) is None  # compressed uploads: size unknown


def test_evaluation_and_secure_rounds_do_not_count_as_a_sites_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A site downloads the new model to evaluate it, waits for the slowest evaluator,
    and trains the next round from its cache; under secure aggregation its upload waits
    for the other sites' key agreement. Neither is the site's own compute (the servicer
    marks evaluation downloads `training=False` and masked uploads `count_compute=False`),
    and only training transfers keep figures from being forgotten."""
    from fedtrain.runtime.server import links as links_module

    clock = FakeClock(1000.0)
    monkeypatch.setattr(links_module.time, "monotonic", clock)
    links = LinkEstimates()

    def transfer(direction: str, seconds: float, *, training: bool = True) -> None:
        meter = links.meter("fast", direction, training=training)
        meter.add(40 * MB)
        clock.now += seconds
        meter.whole = True
        meter.close()

    transfer("down", 4.0, training=False)  # evaluation: 10 MB/s
    clock.now += 100.0 + 5.0  # the evaluation phase waits for a slow evaluator; then trains
    links.upload_started("fast")
    transfer("up", 4.0)
    assert links.plan_round(["fast", "other"], 60.0, 40 * MB, 40 * MB, enough=1) == {}
    transfer("down", 4.0)  # a secure round: the upload waits 70 s for the others' keys
    clock.now += 70.0
    links.upload_started("fast", count_compute=False)
    transfer("up", 4.0)
    assert links.plan_round(["fast", "other"], 60.0, 40 * MB, 40 * MB, enough=1) == {}
    slow = LinkEstimates()  # a slow one's figures are forgotten after FORGET_AFTER_S
    slow.record("s", "down", 4 * MB, 40.0, whole=True)  # even while it keeps evaluating
    assert slow.plan_round(["s", "other"], 30.0, 4 * MB, None, enough=1) != {}
    clock.now += FORGET_AFTER_S / 2
    slow.record("s", "down", 4 * MB, 40.0, whole=True, training=False)
    clock.now += FORGET_AFTER_S / 2 + 1
    assert slow.plan_round(["s", "other"], 30.0, 4 * MB, None, enough=1) == {}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_site_that_stalls_its_upload_does_not_end_the_run(
    tmp_path: Path, stop_after: list
) -> None:
    """A rogue (valid identity) takes an upload's go-ahead and sends nothing: the next
    attempt is planned with a transfer that moved 0 bytes in seconds."""
    task = TinyTask()
    server = inprocess_server(
        tmp_path, task, sites=2, rounds=3, round_timeout_s=3.0, strategy={"min_fit_clients": 1}
    )
    stop_after.append(server)
    fingerprint = task_fingerprint(task)
    honest, rogue = (
        FakeSite(server.port, "honest", fingerprint),
        FakeSite(server.port, "rogue", fingerprint),
    )
    stop_after += [honest, rogue]
    version = rogue.expect("instruction").instruction.model_version
    release = threading.Event()

    def stalled() -> Iterator[pb.UpdateChunk]:
        yield rogue.header(1, model_version=version)
        release.wait(60)

    call = rogue.stub.UploadUpdate.future(stalled(), timeout=90)
    try:
        time.sleep(6.0)  # round 1 times out (3 s); round 2 is planned with the rogue in it
        assert server.coordinator.error is None, repr(server.coordinator.error)
        assert not server.finished.is_set()
    finally:
        release.set()
        call.cancel()


def test_moments_too_short_to_measure_a_link_set_no_rate() -> None:
    links = LinkEstimates()
    links.record("a", "down", 4000, MIN_MEASURED_S / 10, whole=True)
    assert links.estimate("a", 4000, 4000) is None


def test_a_round_is_never_made_impossible_by_an_estimate() -> None:
    links = LinkEstimates()
    for site, rate in (("fast", 100 * MB), ("slow", 1 * MB), ("slower", 0.5 * MB)):
        links.record(site, "down", 10 * MB, 10 * MB / rate, whole=True)
    plan = ["fast", "slow", "slower"]
    # both slow sites miss a 5 s deadline, but the round needs two of the three
    assert list(links.plan_round(plan, 5.0, 10 * MB, None, enough=2)) == ["slower"]
    assert sorted(links.plan_round(plan, 5.0, 10 * MB, None, enough=1)) == ["slow", "slower"]
    assert links.skipped_in_a_row("slower") == 2 and links.skipped_in_a_row("slow") == 1
    assert links.plan_round(plan, 60.0, 10 * MB, None, enough=1) == {}
    assert links.skipped_in_a_row("slower") == 0  # chosen again: the count restarts


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_site_whose_link_cannot_make_the_deadline_is_skipped_and_audited(
    tmp_path: Path,
) -> None:
    """Round 1 measures the slow site's link (its download is cut off at the deadline);
    from round 2 on it is left out before a byte is sent to it, audited with why."""
    # 40 MB: 20 s through a 2 MB/s link (a model far larger than what the kernel's
    # socket buffers absorb, so the server sees the link's pace as it sends)
    task = {"num_params": 10_000_000}
    # The automatic count (the default): on this clean, narrow link it must not climb to
    # many streams and stay there (issue 15, stop 29: 16 read up to 1.9x of 4 streams,
    # which marked the link flow-limited; 64 stayed, and the server's estimate, high by
    # what 64 connections' buffers held, let the slow site try round 2 as well).
    with fast_and_slow(tmp_path, task, 2_000_000, {}, rounds=3, round_timeout_s=8.0) as (
        dep,
        _,
    ):
        assert dep.wait_server(200) == 0, dep.log("server")
        skipped = dep.audit("site_skipped")
        started = {r["round"]: r["participants"] for r in dep.audit("round_started")}

    assert started[1] == ["fast-a", "fast-b", "slow"]  # not measured yet: it tries
    assert [r["round"] for r in skipped] == [2, 3] and {r["site"] for r in skipped} == {"slow"}
    assert "Mbit/s > deadline 8s" in skipped[0]["reason"]
    assert started[2] == started[3] == ["fast-a", "fast-b"]  # nothing sent its way
    assert [m["round"] for m in dep.metrics()] == [1, 2, 3]
    assert "site 'slow' skipped: estimated" in dep.log("server")


def test_the_ranges_of_a_download_over_parallel_streams_are_measured_as_one_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each range's call ends on the server once its bytes are in gRPC's buffers, and
    the site asks for the next only when it has read them: measured one by one, a site
    on a 2 MB/s link looked like megabytes in milliseconds (the slow-site skip did not
    skip), and a range's bytes were taken for the model's size."""
    from fedtrain.runtime.server import links as links_module

    clock = FakeClock(1000.0)
    monkeypatch.setattr(links_module.time, "monotonic", clock)
    links = LinkEstimates()
    for _ in range(8):  # 8 ranges of 2 MB, one a second
        meter = links.meter("slow", "down", transfer="version-1")
        meter.expect(40 * MB)
        meter.add(2 * MB)
        clock.now += 0.002
        meter.completed()
        meter.close()
        clock.now += 1.0
    estimate = links.estimate("slow", 40 * MB, None)
    assert estimate is not None and estimate.down_bps == pytest.approx(16 * MB / 7.016)
    link = links.link("slow")
    assert link is not None and link.down_bytes == 40 * MB  # the download's, not a range's
    assert links.plan_round(["slow", "fast"], 8.0, 40 * MB, None, enough=1) != {}
    other = links.meter("slow", "down", transfer="version-2")  # the next round's: its own
    other.add(4 * MB)
    clock.now += 0.5
    other.close()
    assert links.rates("slow")[0] == pytest.approx((16 * MB / 7.016 + 8 * MB) / 2)
