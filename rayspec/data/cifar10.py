"""CIFAR-10 from the python-pickle batches of ``cifar-10-python.tar.gz``, read by torchvision."""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register

__all__ = ["MEAN", "STD", "FOLDER", "FILES", "cifar10", "crop_flip"]

MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images (pixels in [0, 1])."""
STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images."""
FOLDER = "cifar-10-batches-py"
FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch", "batches.meta")


@functools.cache
def _reader_class() -> type:
    """torchvision's ``CIFAR10`` with an integrity check that can skip the md5 sums (imported lazily)."""
    from torchvision.datasets import CIFAR10

    class Reader(CIFAR10):
        """``CIFAR10`` that returns normalized tensors, augments deterministically and may skip the md5 check.

        torchvision verifies the md5 sum of every batch file and of ``batches.meta``, which only the original
        files pass. With ``verify=False`` both checks become presence checks, so any files in the real format
        are read (a subset, or small files written by tests); with ``verify=True`` torchvision's checks are
        kept, and decide whether ``download=True`` downloads.
        """

        def __init__(self, root: str, train: bool, download: bool, verify: bool, augment: bool, seed: int) -> None:
            self._verify = verify
            super().__init__(root, train=train, download=download)
            self.augment = augment
            self.seed = seed
            self._gen = torch.Generator()
            self._draws = np.zeros(len(self.data), dtype=np.int64)
            self._mean = torch.tensor(MEAN).view(3, 1, 1)
            self._std = torch.tensor(STD).view(3, 1, 1)

        def _check_integrity(self) -> bool:
            if self._verify:
                return super()._check_integrity()
            return all(
                os.path.isfile(os.path.join(self.root, self.base_folder, f))
                for f, _ in self.train_list + self.test_list
            )

        def _load_meta(self) -> None:
            if self._verify:
                return super()._load_meta()
            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

        def rewind(self, draws: np.ndarray) -> None:
            """Set how often each sample was drawn so far (``rayspec.data.loader.train_batches`` on resume)."""
            self._draws = np.asarray(draws, dtype=np.int64).copy()

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(self.data[index]).permute(2, 0, 1)  # uint8 (3, 32, 32)
            if self.augment:
                # The k-th draw of sample i is augmented the same way for the same seed, whatever the order.
                draw = int(self._draws[index])
                self._draws[index] += 1
                self._gen.manual_seed(((self.seed * 1_000_003 + index) * 1_000_033 + draw) % (2**63))
                x = crop_flip(x, self._gen)
            return self.normalize(x), torch.tensor(self.targets[index], dtype=torch.int64)

        def normalize(self, x: torch.Tensor) -> torch.Tensor:
            """uint8 images ``(..., 3, 32, 32)`` to float, normalized with the CIFAR-10 mean and std."""
            return (x.float() / 255 - self._mean) / self._std

    return Reader


def crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """torchvision's ``RandomCrop(size, padding)`` then ``RandomHorizontalFlip()``, drawn from ``generator``.

    Pads ``x`` (``(C, H, W)``) with ``padding`` zeros on every side, crops a window of the original size at
    a uniformly random offset and flips it horizontally with probability 1/2. (A dedicated generator
    keeps the global RNG untouched and is much cheaper than forking it for every sample.)
    """
    h, w = x.shape[-2:]
    top, left, flip = torch.randint(0, 2 * padding + 1, (3,), generator=generator).tolist()
    out = torch.nn.functional.pad(x, (padding,) * 4)[..., top : top + h, left : left + w]
    return out.flip(-1) if flip % 2 else out


@register("cifar10")
def cifar10(root: str | None = None, seed: int = 0, download: bool = False, augment: bool = True) -> DataBundle:
    """CIFAR-10: 50,000 training and 10,000 validation (test split) 32×32 colour images of 10 classes.

    Reads ``<root>/cifar-10-batches-py/`` (``data_batch_1`` … ``data_batch_5``, ``test_batch``,
    ``batches.meta``, as unpacked from ``cifar-10-python.tar.gz``) with torchvision's ``CIFAR10`` reader.
    torchvision checks the md5 sums of the original files before reading; with ``download=False`` this
    loader checks only that the files exist and then validates what it read (shapes, dtype, labels,
    class names), so files in the real format but with other content work too; with ``download=True``
    torchvision's md5 check is kept and downloads the archive when the files are missing or differ.

    Training samples get the standard augmentation, ``RandomCrop(32, padding=4)`` and
    ``RandomHorizontalFlip`` (as :func:`crop_flip`, on a dedicated generator seeded by ``(seed, index,
    how often the sample was drawn)``, so the same seed augments every run alike whatever the batch
    order); both splits are normalized with the CIFAR-10 mean and std.

    Args:
        root: the folder holding ``cifar-10-batches-py/`` (config ``data.root``).
        seed: seeds the augmentation.
        download: download the archive into ``root`` if the files are missing or differ from the originals.
        augment: augment the training split.

    Returns:
        ``train`` yields ``(x float (3, 32, 32), y int64)`` per sample; ``val`` is a ``TensorDataset`` of the
        normalized test split.

    Raises:
        DataError: ``root`` is unset, files are missing or malformed, or the download failed.
    """
    root, folder = _folder(root, download)
    reader = _reader_class()
    splits = [_read_split(reader, root, folder, train, download, augment and train, seed) for train in (True, False)]
    train_set, test_set = splits
    for split in splits:
        _validate(split, folder)
    x_val = test_set.normalize(torch.from_numpy(test_set.data).permute(0, 3, 1, 2))
    val = TensorDataset(x_val, torch.tensor(test_set.targets, dtype=torch.int64))
    return DataBundle(train_set, val, DataInfo("image", 10, (3, 32, 32)))


def _folder(root: str | None, download: bool) -> tuple[str, str]:
    """``data.root`` user-expanded and the CIFAR-10 folder in it, whose files must be there unless downloaded."""
    if root is None:
        raise DataError(
            f"data=cifar10 needs data.root: the folder that holds {FOLDER}/ "
            f"(or that data.download=true downloads it into), e.g. data.root=/data"
        )
    root = os.path.expanduser(str(root))
    folder = os.path.join(root, FOLDER)
    if not download:
        missing = [f for f in FILES if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise DataError(
                f"cifar10: {', '.join(missing)} not found in {folder}/; unpack cifar-10-python.tar.gz "
                f"(https://www.cs.toronto.edu/~kriz/cifar.html) in data.root={root} so that {folder}/ holds "
                f"{', '.join(FILES)}, or set data.download=true"
            )
    return root, folder


def _read_split(reader: Any, root: str, folder: str, train: bool, download: bool, augment: bool, seed: int) -> Any:
    """One split read by ``reader`` (downloading the archive with the training split if asked); its failure as a
    ``DataError`` that says what to do."""
    try:
        return reader(root, train=train, download=download and train, verify=download, augment=augment, seed=seed)
    except OSError as e:
        if download:
            raise DataError(
                f"cifar10: could not download CIFAR-10 into {folder}/ ({e}); download cifar-10-python.tar.gz "
                f"by hand and unpack it in data.root={root}, then set data.download=false"
            ) from e
        raise DataError(f"cifar10: could not read {folder}/ ({e}); check the files and their permissions") from e
    except Exception as e:
        raise DataError(_diagnose(folder, e)) from e


def _validate(split: Any, folder: str) -> None:
    """Raise ``DataError`` unless ``split`` holds uint8 images, one label in 0..9 each, and 10 class names."""
    which = "data_batch_1..5" if split.train else "test_batch"
    fix = "replace the files with those of cifar-10-python.tar.gz or set data.download=true"
    if split.data.dtype != np.uint8:
        raise DataError(f"cifar10: {folder}/{which} hold {split.data.dtype} pixels, expected uint8; {fix}")
    if len(split.targets) != len(split.data):
        raise DataError(
            f"cifar10: {folder}/{which} hold {len(split.data)} images but {len(split.targets)} labels; {fix}"
        )
    bad = [t for t in split.targets if not (isinstance(t, (int, np.integer)) and 0 <= t < 10)]
    if bad:
        raise DataError(f"cifar10: {folder}/{which} hold labels outside 0..9 (e.g. {bad[0]!r}); {fix}")
    if len(split.classes) != 10:
        raise DataError(f"cifar10: {folder}/batches.meta names {len(split.classes)} classes, expected 10; {fix}")


def _diagnose(folder: str, error: Exception) -> str:
    """Say which file in ``folder`` torchvision's reader could not read and why."""
    fix = "replace it with the file from cifar-10-python.tar.gz or set data.download=true"
    for name in FILES:
        path = os.path.join(folder, name)
        keys = ("label_names",) if name == "batches.meta" else ("data", "labels")
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
        except Exception as e:
            return f"cifar10: {path} is not a python pickle ({type(e).__name__}: {e}); {fix}"
        if not isinstance(entry, dict) or any(k not in entry for k in keys):
            found = sorted(map(repr, entry)) if isinstance(entry, dict) else type(entry).__name__
            hint = ""
            if isinstance(entry, dict) and all(k.encode() in entry for k in keys):
                hint = (
                    " (bytes keys: written by Python 3; the real batches are Python 2 pickles whose keys read as str)"
                )
            return f"cifar10: {path} lacks the keys {', '.join(keys)} (found {found}){hint}; {fix}"
        if name != "batches.meta":
            data = np.asarray(entry["data"])
            if data.ndim != 2 or data.shape[1] != 3072:
                return f"cifar10: {path} holds data of shape {data.shape}, expected (N, 3072); {fix}"
    return f"cifar10: could not read {folder}/ ({type(error).__name__}: {error}); replace the files with those of cifar-10-python.tar.gz or set data.download=true"
