"""The study models: the GroupNorm CNN, the Transformer's embedding scale and the residual LSTM's first layer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, build_model

IMAGE = DataInfo("image", 10, (1, 28, 28))
TEXT = DataInfo("text", 2, (16,), 500)


@pytest.mark.parametrize(("size", "width"), [("tiny", 16), ("small", 32), ("full", 64)])
def test_cnn_blocks_shapes_and_groupnorm(size, width):
    model = build_model("cnn", IMAGE, size)
    assert len(model) == 5  # up to five stages
    assert model[0][0].out_channels == width and model[2][0].out_channels == 4 * width
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 3
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_cnn_micro_batches_compute_what_the_batch_does():
    """GroupNorm normalizes each sample alone: two micro-batches give the batch's outputs and gradients."""
    torch.manual_seed(0)
    model = build_model("cnn", IMAGE, "tiny", width=8, groups=4)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    whole = torch.cat([model(x[:4]), model(x[4:])])
    torch.testing.assert_close(whole, model(x))
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    halves = [nn.functional.cross_entropy(model(x[i:i + 4]), y[i:i + 4]) / 2 for i in (0, 4)]
    split = torch.autograd.grad(halves[0] + halves[1], list(model.parameters()))
    for a, b in zip(grads, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("options", "match"), [({"width": 12, "groups": 8}, "divisible by groups"),
                                                 ({"dropout": 1.0}, "model.dropout=1.0")])
def test_cnn_bad_options(options, match):
    with pytest.raises(ModelError, match=match):
        build_model("cnn", IMAGE, "tiny", **options)


def test_transformer_embedding_has_the_positions_scale():
    """Token embeddings times sqrt(d_model) have unit scale, as the sinusoidal positions do (not sqrt(d_model))."""
    torch.manual_seed(0)
    model = build_model("transformer", DataInfo("text", 2, (16,), 5000), "small", layers=1)
    embed = model[0]
    scaled = embed.embedding.weight[1:] * embed.scale
    assert scaled.std().item() == pytest.approx(1.0, rel=0.05)
    assert embed.positions.abs().max().item() <= 1.0 and embed.embedding.weight[0].abs().sum() == 0
    assert embed.scale == math.sqrt(128)


def test_residual_lstm_first_layer_is_not_residual():
    model = build_model("residual_lstm", TEXT, "tiny", layers=3, dropout=0.0)
    assert [block.residual for block in model[1:4]] == [False, True, True]
    tokens = torch.randint(1, 500, (2, 16))
    h, last = model[1](model[0](tokens))
    assert h.abs().max() < 1  # the first layer's output alone: the embedding is not carried on
