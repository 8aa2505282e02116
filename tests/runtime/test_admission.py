"""Unauthenticated streams are few (AdmissionGate); the servicer bounds how long they wait."""

from __future__ import annotations

from contextlib import ExitStack

from fedtrain.runtime.server.admission import AdmissionGate


def test_the_gate_bounds_pending_peers_per_address_and_in_all() -> None:
    gate = AdmissionGate(3, per_address=2, timeout_s=60)
    with ExitStack() as stack:
        slots = [stack.enter_context(gate.pending(f"ipv4:10.0.0.1:{i}")) for i in range(3)]
        assert [s.granted for s in slots] == [True, True, False]  # per address
        other = stack.enter_context(gate.pending("ipv4:10.0.0.2:1"))
        assert other.granted and len(gate) == 3
        assert not stack.enter_context(gate.pending("ipv4:10.0.0.3:1")).granted
    assert len(gate) == 0  # every slot comes back
    with gate.pending("ipv4:10.0.0.1:9") as slot:
        assert slot.granted


def test_a_slot_comes_back_when_the_admission_fails() -> None:
    gate = AdmissionGate(1)
    try:
        with gate.pending("ipv4:10.0.0.1:1") as slot:
            assert slot.granted
            raise TimeoutError("no answer")  # what the servicer's wait_for raises
    except TimeoutError:
        pass
    assert len(gate) == 0
    with gate.pending("ipv4:10.0.0.1:2") as slot:
        assert slot.granted
