"""The training entry point: the quickstart through the CLI, the output contract, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rayspec.config import ConfigError, from_mapping
from rayspec.config.compose import CONF as CONF_DIR
from rayspec.config.compose import compose
from rayspec.data import DataError
from rayspec.models import build_model
from rayspec.partition import PartitionError
from rayspec.training import run_training
from rayspec.training.prepare import prepare

CONF = str(CONF_DIR)


def compose_config(*overrides: str):
    return compose(list(overrides))


def test_quickstart_cli_writes_the_run_directory(tmp_path):
    """The default run (4 stages, spectrain, Ray) through the real CLI: §4 files, and the loss falls."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "rayspec.train", f"hydra.run.dir={run_dir}", "ray.num_cpus=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("metrics.jsonl", "summary.json", "model.pt", ".hydra/config.yaml"):
        assert (run_dir / name).exists(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["step"] == 300 and all(r["samples_per_s"] > 0 for r in steps)
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("method", "stages", "model", "dataset", "updates", "final_train_loss", "val_accuracy",
                "samples_per_s", "wall_s"):
        assert key in summary
    assert (summary["method"], summary["stages"], summary["updates"]) == ("spectrain", 4, 300)
    assert summary["val_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert "samples/s" in res.stderr + res.stdout and "stage 3: busy" in res.stderr + res.stdout
    # model.pt is the merged state_dict, loadable into the model rayspec.models builds
    config = from_mapping(compose_config())
    prepared = prepare(config)
    model = build_model("mlp", prepared.data.info, "small")
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))


@pytest.mark.parametrize("method", ["vanilla", "gpipe", "async", "pipedream", "spectrain", "spectrain accumulate=4"])
def test_every_method_trains_locally(tmp_path, method):
    method, *extra = method.split()
    config = from_mapping(compose_config(f"pipeline.method={method}", "pipeline.executor=local", "train.max_steps=40",
                                         "train.log_every=10", "model.size=tiny", *[f"pipeline.{e}" for e in extra]))
    summary = run_training(config, tmp_path)
    assert summary["updates"] == 40 and summary["final_train_loss"] < 2.31
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"loss"' in line]) == 4


def test_local_and_ray_runs_agree(tmp_path, ray_session):
    common = ["pipeline.method=spectrain", "train.max_steps=20", "model.size=tiny", "pipeline.cpus_per_stage=0.5"]
    a = run_training(from_mapping(compose_config(*common, "pipeline.executor=local")), tmp_path / "a")
    b = run_training(from_mapping(compose_config(*common, "pipeline.executor=ray")), tmp_path / "b")
    wa, wb = torch.load(tmp_path / "a" / "model.pt"), torch.load(tmp_path / "b" / "model.pt")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k])
    assert a["final_train_loss"] == pytest.approx(b["final_train_loss"], rel=1e-5)
    assert (a["transport"], b["transport"]) == ("none", "p2p" if not torch.cuda.is_available() else "p2p_nccl")


BAD = [
    (["pipeline.stages=0"], ConfigError, "pipeline.stages=0 must be >= 1"),
    (["pipeline.stages=9"], PartitionError, "pipeline.stages=9 but the model has 7 blocks"),
    (["pipeline.method=hogwild"], ConfigError, "pipeline.method='hogwild' is unknown; choose one of"),
    (["pipeline.variant=v3"], ConfigError, "pipeline.variant='v3' is unknown"),
    (["pipeline.predictor=quadratic"], ConfigError, "pipeline.predictor='quadratic' is unknown; choose one of linear"),
    (["pipeline.probe=-1"], ConfigError, "pipeline.probe=-1 must be >= 0; use 0 to turn the prediction probe off"),
    (["pipeline.predictor=adaptive", "pipeline.probe=0"], ConfigError,
     "pipeline.probe=0 turns the probe off (every prediction would be linear's); set pipeline.probe to a sample size"),
    (["pipeline.transport=carrier_pigeon"], ConfigError, "pipeline.transport='carrier_pigeon' is unknown"),
    (["pipeline.method=gpipe", "pipeline.microbatches=0"], ConfigError, "pipeline.microbatches=0 must be >= 1"),
    (["pipeline.method=gpipe", "pipeline.microbatches=5"], ConfigError, "not divisible by pipeline.microbatches=5"),
    (["pipeline.accumulate=0"], ConfigError, "pipeline.accumulate=0 must be >= 1"),
    (["pipeline.accumulate=5"], ConfigError, "train.batch_size=64 is not divisible by pipeline.accumulate=5"),
    (["pipeline.method=gpipe", "pipeline.accumulate=2"], ConfigError,
     "pipeline.accumulate=2 does not apply to pipeline.method=gpipe; set pipeline.microbatches instead"),
    (["optim.lr=0"], ConfigError, "optim.lr=0 must be a positive number"),
    (["optim.lr=-0.1"], ConfigError, "optim.lr=-0.1 must be a positive number"),
    (["optim.momentum=1.5"], ConfigError, "optim.momentum=1.5 must be in [0, 1)"),
    (["optim.name=lamb"], ConfigError, "optim.name='lamb' is unknown; choose one of sgd, adam, adamw"),
    (["optim=adamw", "optim.betas=[0.9,1.0]"], ConfigError, "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    (["optim=adam", "optim.eps=0"], ConfigError, "optim.eps=0 must be a positive number"),
    (["optim.clip_grad_norm=0"], ConfigError, "optim.clip_grad_norm=0 must be a positive number"),
    (["pipeline.method=gpipe", "optim.clip_grad_norm=1.0", "pipeline.transport=compiled"], ConfigError,
     "pipeline.transport=compiled cannot gather before an update"),
    (["train.precision=fp16"], ConfigError, "train.precision='fp16' is unknown; choose one of fp32, bf16"),
    (["pipeline.stages=two"], ConfigError, "pipeline.stages='two' must be an integer"),
    (["pipeline.balance=[2,2,2,2]"], PartitionError, "sums to 8 but the model has 7 blocks"),
    (["pipeline.balance=[4,3,0,0]"], PartitionError, "gives a stage no blocks"),
    (["pipeline.balance=[4,3]"], ConfigError, "has 2 entries but pipeline.stages=4"),
    (["train.max_steps=0"], ConfigError, "train.max_steps=0 must be >= 1"),
    (["train.batch_size=100000"], ConfigError, "exceeds the training set"),
    (["model.name=alexnet"], ConfigError, "model='alexnet' is unknown"),
    (["model.size=huge"], ConfigError, "model.size='huge' is unknown"),
    (["data.name=svhn"], ConfigError, "data='svhn' is unknown"),
    (["+pipeline.stagse=3"], ConfigError, "unknown key(s) pipeline.stagse"),
    (["ray.address=auto", "ray.num_cpus=2"], ConfigError, "ray.num_cpus=2 applies only when rayspec starts Ray"),
    (["+trace=yes"], ConfigError, "trace='yes' must be true or false"),
    (["train.train_samples=0"], ConfigError, "train.train_samples=0 must be >= 1"),
    (["logger.name=tensorboard"], ConfigError, "logger='tensorboard' is unknown"),
    (["data=cifar10"], DataError, "data=cifar10 needs data.root"),
    (["data=cifar10", "data.root=/nonexistent"], DataError, "not found in /nonexistent/cifar-10-batches-py/"),
    (["data=imdb"], DataError, "data=imdb needs data.root"),
    (["data=imdb", "data.root=/nonexistent"], DataError, "imdb: /nonexistent/aclImdb/ not found"),
    (["checkpoint.every=-1"], ConfigError, "checkpoint.every=-1 must be >= 0"),
    (["checkpoint.every=often"], ConfigError, "checkpoint.every='often' must be an integer"),
    (["checkpoint.keep=0"], ConfigError, "checkpoint.keep=0 must be >= 1"),
    (["checkpoint.resume=/nonexistent/run"], ConfigError, "checkpoint.resume=/nonexistent/run is neither"),
    (["fault.max_restarts=-2"], ConfigError, "fault.max_restarts=-2 must be >= 0"),
    (["+checkpoint.evry=5"], ConfigError, "unknown key(s) checkpoint.evry"),
    (["pipeline.transport=gloo", "pipeline.gpus_per_stage=1"], ConfigError,
     "pipeline.transport=gloo with pipeline.gpus_per_stage=1: gloo moves CPU tensors only"),
    (["pipeline.transport=nccl", "pipeline.gpus_per_stage=0"], ConfigError,
     "pipeline.transport=nccl with pipeline.gpus_per_stage=0: nccl moves GPU tensors and the stages have none"),
    (["pipeline.transport=p2p_nccl", "pipeline.gpus_per_stage=0.25"], ConfigError,
     "stages that share a GPU would be two NCCL ranks on one device"),
]


@pytest.mark.parametrize("overrides,error,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_a_clear_error(overrides, error, message):
    with pytest.raises(error) as info:
        prepare(from_mapping(compose_config("model.size=tiny", *overrides)))
    assert message in str(info.value)


def test_every_bad_input_fails_before_ray_starts(tmp_path):
    """The whole table through ``run_training()`` in one fresh process: each fails with its message and Ray never starts."""
    cases = [[*o, f"hydra.run.dir={tmp_path / str(i)}"] for i, (o, _, _) in enumerate(BAD)]
    script = """
import json, sys, ray
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.training import run_training
out = []
for i, overrides in enumerate(json.loads(sys.argv[1])):
    try:
        cfg = compose(["model.size=tiny", *overrides[:-1]])
        run_training(from_mapping(cfg), overrides[-1].split("=", 1)[1])
        out.append(["none", "", ray.is_initialized()])
    except Exception as err:
        out.append([type(err).__name__, str(err), ray.is_initialized()])
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for (overrides, error, message), (kind, text, ray_started) in zip(BAD, results):
        assert (kind, ray_started) == (error.__name__, False), (overrides, kind, text)
        assert message in text, (overrides, text)


def test_cli_reports_bad_input_before_ray_starts(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rayspec.train", "pipeline.stages=9", "model.size=tiny",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "error: pipeline.stages=9 but the model has 7 blocks" in res.stderr
    assert "Started a local Ray instance" not in res.stderr + res.stdout


def test_evaluation_records_carry_the_training_clock_without_evaluation(tmp_path):
    """Every evaluation record's ``train_s``: training seconds so far, growing, with the evaluations left out (a
    callback that sleeps at each evaluation adds to the wall time, not to it)."""
    import time

    class SlowEvaluation:
        def on_weights(self, step, state):
            time.sleep(0.3)

    config = from_mapping(compose_config("pipeline.method=spectrain", "pipeline.executor=local", "pipeline.stages=2",
                                         "model.size=tiny", "train.max_steps=40", "train.log_every=10",
                                         "train.eval_every=10"))
    t0 = time.perf_counter()
    summary = run_training(config, tmp_path, callbacks=[SlowEvaluation()])
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [10, 20, 30, 40]
    clock = [r["train_s"] for r in evals]
    assert all(0 < a < b for a, b in zip(clock, clock[1:])) and clock[-1] == summary["train_s"]
    assert clock[-1] < wall - 4 * 0.3  # the four sleeps are outside the clock
