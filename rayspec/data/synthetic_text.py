"""Offline synthetic token sequences whose class shows in cue words and in word order, deterministic by seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register
from rayspec.data.text import PAD

__all__ = ["synthetic_text", "CUES_PER_CLASS"]

CUES_PER_CLASS = 4
"""Cue words per class."""
_MIN_BACKGROUND = 10


@register("synthetic_text")
def synthetic_text(
    root: str | None = None,
    seed: int = 0,
    vocab_size: int = 1000,
    seq_len: int = 64,
    num_classes: int = 2,
    train_size: int = 4096,
    val_size: int = 512,
) -> DataBundle:
    """Token sequences of variable length, padded with 0 at the end, whose class shows two ways.

    Each sequence is ``seq_len // 2`` to ``seq_len`` background words (Zipf-distributed, carrying no
    class information) with, at random positions:

    * 0–2 *cue words* of its class (each class owns ``CUES_PER_CLASS`` words) and, with probability 1/4,
      one cue word of another class: a bag-of-words model learns these and reaches about 75% accuracy
      for two classes (it cannot do better, as some sequences have no cue or a misleading one);
    * 1–3 *ordered pairs* of the ``num_classes + 1`` shared order words ``o``: class ``c`` uses the pairs
      ``(o[i], o[(i + c + 1) % (num_classes + 1)])``. Every class uses every order word equally often, so
      only the order of adjacent words tells the classes apart; a model of word order reaches ~100%.

    Id 0 is padding and id 1 (unknown) is never used. The same ``seed`` gives the same data everywhere.

    Args:
        root: unused.
        seed: fixes the roles of the words and every sequence.
        vocab_size: number of token ids, including padding and unknown.
        seq_len: length of every (padded) sequence.
        num_classes: number of classes.
        train_size: number of training sequences.
        val_size: number of validation sequences (0: no validation split).

    Returns:
        ``TensorDataset`` splits of ``(x int64 (seq_len,), y int64)``.

    Raises:
        DataError: an option is out of range.
    """
    special = _special(num_classes)
    if num_classes < 2 or seq_len < 12 or train_size < 1 or val_size < 0 or vocab_size < special + _MIN_BACKGROUND:
        raise DataError(
            f"synthetic_text needs num_classes>=2, seq_len>=12, train_size>=1, val_size>=0 and "
            f"vocab_size>={special + _MIN_BACKGROUND} (for num_classes={num_classes}); got num_classes={num_classes}, "
            f"seq_len={seq_len}, train_size={train_size}, val_size={val_size}, vocab_size={vocab_size}"
        )
    language = _Language.drawn(seed, vocab_size, seq_len, num_classes)
    train = language.split(train_size)
    val = language.split(val_size) if val_size else None
    return DataBundle(train, val, DataInfo("text", num_classes, (seq_len,), vocab_size))


def _special(num_classes: int) -> int:
    """Ids with a role: padding, unknown, the cue words and the order words."""
    return 2 + CUES_PER_CLASS * num_classes + num_classes + 1


@dataclass
class _Language:
    """The roles of the words, drawn from the seed, and the generator every sequence is then drawn from."""

    g: torch.Generator
    num_classes: int
    seq_len: int
    cues: list[list[int]]
    """``CUES_PER_CLASS`` cue words per class."""
    pairs: list[list[tuple[int, int]]]
    """The ordered pairs of order words per class."""
    background: torch.Tensor
    zipf: torch.Tensor
    """The background words' weights: the ``k``-th is drawn with weight ``1/k``."""

    @classmethod
    def drawn(cls, seed: int, vocab_size: int, seq_len: int, num_classes: int) -> _Language:
        special = _special(num_classes)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(vocab_size - 2, generator=g) + 2
        cues = ids[: CUES_PER_CLASS * num_classes].view(num_classes, CUES_PER_CLASS).tolist()
        order = ids[CUES_PER_CLASS * num_classes : special - 2].tolist()
        background = ids[special - 2 :]
        zipf = 1.0 / torch.arange(1, len(background) + 1, dtype=torch.float64)
        m = num_classes + 1
        pairs = [[(order[i], order[(i + c + 1) % m]) for i in range(m)] for c in range(num_classes)]
        return cls(g, num_classes, seq_len, cues, pairs, background, zipf)

    def randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.g))

    def sample(self, y: int) -> list[int]:
        """One sequence of class ``y``, unpadded: its cue words and ordered pairs among background words."""
        randint, cues, m = self.randint, self.cues, self.num_classes + 1
        items: list[list[int]] = [[cues[y][randint(0, CUES_PER_CLASS)]] for _ in range(randint(0, 3))]
        if randint(0, 4) == 0:
            other = (y + randint(1, self.num_classes)) % self.num_classes
            items.append([cues[other][randint(0, CUES_PER_CLASS)]])
        items += [list(self.pairs[y][randint(0, m)]) for _ in range(randint(1, 4))]
        n_items = sum(len(it) for it in items)
        length = max(randint(self.seq_len // 2, self.seq_len + 1), n_items)
        words = self.background[torch.multinomial(self.zipf, length - n_items, replacement=True, generator=self.g)].tolist()
        # Insert the items at random gaps between background words (in a random order, never splitting a pair).
        perm = torch.randperm(len(items), generator=self.g).tolist()
        gaps = torch.randint(0, len(words) + 1, (len(items),), generator=self.g).sort().values.tolist()
        out: list[int] = []
        prev = 0
        for gap, k in zip(gaps, perm):
            out += words[prev:gap] + items[k]
            prev = gap
        return out + words[prev:]

    def split(self, n: int) -> TensorDataset:
        """``n`` labelled sequences, padded to ``seq_len``."""
        y = torch.randint(self.num_classes, (n,), generator=self.g)
        x = torch.full((n, self.seq_len), PAD, dtype=torch.int64)
        for i, label in enumerate(y.tolist()):
            seq = self.sample(label)
            x[i, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        return TensorDataset(x, y)
