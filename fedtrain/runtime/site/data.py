"""Which examples a site trains (and evaluates) on.

A real site holds its own data: files named in site.toml (`data.source = "parquet"`,
`"csv"` or `"imagefolder"`, read by `fedtrain.datasources`, no code to write), or
whatever a custom task returns from an optional `site_data(site_name, **options)`
hook. The bundled examples instead ship one public dataset, so each site takes its
slice of an agreed split (same partitioner, seed and number of parts everywhere),
exactly as the simulation's virtual clients do. A held-out set (`eval_path`,
`eval_fraction`, or the hook's `SiteData.test`) is evaluated at the site.
"""

from __future__ import annotations

import logging

import numpy as np
from torch.utils.data import Dataset, Subset

from fedtrain.datasources import holdout
from fedtrain.errors import ConfigError, TaskError
from fedtrain.partition import LABEL_PARTITIONERS, partition
from fedtrain.runtime.config import FILE_SOURCES, DataConfig
from fedtrain.task import SiteData, Task

log = logging.getLogger(__name__)

#: Name of the optional Task method that returns a site's own training data.
HOOK = "site_data"


def site_dataset(task: Task, config: DataConfig, site_name: str) -> Dataset:
    """This site's training set, per the `[data]` table of site.toml."""
    return site_data(task, config, site_name).train


def site_data(task: Task, config: DataConfig, site_name: str) -> SiteData:
    """This site's training set and held-out set (None without one)."""
    if config.source in FILE_SOURCES:
        return file_data(config)
    if config.source == "task":
        return _hook_data(task, config, site_name)
    return SiteData(
        *holdout(_partition(task, config, site_name), config.eval_fraction, config.seed)
    )


def file_data(config: DataConfig) -> SiteData:
    """The files `config.path` names, and the held-out set (`eval_path`/`eval_fraction`)."""
    train = _read(config, config.path)
    if config.eval_path:
        return SiteData(train, _read(config, config.eval_path))
    train, test = holdout(train, config.eval_fraction, config.seed)
    return SiteData(train, test)


def _read(config: DataConfig, path: str) -> Dataset:
    if config.source == "imagefolder":
        from fedtrain.datasources.images import ImageFolder

        return ImageFolder(
            path, classes=config.classes, size=config.image_size, mode=config.image_mode
        )
    from fedtrain.datasources.tabular import read_table

    return read_table(
        path,
        "parquet" if config.source == "parquet" else "csv",
        label=config.label,
        features=config.features,
        classes=config.classes,
        batch_rows=config.batch_rows,
    )


def _hook_data(task: Task, config: DataConfig, site_name: str) -> SiteData:
    hook = getattr(task, HOOK, None)
    if hook is None:
        raise ConfigError(
            f"data.source = 'task' but {type(task).__name__} has no {HOOK}(site_name, "
            "**options) method; add one or use data.source = 'partition'"
        )
    data = hook(site_name, **config.options)
    if isinstance(data, Dataset):
        data = SiteData(data)
    if not isinstance(data, SiteData):
        raise TaskError(
            f"{type(task).__name__}.{HOOK}() returned a {type(data).__name__}, not a "
            "torch Dataset or SiteData"
        )
    return data


def _partition(task: Task, config: DataConfig, site_name: str) -> Dataset:
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
