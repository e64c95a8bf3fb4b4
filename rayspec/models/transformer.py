"""A Transformer encoder text classifier (Vaswani et al. 2017) as a block sequence.

Blocks: token embedding (initialized N(0, 1/d_model), then scaled by ``sqrt(d_model)``, so each coordinate
has unit scale as the positions do: the initialization of Vaswani et al.'s tensor2tensor and fairseq; an N(0, 1)
initialization times ``sqrt(d_model)`` drowned the positions) plus sinusoidal positions, then one
``nn.TransformerEncoderLayer`` (post-norm, ReLU, batch first) per block, then masked mean pooling
over the non-pad positions and a linear classifier. Between blocks travels the tuple
``(hidden (B, T, d_model) float, pad_mask (B, T) bool)``, ``pad_mask`` True at padding (id 0),
which every encoder layer takes as ``src_key_padding_mask``. ``full`` is the paper's base
encoder (6 layers, d_model 512, 8 heads, FFN 2048, dropout 0.1); ``small`` has d_model 128,
4 heads, FFN 512; ``tiny`` d_model 32, 2 heads, FFN 64 (all 6 layers).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import pick, text_vocab

# (d_model, heads, feed-forward width, layers) per size
_SIZES = {"full": (512, 8, 2048, 6), "small": (128, 4, 512, 6), "tiny": (32, 2, 64, 6)}

Hidden = tuple[torch.Tensor, torch.Tensor]


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """The ``(length, dim)`` sinusoidal position encoding of Vaswani et al."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return pe


class Embed(nn.Module):
    """Token ids ``(B, T)`` -> ``(embedding + positions, pad_mask)``.

    A sequence that is all padding gets an all-False mask (it attends to, and is pooled over,
    its pad embeddings), since attention over no key at all is undefined.
    """

    positions: torch.Tensor

    def __init__(self, vocab: int, dim: int, length: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=0)
        nn.init.normal_(self.embedding.weight, std=dim**-0.5)  # times sqrt(dim) below: unit scale, as the positions
        with torch.no_grad():
            self.embedding.weight[0].zero_()  # the padding row, as nn.Embedding leaves it
        self.register_buffer("positions", sinusoids(length, dim), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(dim)

    def forward(self, tokens: torch.Tensor) -> Hidden:
        mask = tokens == 0
        mask = mask & ~mask.all(dim=1, keepdim=True)
        h = self.embedding(tokens) * self.scale + self.positions[: tokens.shape[1]]
        return self.dropout(h), mask


class EncoderLayer(nn.Module):
    """One ``nn.TransformerEncoderLayer`` on ``(hidden, pad_mask)``, passing the mask on."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout, batch_first=True)

    def forward(self, x: Hidden) -> Hidden:
        h, mask = x
        return self.layer(h, src_key_padding_mask=mask), mask


class MaskedMeanClassifier(nn.Module):
    """Mean of the hidden states over non-pad positions, then dropout and a linear classifier."""

    def __init__(self, dim: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: Hidden) -> torch.Tensor:
        h, mask = x
        keep = (~mask).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.fc(self.dropout(pooled))


@register("transformer")
def transformer(size: str, info: DataInfo, layers: int | None = None, dropout: float = 0.1) -> nn.Sequential:
    """A Transformer encoder classifier; see the module docstring.

    Args:
        size: ``full``, ``small`` or ``tiny``.
        info: the text data set's description (``vocab_size`` and ``input_shape=(T,)``).
        layers: number of encoder layers (default per size).
        dropout: dropout probability of the embedding, the encoder layers and the classifier.
    """
    dim, heads, ffn, n = pick(_SIZES, size, "transformer")
    n = layers or n
    if n < 1:
        raise ModelError(f"model.layers={n} must be >= 1")
    if not 0 <= dropout < 1:
        raise ModelError(f"model.dropout={dropout} must be in [0, 1)")
    vocab, length = text_vocab("transformer", info)
    blocks: list[nn.Module] = [Embed(vocab, dim, length, dropout)]
    blocks += [EncoderLayer(dim, heads, ffn, dropout) for _ in range(n)]
    blocks.append(MaskedMeanClassifier(dim, info.num_classes, dropout))
    return nn.Sequential(*blocks)
