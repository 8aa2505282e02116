"""FSDP inside a site: the worker group shards the model across its gloo ranks."""

from __future__ import annotations

import pytest
from _ddp_tasks import (
    CONFIG,
    SEED,
    SITE,
    BlocksTask,
    assert_same_model,
    global_state,
    one_process_twice_the_batch,
)

from fedtrain.config import from_dict
from fedtrain.parallel import WorkerGroup
from fedtrain.runtime.config import SiteConfig
from fedtrain.runtime.site.workers import worker_group

pytestmark = pytest.mark.integration


def test_a_sharded_round_equals_one_unsharded_process_with_twice_the_batch():
    """2 gloo ranks shard BlockNet (a frozen block, a trained block, a head); the
    federated tensors come back gathered on rank 0, equal to one process's step."""
    start = global_state(BlocksTask())
    with WorkerGroup(
        "_ddp_tasks:BlocksTask", {"n": 96}, nproc=2, seed=SEED, client_id=SITE, sharding="fsdp"
    ) as group:
        local, result = group.train_round(start, CONFIG, timeout_s=120)
        again, _ = group.train_round(start, CONFIG, timeout_s=120)  # scatter: a fresh start
    expected_state, expected = one_process_twice_the_batch(task_class=BlocksTask)
    assert list(local) == ["blocks.1.0.weight", "blocks.1.0.bias", "head.weight", "head.bias"]
    assert_same_model(local, expected_state)
    assert_same_model(again, expected_state)
    assert result.num_examples == 96
    assert result.metrics["train_loss"] == pytest.approx(expected.metrics["train_loss"], rel=1e-5)
    assert not local.equal(start)


def test_site_toml_sharding_reaches_the_worker_group():
    config = from_dict(
        SiteConfig,
        {"task": "_ddp_tasks:BlocksTask", "name": "a", "nproc": 2, "sharding": "fsdp"},
    )
    group = worker_group(config, "a")
    assert group is not None and group.spec.sharding == "fsdp"
