"""Parquet and CSV tables read with pyarrow: files, partitioned folders, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pcsv = pytest.importorskip("pyarrow.csv")

from fedtrain.datasources import holdout  # noqa: E402
from fedtrain.datasources.tabular import read_table  # noqa: E402
from fedtrain.errors import DataError  # noqa: E402


def table(rows: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "age": rng.integers(20, 90, rows),
            "bmi": rng.normal(25, 4, rows),
            "smoker": rng.integers(0, 2, rows).astype(bool),
            "note": [f"n{i}" for i in range(rows)],
            "ward": rng.integers(1, 4, rows),
            "outcome": rng.choice(["healed", "readmitted"], rows),
        }
    )


def expected(t, features=("age", "bmi", "smoker")):
    x = np.stack([np.asarray(t.column(c).to_pylist(), dtype=np.float32) for c in features], 1)
    y = np.array([["healed", "readmitted"].index(v) for v in t.column("outcome").to_pylist()])
    return x, y


def rows(dataset) -> dict[tuple, int]:
    """Rows as (features..., label) -> count: file order is not part of the contract."""
    x, y = dataset.tensors
    out: dict[tuple, int] = {}
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        key = (*(round(v, 4) for v in xi), yi)
        out[key] = out.get(key, 0) + 1
    return out


def test_a_hive_partitioned_parquet_folder_is_read_whole_in_small_batches(tmp_path: Path):
    t = table(rows=50)
    folder = tmp_path / "lake"
    pq.write_to_dataset(t, folder, partition_cols=["ward"])
    (folder / "_SUCCESS").touch()  # Spark's marker and checksum files are not data
    (folder / ".part-0.crc").write_bytes(b"\x00garbage")
    data = read_table(
        folder,
        "parquet",
        label="outcome",
        features=["age", "bmi", "smoker", "ward"],
        classes=["healed", "readmitted"],
        batch_rows=7,
    )
    x, y = data.tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (50, 4)
    want_x, want_y = expected(t, ("age", "bmi", "smoker", "ward"))
    want = rows(torch.utils.data.TensorDataset(torch.from_numpy(want_x), torch.from_numpy(want_y)))
    assert rows(data) == want  # the partition key came back as a feature column


def test_a_csv_file_gives_every_numeric_column_but_the_label_by_default(tmp_path: Path):
    t = table().drop_columns(["note"])
    pcsv.write_csv(t, tmp_path / "t.csv")
    data = read_table(tmp_path / "t.csv", "csv", label="outcome", classes=["healed", "readmitted"])
    x, y = data.tensors
    want_x, want_y = expected(t, ("age", "bmi", "smoker", "ward"))
    np.testing.assert_allclose(x.numpy(), want_x, rtol=1e-6)
    np.testing.assert_array_equal(y.numpy(), want_y)


def test_integer_labels_are_class_indices_and_float_labels_regression_targets(tmp_path: Path):
    pq.write_table(
        pa.table({"a": [1.0, 2.0], "c": [0, 2], "r": [0.5, 1.5]}), tmp_path / "t.parquet"
    )
    _, c = read_table(tmp_path / "t.parquet", "parquet", label="c", features=["a"]).tensors
    _, r = read_table(tmp_path / "t.parquet", "parquet", label="r", features=["a"]).tensors
    assert c.dtype == torch.int64 and c.tolist() == [0, 2]
    assert r.dtype == torch.float32 and r.tolist() == [0.5, 1.5]


@pytest.mark.parametrize(
    ("label", "features", "classes", "message"),
    [
        ("outcome", ["age", "weight"], ["healed", "readmitted"], r"no feature column 'weight'"),
        ("result", ["age"], [], r"no label column 'result'"),
        ("outcome", ["age", "note"], ["healed", "readmitted"], r"'note' is string, not numeric"),
        ("outcome", ["age"], ["healed"], r"\['readmitted'\] outside data.classes"),
        ("outcome", ["age"], [], r"label column 'outcome' is string; list its values"),
    ],
)
def test_a_bad_column_is_named_with_the_file(tmp_path: Path, label, features, classes, message):
    path = tmp_path / "t.parquet"
    pq.write_table(table(), path)
    with pytest.raises(DataError, match=message):
        read_table(path, "parquet", label=label, features=features, classes=classes)


def test_a_file_without_a_column_the_others_have_is_named(tmp_path: Path):
    folder = tmp_path / "lake"
    folder.mkdir()
    pq.write_table(table(seed=1), folder / "a.parquet")
    pq.write_table(table(seed=2).drop_columns(["bmi"]), folder / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no column 'bmi'"):
        read_table(
            folder,
            "parquet",
            label="outcome",
            features=["age", "bmi"],
            classes=["healed", "readmitted"],
        )


def test_a_missing_value_is_named_with_its_file_and_column(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text("age,bmi,outcome\n30,22.5,1\n41,,0\n")
    with pytest.raises(DataError, match=r"t\.csv: column 'bmi' has 1 missing value"):
        read_table(path, "csv", label="outcome")


@pytest.mark.parametrize(
    ("name", "content", "fmt", "message"),
    [
        ("t.parquet", b"PAR1 this is not parquet", "parquet", r"cannot be read"),
        ("t.csv", b"age,outcome\n1,0\n2,0,7\n", "csv", r"t\.csv.*cannot be read.*Row #3"),
    ],
)
def test_an_unreadable_file_is_named(tmp_path: Path, name, content, fmt, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_table(tmp_path / name, fmt, label="outcome")


def test_a_path_that_does_not_exist_is_named(tmp_path: Path):
    with pytest.raises(DataError, match=r"no such file or folder"):
        read_table(tmp_path / "nowhere", "parquet", label="y")


def test_the_held_out_split_is_seeded_disjoint_and_complete(tmp_path: Path):
    pq.write_table(table(rows=100), tmp_path / "t.parquet")
    data = read_table(
        tmp_path / "t.parquet",
        "parquet",
        label="outcome",
        features=["age"],
        classes=["healed", "readmitted"],
    )
    train, test = holdout(data, 0.2, seed=3)
    again, _ = holdout(data, 0.2, seed=3)
    other, _ = holdout(data, 0.2, seed=4)
    assert len(test) == 20 and len(train) == 80
    assert set(train.indices) | set(test.indices) == set(range(100))
    assert not set(train.indices) & set(test.indices)
    assert train.indices == again.indices and train.indices != other.indices
    assert holdout(data, 0.0, seed=0) == (data, None)
