"""MNIST and Fashion-MNIST from their IDX files (gzipped or plain), read by torchvision."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register
from rayspec.data.selection import check_selection, split_indices

__all__ = ["SOURCES", "FILES", "PADDING", "Images", "crop_flip", "mnist", "fashion_mnist"]

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
"""The four IDX files of either data set, each found plain or with ``.gz``."""
PADDING = 2
"""Zero padding of the random crop: shifts of up to 2 pixels (an MNIST digit's 20x20 box, centred in 28x28, stays whole)."""


@dataclass(frozen=True)
class Source:
    """What differs between the two data sets.

    Attributes:
        name: the registered name (``data=<name>``).
        folder: torchvision's folder under ``root`` (``<root>/<folder>/raw/`` holds the files).
        mean: mean pixel of the training images (pixels in [0, 1]).
        std: standard deviation of the pixels of the training images.
        flip: whether random horizontal flips are on by default.
        root: the default ``data.root`` where it exists (a distribution package's folder), else ``None``.
        install: how else to get the files (a sentence ending in ``"; "``), or ``""``.
    """

    name: str
    folder: str
    mean: float
    std: float
    flip: bool
    root: str | None
    install: str


SOURCES = {
    "mnist": Source(
        "mnist",
        "MNIST",
        0.1307,
        0.3081,
        flip=False,  # a mirrored 2, 3, 4, 5, 7 or 9 is no digit
        root=None,
        install="",
    ),
    "fashion_mnist": Source(
        "fashion_mnist",
        "FashionMNIST",
        0.2860,
        0.3530,
        flip=True,  # a mirrored shirt, bag or shoe is still one
        root="/usr/share/datasets/fashion-mnist",
        install=(
            "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist puts the files "
            "in /usr/share/datasets/fashion-mnist, the default data.root); "
        ),
    ),
}


class Images(Dataset):
    """uint8 images ``(N, 1, 28, 28)`` and labels, normalized on the way out and augmented deterministically.

    Augmentation (:func:`crop_flip`) draws from a generator seeded by ``(seed, index, how often the sample
    was drawn)``, as ``cifar10`` does: the same seed augments every run alike whatever the batch order, and
    ``rewind`` restores the draw counts on resume.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, augment: bool, flip: bool, seed: int
    ) -> None:
        self.images, self.labels = images, labels
        self.mean, self.std = mean, std
        self.augment, self.flip, self.seed = augment, flip, seed
        self._gen = torch.Generator()
        self._draws = np.zeros(len(images), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def rewind(self, draws: np.ndarray) -> None:
        """Set how often each sample was drawn so far (``rayspec.data.loader.train_batches`` on resume)."""
        self._draws = np.asarray(draws, dtype=np.int64).copy()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index]  # uint8 (1, 28, 28)
        if self.augment:
            draw = int(self._draws[index])
            self._draws[index] += 1
            self._gen.manual_seed(((self.seed * 1_000_003 + index) * 1_000_033 + draw) % (2**63))
            x = crop_flip(x, self._gen, self.flip)
        return self.normalize(x), self.labels[index]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images ``(..., 1, 28, 28)`` to float, normalized with the training split's mean and std."""
        return (x.float() / 255 - self.mean) / self.std


def crop_flip(x: torch.Tensor, generator: torch.Generator, flip: bool) -> torch.Tensor:
    """torchvision's ``RandomCrop(28, padding=2)`` and, with ``flip``, ``RandomHorizontalFlip()``.

    Pads ``x`` (``(C, H, W)``) with :data:`PADDING` zeros on every side, crops a window of the original size
    at a uniformly random offset and flips it horizontally with probability 1/2; all three numbers are
    drawn from ``generator`` whether ``flip`` is on or not.
    """
    h, w = x.shape[-2:]
    top, left = torch.randint(0, 2 * PADDING + 1, (2,), generator=generator).tolist()
    coin = int(torch.randint(0, 2, (1,), generator=generator))
    out = torch.nn.functional.pad(x, (PADDING,) * 4)[..., top : top + h, left : left + w]
    return out.flip(-1) if flip and coin else out


def _build(source: Source, root: str | None, seed: int, download: bool, augment: bool, flip: bool | None,
           selection: int | float = 0, eval_split: str = "test") -> DataBundle:
    """Find, read and check the four files of ``source``; see :func:`fashion_mnist`."""
    check_selection(source.name, selection, eval_split)
    if root is None:
        if download or source.root is None or not os.path.isdir(source.root):
            where = "that data.download=true downloads them into" if download else "that holds the IDX files"
            hint = "" if download else f"; {source.install}or set data.root and data.download=true"
            raise DataError(f"data={source.name} needs data.root: the folder {where}, e.g. data.root=/data{hint}")
        root = source.root
    root = os.path.expanduser(str(root))
    layouts = (root, os.path.join(root, source.folder, "raw"))
    paths = _find(layouts)
    if paths is None and download:
        _download(source, root)
        paths = _find(layouts)
    if paths is None:
        missing = "; ".join(_missing(folder) for folder in layouts)
        raise DataError(
            f"{source.name}: the IDX files {', '.join(FILES)} (plain or .gz) were not found: {missing}. "
            f"Put them in data.root={root} (flat) or in torchvision's layout data.root/{source.folder}/raw/; "
            f"{source.install}or set data.download=true (torchvision downloads them)"
        )
    x_train, y_train, x_test, y_test = (_read(p, kind) for p, kind in zip(paths, ("images", "labels") * 2))
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if len(x) != len(y):
            raise DataError(
                f"{source.name}: {split}-images hold {len(x)} images but {split}-labels {len(y)} labels "
                f"({os.path.dirname(paths[0])}/); replace the files with matching ones"
            )
    if selection:  # the held-out training images are never trained on; they are the validation split on request
        kept, held = split_indices(source.name, selection, len(x_train))
        if eval_split == "selection":
            x_test, y_test = x_train[held], y_train[held]
        x_train, y_train = x_train[kept], y_train[kept]
    train = Images(
        x_train.unsqueeze(1), y_train, source.mean, source.std, augment, source.flip if flip is None else flip, seed
    )
    val = TensorDataset(train.normalize(x_test.unsqueeze(1)), y_test)
    return DataBundle(train, val, DataInfo("image", 10, (1, 28, 28)))


def _path(folder: str, name: str) -> str | None:
    """``folder/name`` or else ``folder/name.gz``, whichever exists first; ``None`` if neither does."""
    for path in (os.path.join(folder, name), os.path.join(folder, name + ".gz")):
        if os.path.isfile(path):
            return path
    return None


def _missing(folder: str) -> str:
    """Which of the four files ``folder`` lacks, in words."""
    absent = [f for f in FILES if _path(folder, f) is None]
    return f"{folder}/ holds none of them" if len(absent) == len(FILES) else f"{folder}/ lacks {', '.join(absent)}"


def _find(layouts: tuple[str, ...]) -> list[str] | None:
    """The four files from the first folder of ``layouts`` that holds all of them (files are not mixed)."""
    for folder in layouts:
        paths = [_path(folder, f) for f in FILES]
        if all(paths):
            return paths  # type: ignore[return-value]
    return None


def _read(path: str, kind: str) -> torch.Tensor:
    """An IDX file of uint8 images ``(N, 28, 28)`` or labels (int64 ``(N,)`` in 0..9), by torchvision's reader.

    torchvision's reader opens plain files only, so a ``.gz`` file is first decompressed into a temporary
    folder.
    """
    from torchvision.datasets.mnist import read_image_file, read_label_file

    reader = read_image_file if kind == "images" else read_label_file
    fix = "replace it with the original file (gzipped or not) or set data.download=true"
    try:
        if path.endswith(".gz"):
            with tempfile.TemporaryDirectory() as tmp:
                plain = os.path.join(tmp, "idx")
                with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                data = reader(plain)
        else:
            data = reader(path)
    except (AssertionError, TypeError, ValueError, RuntimeError, EOFError, gzip.BadGzipFile) as e:
        # torchvision asserts on a bad magic number and raises TypeError/ValueError on a wrong dtype or rank.
        detail = str(e) or "its header (magic number, sizes) is not one of IDX " + kind
        raise DataError(f"{path} is not an IDX file of {kind} ({type(e).__name__}: {detail}); {fix}") from e
    except OSError as e:
        raise DataError(f"could not read {path} ({e}); check the file and its permissions") from e
    if kind == "images" and tuple(data.shape[1:]) != (28, 28):
        raise DataError(f"{path} holds images of {tuple(data.shape[1:])} pixels, expected (28, 28); {fix}")
    if kind == "labels" and len(data) and not 0 <= int(data.min()) <= int(data.max()) <= 9:
        raise DataError(f"{path} holds labels outside 0..9 ({int(data.min())}..{int(data.max())}); {fix}")
    return data


def _download(source: Source, root: str) -> None:
    """Download the four files into ``<root>/<folder>/raw/`` with torchvision's data set class."""
    import torchvision.datasets

    try:
        getattr(torchvision.datasets, source.folder)(root, train=False, download=True)
    except Exception as e:
        raise DataError(
            f"{source.name}: could not download into {os.path.join(root, source.folder, 'raw')}/ "
            f"({type(e).__name__}: {e}); {source.install}or put the files there by hand, then set data.download=false"
        ) from e


@register("mnist")
def mnist(
    root: str | None = None, seed: int = 0, download: bool = False, augment: bool = True, flip: bool | None = None,
    selection: int | float = 0, eval_split: str = "test",
) -> DataBundle:
    """MNIST handwritten digits: as :func:`fashion_mnist`, with three differences.

    ``root`` has no default (Debian packages no MNIST); the torchvision layout is ``<root>/MNIST/raw/``; the
    mean and standard deviation of the training pixels are 0.1307 and 0.3081; and ``flip`` is off by
    default, since a mirrored 2, 3, 4, 5, 7 or 9 is no digit.
    """
    return _build(SOURCES["mnist"], root, seed, download, augment, flip, selection, eval_split)


@register("fashion_mnist")
def fashion_mnist(
    root: str | None = None, seed: int = 0, download: bool = False, augment: bool = True, flip: bool | None = None,
    selection: int | float = 0, eval_split: str = "test",
) -> DataBundle:
    """Fashion-MNIST: 60,000 training and 10,000 validation (t10k split) 28x28 grey article images, 10 classes.

    Reads ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte``, each plain or gzipped (``.gz``), with torchvision's IDX readers: from
    ``root`` itself (a flat folder, as the Debian package ``dataset-fashion-mnist`` installs them in
    ``/usr/share/datasets/fashion-mnist``) or else from torchvision's layout ``<root>/FashionMNIST/raw/``;
    all four come from one folder. Nothing is downloaded unless ``download=True``, which downloads them
    into ``<root>/FashionMNIST/raw/`` with ``torchvision.datasets.FashionMNIST`` when neither folder has them.

    Both splits are normalized with the mean (0.2860) and standard deviation (0.3530) of the training
    split's pixels. Training images get a random crop with 2-pixel zero padding and, with ``flip``, a
    horizontal flip with probability 1/2 (see :class:`Images`: deterministic per seed and resumable).

    Args:
        root: the folder of the files (config ``data.root``); defaults to
            ``/usr/share/datasets/fashion-mnist`` where that exists.
        seed: seeds the augmentation.
        download: download the files with torchvision when they are missing.
        augment: augment the training split.
        flip: add random horizontal flips to the augmentation; ``None`` (default) is on for Fashion-MNIST.
        selection: training images held out as the selection split (a share in ``(0, 1)`` or a count, e.g.
            5000; 0: none), chosen by a fixed generator (``rayspec.data.selection``) and never trained on.
        eval_split: ``test`` (the t10k split) or ``selection`` (the held-out training images) as ``val``.

    Returns:
        ``train`` yields ``(x float (1, 28, 28), y int64)`` per sample; ``val`` is a ``TensorDataset`` of the
        normalized t10k split (or of the held-out training images, not augmented).

    Raises:
        DataError: ``root`` is unset (and the Debian folder absent), files are missing or malformed, or the
            download failed.
    """
    return _build(SOURCES["fashion_mnist"], root, seed, download, augment, flip, selection, eval_split)
