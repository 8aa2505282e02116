"""Unauthenticated streams are few and short-lived (AdmissionGate)."""

from __future__ import annotations

import threading
from contextlib import ExitStack

from fedtrain.runtime.admission import AdmissionGate


def test_the_gate_bounds_pending_peers_per_address_and_in_all() -> None:
    gate = AdmissionGate(3, per_address=2, timeout_s=60)
    with ExitStack() as stack:
        slots = [
            stack.enter_context(gate.pending(f"ipv4:10.0.0.1:{i}", lambda: None)) for i in range(3)
        ]
        assert [s.granted for s in slots] == [True, True, False]  # per address
        other = stack.enter_context(gate.pending("ipv4:10.0.0.2:1", lambda: None))
        assert other.granted and len(gate) == 3
        assert not stack.enter_context(gate.pending("ipv4:10.0.0.3:1", lambda: None)).granted
    assert len(gate) == 0  # every slot comes back
    with gate.pending("ipv4:10.0.0.1:9", lambda: None) as slot:
        assert slot.granted


def test_a_peer_that_does_not_answer_in_time_is_cancelled() -> None:
    gate = AdmissionGate(4, timeout_s=0.05)
    cancelled = threading.Event()
    with gate.pending("ipv4:10.0.0.1:1", cancelled.set) as slot:
        assert cancelled.wait(5)
        assert slot.expired
    with gate.pending("ipv4:10.0.0.1:1", cancelled.clear) as slot:
        pass
    assert not slot.expired
