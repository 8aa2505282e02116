"""The WAN benchmark's pure logic: links, scenarios, the line-rate bound, its tables.

The namespace runs themselves need root and minutes; they are benchmarks
(`python -m benchmarks.wan.run`), not tests.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from benchmarks.flower_peer.run import listening
from benchmarks.wan.emulator import HERE, Counters, parse_counters
from benchmarks.wan.links import (
    MODEL_PARAMS,
    Link,
    Scenario,
    line_rate_bound,
    nodes_for,
    render_links,
    select,
)
from benchmarks.wan.run import SystemRun, outcome, parse_systems, render_markdown

MODEL = MODEL_PARAMS * 4


def _star(site: Link, server: Link | None = None, n: int = 3) -> dict[str, Link]:
    return {"server": server or Link(), **{f"site-{i}": site for i in range(n)}}


def test_the_line_rate_bound_is_a_download_plus_an_upload_at_the_slowest_link() -> None:
    assert line_rate_bound(_star(Link.symmetric(100)), MODEL, MODEL) == pytest.approx(6.4)
    slow = _star(Link.symmetric(1000)) | {"site-0": Link.symmetric(10)}
    assert line_rate_bound(slow, MODEL, MODEL) == pytest.approx(64.0)
    # top-k 1% uploads (int32 index + float32 value): 32 s down + 0.64 s up
    assert line_rate_bound(slow, MODEL, MODEL * 0.02) == pytest.approx(32.64)


def test_a_shaped_server_link_carries_every_sites_bytes() -> None:
    links = _star(Link(), server=Link.symmetric(100))
    assert line_rate_bound(links, MODEL, MODEL) == pytest.approx(3 * 6.4)
    assert line_rate_bound(_star(Link()), MODEL, MODEL) == 0.0  # unlimited everywhere


def test_the_issue_scenarios_have_the_issue_bounds() -> None:
    bounds = {s.name: s.bound_s(MODEL_PARAMS) for s in select(["all"])}
    assert bounds["baseline"] == pytest.approx(6.4)
    assert bounds["loss1"] == pytest.approx(6.4)
    assert bounds["slow-site"] == pytest.approx(64.0)
    assert {"cut-upload-45", "cut-upload-10", "cut-upload-60", "cut-server-30"} <= set(bounds)


def test_cut_points_scale_with_the_model_and_land_mid_round_two() -> None:
    (small,) = select(["cut-upload-45"], num_params=1_000_000)
    (big,) = select(["cut-upload-45"])
    assert small.cut is not None and big.cut is not None
    assert small.cut.at_bytes == 6_000_000  # 1.5 models of 4 MB: half-way through upload 2
    assert big.cut.at_bytes == 60_000_000
    assert (big.cut.node, big.cut.direction, big.cut.seconds) == ("site-0", "sent", 45)
    (server,) = select(["cut-server-30"])
    assert server.cut is not None and server.cut.at_bytes == int(1.5 * MODEL * 3)


def test_unknown_scenarios_and_bad_overrides_are_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario.*nope.*choose from: all, baseline"):
        select(["baseline", "nope"])
    with pytest.raises(ValueError, match="--rounds"):
        select(["baseline"], rounds=0)
    (s,) = select(["loss5"], rounds=2, deadline_s=30, cc="bbr")
    assert (s.rounds, s.deadline_s, s.cc) == (2, 30, "bbr")
    with pytest.raises(ValueError, match="--systems"):
        parse_systems("fedtrain,flwr")
    assert parse_systems("flower, fedtrain") == ["flower", "fedtrain"]


def test_links_refuse_impossible_values() -> None:
    with pytest.raises(ValueError, match="loss_pct"):
        Link(loss_pct=100)
    with pytest.raises(ValueError, match="up_mbit"):
        Link(up_mbit=-1)
    with pytest.raises(ValueError, match="prefix"):
        nodes_for("bad-prefix!")


def test_the_shaper_config_has_one_line_per_node_in_kbit() -> None:
    nodes = nodes_for("ftwt", num_sites=2)
    links = _star(Link(100, 10, 20, 1.5), n=2) | {"site-1": Link(up=False)}
    lines = render_links(nodes, links).splitlines()[1:]
    assert lines == [
        "server ftwtsrv wan0 10.78.0.1 0 0 0 0 1",
        "site-0 ftwts0 wan0 10.78.0.11 100000 10000 20 1.5 1",
        "site-1 ftwts1 wan0 10.78.0.12 0 0 0 0 0",
    ]
    with pytest.raises(ValueError, match="no link given for node 'site-1'"):
        render_links(nodes, {"server": Link(), "site-0": Link()})


def test_the_shaper_compiles_without_warnings(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    assert gcc, "the WAN benchmark builds its shaper with gcc"
    for source, extra in (("shaper.c", []), ("ccshim.c", ["-shared", "-fPIC", "-ldl"])):
        out = subprocess.run(
            [
                gcc,
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                *extra,
                "-o",
                str(tmp_path / "x"),
                str(HERE / source),
            ],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr


def test_counters_are_read_per_node_and_partial_lines_ignored() -> None:
    text = "server 10 20 0 0 0\nsite-0 60000000 1 2 3 4\nsite-1 5\n"
    assert parse_counters(text) == {
        "server": Counters(10, 20, 0, 0, 0),
        "site-0": Counters(60_000_000, 1, 2, 3, 4),
    }


def test_a_run_past_its_deadline_says_what_had_moved() -> None:
    run = SystemRun("fedtrain", 1, 300.0, error="timed out:\n...")
    run.sent_mb = {"site-0": 29.4, "site-1": 28.0, "site-2": 30.2}
    run.received_mb = {"site-0": 41.6, "site-1": 41.7, "site-2": 41.6}
    assert outcome(run) == (
        "did not finish in 300 s: 0/1 rounds; sites had received 42/42/42 MB and sent 29/28/30 MB"
    )
    done = SystemRun("fedtrain", 2, 300.0, walls=[45.1, 45.0], ok=True)
    done.clients_per_round = [2, 2]
    done.drops = ["site-0 r1: deadline", "site-0 r2: deadline"]
    assert outcome(done).startswith("2/2 rounds; 2 round(s) closed with fewer than 3 sites")
    assert done.line_rate_pct(64.0) is None  # 45 s rounds without the slow site beat no bound
    assert SystemRun("flower", 2, 300.0, walls=[80.0, 64.0]).line_rate_pct(64.0) == 100 * 64 / 72


def test_the_tables_put_the_bound_and_share_of_line_rate_beside_each_figure() -> None:
    (s,) = select(["baseline"])
    runs = [
        SystemRun("fedtrain", 3, 300.0, walls=[7.0, 8.0, 7.1], ok=True),
        SystemRun("flower", 3, 300.0, walls=[16.0, 16.0, 16.0], ok=True),
    ]
    text = render_markdown([(s, 6.4, runs)])
    assert "| 100 Mbit/s, 40 ms RTT, cubic | 7.0 / 8.0 / 7.1 | 16.0 / 16.0 / 16.0 | 6.4 s " in text
    assert "| 90% | 40% |" in text  # 6.4 / 7.1 (median) and 6.4 / 16
    (cut,) = select(["cut-upload-10"])
    text = render_markdown([(cut, 6.4, runs)])
    assert "| 7.0 / 8.0 / 7.1 | 16.0 / 16.0 / 16.0 | 6.4 s | — | — |" in text  # read the rounds
    skipped = Scenario("x", "x", _star(Link.symmetric(10)), flower=False)
    text = render_markdown([(skipped, 64.0, [SystemRun("flower", 1, 1.0, skipped="not run")])])
    assert "| flower | — | — | 64.0 s | — |" in text


def test_the_flower_peer_sees_a_port_listening_in_a_process_network_namespace() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert not listening(os.getpid(), port)
        sock.listen()
        assert listening(os.getpid(), port)


def test_the_incompressible_model_has_no_two_chunks_alike_and_sites_differ() -> None:
    """Flower content-addresses 5 MiB chunks: a constant model would travel as one."""
    from benchmarks.flat_task import FlatTask, site_delta

    task = FlatTask(num_params=4 * 1024 * 1024, incompressible=True)
    weights = task.model().weights.detach()
    chunks = weights.view(4, -1)
    assert len({bytes(c.numpy().tobytes()[:4096]) for c in chunks}) == 4
    assert bool((task.model().weights == weights).all())  # seeded: server and sites agree
    deltas = {site_delta(f"site-{i}") for i in range(3)}
    assert len(deltas) == 3
    assert (FlatTask(10).model().weights == 0).all()  # the loopback default is unchanged


def test_retries_drops_and_discarded_uploads_are_read_from_the_server_log(tmp_path: Path) -> None:
    from benchmarks.wan.run import _log_events

    log = tmp_path / "server.log"
    log.write_text(
        "... coordinator: round 2 (attempt 1): 3 site(s) train from model a: s0\n"
        "... coordinator: site 'site-0' dropped out of round 2 (heartbeat timed out)\n"
        "... servicer: site 'site-0', round 2: the upload stream broke off; partial update "
        "discarded\n"
        "... coordinator: round 2 (attempt 2): 3 site(s) train from model a: s0\n"
        "... coordinator: round 2 (attempt 2): 3 site(s) train from model a: s0\n"
        "... servicer: upload refused: site 'site-0', round 1: the round closed while the "
        "update was being received; update dropped\n"
        "... servicer: site 'site-0' reports for round 1: FAILED_PRECONDITION: site 'site-0', "
        "round 1: the round closed while the update was being received; update dropped\n"
    )
    retries, drops, discarded = _log_events(log)
    assert (retries, discarded) == (1, 2)
    assert drops == ["site-0 r2: heartbeat timed out"]
    assert _log_events(tmp_path / "missing.log") == (0, [], 0)
