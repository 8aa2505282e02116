"""Bandwidth-aware rounds: each site's link measured from its own transfers, and a site
that cannot finish before the deadline left out, audited with the estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from runtime_support import Deployment
from slow_link import SlowLink

from fedtrain.runtime.server.links import FORGET_AFTER_S, MIN_MEASURED_S, LinkEstimates

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
    with (
        Deployment(
            tmp_path,
            "benchmarks.flat_task:FlatTask",
            task_options=task,
            allowed_sites=["fast-a", "fast-b", "slow"],
            strategy={"min_fit_clients": 2, "min_available_clients": 3},
            rounds=3,
            round_timeout_s=8.0,
        ) as dep,
        SlowLink(dep.port, rate=2_000_000) as link,
    ):
        dep.start_server()
        for name in ("fast-a", "fast-b"):
            dep.start_site(name, task_options=task)
        slow = dep.site_toml("slow", task_options=task)
        slow.write_text(slow.read_text().replace(f"127.0.0.1:{dep.port}", f"127.0.0.1:{link.port}"))
        dep.start_site("slow", slow)
        assert dep.wait_server(200) == 0, dep.log("server")
        skipped = dep.audit("site_skipped")
        started = {r["round"]: r["participants"] for r in dep.audit("round_started")}

    assert started[1] == ["fast-a", "fast-b", "slow"]  # not measured yet: it tries
    assert [r["round"] for r in skipped] == [2, 3] and {r["site"] for r in skipped} == {"slow"}
    assert "Mbit/s > deadline 8s" in skipped[0]["reason"]
    assert started[2] == started[3] == ["fast-a", "fast-b"]  # nothing sent its way
    assert [m["round"] for m in dep.metrics()] == [1, 2, 3]
    assert "site 'slow' skipped: estimated" in dep.log("server")
