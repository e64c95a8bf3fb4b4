"""``pipeline.method=dataparallel`` on real Ray Train: equal to SGD on the global batch, and the run directory contract."""

from __future__ import annotations

import copy
import itertools
import json
import logging

import pytest
import torch
from conftest import assert_same_weights
from test_train import compose_config

from rayspec.config import ConfigError, from_mapping
from rayspec.core.lr import LRSchedule
from rayspec.data.loader import train_batches
from rayspec.training import run_training
from rayspec.training.prepare import prepare

TINY = ("pipeline.method=dataparallel", "model=mlp", "model.size=tiny")


def dataparallel_config(*overrides: str):
    return from_mapping(compose_config(*TINY, *overrides))


def sgd_on_global_batches(config) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: one process, ``torch.optim.SGD`` on the whole model and the whole batch, per update.

    The batch's gradient is formed as DDP forms it: each worker's chunk mean, divided by the world size and
    summed (scaling by a power of two is exact). One matmul over the whole batch rounds differently, and
    120 updates of this small net amplify a rounding difference to ~1e-3 (measured: the same reference with
    2 torch threads instead of 1 ends 4.8e-3 away), so only the same arithmetic makes a tight comparison.
    """
    prepared = prepare(config)
    o = config.optim
    model = copy.deepcopy(prepared.model)
    lr = LRSchedule(o.lr, o.schedule, config.train.max_steps, o.warmup, o.power, o.min_lr)
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                          nesterov=o.nesterov)
    batches = train_batches(prepared.data.train, config.train.batch_size, config.seed)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: the same matmul blocking, so rounding differs only by the all-reduce
    try:
        for t, (x, y) in enumerate(itertools.islice(batches, config.train.max_steps)):
            for group in opt.param_groups:
                group["lr"] = lr(t)
            opt.zero_grad()
            world = config.pipeline.stages
            chunk_losses = []
            for xc, yc in zip(x.chunk(world), y.chunk(world)):
                loss = torch.nn.functional.cross_entropy(model(xc), yc)
                (loss / world).backward()  # gradients accumulate as the all-reduce sums the scaled chunks
                chunk_losses.append(loss.detach())
            opt.step()
            losses.append(torch.stack(chunk_losses).double().mean().item())
    finally:
        torch.set_num_threads(threads)
    return model.state_dict(), losses


def read_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


OPTIM = ("optim.lr=0.05", "optim.weight_decay=1e-4")
SCHEDULED = (*OPTIM, "optim.nesterov=true", "optim.schedule=cosine", "optim.warmup=3")


def assert_like_sgd(run_dir, config) -> None:
    """model.pt and the logged losses are single-process SGD's on the same global batches.

    The tolerances are assert_close's float32 defaults: the reference forms the batch gradient from the same
    chunks, so what is left is the all-reduce's summation order over more than two workers.
    """
    expected, losses = sgd_on_global_batches(config)
    got = torch.load(run_dir / "model.pt", weights_only=True)
    assert_same_weights(got, expected)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{config.pipeline.stages} workers, {config.train.max_steps} updates: "
          f"max abs weight difference to single-process SGD {diff:.3g}")
    every = config.train.log_every
    for r in read_records(run_dir):
        if "loss" in r:
            assert r["loss"] == pytest.approx(sum(losses[r["step"] - every : r["step"]]) / every, rel=1e-5)


SLEEP = 1.5


def test_two_workers_train_like_sgd_and_write_the_run_directory(tmp_path, ray_session, caplog):
    """Through ``rayspec.training.train``: SGD's weights, the §4 files, live records to the callbacks, the loss falls;
    a slow evaluation (a callback sleeping at the first) pauses training and stays out of both clocks."""
    import time

    class Recorder:
        def __init__(self):
            self.started, self.records, self.ended = None, [], []

        def on_start(self, config):
            self.started = config

        def on_metrics(self, record):
            self.records.append(record)
            if record.get("step") == 60 and "val_loss" in record:
                time.sleep(SLEEP)

        def on_end(self, summary):
            self.ended.append(summary)

    config = dataparallel_config("pipeline.stages=2", "train.max_steps=120", "train.batch_size=128",
                                 "train.log_every=20", "train.eval_every=60", *OPTIM)
    caplog.set_level(logging.INFO, logger="rayspec")
    rec = Recorder()
    summary = run_training(config, tmp_path, callbacks=[rec])
    assert_like_sgd(tmp_path, config)

    records = read_records(tmp_path)
    assert rec.started is config and rec.ended == [summary] and rec.records == records
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == [20, 40, 60, 80, 100, 120]
    assert all(set(r) == {"step", "loss", "lr", "samples_per_s", "elapsed_s"} for r in steps)
    assert all(r["samples_per_s"] > 0 for r in steps)
    assert all(r["lr"] == 0.05 for r in steps)
    assert [r["step"] for r in evals] == [60, 120]
    assert all(set(r) == {"step", "train_s", "val_loss", "val_accuracy"} for r in evals)
    # rank 0's clock grows and, like the driver's, leaves out the evaluation it waited for
    assert 0 < evals[0]["train_s"] < evals[1]["train_s"] < summary["train_s"] + SLEEP / 2
    assert summary["train_s"] < summary["wall_s"] - SLEEP
    assert records.index(evals[0]) == records.index(steps[2]) + 1  # the step record, then the evaluation
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    assert evals[-1]["val_accuracy"] > 0.3  # 10 classes: chance is 0.1

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    pipeline_keys = {"method", "variant", "stages", "model", "model_size", "dataset", "executor", "transport",
                     "balance", "updates", "final_train_loss", "val_loss", "val_accuracy", "samples_per_s",
                     "train_s", "wall_s", "bubble_fraction", "bytes_per_update", "seed", "stage_stats", "config",
                     "restarts", "checkpoint", "resumed_from", "layout_changes"}
    assert set(on_disk) == pipeline_keys
    assert (on_disk["method"], on_disk["stages"], on_disk["updates"]) == ("dataparallel", 2, 120)
    assert on_disk["transport"] == "gloo" and on_disk["val_accuracy"] == evals[-1]["val_accuracy"]
    assert [st["stage"] for st in on_disk["stage_stats"]] == [0, 1]
    assert all(st["version"] == 120 and st["actions"] == {"F": 120, "B": 120} for st in on_disk["stage_stats"])

    # model.pt: the model's own state_dict names (no DDP "module." prefix), loadable into a fresh model
    model = copy.deepcopy(prepare(config).model)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert any(line.startswith("step    120/120") and "samples/s" in line for line in caplog.messages), caplog.messages  # _Progress's
    assert any(line.startswith("worker 1: busy") for line in caplog.messages)


@pytest.mark.slow
def test_four_workers_equal_sgd_on_the_global_batch(tmp_path, ray_session):
    """Four workers on two cores (half a CPU each by default), 16 samples each per update; Nesterov, warm-up, cosine."""
    config = dataparallel_config("pipeline.stages=4", "train.max_steps=12", "train.log_every=4", *SCHEDULED)
    run_training(config, tmp_path)
    assert_like_sgd(tmp_path, config)
    steps = [r for r in read_records(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == [4, 8, 12]
    lr = LRSchedule(0.05, "cosine", 12, 3)
    assert [r["lr"] for r in steps] == pytest.approx([lr(3), lr(7), lr(11)])  # the schedule per update


@pytest.mark.slow  # Ray Train workers
def test_a_worker_failure_is_a_clear_error_on_the_driver(tmp_path, ray_session):
    """A diverging run fails on the workers; the driver raises the pipeline's FloatingPointError, no hang."""
    ended = []

    class Recorder:
        def on_end(self, summary):
            ended.append(summary)

    config = dataparallel_config("pipeline.stages=2", "train.max_steps=40", "train.log_every=5", "optim.lr=1000")
    with pytest.raises(FloatingPointError, match=r"the loss of micro-batch \d+ is \S+ at update \d+ on stage 0 \(the last\); lower optim.lr"):
        run_training(config, tmp_path, callbacks=[Recorder()])
    assert ended == [None]
    assert not (tmp_path / "model.pt").exists()


BAD = [
    (["pipeline.stages=3"], "train.batch_size=64 is not divisible by pipeline.stages=3"),
    (["pipeline.stages=4", "train.batch_size=30"], "train.batch_size=30 is not divisible by pipeline.stages=4"),
    (["pipeline.executor=local"], "pipeline.executor=local does not apply to pipeline.method=dataparallel"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_settings_are_a_clear_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        dataparallel_config(*overrides)


def test_workers_are_not_limited_by_the_number_of_blocks():
    """Each worker holds the whole model: more workers than blocks is fine, and pipeline-only keys are ignored."""
    prepared = prepare(dataparallel_config("pipeline.stages=8", "pipeline.balance=[4,3]", "pipeline.partition=profile"))
    assert prepared.balance == [len(prepared.model)] and prepared.plan is None


def test_a_tune_placement_group_is_refused_before_ray_train_starts(tmp_path):
    ended = []

    class Recorder:
        def on_end(self, summary):
            ended.append(summary)

    with pytest.raises(ConfigError, match="cannot run inside a Ray Tune trial's placement group"):
        run_training(dataparallel_config("pipeline.stages=2"), tmp_path, callbacks=[Recorder()],
              placement_group=object())
    assert ended == [None]


@pytest.mark.slow
def test_an_interrupted_dataparallel_run_resumes_like_sgd(tmp_path, ray_session):
    """Stopped by a failure after update 12 (checkpoint at 10), resumed with checkpoint.resume=auto: the weights and
    the logged losses are still those of single-process SGD over all 24 updates, and no record is written twice."""

    class StopAfter:
        def on_metrics(self, record):
            if "loss" in record and record["step"] >= 12:
                raise KeyboardInterrupt

    overrides = ("pipeline.stages=2", "train.max_steps=24", "train.batch_size=64", "train.log_every=2",
                 "checkpoint.every=5", *SCHEDULED)
    with pytest.raises(KeyboardInterrupt):
        run_training(dataparallel_config(*overrides), tmp_path, callbacks=[StopAfter()])
    assert (tmp_path / "checkpoints" / "step_00000010.pt").exists()
    config = dataparallel_config(*overrides, "checkpoint.resume=auto")
    summary = run_training(config, tmp_path)
    assert summary["resumed_from"] == 10 and summary["updates"] == 24
    assert_like_sgd(tmp_path, config)
    steps = [r["step"] for r in read_records(tmp_path) if "loss" in r]
    assert steps == list(range(2, 25, 2))
