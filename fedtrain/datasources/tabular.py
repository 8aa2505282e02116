"""Tables in Parquet or CSV files as (features, label) tensors, read with pyarrow.

`pyarrow.dataset` opens a single file, a folder of files or a Hive-partitioned
folder (`hospital=a/year=2024/part-0.parquet`, as Spark and Hadoop write them; the
partition keys become columns; `_SUCCESS`, `.crc` and other `_`/`.` files are
skipped). The files are read one at a time, in record batches of `batch_rows`, and
only the configured columns are decoded: each batch is converted to float32 at
once, so memory holds the float32 matrix of the columns used plus one batch, never
a whole Arrow table or a pandas frame. A file that cannot be read, lacks a column,
holds a non-numeric feature, a missing value or a label outside `classes` is named
in the error, with the column.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedtrain.datasources import INSTALL_HINT
from fedtrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

Format = Literal["parquet", "csv"]


def _pyarrow() -> tuple[Any, Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.dataset as ds
    except ImportError:
        raise ConfigError(
            f"data.source = 'parquet' or 'csv' needs pyarrow: {INSTALL_HINT}"
        ) from None
    return pa, pc, ds


def open_dataset(path: str | Path, fmt: Format) -> Any:
    """The pyarrow dataset at `path` (a file or folder; Hive partitions for Parquet)."""
    pa, _, ds = _pyarrow()
    where = Path(path)
    if not where.exists():
        raise DataError(f"data.path = {str(path)!r}: no such file or folder")
    try:
        if fmt == "parquet":
            return ds.dataset(where, format="parquet", partitioning="hive")
        return ds.dataset(where, format="csv")
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"data.path = {str(path)!r}: cannot be read as {fmt}: {exc}") from None


def read_table(
    path: str | Path,
    fmt: Format,
    *,
    label: str,
    features: Sequence[str] = (),
    classes: Sequence[Any] = (),
    batch_rows: int = 65536,
) -> TensorDataset:
    """TensorDataset(features float32 [n, f], label) of every row under `path`.

    `features` empty: every column but the label, in the table's order. `classes`
    given: label values (text or numbers) become their index in it (every site must
    list the same classes in the same order); else an integer label is a class index
    (int64) and a floating one a regression target (float32).
    """
    pa, pc, ds = _pyarrow()
    dataset = open_dataset(path, fmt)
    names = dataset.schema.names
    if label not in names:
        raise DataError(
            f"data.path = {str(path)!r} has no label column {label!r} (data.label); its "
            f"columns are {names}"
        )
    columns = list(features) or [c for c in names if c != label]
    for column in columns:
        if column not in names:
            raise DataError(
                f"data.path = {str(path)!r} has no feature column {column!r} "
                f"(data.features); its columns are {names}"
            )
        _check_numeric(column, dataset.schema.field(column).type, pa, str(path))
    wanted = [*columns, label]
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    files = 0
    for fragment in dataset.get_fragments():
        files += 1
        where = fragment.path
        present = set(fragment.physical_schema.names) | set(
            ds.get_partition_keys(fragment.partition_expression)
        )
        for column in wanted:
            if column not in present:
                raise DataError(f"{where}: no column {column!r} (the other files have it)")
        try:
            batches = fragment.to_batches(
                schema=dataset.schema, columns=wanted, batch_size=batch_rows
            )
            for batch in batches:
                xs.append(_features(batch, columns, where, pa, pc))
                ys.append(_labels(batch.column(label), label, classes, where, pa, pc))
        except pa.ArrowException as exc:  # a corrupt file, a malformed CSV row, a bad type
            raise DataError(f"{where}: cannot be read: {exc}") from None
    if files == 0 or not xs or sum(len(x) for x in xs) == 0:
        raise DataError(f"data.path = {str(path)!r} holds no rows ({files} {fmt} file(s))")
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    del xs, ys
    log.info(
        "read %d rows x %d features from %d %s file(s) under %s",
        len(x),
        x.shape[1],
        files,
        fmt,
        path,
    )
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def _check_numeric(column: str, arrow_type: Any, pa: Any, where: str) -> None:
    types = pa.types
    if not (
        types.is_integer(arrow_type)
        or types.is_floating(arrow_type)
        or types.is_boolean(arrow_type)
    ):
        raise DataError(
            f"{where}: feature column {column!r} is {arrow_type}, not numeric; encode it as "
            "numbers before training, or leave it out of data.features"
        )


def _features(batch: Any, columns: list[str], where: str, pa: Any, pc: Any) -> np.ndarray:
    """The batch's feature columns as one float32 [rows, features] array."""
    out = np.empty((batch.num_rows, len(columns)), dtype=np.float32)
    for j, column in enumerate(columns):
        values = batch.column(column)
        _check_numeric(column, values.type, pa, where)
        if values.null_count:
            raise DataError(
                f"{where}: column {column!r} has {values.null_count} missing value(s); fill "
                "or drop them before training"
            )
        out[:, j] = pc.cast(values, pa.float32()).to_numpy(zero_copy_only=False)
    return out


def _labels(
    values: Any, label: str, classes: Sequence[Any], where: str, pa: Any, pc: Any
) -> np.ndarray:
    if values.null_count:
        raise DataError(f"{where}: label column {label!r} has {values.null_count} missing value(s)")
    if classes:
        value_set = pa.array(list(classes))
        try:
            index = pc.index_in(values.cast(value_set.type), value_set=value_set)
        except pa.ArrowException:
            index = pc.index_in(values, value_set=value_set)
        if index.null_count:
            unknown = pc.filter(values, pc.is_null(index)).unique().to_pylist()[:5]
            raise DataError(
                f"{where}: label column {label!r} holds {unknown} outside data.classes = "
                f"{list(classes)}; add them there (the same list at every site)"
            )
        return index.to_numpy(zero_copy_only=False).astype(np.int64)
    kind = values.type
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return pc.cast(values, pa.int64()).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(kind):
        return pc.cast(values, pa.float32()).to_numpy(zero_copy_only=False)
    raise DataError(
        f"{where}: label column {label!r} is {kind}; list its values in data.classes (the "
        "same list at every site) so they become class indices"
    )
