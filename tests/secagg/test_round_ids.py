"""Protocol round ids read back as the round and attempt an operator knows."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedtrain.errors import SecAggError
from fedtrain.secagg import SecAggConfig, run_in_memory
from fedtrain.secagg.round_ids import describe, round_id


def test_an_attempt_of_a_round_reads_back_as_round_and_attempt() -> None:
    assert round_id(10, 1) == 10_000_001
    assert describe(round_id(10, 1)) == "round 10 (attempt 1)"
    assert describe(round_id(3, 999_999)) == "round 3 (attempt 999999)"
    assert describe(7) == "round 7"  # a driver that never retries numbers plain rounds
    assert describe(2_000_000) == "round 2000000"  # no attempt 0: a plain number
    with pytest.raises(SecAggError, match="attempt 0 is out of range"):
        round_id(4, 0)


def test_protocol_log_lines_and_errors_say_round_and_attempt(caplog) -> None:
    """Never "secagg round 10000001": an operator knows rounds and attempts."""
    caplog.set_level(logging.INFO, logger="fedtrain.secagg")
    vectors = [np.full(8, 0.1 * i, dtype=np.float32) for i in range(1, 4)]
    config = SecAggConfig(clip=1.0, max_clients=8, max_weight=10.0)
    run_in_memory(vectors, [1.0, 2.0, 3.0], config, round_id=round_id(10, 2), rng=0)
    assert "secure aggregation, round 10 (attempt 2): unmasked the sum of 3/3 sites" in (
        caplog.messages
    )
    with pytest.raises(SecAggError, match=r"^round 10 \(attempt 2\): .*too many dropouts"):
        run_in_memory(vectors, [1.0] * 3, config, {1: {1, 2}}, round_id=round_id(10, 2), rng=0)
    assert not [m for m in caplog.messages if "10000002" in m], caplog.messages
