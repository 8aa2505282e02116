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
from pathlib import Path
from typing import Any

import pytest
from runtime_support import FakeSite, TinyTask, inprocess_server, wait_for

from fedtrain.config import from_dict
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.demo import dump_toml, free_port
from fedtrain.runtime.server.audit import read_audit
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
    assert run.status_max_s is not None


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
