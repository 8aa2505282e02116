"""`max_transfers` slots: a transfer's streams share one; a cut transfer's is freed at once."""

from __future__ import annotations

import asyncio

from fedtrain.runtime.server.transfer_slots import TransferSlots


def test_a_freed_slot_goes_to_the_next_transfer_before_the_cut_streams_unwind() -> None:
    async def scenario() -> list[str]:
        slots: TransferSlots[str] = TransferSlots(1)
        meters = {"rogue": "meter-rogue", "honest": "meter-honest"}  # one object each
        closed: list[str] = []
        events: list[str] = []
        unwind = asyncio.Event()

        async def stream(key: str) -> None:
            async with slots.hold(key, lambda: meters[key], closed.append) as meter:
                events.append(f"{key} granted {meter}")
                await unwind.wait()  # a cut stream whose end waits on its site
            events.append(f"{key} ended")

        cut = [asyncio.create_task(stream("rogue")) for _ in range(2)]  # two of one transfer
        await asyncio.sleep(0)
        waiting = asyncio.create_task(stream("honest"))
        await asyncio.sleep(0.01)
        assert events == ["rogue granted meter-rogue"] * 2 and len(slots) == 2
        assert slots.waiting == 1  # what makes the servicer cut an idle transfer
        assert slots.free(meters["rogue"], closed.append)
        assert not slots.free(meters["rogue"], closed.append)  # once
        await asyncio.sleep(0.01)
        assert events[-1] == "honest granted meter-honest"  # the slot, while rogue unwinds
        assert slots.waiting == 0
        unwind.set()
        await asyncio.gather(*cut, waiting)
        assert closed == ["meter-rogue", "meter-honest"]  # each closed once
        assert slots.semaphore._value == 1 and len(slots) == 0  # nothing released twice
        return events

    asyncio.run(scenario())
