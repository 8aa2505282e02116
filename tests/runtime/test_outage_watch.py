"""The outage watch (fake clock, fake dials): a session's connections are replaced only
when a dial failed during the transfers' stall (the link was down) and a later one goes
through while they are still stalled (the link is back, their connections are not)."""

from __future__ import annotations

from collections.abc import Callable

from fake_clock import FakeClock

from fedtrain.runtime.site.outage_watch import (
    DIAL_EVERY_S,
    DIAL_UP_MAX_S,
    DOWN_S,
    LOOK_S,
    OutageWatch,
)
from fedtrain.runtime.site.streams import STALL_S, StreamCount


class World:
    """A clock, a transfer's count on it, and a server reachable or not."""

    def __init__(self) -> None:
        self.clock = FakeClock(100.0)
        self.count = StreamCount(1, 1, adaptive=False, clock=self.clock)
        self.link_up = True
        self.dials: list[float] = []
        self.replaced = 0
        #: Runs during a dial (chunks that arrive meanwhile).
        self.during_dial: Callable[[], None] = lambda: None
        self.watch = OutageWatch(self._dial, self._replace, clock=self.clock, sleep=self._sleep)
        #: Runs while the watch waits after a dial (what arrives meanwhile).
        self.during_wait: Callable[[], None] = lambda: None

    def _sleep(self, seconds: float) -> None:
        self.clock.now += seconds
        self.during_wait()

    def _dial(self, timeout_s: float) -> bool:
        self.dials.append(self.clock.now)
        self.during_dial()
        if not self.link_up:
            self.clock.now += timeout_s
        return self.link_up

    def _replace(self, since: float) -> bool:
        assert since == self.count.arrived_at
        self.replaced += 1
        return True

    def chunks(self, n: int, every_s: float = 0.1) -> None:
        for _ in range(n):
            self.clock.now += every_s
            self.count.moved(1000)

    def outage(self, seconds: float) -> None:
        """The link is down for `seconds` (nothing moves, dials fail), then back."""
        self.link_up = False
        self.run(seconds)
        self.link_up = True

    def run(self, seconds: float) -> None:
        """Look at the transfer, as the watch's thread does, for `seconds`."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += max(self.watch.look([self.count]), 0.01)


def test_a_moving_transfer_is_never_dialled_for() -> None:
    world = World()
    for _ in range(50):
        world.chunks(1, every_s=0.3)
        assert world.watch.look([world.count]) == LOOK_S
    assert world.dials == [] and world.replaced == 0


def test_a_transfer_yet_to_move_its_first_chunk_is_not_stalled() -> None:
    world = World()
    world.run(30)  # waiting for the server's go-ahead, say
    assert world.dials == []


def test_connections_silent_after_the_link_came_back_are_replaced_once() -> None:
    world = World()
    world.chunks(10)
    world.link_up = False  # the outage: nothing moves, dials fail
    world.run(10)
    failed = len(world.dials)
    assert failed >= 3 and world.replaced == 0
    # the first dial came once the silence passed the stall bound, not before
    assert world.dials[0] - 101.0 >= STALL_S
    world.link_up = True  # the link is back; the transfer's connection still backs off
    world.run(DIAL_EVERY_S + 0.5)
    assert world.replaced == 1
    world.run(20)  # dials go through while the rejoin is under way: nothing more replaced
    assert world.replaced == 1


def test_a_dial_that_goes_through_only_once_the_link_came_back_replaces_them() -> None:
    """A short outage: the only dial made during it waits for the link, and goes through
    after DOWN_S (its packets were sent again): the link was down and is back."""
    world = World()
    world.chunks(10)

    def link_comes_back() -> None:
        world.clock.now += DOWN_S + 0.2
        world.during_dial = lambda: None

    world.during_dial = link_comes_back
    world.run(10)
    assert len(world.dials) > 1 and world.replaced == 1


def test_a_connection_that_moves_again_as_the_link_comes_back_is_kept() -> None:
    world = World()
    world.chunks(10)
    world.outage(5)
    world.during_dial = lambda: world.count.moved(1000)  # its retransmission got through
    world.run(5)
    assert world.replaced == 0


def test_a_stall_while_the_server_is_reachable_replaces_nothing_and_dials_ever_less() -> None:
    world = World()  # e.g. a busy server that has stopped reading for a while
    world.chunks(10)
    world.run(120)
    assert world.replaced == 0
    gaps = [b - a for a, b in zip(world.dials, world.dials[1:], strict=False)]
    assert gaps[:4] == [DIAL_EVERY_S, 2 * DIAL_EVERY_S, 4 * DIAL_EVERY_S, 8 * DIAL_EVERY_S]
    assert max(gaps) <= DIAL_UP_MAX_S + LOOK_S


def test_after_chunks_move_again_an_old_failed_dial_is_no_evidence() -> None:
    """A failed dial belongs to its stall: once chunks move, the next stall starts over."""
    world = World()
    world.chunks(10)
    world.outage(3)
    world.chunks(5)  # the old connection recovered by itself
    world.watch.look([world.count])
    world.run(10)  # stalled again (the server stopped reading), dials go through
    assert world.replaced == 0


def test_an_answer_from_the_server_as_the_link_comes_back_keeps_the_connections() -> None:
    """The server had cut the stalled upload (its slot was wanted): the cut's status
    arrives on the old connection as the link comes back, so that connection works, and
    the upload's next try waits for a slot without moving: no outage's doing."""
    world = World()
    world.chunks(10)
    world.outage(5)
    world.during_wait = world.watch.heard
    world.run(1)
    world.during_wait = lambda: None
    world.run(30)
    assert world.replaced == 0 and world.dials


def test_while_the_server_talks_the_transfers_are_not_stalled() -> None:
    world = World()
    world.chunks(10)
    for _ in range(40):
        world.clock.now += 0.5
        world.watch.heard()  # e.g. the control stream's messages
        world.watch.look([world.count])
    assert world.dials == []
