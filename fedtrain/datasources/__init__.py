"""Site data from files, configured in site.toml rather than written as code.

Hospitals keep tables and images in files: Parquet written by Spark or Hadoop jobs
(often a partitioned folder, `key=value/part-*.parquet`), CSV exports, folders of
images with one sub-folder per class. These readers turn them into torch datasets the
default `TorchTask` loop trains on:

- `tabular.read_table`: Parquet (a file or a partitioned dataset) or CSV (a file or a
  folder of them) through `pyarrow.dataset`, read file by file and batch by batch, so
  only the columns used are ever decoded and no whole table (nor a pandas copy) is
  held; features become one float32 matrix, the label one int64 (classes) or float32
  (regression) vector.
- `images.ImageFolder`: class folders; only the file list is held, each image is
  decoded when a batch needs it.
- `holdout`: a seeded, reproducible held-out split for evaluation.

Every failure is a `DataError` that names the file and the column or value. pyarrow
is the `data` extra (`pip install 'fedtrain[data]'`); Pillow comes with matplotlib.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset, Subset

from fedtrain.errors import ConfigError

INSTALL_HINT = "pip install 'fedtrain[data]'"


def holdout(data: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """(train, held-out) with a seeded `fraction` of the examples held out; the same
    files and seed give the same split on every start, so a restarted site never
    trains on what it evaluated on before."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"data.eval_fraction = {fraction} must be in [0, 1)")
    n = len(data)  # type: ignore[arg-type]
    held = round(n * fraction)
    if fraction == 0.0 or held == 0:
        return data, None
    if held >= n:
        raise ConfigError(f"data.eval_fraction = {fraction} holds out all {n} examples; lower it")
    order = np.random.default_rng(seed).permutation(n)
    return Subset(data, np.sort(order[held:]).tolist()), Subset(
        data, np.sort(order[:held]).tolist()
    )
