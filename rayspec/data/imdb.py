"""IMDB movie reviews (Maas et al., 2011) as padded token ids, from ``aclImdb/`` files or Hugging Face."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register
from rayspec.data.text import check_sizes, encode_splits

__all__ = ["imdb", "CACHE_FOLDER"]

log = logging.getLogger(__name__)

CACHE_FOLDER = ".rayspec_cache"
_CACHE_VERSION = 1  # bump when the tokenizer, the vocabulary or the file layout changes
_SPLITS = ("train", "test")
_LABELS = (("neg", 0), ("pos", 1))
_NAME = re.compile(r"^(\d+)_(\d+)\.txt$")
_ARCHIVE = "aclImdb_v1.tar.gz (https://ai.stanford.edu/~amaas/data/sentiment/)"

Texts = dict[str, tuple[list[str], list[int]]]  # split -> (reviews, labels)


@register("imdb")
def imdb(
    root: str | None = None,
    seed: int = 0,
    vocab_size: int = 20000,
    max_len: int = 256,
    cache: bool = True,
    source: str = "files",
) -> DataBundle:
    """IMDB sentiment: 25,000 training and 25,000 validation (test split) reviews, labels neg=0, pos=1.

    Reviews are tokenized by :func:`rayspec.data.text.tokenize` (lowercase, ``<br />`` removed, runs of
    letters, digits and apostrophes); the vocabulary holds the ``vocab_size - 2`` most frequent tokens of
    the training split (ties alphabetical) after ``0 = <pad>`` and ``1 = <unk>``; each review keeps its
    first ``max_len`` tokens and is padded with 0 at the end.

    With ``cache=True`` the tensors are saved after the first build to
    ``<root>/aclImdb/.rayspec_cache/<key>.pt`` (``<root>/.rayspec_cache/imdb-hf-<key>.pt`` for
    ``source="hf"``), where the key hashes the options and, for files, the names, sizes and modification
    times of the reviews, so changed options or files build anew. The file is written atomically
    (temporary file, then ``os.replace``) and read with ``torch.load(weights_only=True)``; an unreadable
    cache is rebuilt, an unwritable one only warns.

    Args:
        root: the folder holding ``aclImdb/`` (config ``data.root``); for ``source="hf"`` the optional
            Hugging Face cache folder.
        seed: unused (the splits are fixed).
        vocab_size: vocabulary size including padding and unknown.
        max_len: tokens per review after truncation and padding.
        cache: read and write the tensor cache.
        source: ``"files"`` reads ``<root>/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt``; ``"hf"`` the
            ``imdb`` data set of the Hugging Face ``datasets`` package (not a dependency of rayspec).

    Returns:
        ``TensorDataset`` splits of ``(x int64 (max_len,), y int64)``.

    Raises:
        DataError: a bad option, missing files, or ``datasets`` not installed for ``source="hf"``.
    """
    check_sizes("imdb", vocab_size, max_len)
    options = {"version": _CACHE_VERSION, "vocab_size": vocab_size, "max_len": max_len, "source": source}
    read, cache_path = _source(source, root, options)
    tensors: dict[str, Any] | None = _load_cache(cache_path, max_len) if cache and cache_path else None
    if tensors is None:
        tensors = _tensorize(read(), vocab_size, max_len)
        if cache and cache_path:
            _save_cache(cache_path, tensors)
    train = TensorDataset(tensors["train_x"], tensors["train_y"])
    val = TensorDataset(tensors["test_x"], tensors["test_y"])
    return DataBundle(train, val, DataInfo("text", 2, (max_len,), vocab_size))


def _source(source: str, root: str | None, options: dict[str, Any]) -> tuple[Callable[[], Texts], str | None]:
    """The reader of the reviews for ``source`` and the path of their tensor cache (None: no cache); the
    files' fingerprint joins ``options``, which key the cache."""
    if source == "files":
        if root is None:
            raise DataError("data=imdb needs data.root: the folder that holds aclImdb/ (unpacked " + _ARCHIVE + ")")
        base = os.path.join(os.path.expanduser(str(root)), "aclImdb")
        files = _list_files(base)
        options["files"] = _fingerprint(base, files)
        return (lambda: _read_files(files)), os.path.join(base, CACHE_FOLDER, _key(options) + ".pt")
    if source == "hf":
        hf_root = None if root is None else os.path.expanduser(str(root))
        cache_path = None if hf_root is None else os.path.join(hf_root, CACHE_FOLDER, f"imdb-hf-{_key(options)}.pt")
        return (lambda: _read_hf(hf_root)), cache_path
    raise DataError(
        f"imdb: data.source={source!r} is unknown; use data.source=files (aclImdb/ under data.root) or hf"
    )


def _list_files(base: str) -> dict[str, dict[int, list[str]]]:
    """The review files by split and label, sorted by id and rating; ``DataError`` if a folder has none."""
    if not os.path.isdir(base):
        raise DataError(
            f"imdb: {base}/ not found; unpack {_ARCHIVE} in data.root={os.path.dirname(base)} so that "
            f"{base}/train/{{pos,neg}}/ and {base}/test/{{pos,neg}}/ hold the reviews, or set data.source=hf"
        )
    files: dict[str, dict[int, list[str]]] = {}
    for split in _SPLITS:
        files[split] = {}
        for name, label in _LABELS:
            folder = os.path.join(base, split, name)
            found = sorted(
                (f for f in (os.listdir(folder) if os.path.isdir(folder) else []) if f.endswith(".txt")), key=_order
            )
            if not found:
                raise DataError(
                    f"imdb: no reviews (*.txt) in {folder}/; {base}/ must be the unpacked {_ARCHIVE} with "
                    f"train/{{pos,neg}}/ and test/{{pos,neg}}/ folders of <id>_<rating>.txt files"
                )
            files[split][label] = [os.path.join(folder, f) for f in found]
    return files


def _order(name: str) -> tuple[int, int, str]:
    """Sort ``<id>_<rating>.txt`` by number; other names after them, by name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2)), name) if m else (2**62, 0, name)


def _fingerprint(base: str, files: dict[str, dict[int, list[str]]]) -> str:
    """A hash of the relative paths, sizes and modification times of the review files."""
    h = hashlib.sha256()
    for split in _SPLITS:
        for _, paths in sorted(files[split].items()):
            for p in paths:
                st = os.stat(p)
                h.update(f"{os.path.relpath(p, base)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _key(options: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]


def _read_files(files: dict[str, dict[int, list[str]]]) -> Texts:
    """The reviews and labels of each split, read from ``files``."""
    texts: Texts = {}
    for split in _SPLITS:
        reviews: list[str] = []
        labels: list[int] = []
        for label, paths in sorted(files[split].items()):
            for p in paths:
                with open(p, encoding="utf-8", errors="replace") as f:
                    reviews.append(f.read())
                labels.append(label)
        texts[split] = (reviews, labels)
    return texts


def _read_hf(root: str | None) -> Texts:
    """The reviews and labels of each split of the Hugging Face ``imdb`` data set (0 = neg, 1 = pos)."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as e:
        raise DataError(
            "imdb: data.source=hf needs the Hugging Face `datasets` package, which is not installed; "
            "install it (pip install datasets) or use data.source=files with aclImdb/ under data.root"
        ) from e
    try:
        ds = datasets.load_dataset("imdb", cache_dir=root)
    except Exception as e:
        raise DataError(
            f"imdb: could not load the Hugging Face `imdb` data set ({type(e).__name__}: {e}); "
            f"check the network or the cache (data.root={root}), or use data.source=files"
        ) from e
    return {split: (list(ds[split]["text"]), [int(v) for v in ds[split]["label"]]) for split in _SPLITS}


def _tensorize(texts: Texts, vocab_size: int, max_len: int) -> dict[str, Any]:
    """Tokenize both splits, build the vocabulary from the training split only and encode."""
    vocab, ids = encode_splits({split: texts[split][0] for split in _SPLITS}, vocab_size, max_len)
    out: dict[str, Any] = {"vocab": vocab}
    for split in _SPLITS:
        out[f"{split}_x"] = ids[split]
        out[f"{split}_y"] = torch.tensor(texts[split][1], dtype=torch.int64)
    log.info(
        "imdb: built %d train / %d test reviews, %d tokens in the vocabulary",
        len(ids["train"]),
        len(ids["test"]),
        len(vocab),
    )
    return out


def _load_cache(path: str, max_len: int) -> dict[str, Any] | None:
    """The cached tensors at ``path``, or ``None`` if there are none or they are unreadable."""
    if not os.path.isfile(path):
        return None
    try:
        data = torch.load(path, weights_only=True)
        for split in _SPLITS:
            x, y = data[f"{split}_x"], data[f"{split}_y"]
            if x.dtype != torch.int64 or x.dim() != 2 or x.shape[1] != max_len or y.shape != (x.shape[0],):
                raise ValueError(f"{split} tensors of shapes {tuple(x.shape)}, {tuple(y.shape)}")
    except Exception as e:
        warnings.warn(
            f"imdb: ignoring the unreadable cache {path} ({type(e).__name__}: {e}); rebuilding it", stacklevel=3
        )
        return None
    log.info("imdb: read the cached tensors %s", path)
    return data


def _save_cache(path: str, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` to ``path`` atomically; warn (and go on) if that fails."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save(tensors, f)
        os.replace(tmp, path)
        tmp = None
        log.info("imdb: cached the tensors in %s", path)
    except OSError as e:
        warnings.warn(f"imdb: could not write the cache {path} ({e}); set data.cache=false to skip it", stacklevel=3)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
