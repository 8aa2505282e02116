"""Which examples a site trains on.

A real site holds its own data, which a custom task returns from an optional
`site_data(site_name, **options)` hook. The bundled examples instead ship one public
dataset, so each site takes its slice of an agreed split (same partitioner, seed and
number of parts everywhere), exactly as the simulation's virtual clients do.
"""

from __future__ import annotations

import logging

import numpy as np
from torch.utils.data import Dataset, Subset

from fedtrain.errors import ConfigError, TaskError
from fedtrain.partition import LABEL_PARTITIONERS, partition
from fedtrain.runtime.config import DataConfig
from fedtrain.task import SiteData, Task

log = logging.getLogger(__name__)

#: Name of the optional Task method that returns a site's own training data.
HOOK = "site_data"


def site_dataset(task: Task, config: DataConfig, site_name: str) -> Dataset:
    """This site's training set, per the `[data]` table of site.toml."""
    if config.source == "task":
        hook = getattr(task, HOOK, None)
        if hook is None:
            raise ConfigError(
                f"data.source = 'task' but {type(task).__name__} has no {HOOK}(site_name, "
                "**options) method; add one or use data.source = 'partition'"
            )
        data = hook(site_name, **config.options)
        if isinstance(data, SiteData):
            data = data.train
        if not isinstance(data, Dataset):
            raise TaskError(
                f"{type(task).__name__}.{HOOK}() returned a {type(data).__name__}, not a "
                "torch Dataset or SiteData"
            )
        return data
    train, _ = task.datasets()
    needs_labels = config.kind in LABEL_PARTITIONERS
    labels = task.labels(train).numpy() if needs_labels else np.zeros(len(train))  # type: ignore[arg-type]
    parts = partition(
        config.kind,
        labels,
        config.num_partitions,
        seed=config.seed,
        alpha=config.alpha,
        labels_per_client=config.labels_per_client,
    )
    mine = parts[config.partition]
    log.info(
        "site %r trains on part %d of %d (%s split): %d examples",
        site_name,
        config.partition,
        config.num_partitions,
        config.kind,
        len(mine),
    )
    return Subset(train, mine.tolist())
