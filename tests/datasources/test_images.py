"""Image folders: one folder per class, decoded on access, bad files named up front."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedtrain.datasources.images import ImageFolder
from fedtrain.errors import DataError
from fedtrain.task import iterate_batches


def write(path: Path, colour: int, size=(6, 4)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), colour, dtype=np.uint8)).save(path)


def test_class_folders_become_labels_and_images_decode_to_chw_floats(tmp_path: Path):
    write(tmp_path / "benign" / "a.png", 0)
    write(tmp_path / "benign" / "nested" / "b.jpg", 0)
    write(tmp_path / "malignant" / "c.png", 255)
    (tmp_path / "malignant" / "Thumbs.db").write_bytes(b"not an image")
    data = ImageFolder(tmp_path)
    assert data.classes == ["benign", "malignant"] and len(data) == 3
    x, y = next(iter(iterate_batches(data, 8)))
    assert x.shape == (3, 3, 4, 6) and x.dtype == torch.float32
    assert y.tolist() == [0, 0, 1] and float(x[2].min()) == 1.0 and float(x[0].max()) == 0.0
    assert data.labels().tolist() == [0, 0, 1]


def test_configured_classes_fix_the_label_order_and_the_size_and_mode(tmp_path: Path):
    write(tmp_path / "benign" / "a.png", 10, size=(6, 4))
    write(tmp_path / "malignant" / "b.png", 20, size=(9, 9))
    data = ImageFolder(tmp_path, classes=["malignant", "benign"], size=[5, 7], mode="L")
    image, label = data[data.items.index((tmp_path / "benign" / "a.png", 1))]
    assert label == 1 and image.shape == (1, 5, 7)


@pytest.mark.parametrize(
    ("arrange", "kwargs", "message"),
    [
        (
            lambda root: write(root / "a" / "x.png", 0),
            {"classes": ["a", "b"]},
            r"no class folder 'b'",
        ),
        (
            lambda root: (
                (root / "a" / "x.png").parent.mkdir(parents=True)
                or (root / "a" / "x.png").write_bytes(b"no")
            ),
            {},
            r"x\.png: not a readable image",
        ),
        (
            lambda root: (
                write(root / "a" / "x.png", 0),
                write(root / "b" / "y.png", 0, size=(3, 3)),
            ),
            {},
            r"y\.png is 3x3 .*data\.image_size",
        ),
        (lambda root: root.mkdir(exist_ok=True), {}, r"no class folders"),
    ],
)
def test_a_bad_folder_or_image_is_named_before_training(tmp_path: Path, arrange, kwargs, message):
    root = tmp_path / "images"
    root.mkdir()
    arrange(root)
    with pytest.raises(DataError, match=message):
        ImageFolder(root, **kwargs)
