"""Site daemon pieces that need no server: the streamed delta, backoff, data selection."""

from __future__ import annotations

import pytest
import torch
from runtime_support import TinyTask
from torch.utils.data import Subset, TensorDataset

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.partition import partition
from fedtrain.runtime.config import DataConfig, SiteConfig
from fedtrain.runtime.site.daemon import Backoff, SiteDaemon, delta_chunks
from fedtrain.runtime.site.data import site_dataset
from fedtrain.strategy import compute_delta
from fedtrain.tensors import ModelState, assemble


def test_streamed_delta_equals_compute_delta() -> None:
    gen = torch.Generator().manual_seed(0)
    global_state = ModelState(
        {
            "w": torch.randn(37, 5, generator=gen).to(torch.bfloat16),
            "b": torch.randn(300, generator=gen),
            "steps": torch.arange(11),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4),
        }
    )
    local = ModelState(
        {
            k: (~v if v.dtype == torch.bool else v + torch.ones_like(v))
            for k, v in global_state.items()
        }
    )
    chunks = list(delta_chunks(local, global_state, 64))
    assert len(chunks) > len(global_state)  # really chunked
    assert max(len(c.data) for c in chunks) <= 64
    assert assemble(chunks, global_state.specs).equal(compute_delta(local, global_state))


def test_backoff_grows_with_jitter_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.5, 4.0)
    delays = [backoff.next() for _ in range(8)]
    assert all(0.5 <= d <= 4.0 for d in delays)
    assert delays[0] == 0.5  # the first retry is quick
    assert backoff._cap == 4.0
    backoff.reset()
    assert backoff.next() == 0.5


def test_partitioned_site_data_matches_the_agreed_split() -> None:
    task = TinyTask()
    train = task.datasets()[0]
    config = DataConfig(kind="dirichlet", alpha=0.3, partition=2, num_partitions=3, seed=7)
    data = site_dataset(task, config, "site-2")
    expected = partition("dirichlet", task.labels(train).numpy(), 3, seed=7, alpha=0.3)[2]
    assert isinstance(data, Subset) and data.indices == expected.tolist()


def test_task_hook_provides_site_data_or_a_clear_error() -> None:
    class WithHook(TinyTask):
        def site_data(self, site_name: str, rows: int) -> TensorDataset:
            return TensorDataset(torch.zeros(rows, 8), torch.zeros(rows, dtype=torch.long))

    data = site_dataset(WithHook(), DataConfig(source="task", options={"rows": 5}), "x")
    assert len(data) == 5
    with pytest.raises(ConfigError, match="has no site_data"):
        site_dataset(TinyTask(), DataConfig(source="task"), "x")


def test_site_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data.partition = 3 must be in \[0, 2\)"):
        from_dict(SiteConfig, {"task": "t:T", "data": {"partition": 3, "num_partitions": 2}})
    with pytest.raises(ConfigError, match=r"reconnect\.min_s"):
        from_dict(SiteConfig, {"task": "t:T", "reconnect": {"min_s": 5.0, "max_s": 1.0}})
    with pytest.raises(ConfigError, match=r"unknown key data\.partitions"):
        from_dict(SiteConfig, {"task": "t:T", "data": {"partitions": 2}})
    task = TinyTask()
    with pytest.raises(ConfigError, match="`name` is required without TLS"):
        SiteDaemon(from_dict(SiteConfig, {"task": "t:T"}), insecure=True, task=task)
    with pytest.raises(ConfigError, match=r"tls\.ca, tls\.cert, tls\.key not set"):
        SiteDaemon(from_dict(SiteConfig, {"task": "t:T"}), task=task)
