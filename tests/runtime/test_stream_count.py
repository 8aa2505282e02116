"""The automatic count of parallel streams (`StreamCount`) and the ranges it shares out
(`RangeCutter`, `run_ranges`), against a fake clock and links whose rate is a function
of the streams: no network, so the decisions are exact."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest
import torch
from fake_clock import FakeClock

from fedtrain.runtime import wire
from fedtrain.runtime.site.streams import (
    DECIDE_S,
    DESCEND_EVERY,
    FIRST_RANGE_BYTES,
    GROWTH,
    LANES,
    MEASURE_S,
    PAID_GAIN,
    PARALLEL_CHUNK_BYTES,
    RANGE_S,
    REPROBE_S,
    WARMUP_S,
    RangeCutter,
    StreamCount,
    StreamMemory,
    UpdateChunks,
    descent_room,
    run_ranges,
)
from fedtrain.tensors import ModelState

CHUNK = 256 * 1024
FLOW = 0.44e6  # one cubic flow at 1% loss and 40 ms, B/s
LINE = 12.5e6  # 100 Mbit/s


def _transfer(
    count: StreamCount,
    clock: FakeClock,
    rate: Callable[[int, float], float],
    nbytes: int,
    chunk: int = CHUNK,
):
    """Move `nbytes` in chunks at `rate(streams, seconds since the count changed)`; a
    plain call is judged after each chunk (as `CallSwitch` does every POLL_S)."""
    changed_at, streams = 0.0, count.current
    for _ in range(nbytes // chunk):
        if count.current != streams:
            changed_at, streams = clock.now, count.current
        clock.advance(chunk / rate(streams, clock.now - changed_at))
        count.moved(chunk)
        count.poll(chunk)


def _auto(clock: FakeClock, nbytes: int, start: int = 1, limit: int = 64, **options) -> StreamCount:
    return StreamCount(start, limit, total=nbytes, clock=clock, **options)


def _cut_unmeasured(count: StreamCount, clock: FakeClock) -> None:
    """A plain call cut at DECIDE_S before its first 4 MiB chunk arrived (from a server
    that sends no small first pieces, or an upload whose chunks are not cut finer):
    nothing says how fast one flow is, so the count steps GROWTH at a time."""
    clock.advance(DECIDE_S + 0.01)
    assert count.poll(4 << 20) and count.current == GROWTH


def _overflowing(k: int, _: float) -> float:
    """A lossy link whose queue 64 flows overflow: each flow adds its share up to 16,
    and 64 move half what 16 do."""
    return min(k, 16) * FLOW if k <= 16 else 8 * FLOW


def test_on_a_lossy_link_streams_multiply_while_they_pay_and_stay_unless_slower() -> None:
    """Every flow adds its share until the link is full (about 17 flows here): 64 gain
    nothing over 16 but are not slower, and stay (a window cannot tell them apart from
    a gain: measured on a real lossy link 64 move 65% of it, 16 39%); where 64 are
    slower the count goes back to 16, and the next transfer does not try 64 again."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20)
    assert count.alone and not count.parallel  # a plain call first
    _cut_unmeasured(count, clock)
    _transfer(count, clock, lambda k, _: min(k * FLOW, LINE * 0.6), 100 << 20)
    assert count.tried == [1, 4, 16, 64] and count.settled
    assert count.next_start() == (64, None)
    slower = _auto(clock, 100 << 20)
    _cut_unmeasured(slower, clock)
    _transfer(slower, clock, _overflowing, 100 << 20)
    assert slower.tried[:5] == [1, 4, 16, 64, 16]
    assert set(slower.tried[5:]) <= {16, 64}  # probed again now and then: still slower
    start, known = slower.next_start()
    assert start == 16 and known is not None
    following = _auto(clock, 20 << 20, start, known=known)  # 64 lost: not again
    _transfer(following, clock, _overflowing, 20 << 20)
    assert following.tried == [16]
    full = _auto(clock, 200 << 20)  # a link 64 flows do not fill: all 64 stay
    _cut_unmeasured(full, clock)
    _transfer(full, clock, lambda k, _: k * FLOW, 200 << 20)
    assert full.tried == [1, 4, 16, 64] and full.settled


def test_one_slow_window_right_after_a_step_does_not_take_back_streams_that_paid() -> None:
    """On a real 1% loss link the first window after 48 new streams started read 64 at
    half of 16's rate, and the count went back to 16 (for that transfer and the next
    two); 64 then move as much as 16 here (a real link: more). A second window decides:
    the streams stay. Where they stay slower, the second window takes them back."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20)

    def late(k: int, since: float) -> float:
        if k < 64:
            return min(k * FLOW, 16 * FLOW)
        return 16 * FLOW * (0.5 if since < 5.5 else 1.0)  # slow for its first window

    _cut_unmeasured(count, clock)
    _transfer(count, clock, late, 100 << 20)
    assert count.tried == [1, 4, 16, 64] and count.settled and count.current == 64
    assert count.next_start() == (64, None)
    slower = _auto(clock, 100 << 20)
    _cut_unmeasured(slower, clock)
    _transfer(slower, clock, _overflowing, 60 << 20)  # 64 stay at half of 16
    assert slower.tried[:5] == [1, 4, 16, 64, 16]


def test_a_descent_keeps_fewer_streams_only_if_a_second_window_agrees() -> None:
    """Right after a descent the streams left read as fast as all of them (their chunks
    in flight land together), then move less: the second window takes the count back
    up for good instead of stepping further down."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20, 64, descend=True)

    def fewer_look_fast(k: int, since: float) -> float:
        if k == 64:
            return LINE * 0.6
        return LINE * (0.65 if since < 1.3 else 0.35)

    _transfer(count, clock, fewer_look_fast, 100 << 20)
    assert count.tried == [64, 16, 64] and count.current == 64 and count.settled


def test_on_a_narrow_clean_link_a_modest_gain_does_not_mark_more_streams_as_paying() -> None:
    """A 2 MB/s link, one call cut before its first 4 MiB chunk arrived: four streams
    share the link with what the cut call had in flight and read 70% of it, sixteen then
    read all of it (1.4x: a gain, so 64 are tried), 64 no more. Once, any gain over
    GAIN marked the link flow-limited: 64 stayed, and the server's rate estimate read
    high by what 64 connections' buffers held (a slow site it should have skipped tried
    the next round). Only a step that multiplies the rate (PAID_GAIN) marks it: 64 are
    taken back to 16 (each time they are probed again), where the next transfer starts."""
    link = 2e6
    clock = FakeClock()
    count = _auto(clock, 80 << 20)  # (a window at 64 takes 16 MB)
    clock.advance(DECIDE_S)
    assert count.poll(4 << 20) and count.current == GROWTH  # cut unmeasured

    def narrow(k: int, _: float) -> float:
        return link * (0.7 if k == GROWTH else 1.0)

    _transfer(count, clock, narrow, 70 << 20)
    assert count.tried[:5] == [1, 4, 16, 64, 16] and not count.paid
    assert set(count.tried[5:]) <= {16, 64} and count.current == 16  # re-probed: no gain
    assert count.next_start()[0] == 16
    lossy = _auto(clock, 100 << 20)  # where a step multiplies the rate, it does mark it
    clock.advance(DECIDE_S)
    assert lossy.poll(4 << 20)
    _transfer(lossy, clock, lambda k, _: min(k * FLOW, LINE * 0.6), 100 << 20)
    assert lossy.paid and lossy.tried[:4] == [1, 4, 16, 64]
    assert lossy.rates[2] >= PAID_GAIN * lossy.rates[1]


def test_a_count_that_stopped_growing_is_probed_again_and_grows_once_it_pays() -> None:
    """More streams lost rate while the server was busy with other sites (four flows'
    worth for it, two when more came); once their transfers end, the next probe finds
    the gain."""
    clock = FakeClock()
    count = _auto(clock, 56 << 20)
    _cut_unmeasured(count, clock)
    _transfer(count, clock, lambda k, _: (min(k, 4) if k <= 4 else 2) * FLOW, 14 << 20)
    assert count.tried == [1, 4, 16, 4] and count.settled
    _transfer(count, clock, lambda k, _: k * FLOW, 40 << 20)  # the others are done
    assert count.tried[4:] == [16, 64] and count.current == 64
    assert clock.now > REPROBE_S


def test_on_a_clean_link_a_plain_call_is_never_cut() -> None:
    """One flow fills the link and the 40 MB are soon moved: no second stream."""
    clock = FakeClock()
    count = _auto(clock, 40 << 20)
    _transfer(count, clock, lambda k, _: LINE, 40 << 20)
    assert count.tried == [1] and count.alone and count.next_start() == (1, None)


def test_a_fast_transfer_is_over_before_it_is_judged() -> None:
    """400 MB on loopback (~1 GB/s): one plain call, never judged, never cut; at a fifth
    of that it is judged, and soon done."""
    for rate in (1e9, 2e8):
        clock = FakeClock()
        count = _auto(clock, 400 << 20)
        _transfer(count, clock, lambda k, _, rate=rate: rate, 400 << 20)
        assert count.tried == [1] and count.alone


def test_a_plain_call_whose_chunks_take_seconds_switches_unmeasured() -> None:
    """A lossy link's single flow and the server's 4 MiB chunks: not one has arrived by
    DECIDE_S, and even counting the one in flight as moved the rest would take far
    longer than SWITCH_S: the call is cut for four streams at once."""
    clock = FakeClock()
    count = _auto(clock, 40 << 20)
    clock.advance(DECIDE_S - 0.1)
    assert not count.poll(4 << 20)
    clock.advance(0.1)
    assert count.poll(4 << 20) and count.parallel and count.current == GROWTH
    assert not count.poll(4 << 20)  # once


def test_a_call_measured_slow_steps_at_once_to_the_streams_that_would_finish_it() -> None:
    """A lossy link's single flow, measured from the server's small first pieces
    (wire.HEAD_BYTES): at its rate 4 streams would still take 22 s for the rest, 16 6 s,
    so the call is cut for 64 at once, within a second (not three steps of a window each), and their
    window, 27 times the call's rate, marks the link flow-limited. A narrow link one flow
    fills steps as far, reads no faster there, and goes back to one call, with whose
    rate the next transfer stays one call; a faster call steps less far."""
    piece = wire.RANGE_CHUNK_BYTES
    clock = FakeClock()
    lossy = _auto(clock, 40 << 20)
    while not lossy.poll(piece):
        clock.advance(piece / FLOW)
        lossy.moved(piece)
    assert lossy.tried == [1, 64] and clock.now < DECIDE_S
    _transfer(lossy, clock, lambda k, _: min(k * FLOW, LINE * 0.95), 30 << 20, piece)
    assert lossy.tried == [1, 64] and lossy.settled and lossy.paid
    assert lossy.rates[0] == pytest.approx(FLOW)
    assert lossy.next_start() == (64, None)
    narrow = _auto(clock, 40_000_000)
    _transfer(narrow, clock, lambda k, _: 1.25e6, 6 << 20, piece)
    assert narrow.tried == [1, 64, 1] and not narrow.paid
    start, known = narrow.next_start()
    assert start == 1 and known == pytest.approx(1.25e6)
    faster = _auto(clock, 40_000_000)  # 5 MB/s: 16 streams would end the rest in 0.5 s
    _transfer(faster, clock, lambda k, _: 5e6, 12 << 20, piece)
    assert faster.tried[:2] == [1, 16]
    # an upload's ranges are 256 KiB at least: 64 streams' lanes would take 33 MB of the
    # 40 at once and leave nothing to judge them by (on a narrow link they stayed)
    upload = _auto(clock, 40_000_000, range_chunk=PARALLEL_CHUNK_BYTES)
    _transfer(upload, clock, lambda k, _: 1.25e6, 12 << 20, PARALLEL_CHUNK_BYTES)
    assert upload.tried[:3] == [1, 16, 1]
    _cut_unmeasured(_auto(clock, 40 << 20), clock)  # no chunk yet: a step of GROWTH


def test_a_plain_call_whose_chunks_stop_coming_is_stalled_not_slow_and_is_not_cut() -> None:
    """A clean link's call moves a chunk every 0.35 s, then the link goes down for 10 s:
    cut for more streams then, their connections were dialled into the outage and came
    up seconds after it (a 10 s cut mid-download cost 18 s). Stalled, it waits; once
    chunks come again it is judged as before."""
    clock = FakeClock()
    count = _auto(clock, 40 << 20)
    for _ in range(3):
        clock.advance(0.35)
        count.moved(4 << 20)
        assert not count.poll(4 << 20)
    for _ in range(50):  # the outage, polled every 0.2 s
        clock.advance(0.2)
        assert not count.poll(4 << 20)
    assert count.alone and count.tried == [1]
    slow = _auto(clock, 400 << 20)  # a chunk every 0.35 s, then a slow one: not a stall
    for _ in range(4):
        clock.advance(0.35)
        slow.moved(4 << 20)
    clock.advance(0.9)
    slow.moved(4 << 20)
    clock.advance(2.5)  # < 3 x 0.9: this wait is still the link's pace
    assert slow.poll(4 << 20) and slow.parallel


def test_a_call_cut_before_it_was_measured_proves_nothing_more_streams_must_gain() -> None:
    """Cut unmeasured (its first chunk late: an outage at its start), on a clean link:
    16 streams gain nothing over 4 and are taken back; the next transfer starts at 4
    and has no history of more streams paying. On a lossy link the step 4 -> 16 is
    measured to pay, and the memory carries that to the next transfer and the other
    direction, where 64 then stay unless slower."""
    clock = FakeClock()
    memory = StreamMemory()
    clean = memory.plan(0, 100 << 20, "down")
    clean._clock, clean._changed_at = clock, 0.0
    clock.advance(DECIDE_S + 0.01)
    assert clean.poll(4 << 20) and clean.current == GROWTH and not clean.paid
    _transfer(clean, clock, lambda k, _: LINE, 60 << 20)
    assert clean.tried[:3] == [1, 4, 16] and clean.current == 4 and not clean.paid
    memory.ended("down", clean)
    assert memory.plan(0, 100 << 20, "down").current == 4
    assert not memory.plan(0, 100 << 20, "up").paid
    lossy = _auto(clock, 100 << 20)
    _transfer(lossy, clock, lambda k, _: min(k * FLOW, LINE * 0.6), 100 << 20)
    assert lossy.paid and lossy.current == 64
    memory.ended("down", lossy)
    upload = memory.plan(0, 100 << 20, "up")
    assert upload.paid and upload.current == 64


def test_a_plain_call_that_waited_for_its_go_ahead_is_judged_from_then() -> None:
    clock = FakeClock()
    count = _auto(clock, 40 << 20)
    clock.advance(10.0)  # the server's transfer slots were all taken
    count.began()
    assert not count.poll(4 << 20)


def test_on_a_clean_link_streams_that_gain_nothing_go_and_the_next_call_stays_plain() -> None:
    """A transfer long enough to be worth a probe (400 MB at 100 Mbit/s): four streams
    move no more than one; the rest goes on one stream, and the next transfers are one
    plain call while they move about as fast, probed again once slower."""
    clock = FakeClock()
    first = _auto(clock, 400 << 20)
    _transfer(first, clock, lambda k, _: LINE * (0.95 if k > 1 else 1.0), 400 << 20)
    # (measured, the call steps as far as its rate says, 64: at 16 flows' worth the rest
    # would take 2.1 s; one window there, and back)
    assert first.tried[:3] == [1, 64, 1] and first.current == 1
    start = first.next_start()
    assert start == (1, pytest.approx(LINE))
    second = _auto(clock, 400 << 20, start[0], known=start[1])
    assert second.alone and not second.parallel  # one call, as transfer_streams = 1
    _transfer(second, clock, lambda k, _: LINE * 0.9, 400 << 20)  # about as fast: no probe
    assert second.tried == [1] and second.next_start() == (1, pytest.approx(LINE))
    slower = _auto(clock, 40 << 20, known=LINE)  # the link turned lossy
    _transfer(slower, clock, lambda k, _: k * FLOW, 40 << 20)
    assert slower.tried == [1, 64]  # (16 flows' worth: 6 s for the rest)


def test_the_next_transfer_starts_where_this_one_stayed_and_an_upload_where_its_download_did() -> (
    None
):
    clock = FakeClock()
    memory = StreamMemory()
    first = memory.plan(0, 100 << 20, "down")
    assert first.alone
    first._clock = clock  # (the fake clock from here on)
    first._changed_at = 0.0
    _cut_unmeasured(first, clock)
    _transfer(first, clock, _overflowing, 100 << 20)
    assert first.tried[:5] == [1, 4, 16, 64, 16]  # (then 64 re-probed now and then)
    memory.ended("down", first)
    upload = memory.plan(0, 100 << 20, "up")  # no upload yet: where the download stayed
    assert upload.current == 16 and upload.parallel
    again = memory.plan(0, 100 << 20, "down")  # not half of it: no probe from 8 up again
    assert again.current == 16 and again.parallel


def test_a_link_that_got_clean_sheds_its_streams_and_its_transfers_become_plain_calls() -> None:
    """Remembered at 16 streams, on a link one flow now fills (and no step measured to
    pay, so 64 are taken back): one transfer in DESCEND_EVERY steps down while fewer
    move as much, to one; the next is a plain call."""
    clock = FakeClock()
    memory = StreamMemory()
    memory._last["up"] = (16, None)
    for _ in range(DESCEND_EVERY - 1):  # these start at 16 and stay there (no gain at 64)
        count = memory.plan(0, 100 << 20, "up")
        assert count.tried == [16]
        count._clock, count._changed_at = clock, clock.now
        _transfer(count, clock, lambda k, _: LINE, 100 << 20)
        assert count.current == 16
        memory.ended("up", count)
    shedding = memory.plan(0, 100 << 20, "up")
    shedding._clock, shedding._changed_at = clock, clock.now
    _transfer(shedding, clock, lambda k, _: LINE, 100 << 20)
    assert shedding.tried[:3] == [16, 4, 1] and shedding.current == 1
    memory.ended("up", shedding)
    assert memory.plan(0, 100 << 20, "up").alone


def test_only_a_transfer_with_room_to_judge_a_descent_starts_one() -> None:
    """At 64 streams a 40 MB upload (256 KiB chunks: 16 MB for a window at 64) cannot
    judge a descent, and stays at 64; a 40 MB download (64 KiB range chunks) can, and
    sheds streams on a link one flow fills."""
    clock = FakeClock()
    memory = StreamMemory()
    for direction in ("up", "down"):
        memory._last[direction] = (64, None)
        memory._above[direction] = DESCEND_EVERY - 1  # the next one would descend
    upload = memory.plan(0, 40 << 20, "up")
    upload._clock, upload._changed_at = clock, clock.now
    _transfer(upload, clock, lambda k, _: LINE, 40 << 20)
    assert upload.tried == [64]
    assert descent_room(64, PARALLEL_CHUNK_BYTES) > 40 << 20
    download = memory.plan(0, 40 << 20, "down")
    download._clock, download._changed_at = clock, clock.now
    _transfer(download, clock, lambda k, _: LINE, 40 << 20)
    assert download.tried[:2] == [64, 16]


def test_a_descent_that_loses_goes_back_up_for_good() -> None:
    """On a lossy link a quarter of the streams move a quarter as much: back to 16."""
    clock = FakeClock()
    count = _auto(clock, 24 << 20, 16, descend=True)
    _transfer(count, clock, lambda k, _: min(k * FLOW, LINE * 0.6), 24 << 20)
    assert count.tried == [16, 4, 16] and count.current == 16
    assert count.next_start() == (16, None)


def test_a_descent_keeps_its_streams_unless_fewer_move_as_much() -> None:
    """16 streams read 10% below 64: a step up would stay (within SLOWER), but a
    descent comes back up to 64: on a lossy link too few streams cost most of its rate;
    a descent cut short by the transfer's end starts the next transfer at 64 too."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20, 64, descend=True)
    _transfer(count, clock, lambda k, _: LINE * (0.9 if k < 64 else 1.0), 100 << 20)
    assert count.tried == [64, 16, 64] and count.current == 64 and count.settled
    short = _auto(clock, 100 << 20, 64, descend=True)
    _transfer(short, clock, lambda k, _: LINE, 24 << 20)  # over before 16 were judged
    assert short.tried == [64, 16] and not short.settled
    assert short.next_start() == (64, None)


def test_a_new_connections_slow_start_is_not_taken_for_no_gain() -> None:
    """The streams just added move nothing for most of the warm-up (handshake, slow
    start): measured from the change on, four streams would look no better than one."""
    clock = FakeClock()
    count = _auto(clock, 40 << 20, limit=16)

    def rate(k: int, since: float) -> float:
        return FLOW * (k if since >= WARMUP_S * 0.9 else k // GROWTH or 1)

    _cut_unmeasured(count, clock)
    _transfer(count, clock, rate, 40 << 20)
    assert count.tried == [1, 4, 16] and count.settled  # the limit


def test_a_slow_stream_is_measured_over_several_chunks_not_one() -> None:
    """At ~0.6 s a chunk, a window of MEASURE_S would hold one chunk or none."""
    clock = FakeClock()
    count = _auto(clock, 40 << 20)
    slow = 0.4e6
    _transfer(count, clock, lambda k, _: slow, 2 * CHUNK)
    assert count.tried == [1]  # still measuring: too few chunks to tell
    _transfer(count, clock, lambda k, _: slow, 4 * CHUNK)
    assert count.tried == [1, 64]  # (at 16 flows' worth the rest would take 6 s)
    assert clock.now > WARMUP_S + MEASURE_S


def test_a_window_holds_about_a_chunk_per_stream() -> None:
    """A chunk arrives whole: with 16 streams, 4 chunks that land together right after
    the warm-up (streams started together finish their first ones together) would read
    as a rate four times the link's; the window waits for one chunk per stream."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20, 16)
    clock.advance(WARMUP_S)
    count.moved(CHUNK)  # the window opens
    for _ in range(5):
        clock.advance(MEASURE_S / 5)
        count.moved(CHUNK)
    assert count.tried == [16] and not count.rates  # 5 chunks in MEASURE_S: not judged
    for _ in range(11):
        count.moved(CHUNK)
    assert count.tried == [16, 64] and len(count.rates) == 1


def test_what_moves_once_every_range_is_handed_out_changes_no_count() -> None:
    """At a transfer's end its streams run out of ranges one by one: the rate falls, and
    the count that moved it must not be taken for slower."""
    clock = FakeClock()
    count = _auto(clock, 8 << 20, 4, paid=True)
    cutter = RangeCutter.over_download(0, 8 << 20)
    _transfer(count, clock, lambda k, _: k * FLOW, 4 << 20)  # 4 -> 16 paid
    assert count.tried == [4, 16]
    while cutter.take(count, want=LINE) is not None:
        pass
    clock.advance(WARMUP_S)
    _transfer(count, clock, lambda k, _: FLOW, 4 << 20)  # the last range's stream alone
    assert count.tried == [4, 16] and count.next_start() == (16, None)


def test_a_transfer_over_mid_step_starts_the_next_at_that_step_unless_the_call_was_alone() -> None:
    """Ended before 64 streams were measured, after 16 paid: the next starts at 64 (it
    would be kept unless slower); ended before 4 were measured against a plain call:
    the next is a plain call."""
    clock = FakeClock()
    count = _auto(clock, 100 << 20, 4)
    _transfer(count, clock, lambda k, _: k * FLOW, 12 << 20)
    assert count.tried == [4, 16, 64] and not count.settled
    assert count.next_start() == (64, None)
    plain = _auto(clock, 40 << 20)
    _transfer(plain, clock, lambda k, _: FLOW, 2 << 20)
    assert plain.tried == [1, 64] and plain.rates[0] > 0 and not plain.settled
    assert plain.next_start() == (1, None)


def test_a_step_the_transfers_end_cut_short_is_judged_over_all_it_moved() -> None:
    """6 MB at 0.5 MB/s a flow: the call, measured, is cut for 16 streams, and the last
    range is handed out before their window ends; counted from the step (warm-up and
    all) they moved 16 times the call's rate: they paid, and the next transfer starts
    at 16, not as one call probed again."""
    piece, flow, total = wire.RANGE_CHUNK_BYTES, 0.5e6, 6 << 20
    clock = FakeClock()
    count = _auto(clock, total)
    while not count.poll(piece):
        clock.advance(piece / flow)
        count.moved(piece)
    assert count.tried == [1, 16]
    cutter = RangeCutter.over_download(count.moved_bytes, total)
    while (byte_range := cutter.take(count, want=1e9)) is not None:
        size = byte_range[1] - byte_range[0]
        clock.advance(size / (16 * flow))
        count.moved(size)
    assert count.tried == [1, 16] and count.paid and count.rates[-1] > PAID_GAIN * flow
    assert count.next_start() == (16, None)


def test_a_fixed_count_and_one_started_at_the_limit_never_change() -> None:
    clock = FakeClock()
    for count in (StreamCount(8, 8, adaptive=False, clock=clock), StreamCount(64, 64, clock=clock)):
        _transfer(count, clock, lambda k, _: k * FLOW, 40 << 20)
        assert count.tried == [count.current] and count.settled


def test_an_uploads_ranges_end_at_chunks_and_stay_within_what_the_server_accepts() -> None:
    sizes = [CHUNK] * 400 + [1000]
    cutter = RangeCutter.over_chunks(sizes)
    count = StreamCount.fixed(64)
    ranges = list(iter(lambda: cutter.take(count), None))
    ends = set(itertools.accumulate(sizes))
    assert len(ranges) <= wire.MAX_UPLOAD_RANGES
    assert all(end in ends for _, end in ranges)
    assert ranges[0][0] == 0 and ranges[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_a_plain_uploads_first_bytes_go_in_range_chunks_that_end_where_its_chunks_do() -> None:
    """A plain call the automatic count judges sends its first HEAD_BYTES in ranges'
    chunks (a slow link's single flow moves no 4 MiB chunk in the second it is judged
    in), the rest whole; a call cut or resumed at any of them continues in ranges or
    another call from there. Chunks that ranges' do not cut go as they are."""
    state = ModelState({"b": torch.ones(10), "w": torch.arange(3_000_000, dtype=torch.float32)})
    update = UpdateChunks(state.chunks, 4 << 20)
    headed = update.with_head()
    sizes = headed.sizes()
    head = 1 + (4 << 20) // PARALLEL_CHUNK_BYTES  # the bias, then 4 MiB in 256 KiB
    assert sizes[:head] == [40] + [PARALLEL_CHUNK_BYTES] * (head - 1)
    assert sizes[head:] == [4 << 20, 12_000_040 - 40 - (8 << 20)]
    assert set(itertools.accumulate(sizes)) <= set(
        itertools.accumulate(update.for_ranges().sizes())
    )
    whole = b"".join(bytes(c.data) for c in update())
    assert b"".join(bytes(c.data) for c in headed()) == whole
    resumed = b"".join(bytes(c.data) for c in headed.between(40 + 3 * PARALLEL_CHUNK_BYTES, None))
    assert resumed == whole[40 + 3 * PARALLEL_CHUNK_BYTES :]
    assert headed.in_flight(0) == PARALLEL_CHUNK_BYTES and headed.in_flight(8 << 20) == 4 << 20
    odd = UpdateChunks(state.chunks, 1_000_000)  # no multiple of ranges' chunks
    assert odd.with_head() is odd and odd.in_flight(0) == 1_000_000


def test_a_downloads_ranges_never_shrink_below_the_servers_range_pieces() -> None:
    """A range gets the server's pieces that start in it, so a download's ranges cut
    to a few KB near the end were calls that got one piece or none: with 64 streams at
    1% loss 39-45% of line rate, 64-76% with ranges of at least a piece."""
    total = 40 << 20
    cutter = RangeCutter.over_download(0, total, first_end=64 * 1024)
    count = StreamCount.fixed(64)
    ranges = list(iter(lambda: cutter.take(count, want=8 * 1024), None))
    assert ranges[0] == (0, 64 * 1024)  # the first call's range, asked before the size
    assert all(end - start >= wire.RANGE_CHUNK_BYTES for start, end in ranges[1:-1])
    assert len(ranges) <= 2 + total // wire.RANGE_CHUNK_BYTES
    assert ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_ranges_shrink_as_the_transfer_ends_and_one_stream_left_alone_takes_the_rest() -> None:
    cutter = RangeCutter(0, 40 << 20)
    probing = StreamCount(1, 64)
    first, second = (cutter.take(probing, want=LINE * RANGE_S) for _ in range(2))
    assert first is not None and second is not None
    assert second[1] - second[0] < first[1] - first[0]  # room left for streams added later
    alone = StreamCount.fixed(1)
    assert cutter.take(alone) == (second[1], 40 << 20)
    assert cutter.take(alone) is None and cutter.exhausted


def test_a_stream_takes_what_it_moves_in_range_s_so_a_slow_one_never_holds_the_end() -> None:
    """Sized only to the streams' count, the second range of a 40 MB transfer went to a
    lossy link's single flow as 10 MB (23 s at 0.44 MB/s), and the transfer waited for
    it long after the streams added meanwhile had moved the rest."""
    cutter = RangeCutter.over_chunks([CHUNK] * 160)
    count = StreamCount.fixed(4)
    first = cutter.take(count)  # no rate known yet
    assert first == (0, FIRST_RANGE_BYTES)
    slow = cutter.take(count, want=FLOW * RANGE_S)
    assert slow is not None and slow[1] - slow[0] == 2 * CHUNK  # 0.44 MB, to a chunk
    fast = cutter.take(count, want=LINE * RANGE_S)
    assert fast is not None and fast[1] - fast[0] == 10 * CHUNK  # capped: 1/16 of the 154 left


def test_while_the_count_may_grow_ranges_are_cut_for_its_limit() -> None:
    """At 1% loss the round-1 download's first four streams took 1 MB ranges while they
    had the link to themselves; once 64 streams shared it those took 7-8 s, and the
    download ended 5 s after its last range was handed out. Ranges are cut for the most
    streams the count may reach: 1 / (4 x 64) of what is left, however fast the asking
    stream moved its last."""
    cutter = RangeCutter.over_download(0, 40 << 20)
    probing = StreamCount(4, 64)
    assert not probing.settled
    for want in (None, FLOW * RANGE_S, LINE * RANGE_S):
        byte_range = cutter.take(probing, want)
        assert byte_range is not None
        left = (40 << 20) - byte_range[0]
        assert byte_range[1] - byte_range[0] == max(wire.RANGE_CHUNK_BYTES, left // (4 * 64))
    assert FIRST_RANGE_BYTES > (40 << 20) // (4 * 64)  # (what the first took before)


def test_streams_added_while_a_transfer_runs_take_ranges_and_every_byte_goes_once() -> None:
    clock = FakeClock()
    count = StreamCount(2, 8, clock=clock)  # (ranges from the start: a count remembered)
    total = 64 << 20
    cutter = RangeCutter.over_chunks([CHUNK] * (total // CHUNK))
    used: list[tuple[int, tuple[int, int]]] = []
    lock = threading.Lock()

    def send(stream: int, byte_range: tuple[int, int]) -> int:
        start, end = byte_range
        for _ in range(start, end, CHUNK):
            with lock:  # every stream adds its share: a lossy link
                clock.advance(CHUNK / (count.current * FLOW))
                count.moved(CHUNK)
            time.sleep(0.001)  # (real time too, so that the new streams' threads start)
        with lock:
            used.append((stream, byte_range))
        return start

    results = run_ranges(cutter, count, send)
    assert count.tried[-1] == 8 and max(stream for stream, _ in used) == 7
    assert results == sorted(start for _, (start, _) in used)
    covered = sorted(byte_range for _, byte_range in used)
    assert covered[0][0] == 0 and covered[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_a_failed_stream_stops_the_others_and_is_raised() -> None:
    count = StreamCount.fixed(2)
    cutter = RangeCutter(0, 1 << 20)
    sent: list[int] = []

    def send(stream: int, byte_range: tuple[int, int]) -> None:
        sent.append(stream)
        if len(sent) == 2:
            raise ConnectionError("the link broke")

    with pytest.raises(ConnectionError, match="the link broke"):
        run_ranges(cutter, count, send)
    assert len(sent) <= 2 * LANES  # no stream took a new range after the failure


def test_streams_a_descent_retired_start_again_when_the_count_comes_back_up() -> None:
    """A descent on a lossy link: 4 streams -> 1 (a quarter as fast) -> 4 again; the
    three the descent retired take ranges again (before, a retired stream's lanes were
    counted as running and never started again)."""
    clock = FakeClock()
    count = StreamCount(4, 16, total=64 << 20, descend=True, clock=clock)
    cutter = RangeCutter.over_chunks([CHUNK] * (256))
    used: list[tuple[int, int]] = []  # (stream, count.tried's length when it took it)
    lock = threading.Lock()

    def send(stream: int, byte_range: tuple[int, int]) -> None:
        with lock:
            used.append((stream, len(count.tried)))
        for _ in range(byte_range[0], byte_range[1], CHUNK):
            with lock:
                clock.advance(CHUNK / (min(count.current, 4) * FLOW))
                count.moved(CHUNK)
            time.sleep(0.001)

    run_ranges(cutter, count, send)
    assert count.tried[:3] == [4, 1, 4]
    assert any(stream > 0 and tried >= 3 for stream, tried in used), used
