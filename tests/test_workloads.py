"""Every model at size tiny trains through the training entry point on 4 stages with spectrain, on Ray and locally, with the same numbers."""

from __future__ import annotations

import pytest
import torch
from test_train import compose_config

from rayspec.config import from_mapping
from rayspec.data import DATASETS
from rayspec.models import MODELS
from rayspec.training import run_training

IMAGE_MODELS = ["mlp", "vgg16", "resnet50", "resnet152", "densenet121", "googlenet", "inception_v4", "snn", "cnn"]
TEXT_MODELS = ["transformer", "residual_lstm"]


def _overrides(model):
    if model in TEXT_MODELS:
        data = ["data=synthetic_text", "data.train_size=256", "data.val_size=64"]
    else:
        data = ["data.image_size=32", "data.train_size=256", "data.val_size=64"]
    return [f"model={model}", "model.size=tiny", *data, "pipeline.method=spectrain", "pipeline.stages=4",
            "train.max_steps=4", "train.batch_size=16", "train.log_every=2", "pipeline.cpus_per_stage=0.5"]


# run with pytest -m slow; in the default set the Transformer runs on Ray in the tuple test below, the quickstart
# MLP in tests/test_experiments.py
SLOW = {"vgg16", "resnet50", "resnet152", "densenet121", "googlenet", "inception_v4", "snn", "residual_lstm", "mlp", "cnn",
        "transformer"}


@pytest.mark.parametrize("model", [m if m not in SLOW else pytest.param(m, marks=pytest.mark.slow)
                                   for m in IMAGE_MODELS + TEXT_MODELS])
def test_tiny_model_trains_on_ray_like_local(model, tmp_path, ray_session):
    if model in TEXT_MODELS and "synthetic_text" not in DATASETS:
        pytest.fail("synthetic_text is not registered")
    assert model in MODELS
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each stage actor: the same float summation order
    try:
        for executor in ("local", "ray"):
            config = from_mapping(compose_config(*_overrides(model), f"pipeline.executor={executor}"))
            runs[executor] = run_training(config, tmp_path / executor)
    finally:
        torch.set_num_threads(threads)
    assert runs["ray"]["updates"] == runs["local"]["updates"] == 4
    assert runs["ray"]["final_train_loss"] == pytest.approx(runs["local"]["final_train_loss"], rel=1e-4)
    a = torch.load(tmp_path / "local" / "model.pt")
    b = torch.load(tmp_path / "ray" / "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k])


@pytest.mark.parametrize(("model_name", "transport"), [
    ("transformer", "p2p"), pytest.param("residual_lstm", "gloo", marks=pytest.mark.slow),
    pytest.param("transformer", "object_store", marks=pytest.mark.slow),
    pytest.param("transformer", "gloo", marks=pytest.mark.slow),
    pytest.param("residual_lstm", "object_store", marks=pytest.mark.slow),
])
def test_text_pipelines_carry_tuples_with_gradients(model_name, transport, ray_session):
    """Tuple activations (hidden states with masks or LSTM state) cross every stage boundary with their
    gradients: a 4-stage ``vanilla`` pipeline on Ray equals plain SGD on the unpartitioned model."""
    from conftest import make_stages, plain_sgd

    from rayspec.core.schedule import build_schedule
    from rayspec.data import build_data
    from rayspec.exec.ray import RayExecutor
    from rayspec.models import build_model

    torch.manual_seed(0)
    data = build_data("synthetic_text", seed=0, vocab_size=200, seq_len=24, train_size=256, val_size=0)
    model = build_model(model_name, data.info, "tiny", dropout=0.0)  # dropout draws differ per process
    updates, batch = 6, 16
    x, y = data.train.tensors
    batches = list(zip(x[: updates * batch].split(batch), y[: updates * batch].split(batch)))
    with RayExecutor(make_stages(model, "vanilla", 4, weight_decay=0.0), "vanilla", transport=transport,
                     cpus_per_stage=0.5) as ex:
        ex.run(build_schedule("vanilla", 4, updates), iter(batches))
        got = ex.state_dict()
    ref = plain_sgd(model, data, updates, batch, weight_decay=0.0)
    assert got.keys() == ref.keys()
    moved = 0
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        moved += int(not torch.equal(ref[k], model.state_dict()[k]))
    assert moved == len(ref)  # every parameter got a gradient through the tuples, none was left behind
