"""FedBuff in a real deployment: one site 10x slower than the other two.

`fedtrain server` and three `fedtrain client` processes on 127.0.0.1 (see
test_deployment.py). Every training batch (4 per job) takes the fast sites 50 ms
longer and the slow one 500 ms (0.2 s and 2 s per job); every 2 updates make a version, so
the model moves on at the fast sites' pace while the slow site trains, and its late
updates arrive stale and weigh less. Refusing updates beyond `max_staleness` is
checked in-process, where timing is exact (test_fedbuff_server.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_support import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FAST_S, SLOW_S = 0.05, 0.5  # per batch
VERSIONS = 16


def test_slow_site_never_holds_back_the_fast_ones_and_its_stale_updates_weigh_less(
    tmp_path: Path,
) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:PacedTask",
        secure=False,
        rounds=VERSIONS,
        strategy={
            "name": "fedbuff",
            "min_fit_clients": 1,
            "min_available_clients": 3,  # all three start together
            "options": {"buffer_size": 2},
        },
        client={"epochs": 1, "batch_size": 50, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for name, delay in (("fast-a", FAST_S), ("fast-b", FAST_S), ("slow", SLOW_S)):
            dep.start_site(name, task_options={"batch_s": delay})
        assert dep.wait_server(90) == 0, dep.log("server")
        codes = dep.close()
    assert set(codes.values()) == {0}
    assert [r["round"] for r in dep.metrics()] == list(range(1, VERSIONS + 1))
    buffered = dep.audit("update_buffered")
    by_site = {site: [r for r in buffered if r["site"] == site] for site in ("fast-a", "slow")}
    slow = by_site["slow"]
    assert slow, "the slow site's update never made it into a version"
    # versions were made by the fast sites while the slow site trained...
    assert all(u["staleness"] >= 1 for u in slow)
    assert max(u["staleness"] for u in slow) >= 3
    for update in slow:
        # ...so its updates counted less: 1 / sqrt(1 + staleness)
        assert update["weight"] == pytest.approx((1 + update["staleness"]) ** -0.5)
        assert update["staleness"] == update["version"] - 1 - update["base_version"]
    assert len(buffered) == 2 * VERSIONS
    assert len(by_site["fast-a"]) >= 2 * len(slow)
    metrics = dep.metrics()
    assert max(r["staleness_max"] for r in metrics) >= 3
    assert all(r["clients"] == 2 and r["stale_dropped"] == 0 for r in metrics)
    assert metrics[-1]["accuracy"] > 0.8
    completed = dep.audit("round_completed")
    assert [r["round"] for r in completed] == list(range(1, VERSIONS + 1))
    assert len({r["model_version"] for r in completed}) == VERSIONS


def test_sites_evaluate_between_their_jobs_every_eval_every_versions(tmp_path: Path) -> None:
    """No test set on the server: every 2nd version the three sites evaluate it on their
    held-out fifth between jobs; no job is lost or expires for it."""
    from held_out_sites import SITES, site_data

    with Deployment(
        tmp_path,
        "runtime_support:HeldOutTask",
        secure=False,
        rounds=6,
        eval_every=2,
        strategy={
            "name": "fedbuff",
            "min_fit_clients": 1,
            "min_available_clients": 3,
            "options": {"buffer_size": 2},
        },
        client={"epochs": 1, "batch_size": 16, "lr": 0.1},
    ) as dep:
        dep.start_server()
        for i, name in enumerate(SITES):
            dep.start_site(name, data=site_data(i))
        assert dep.wait_server(90) == 0, dep.log("server")
        dep.close()
    metrics = dep.metrics()
    assert [r["round"] for r in metrics] == list(range(1, 7))
    evaluated = [r for r in metrics if r["accuracy"] is not None]
    assert [r["round"] for r in evaluated] == [2, 4, 6]
    for record in evaluated:
        sites = record["site_metrics"]
        assert record["eval_source"] == "sites" and sorted(sites) == list(SITES)
        assert record["eval_missing"] == []
        n = sum(s["examples"] for s in sites.values())
        mean = sum(s["examples"] * s["accuracy"] for s in sites.values()) / n
        assert record["accuracy"] == pytest.approx(mean, abs=1e-12)
    assert not dep.audit("job_expired")
    # jobs still under way when the last version is made are refused ("the run is over")
    errors = [e["message"] for e in dep.audit("site_error")]
    assert all("the run is over" in message for message in errors), errors
    assert len(dep.audit("update_buffered")) >= 2 * 6
