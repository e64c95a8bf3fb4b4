"""A stacked residual LSTM text classifier (as in GNMT, Wu et al. 2016) as a block sequence.

Blocks: token embedding; one single-layer ``nn.LSTM`` (batch first) per block, computing
``dropout(lstm(h))`` in the first layer and ``h + dropout(lstm(h))`` in every later one (GNMT's
encoder also starts its residual connections above the bottom layers). A residual first layer would
carry the raw token embedding to the classifier, where the last token's embedding (N(0, 1) in every
coordinate) outweighs the LSTMs' outputs (each in (-1, 1)): such a model stayed at the majority class
on the Rotten Tomatoes snippets. Then a linear
classifier on the hidden state at each sequence's last non-pad position. The LSTMs run
left to right over the padded sequence, so with right padding that state is exactly the one a
packed sequence would give. Between blocks travels ``(hidden (B, T, H) float, last (B,) int64)``,
``last`` the index of the last non-pad token (0 for an all-pad sequence). ``full`` has 8 layers
of 1024 units (GNMT's encoder depth and width), ``small`` 6 of 256, ``tiny`` 6 of 32.
"""

from __future__ import annotations

import torch
from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import pick, text_vocab

# (embedding width = hidden width, LSTM layers) per size
_SIZES = {"full": (1024, 8), "small": (256, 6), "tiny": (32, 6)}

Hidden = tuple[torch.Tensor, torch.Tensor]


class Embed(nn.Module):
    """Token ids ``(B, T)`` -> ``(embeddings, index of the last non-pad token)``."""

    def __init__(self, vocab: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=0)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> Hidden:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        last = (positions * (tokens != 0)).amax(dim=1)
        return self.dropout(self.embedding(tokens)), last


class ResidualLSTM(nn.Module):
    """One LSTM layer over the whole sequence, with a residual connection where widths match."""

    def __init__(self, in_dim: int, hidden: int, dropout: float, residual: bool = True) -> None:
        super().__init__()
        self.lstm = nn.LSTM(in_dim, hidden, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.residual = residual and in_dim == hidden

    def forward(self, x: Hidden) -> Hidden:
        h, last = x
        out = self.dropout(self.lstm(h)[0])
        return (h + out if self.residual else out), last


class LastStateClassifier(nn.Module):
    """A linear classifier on the hidden state at each sequence's last non-pad position."""

    def __init__(self, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: Hidden) -> torch.Tensor:
        h, last = x
        return self.fc(h[torch.arange(h.shape[0], device=h.device), last])


@register("residual_lstm")
def residual_lstm(
    size: str, info: DataInfo, hidden: int | None = None, layers: int | None = None, dropout: float = 0.1
) -> nn.Sequential:
    """A stacked residual LSTM classifier; see the module docstring.

    Args:
        size: ``full``, ``small`` or ``tiny``.
        info: the text data set's description (``vocab_size`` and ``input_shape=(T,)``).
        hidden: embedding and LSTM width (default per size).
        layers: number of LSTM layers (default per size).
        dropout: dropout probability of the embedding and of each LSTM layer's output.
    """
    dim, n = pick(_SIZES, size, "residual_lstm")
    dim, n = hidden or dim, layers or n
    if dim < 1 or n < 1:
        raise ModelError(f"model=residual_lstm needs hidden >= 1 and layers >= 1, got hidden={dim}, layers={n}")
    if not 0 <= dropout < 1:
        raise ModelError(f"model.dropout={dropout} must be in [0, 1)")
    vocab, _ = text_vocab("residual_lstm", info)
    blocks: list[nn.Module] = [Embed(vocab, dim, dropout)]
    blocks += [ResidualLSTM(dim, dim, dropout, residual=i > 0) for i in range(n)]
    blocks.append(LastStateClassifier(dim, info.num_classes))
    return nn.Sequential(*blocks)
