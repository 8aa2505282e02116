"""Virtual clients spread over a machine's GPUs."""

from __future__ import annotations

import pytest

from fedtrain.errors import ConfigError
from fedtrain.parallel.placement import assign_devices, slots

GPUS = ["cuda:0", "cuda:1", "cuda:2"]
CLIENTS = [f"c{i}" for i in range(7)]


def test_round_robin_with_one_gpu_or_less_per_client():
    for share in (1, 0.5, 0.25):
        placed = assign_devices(CLIENTS, GPUS, share)
        assert [placed[c] for c in CLIENTS] == [(GPUS[i % 3],) for i in range(7)]
    assert slots(GPUS, 1) == 3 and slots(GPUS, 0.5) == 6 and slots(GPUS, 1 / 3) == 9


def test_several_gpus_per_client_take_consecutive_groups():
    placed = assign_devices(CLIENTS, [*GPUS, "cuda:3", "cuda:4"], 2)
    assert placed["c0"] == ("cuda:0", "cuda:1")
    assert placed["c1"] == ("cuda:2", "cuda:3")
    assert placed["c2"] == ("cuda:0", "cuda:1")  # cuda:4 is left over
    assert slots(GPUS, 2) == 1


def test_no_gpus_means_cpu_and_bad_requests_are_refused():
    assert assign_devices(["a", "b"], [], 0.5) == {"a": ("cpu",), "b": ("cpu",)}
    assert slots([], 1) == 1
    for share, match in [(0, "must be > 0"), (1.5, "whole number"), (4, "only 3 GPU")]:
        with pytest.raises(ConfigError, match=match):
            assign_devices(CLIENTS, GPUS, share)
    with pytest.raises(ConfigError, match="twice"):
        assign_devices(CLIENTS, ["cuda:0", "cuda:0"], 1)
