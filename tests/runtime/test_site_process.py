"""A real `fedtrain client` process as an operator sees it: what it says while it
starts, how fast it leaves on SIGTERM, and `exit_when_done` for scripts and Jobs.

Bounds on time are generous (a loaded CI machine); the measured figures are in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from runtime_support import Deployment, wait_for

from fedtrain.runtime.demo import fedtrain_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: What `fedtrain client` logs before it joins, in this order.
START_UP = (
    "starting the site",
    "loading task runtime_support:TinyTask",
    "building this site's training data (part 0 of 2, iid split)",
    "connecting to the server at 127.0.0.1:",
    "joined run",
)


def _lines(log: str, level: str) -> list[str]:
    return [line for line in log.splitlines() if f" {level} " in line]


def test_sites_say_what_they_do_and_exit_when_the_run_is_done(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["keyed", "flagged", "waiting"],
        strategy={"min_fit_clients": 3, "min_available_clients": 3},
        rounds=2,
    ) as dep:
        dep.start_server()
        data = {"num_partitions": 2}
        dep.start_site("keyed", data=data, exit_when_done=True)  # site.toml's key
        flagged = dep.site_toml("flagged", data=data)
        dep.start_command(
            "flagged", fedtrain_command("client", "--config", str(flagged), "--exit-when-done")
        )
        dep.start_site("waiting", data=data)
        assert dep.wait_server(180) == 0, dep.log("server")
        for name in ("keyed", "flagged"):
            assert dep.proc(name).wait(30) == 0, dep.log(name)
        # The site without it waits for a next run: the server is gone, and that is no news.
        wait_for(lambda: "connection to 127.0.0.1" in dep.log("waiting"), 30, "a reconnect attempt")
        assert dep.proc("waiting").poll() is None
        codes = dep.close()
    assert codes["waiting"] == 0

    for name in ("keyed", "flagged", "waiting"):
        log = dep.log(name)
        places = [log.find(step) for step in START_UP]
        assert -1 not in places and places == sorted(places), (name, places, log)
        assert "round 2: trained on 100 examples" in log
        joined = log[log.find("joined run") :]  # before: the server may not listen yet
        assert _lines(joined, "WARNING") == [], log
    for name in ("keyed", "flagged"):
        assert "the server's run is complete; exiting (exit_when_done)" in dep.log(name)
    waiting = dep.log("waiting")
    assert "the server's run is complete; waiting for its next run" in waiting
    after = re.search(
        r" INFO fedtrain\.runtime\.site\.daemon: connection to 127\.0\.0\.1:\d+ failed", waiting
    )
    assert after, waiting


def test_a_site_leaves_within_seconds_of_sigterm_even_mid_round(tmp_path: Path) -> None:
    """A round training in the daemon cannot be cut short, and the interpreter's
    teardown of a torch process takes seconds on a busy machine: the site waits for
    neither (the server counts it as a dropout, as it would any site that stops)."""
    slow = {"delay_s": 60.0}  # a round outlasts the test
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        task_options=slow,
        strategy={"min_fit_clients": 1, "min_available_clients": 1},
        rounds=1,
    ) as dep:
        dep.start_server()
        dep.start_site("a", task_options=slow)
        wait_for(lambda: dep.audit("round_started"), 120, "round 1 to start")
        time.sleep(1.0)  # well into training
        site = dep.proc("a")
        sent = time.monotonic()
        site.send_signal(signal.SIGTERM)
        code = site.wait(60)
        took = time.monotonic() - sent
        dep.close()
    assert code == 0, dep.log("a")
    assert took < 5.0, f"the site took {took:.1f}s to exit after SIGTERM:\n{dep.log('a')}"
    assert "site 'a' stopped" in dep.log("a")
