"""`fedtrain status` output: the same state as a rich table, plain lines and JSON."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console

from fedtrain.observability.status import (
    ServerState,
    SiteState,
    TransferState,
    render_rich,
    render_text,
)

STATE = ServerState(
    run_id="0123456789ab",
    task="fedtrain.examples:DigitsTask",
    phase="training",
    round=3,
    attempt=2,
    total_rounds=10,
    rounds_completed=2,
    min_sites=2,
    secagg=True,
    model_version="f" * 64,
    finished=False,
    sites=(
        SiteState(
            "hospital-a",
            125.2,
            0.4,
            down_bps=12.5e6,
            up_bps=1.25e6,
            transfers=(TransferState("up", 12_500_000, 40_000_000, 1.225e6, 21.4),),
        ),
        SiteState("hospital-b", 60.0, 1.25),
    ),
    last_metrics={"round": 2.0, "accuracy": 0.91234, "bytes": 2048.0},
    bytes={
        "received": 120_000_000,
        "sent": 160_000_000,
        "accepted": 80_000_000,
        "discarded": 38_000_000,
        "resent": 2_000_000,
    },
)


def test_plain_text_has_one_fact_per_line():
    lines = render_text(STATE).splitlines()
    assert "phase: training: round in progress (sites train and upload)" in lines
    assert "round: 3 of 10 in progress (2 completed), attempt 2" in lines
    assert "sites: 2 connected, 2 needed to start a round" in lines
    assert "secure aggregation: on" in lines
    assert (
        "site hospital-a: connected 125s, last heard 0.4s ago, link down 100.0 / up 10.0 Mbit/s"
        ", up 12.5/40.0 MB 9.8 Mbit/s, idle 21s" in lines
    )
    assert "bytes: in 120.0 MB (accepted 80.0, discarded 38.0, resent 2.0), out 160.0 MB" in lines
    assert "site hospital-b: connected 60s, last heard 1.2s ago" in lines  # not measured yet
    assert lines[-1] == "last round (2): accuracy 0.9123, bytes 2048"
    waiting = dataclasses.replace(STATE, phase="waiting", round=2, attempt=0, sites=())
    assert "round: 2 of 10 completed" in render_text(waiting).splitlines()


def test_rich_tables_and_json_carry_the_same_state():
    console = Console(record=True, width=160)
    render_rich(STATE, console)
    text = console.export_text()
    for needle in ("hospital-a", "hospital-b", "3 of 10 in progress", "last round (2)", "0.9123"):
        assert needle in text
    assert "down 100.0 / up 10.0 Mbit/s" in text
    assert "up 12.5/40.0 MB" in text and "idle 21s" in text
    assert json.loads(STATE.to_json())["sites"][1] == {
        "name": "hospital-b",
        "connected_for_s": 60.0,
        "last_heartbeat_age_s": 1.25,
        "down_bps": None,
        "up_bps": None,
        "eval_accuracy": None,
        "eval_loss": None,
        "transfers": [],
    }


def test_measured_links_survive_the_wire_and_unmeasured_ones_stay_unknown():
    from fedtrain.runtime.status import from_proto, to_proto

    assert from_proto(to_proto(STATE)).sites == STATE.sites
    assert from_proto(to_proto(STATE)).bytes == STATE.bytes
