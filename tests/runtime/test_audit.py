"""audit.jsonl: refusals are all counted, but a retrying peer cannot fill the disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fake_clock import FakeClock

from fedtrain.runtime.server.audit import (
    MANY_PEERS,
    AuditLog,
    RefusalThrottle,
    peer_host,
    read_audit,
)


def _log(tmp_path: Path, clock: FakeClock, **kw: Any) -> AuditLog:
    return AuditLog(tmp_path / "audit.jsonl", RefusalThrottle(window_s=60.0, clock=clock, **kw))


def _refused(audit: AuditLog, peer: str, cause: str = "expired") -> bool:
    return audit.refusal("join_refused", peer=peer, cause=cause, site=None, reason=cause)


def test_a_peer_retrying_for_an_hour_writes_two_records_a_minute_at_most(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    audit = _log(tmp_path, clock)
    heard: list[dict[str, Any]] = []
    audit.subscribe(lambda event, fields: heard.append(dict(fields)))
    written = 0
    for i in range(3600):  # one retry a second, each from a new source port
        written += _refused(audit, f"ipv4:10.0.0.7:{40000 + i}")
        clock.now += 1.0
    audit.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert written == 60  # the first of each minute
    assert len(records) <= 2 * 60
    assert sum(r["count"] for r in records) == 3600
    assert len(heard) == 3600  # the metrics hear of every refusal
    summaries = [r for r in records if r["count"] > 1]
    assert summaries and all(r["first"] <= r["last"] for r in summaries)
    assert {r["cause"] for r in records} == {"expired"}


def test_other_addresses_and_causes_are_recorded_separately(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    audit = _log(tmp_path, clock)
    assert _refused(audit, "ipv4:10.0.0.7:1", "expired")
    assert not _refused(audit, "ipv4:10.0.0.7:2", "expired")
    assert _refused(audit, "ipv4:10.0.0.7:3", "foreign_ca")
    assert _refused(audit, "ipv4:10.0.0.8:1", "expired")
    assert _refused(audit, "ipv6:%5B::1%5D:5", "expired")
    clock.now += 61
    audit.flush_refusals()
    records = read_audit(tmp_path / "audit.jsonl")
    assert [(r["peer"], r["cause"], r["count"]) for r in records] == [
        ("ipv4:10.0.0.7:1", "expired", 1),
        ("ipv4:10.0.0.7:3", "foreign_ca", 1),
        ("ipv4:10.0.0.8:1", "expired", 1),
        ("ipv6:%5B::1%5D:5", "expired", 1),
        ("ipv4:10.0.0.7:2", "expired", 1),  # the repeat, written when its minute was over
    ]
    audit.close()


def test_a_peer_rotating_addresses_is_summed_up_past_the_key_limit(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    audit = _log(tmp_path, clock, max_keys=10)
    for i in range(500):
        _refused(audit, f"ipv4:10.1.{i // 250}.{i % 250}:4000")
    audit.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert len(records) == 12  # ten addresses, the first past the limit, one sum of the rest
    assert sum(r["count"] for r in records) == 500
    assert records[-1]["peer"] == MANY_PEERS and records[-1]["count"] == 489


def test_peer_host_drops_only_the_port() -> None:
    assert peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:%5B::1%5D:51234") == "ipv6:%5B::1%5D"
    assert peer_host("unix:/run/fedtrain.sock") == "unix:/run/fedtrain.sock"
