"""Text helpers: a simple deterministic tokenizer, a frequency vocabulary and padded encoding of splits."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from rayspec.data import DataError

__all__ = ["PAD", "UNK", "PAD_TOKEN", "UNK_TOKEN", "tokenize", "build_vocab", "encode", "encode_splits", "check_sizes"]

PAD = 0
"""Id of the padding token."""
UNK = 1
"""Id of the unknown (out-of-vocabulary) token."""
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"

_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_WORD = re.compile(r"(?:[^\W_]|')+")  # runs of letters, digits and apostrophes (Unicode-aware)


def tokenize(text: str) -> list[str]:
    """Split ``text`` into lowercase word tokens.

    HTML line breaks (``<br />``) become spaces; tokens are runs of letters, digits and apostrophes
    (everything else separates tokens); apostrophes at either end of a token are stripped, so quotes
    do not create new words while ``don't`` stays one token.

    Args:
        text: raw text.

    Returns:
        The tokens in order.
    """
    tokens = (t.strip("'") for t in _WORD.findall(_BREAK.sub(" ", text).lower()))
    return [t for t in tokens if t]


def build_vocab(counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """The vocabulary of the ``vocab_size - 2`` most frequent tokens, ties broken alphabetically.

    Args:
        counts: how often each token occurs (count the training split only), e.g.
            ``Counter(t for doc in docs for t in doc)``.
        vocab_size: the size of the vocabulary including ``<pad>`` (id 0) and ``<unk>`` (id 1).

    Returns:
        The tokens by id: ``[PAD_TOKEN, UNK_TOKEN, most frequent, ...]``; shorter than ``vocab_size`` if
        there are fewer distinct tokens.
    """
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: max(vocab_size - 2, 0)]
    return [PAD_TOKEN, UNK_TOKEN] + [tok for tok, _ in ranked]


def encode(docs: Sequence[Sequence[str]], vocab: Sequence[str], max_len: int) -> torch.Tensor:
    """Token ids of ``docs``, truncated to their first ``max_len`` tokens and padded with ``PAD`` at the end.

    Args:
        docs: tokenized documents.
        vocab: the tokens by id, as returned by :func:`build_vocab`; unknown tokens become ``UNK``.
        max_len: the length of every encoded row.

    Returns:
        An int64 tensor of shape ``(len(docs), max_len)``.
    """
    index = {tok: i for i, tok in enumerate(vocab) if i >= 2}
    out = torch.full((len(docs), max_len), PAD, dtype=torch.int64)
    for row, doc in enumerate(docs):
        ids = [index.get(tok, UNK) for tok in doc[:max_len]]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def encode_splits(
    texts: Mapping[str, Sequence[str]], vocab_size: int, max_len: int, train: str = "train"
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Tokenize every split, build the vocabulary from split ``train`` only and encode every split with it.

    Args:
        texts: the raw texts of each split, by split name.
        vocab_size: the size of the vocabulary including ``<pad>`` and ``<unk>`` (see :func:`build_vocab`).
        max_len: tokens per encoded text (see :func:`encode`).
        train: the split whose tokens are counted for the vocabulary.

    Returns:
        The vocabulary and, by split name, the int64 ids of shape ``(len(texts[split]), max_len)``.
    """
    counts: Counter[str] = Counter()
    docs: dict[str, list[list[str]]] = {}
    for split, raw in texts.items():
        docs[split] = []
        for text in raw:
            tokens = tokenize(text)
            if split == train:
                counts.update(tokens)
            docs[split].append(tokens[:max_len])  # only the kept tokens, to bound memory
    vocab = build_vocab(counts, vocab_size)
    return vocab, {split: encode(split_docs, vocab, max_len) for split, split_docs in docs.items()}


def check_sizes(name: str, vocab_size: object, max_len: object) -> None:
    """Raise ``DataError`` naming data set ``name`` unless ``vocab_size >= 3`` and ``max_len >= 1`` are integers."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 3:
        raise DataError(
            f"{name}: data.vocab_size={vocab_size!r} must be an integer >= 3 (padding, unknown and one token)"
        )
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise DataError(f"{name}: data.max_len={max_len!r} must be an integer >= 1")
