"""Labelled texts from a CSV file (plain, ``.gz``, ``.bz2`` or ``.xz``) as padded token ids.

The validation split is the rows whose ``split_column`` value is ``split_values[1]`` (training:
``split_values[0]``; other rows dropped) when ``split_column`` is set, else a seeded random split
(:func:`group_split`): whole groups of ``group_column`` (e.g. every review of one movie) go to one
side, so no group straddles the split; without ``group_column`` (or for an empty group value) a row is
a group of its own.

The file is read anew every time (no tensor cache): tokenizing the 12,808 Rotten Tomatoes reviews
of ``rt_reviews`` takes one to two seconds.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import logging
import lzma
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register
from rayspec.data.selection import SELECTION_SEED, check_selection, held_out
from rayspec.data.text import check_sizes, encode_splits

__all__ = ["text_csv", "read_rows", "group_split"]

log = logging.getLogger(__name__)

_OPENERS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
"""Text-mode openers by file extension; any other extension is read with ``open``."""


@register("text_csv")
def text_csv(root: str | None = None, seed: int = 0, path: str | None = None, text_column: str = "text",
             label_column: str = "label", labels: Sequence[Any] | None = None, group_column: str | None = None,
             split_column: str | None = None, split_values: Sequence[Any] = ("train", "test"),
             val_fraction: float = 0.2, split_seed: int = 0, vocab_size: int = 20000, max_len: int = 256,
             encoding: str = "utf-8", selection: int | float = 0, eval_split: str = "test") -> DataBundle:
    """Text classification from any CSV file with a header, a text column and a label column.

    Labels become class ids in the order of ``labels`` (rows with other labels, or none, are dropped and
    counted in the log); without ``labels``, the sorted distinct labels of the file. Texts are tokenized
    as IMDB's (:func:`rayspec.data.text.tokenize`); the vocabulary holds the ``vocab_size - 2`` most
    frequent tokens of the training split only; each text keeps its first ``max_len`` tokens, padded with
    0 at the end.

    Args:
        root: the folder a relative ``path`` is read from (default: the working directory).
        seed: unused (``split_seed`` seeds the split).
        path: the CSV file; compressed by its extension ``.gz``, ``.bz2`` or ``.xz``.
        text_column: the column holding the texts.
        label_column: the column holding the labels.
        labels: the labels by class id (compared as strings, so ``[0, 1]`` matches ``0`` and ``1``).
        group_column: the column whose values are kept together in the random split.
        split_column: the column naming each row's split, if the file has its own.
        split_values: the ``split_column`` values of the training and validation rows.
        val_fraction: the share of rows in the validation split of the random split (whole groups are
            moved, so it is reached to within one group).
        split_seed: seeds the random split; fixed by default, so runs of every seed validate on the same rows.
        vocab_size: vocabulary size including padding and unknown.
        max_len: tokens per text after truncation and padding.
        encoding: the text encoding of the file.
        selection: training rows held out as the selection split (a share in ``(0, 1)`` or a count of rows;
            0: none), whole groups as in the validation split (:func:`group_split`, seeded apart from it); they
            are never trained on and add nothing to the vocabulary.
        eval_split: ``test`` (the validation split above) or ``selection`` (the held-out rows) as ``val``.

    Returns:
        ``TensorDataset`` splits of ``(x int64 (max_len,), y int64)``.

    Raises:
        DataError: a bad option, a missing or unreadable file, a missing column, or an empty split.
    """
    check_sizes("text_csv", vocab_size, max_len)
    check_selection("text_csv", selection, eval_split)
    path = _csv_path(path, root)
    labels = _checked_options(labels, split_column, split_values, val_fraction)
    rows = read_rows(path, [c for c in (text_column, label_column, group_column, split_column) if c is not None],
                     encoding)
    texts = [r[text_column] for r in rows]
    values = [r[label_column] for r in rows]
    labels = labels if labels is not None else _labels_of(values, path, label_column)
    ids = {v: i for i, v in enumerate(labels)}
    keep = _labelled(values, ids, label_column, labels)
    train_rows, val_rows = _train_val_rows(rows, keep, group_column, split_column, split_values, val_fraction,
                                           split_seed, selection, eval_split)
    _check_not_empty(train_rows, val_rows, path, len(keep), labels)
    x, y, vocab = _encoded(texts, values, ids, {"train": train_rows, "val": val_rows}, vocab_size, max_len)
    log.info("text_csv: %s: %d training / %d validation rows, classes %s, %d tokens in the vocabulary", path,
             len(train_rows), len(val_rows), ", ".join(f"{i}={v}" for i, v in enumerate(labels)), len(vocab))
    return DataBundle(TensorDataset(x["train"], y["train"]), TensorDataset(x["val"], y["val"]),
                      DataInfo("text", len(labels), (max_len,), vocab_size))


def _train_val_rows(rows: list[dict[str, str]], keep: list[int], group_column: str | None,
                    split_column: str | None, split_values: Sequence[Any], val_fraction: float, split_seed: int,
                    selection: int | float, eval_split: str) -> tuple[list[int], list[int]]:
    """The training rows and the rows scored as ``val``: the file's own split or a seeded split by group, then the
    selection split carved from the training rows (whole groups, never trained on)."""
    if split_column is not None:
        train_rows, val_rows = _split_by_column(rows, keep, split_column, split_values)
    else:
        train_rows, val_rows = group_split(keep, _groups(rows, keep, group_column), val_fraction, split_seed)
    if selection:
        share = held_out("text_csv", selection, len(train_rows)) / len(train_rows)
        train_rows, held = group_split(train_rows, _groups(rows, train_rows, group_column), share,
                                       split_seed + SELECTION_SEED)
        val_rows = held if eval_split == "selection" else val_rows
    return train_rows, val_rows


def _groups(rows: list[dict[str, str]], keep: list[int], group_column: str | None) -> list[str | None]:
    """The group of each kept row (None: a group of its own)."""
    return [rows[i][group_column] or None for i in keep] if group_column else [None] * len(keep)


def _check_not_empty(train_rows: list[int], val_rows: list[int], path: str, kept: int, labels: list[str]) -> None:
    for name, split in (("training", train_rows), ("validation", val_rows)):
        if not split:
            raise DataError(
                f"text_csv: the {name} split of {path} is empty ({kept} rows have a label of "
                f"{', '.join(labels)}); check data.labels, data.split_column/data.split_values or data.val_fraction"
            )


def _encoded(texts: list[str], values: list[str], ids: dict[str, int], splits: dict[str, list[int]],
             vocab_size: int, max_len: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """The token ids and class ids of each split's rows, and the vocabulary (of the training split)."""
    vocab, x = encode_splits({k: [texts[i] for i in rows] for k, rows in splits.items()}, vocab_size, max_len)
    y = {k: torch.tensor([ids[values[i]] for i in rows], dtype=torch.int64) for k, rows in splits.items()}
    return x, y, vocab


def _csv_path(path: str | None, root: str | None) -> str:
    """``data.path``, user-expanded, under ``root`` when relative."""
    if path is None:
        raise DataError("data=text_csv needs data.path: the CSV file, e.g. data.path=/data/reviews.csv.gz")
    path = os.path.expanduser(str(path))
    if root is not None and not os.path.isabs(path):
        path = os.path.join(os.path.expanduser(str(root)), path)
    return path


def _checked_options(labels: Sequence[Any] | None, split_column: str | None, split_values: Sequence[Any],
                     val_fraction: float) -> list[str] | None:
    """Check the label and split options; the labels as strings (None: taken from the file)."""
    if labels is not None:
        labels = [str(v) for v in labels]
        if len(labels) < 2 or len(set(labels)) != len(labels):
            raise DataError(f"text_csv: data.labels={labels} must list at least two distinct labels")
    if split_column is None and not 0 < val_fraction < 1:
        raise DataError(f"text_csv: data.val_fraction={val_fraction!r} must be between 0 and 1 (exclusive)")
    if len(split_values) != 2:
        raise DataError(
            f"text_csv: data.split_values={list(split_values)} must name two values: training, then validation"
        )
    return labels


def _labels_of(values: list[str], path: str, label_column: str) -> list[str]:
    """The sorted distinct non-empty labels of the file; at least two."""
    labels = sorted({v for v in values if v})
    if len(labels) < 2:
        raise DataError(
            f"text_csv: the column {label_column} of {path} holds {len(labels)} distinct label(s) "
            f"({', '.join(labels) or 'none'}); a classifier needs two or more: check data.label_column"
        )
    return labels


def _labelled(values: list[str], ids: dict[str, int], label_column: str, labels: list[str]) -> list[int]:
    """The rows whose label is one of ``labels``; the others are counted in the log."""
    keep = [i for i, v in enumerate(values) if v in ids]
    dropped = Counter(v for v in values if v not in ids)
    if dropped:
        log.info(
            "text_csv: dropped %d of %d rows whose %s is not one of %s (%s)",
            sum(dropped.values()),
            len(values),
            label_column,
            ", ".join(labels),
            ", ".join(f"{v or '<empty>'}: {n}" for v, n in dropped.most_common()),
        )
    return keep


def _split_by_column(rows: list[dict[str, str]], keep: list[int], split_column: str,
                     split_values: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The kept rows whose ``split_column`` names the training split, and those naming the validation split."""
    train_value, val_value = (str(v) for v in split_values)
    train_rows = [i for i in keep if rows[i][split_column] == train_value]
    val_rows = [i for i in keep if rows[i][split_column] == val_value]
    if len(train_rows) + len(val_rows) < len(keep):
        log.info(
            "text_csv: dropped %d rows whose %s is neither %s nor %s",
            len(keep) - len(train_rows) - len(val_rows),
            split_column,
            train_value,
            val_value,
        )
    return train_rows, val_rows


def read_rows(path: str, columns: Sequence[str], encoding: str = "utf-8") -> list[dict[str, str]]:
    """The rows of the CSV file at ``path`` (decompressed by its extension) as ``{column: value}``.

    A short row reads as ``""`` in the columns it lacks.

    Raises:
        DataError: the file is missing or unreadable, or its header lacks one of ``columns``.
    """
    if not os.path.isfile(path):
        raise DataError(f"text_csv: {path} not found; set data.path to a CSV file (plain, .gz, .bz2 or .xz)")
    opener: Callable[..., Any] = _OPENERS.get(os.path.splitext(path)[1], open)
    reader = None
    try:
        with opener(path, "rt", encoding=encoding, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in columns if c not in header]
            if missing:
                raise DataError(
                    f"text_csv: {path} has no column {', '.join(missing)}; its columns are "
                    f"{', '.join(header) or '(none: the file is empty)'}; set data.text_column, data.label_column, "
                    f"data.group_column or data.split_column to one of them"
                )
            return [{c: row[c] or "" for c in columns} for row in reader]
    except (OSError, EOFError, UnicodeDecodeError, csv.Error, lzma.LZMAError) as e:
        near = f" near line {reader.line_num}" if reader is not None else ""
        raise DataError(
            f"text_csv: could not read {path}{near} ({type(e).__name__}: {e}); check that it is a CSV file with a "
            f"header, compressed as its extension says, and its encoding (data.encoding={encoding})"
        ) from e


def group_split(
    rows: Sequence[int], groups: Sequence[str | None], val_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Split ``rows`` into training and validation rows, keeping the rows of each group on one side.

    The groups (the distinct names, sorted, then one per row whose group is ``None``) are shuffled by a
    generator seeded with ``seed`` and moved to validation in that order until it holds at least
    ``round(val_fraction * len(rows))`` rows, so it overshoots by less than one group. Both lists keep
    the order of ``rows``.

    Args:
        rows: the row indices.
        groups: the group of each row; ``None``: a group of its own.
        val_fraction: the target share of validation rows.
        seed: seeds the shuffle; the same rows, groups and seed give the same split.
    """
    named: dict[str, list[int]] = {}
    single: list[list[int]] = []
    for pos, group in enumerate(groups):
        if group is None:
            single.append([pos])
        else:
            named.setdefault(group, []).append(pos)
    units = [named[g] for g in sorted(named)] + single
    order = torch.randperm(len(units), generator=torch.Generator().manual_seed(seed)).tolist()
    target = round(val_fraction * len(rows))
    in_val = [False] * len(rows)
    taken = 0
    for u in order:
        if taken >= target:
            break
        for pos in units[u]:
            in_val[pos] = True
        taken += len(units[u])
    return [r for r, v in zip(rows, in_val) if not v], [r for r, v in zip(rows, in_val) if v]
