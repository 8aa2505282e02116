"""The log lines of transfers in flight: progress at 25/50/75% for long transfers only,
one warning per stall and one line when it moves again; and the recent rate and
silence that `fedtrain status` and per-site deadlines read."""

from __future__ import annotations

import logging

import pytest

from fedtrain.runtime.config import TransfersConfig
from fedtrain.runtime.server.links import LinkEstimates, TransferMeter
from fedtrain.runtime.server.transfer_watch import TransferWatch

MB = 1_000_000


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = [r.getMessage() for r in caplog.records]
    caplog.clear()
    return out


def test_a_long_transfer_logs_its_quarters_and_a_stall_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.server.transfer_watch")
    links = LinkEstimates()
    watch = TransferWatch(links, TransfersConfig(stall_s=20.0, progress_after_s=10.0))
    meter = links.meter("site-3", "up")
    meter.expect(40 * MB)
    t0 = meter.started
    for second in range(1, 12):  # 1.25 MB/s: a quarter in 8 s
        meter.add(1_250_000)
        watch.tick(t0 + second)
    # nothing in the first 10 s; then the quarter it reached, once
    assert lines(caplog) == ["site 'site-3': upload 12.5 of 40.0 MB (31%), 10.0 Mbit/s, 10s so far"]
    assert meter.watched is not None and meter.watched.bps == pytest.approx(1.25 * MB)
    for second in range(12, 40):  # nothing moves
        watch.tick(t0 + second)
    assert lines(caplog) == [
        "transfer stalled: no bytes from site 'site-3' for 20s (upload 13.8 of 40.0 MB)"
    ]
    assert meter.watched.idle_s(t0 + 39) == pytest.approx(28) and meter.watched.bps == 0
    meter.add(8 * MB)
    watch.tick(t0 + 40)
    assert lines(caplog) == [
        "site 'site-3': upload 21.8 of 40.0 MB moves again after 29s without a byte",
        "site 'site-3': upload 21.8 of 40.0 MB (54%), 12.8 Mbit/s, 40s so far",
    ]
    meter.close()
    watch.tick(t0 + 41)  # ended: forgotten, nothing more
    assert lines(caplog) == []


def test_short_transfers_log_nothing(caplog) -> None:
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.server.transfer_watch")
    links = LinkEstimates()
    watch = TransferWatch(links, TransfersConfig())
    meter = links.meter("a", "down")
    meter.expect(40 * MB, before=10 * MB)  # a resumed download
    for second in range(1, 8):
        meter.add(4 * MB)
        watch.tick(meter.started + second)
    assert meter.done == 38 * MB
    assert lines(caplog) == []


def test_a_transfer_idle_three_stalls_is_offered_to_the_cut_until_it_takes_it() -> None:
    links = LinkEstimates()
    offered: list[tuple[str, float]] = []
    needed = {"slot": False}  # whether the servicer cuts it (another transfer waits)

    def cut(meter: TransferMeter, idle_s: float) -> bool:
        offered.append((meter.site, idle_s))
        return needed["slot"]

    watch = TransferWatch(links, TransfersConfig(stall_s=20.0), cut)
    meter = links.meter("a", "up")
    t0 = meter.started
    meter.add(1)
    watch.tick(t0 + 1)
    for second in range(2, 61):  # the stall warning at 21 s, nothing else yet
        watch.tick(t0 + second)
    assert offered == []
    watch.tick(t0 + 61)  # 60 s = 3 x stall_s after its last byte
    watch.tick(t0 + 62)  # nobody needed its slot: offered again
    assert offered == [("a", 60.0), ("a", 61.0)]
    needed["slot"] = True
    for second in range(63, 200):  # taken once: the servicer freed its slot, ended its streams
        watch.tick(t0 + second)
    assert offered[2:] == [("a", 62.0)]


def test_the_servers_own_work_on_a_transfer_is_not_the_sites_silence() -> None:
    """Encoding a download or journaling a chunk on a busy CPU pool: the site waits for
    the server then, and is neither stalled nor cut however long it takes."""
    links = LinkEstimates()
    cut: list[str] = []

    def take(meter: TransferMeter, idle_s: float) -> bool:
        cut.append(meter.site)
        return True

    watch = TransferWatch(links, TransfersConfig(stall_s=20.0), take)
    meter = links.meter("a", "down")
    t0 = meter.started
    with meter.on_server():
        for second in range(1, 200):
            watch.tick(t0 + second)
    assert cut == [] and meter.watched is not None and meter.watched.idle_s(t0 + 199) == 0
    for second in range(200, 259):  # then the site's own silence counts, from there
        watch.tick(t0 + second)
    assert cut == []
    watch.tick(t0 + 259)
    assert cut == ["a"]
