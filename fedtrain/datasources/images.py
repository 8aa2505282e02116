"""A folder of images with one sub-folder per class, decoded only when trained on.

    path/benign/0001.png
    path/malignant/0002.jpg

Only the list of files is held in memory; each image is opened when a batch needs
it (Pillow), converted to `mode` ("RGB" or "L"), resized to `size` when given, and
returned as a float32 [channels, height, width] tensor in [0, 1]. Every header is
read when the dataset is built, so an unreadable image or one of another size is
named before the site joins instead of in the middle of a round.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fedtrain.errors import DataError

log = logging.getLogger(__name__)

EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


class ImageFolder(Dataset):
    """(image tensor, class index) for every image under `root`'s class folders."""

    def __init__(
        self,
        root: str | Path,
        *,
        classes: Sequence[str] = (),
        size: Sequence[int] = (),
        mode: str = "RGB",
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(
                f"data.path = {str(root)!r}: no such folder (data.source = 'imagefolder')"
            )
        found = sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        self.classes = list(classes) or found
        missing = [c for c in self.classes if c not in found]
        if missing:
            raise DataError(
                f"data.path = {str(root)!r} has no class folder {missing[0]!r} (data.classes); "
                f"its folders are {found}"
            )
        if not self.classes:
            raise DataError(f"data.path = {str(root)!r} has no class folders (one per class)")
        self.size = tuple(size)  # (height, width)
        if self.size and (len(self.size) != 2 or min(self.size) < 1):
            raise DataError(f"data.image_size = {list(size)} must be [height, width]")
        self.mode = mode
        self.items: list[tuple[Path, int]] = []
        for index, name in enumerate(self.classes):
            for path in sorted((self.root / name).rglob("*")):
                if (
                    path.is_file()
                    and path.suffix.lower() in EXTENSIONS
                    and not path.name.startswith(".")
                ):
                    self.items.append((path, index))
        if not self.items:
            raise DataError(f"data.path = {str(root)!r}: no images in {self.classes}")
        self._check_headers()
        log.info("%d images in %d classes under %s", len(self.items), len(self.classes), root)

    def _check_headers(self) -> None:
        from PIL import Image

        first: tuple[int, int] | None = None
        for path, _ in self.items:
            try:
                with Image.open(path) as image:
                    width, height = image.size
            except (OSError, SyntaxError) as exc:
                raise DataError(f"{path}: not a readable image ({exc})") from None
            if self.size:
                continue
            if first is None:
                first = (height, width)
            elif (height, width) != first:
                raise DataError(
                    f"{path} is {width}x{height} but {self.items[0][0]} is {first[1]}x{first[0]}; "
                    "set data.image_size = [height, width] to resize every image"
                )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.items[index]
        try:
            with Image.open(path) as image:
                image = image.convert(self.mode)
                if self.size:
                    image = image.resize((self.size[1], self.size[0]))
                pixels = np.asarray(image, dtype=np.float32) / 255.0
        except (OSError, SyntaxError) as exc:
            raise DataError(f"{path}: cannot decode the image ({exc})") from None
        tensor = torch.from_numpy(pixels)
        tensor = tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)
        return tensor.contiguous(), label

    def labels(self) -> torch.Tensor:
        """Every item's class index, without decoding an image."""
        return torch.tensor([label for _, label in self.items], dtype=torch.long)
