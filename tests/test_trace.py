"""Timelines and counters: one trace interval per action, the Chrome trace and Gantt chart, bubble fraction,
and byte counters equal to the analytic activation and gradient volume."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import compose_config

from rayspec.config import from_mapping
from rayspec.models import build_model
from rayspec.partition import split, uniform
from rayspec.training import run_training
from rayspec.training.prepare import prepare
from rayspec.training.trace import bubble_fraction, chrome_trace

BASE = ["model.size=tiny", "data.train_size=512", "data.val_size=64", "train.max_steps=6", "train.batch_size=16",
        "train.log_every=3", "pipeline.cpus_per_stage=0.5", "+trace=true"]


@pytest.mark.parametrize(("executor", "method"), [("local", "gpipe"), pytest.param("ray", "spectrain", marks=pytest.mark.slow),
                                                  pytest.param("ray", "pipedream", marks=pytest.mark.slow)])
def test_trace_has_one_interval_per_action(executor, method, tmp_path, ray_session):
    cfg = compose_config(*BASE, f"pipeline.executor={executor}", f"pipeline.method={method}", "train.eval_every=3")
    summary = run_training(from_mapping(cfg), tmp_path)
    micro = 6 * (4 if method == "gpipe" else 1)
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 4 * 2 * micro  # every stage: one F and one B per micro-batch
    for k in range(4):
        mine = [e for e in events if e["tid"] == k]
        assert sorted((e["cat"], e["args"]["microbatch"]) for e in mine) == sorted(  # two runs: eval after 3
            (kind, m) for kind in "FB" for m in range(micro // 2) for _run in range(2))
        assert all(e["dur"] > 0 and e["ts"] >= 0 for e in mine)
        starts = sorted(e["ts"] for e in mine)
        ends = sorted(e["ts"] + e["dur"] for e in mine)
        assert all(s >= e - 1e-3 for s, e in zip(starts[1:], ends[:-1]))  # a stage runs one action at a time
    assert (tmp_path / "timeline.png").stat().st_size > 5000
    assert 0.0 <= summary["bubble_fraction"] < 1.0


def test_bubble_fraction_of_a_known_timeline():
    # Two stages, 1 s span: stage 0 busy 1.0 s, stage 1 busy 0.5 s -> 25% idle.
    timeline = [[("F", 0, 10.0, 10.5), ("B", 0, 10.5, 11.0)], [("F", 0, 10.2, 10.4), ("B", 0, 10.4, 10.7)]]
    assert bubble_fraction(timeline) == pytest.approx(0.25)
    # Time between two runs (an evaluation) is not bubble.
    later = [[(k, m, s + 100, e + 100) for k, m, s, e in st] for st in timeline]
    both = [a + b for a, b in zip(timeline, later)]
    assert bubble_fraction(both, segments=[(9, 12), (109, 112)]) == pytest.approx(0.25)
    doc = chrome_trace(timeline)
    assert [e["ts"] for e in doc["traceEvents"] if e["ph"] == "X"] == pytest.approx([0, 5e5, 2e5, 4e5])


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_byte_counters_match_the_analytic_volume(executor, tmp_path, ray_session):
    """Per update each boundary moves one activation forward and one gradient of the same shape back."""
    cfg = compose_config(*BASE[:-1], f"pipeline.executor={executor}", "pipeline.method=async")
    config = from_mapping(cfg)
    prepared = prepare(config)
    x = next(iter(torch.utils.data.DataLoader(prepared.data.train, batch_size=16)))[0]
    boundary = 0
    with torch.no_grad():
        for part in split(build_model("mlp", prepared.data.info, "tiny"), uniform(len(prepared.model), 4))[:-1]:
            x = part(x)
            boundary += x.numel() * x.element_size()
    summary = run_training(config, tmp_path)
    assert summary["bytes_per_update"] == 2 * boundary
    sent = [st["sent_bytes"] for st in summary["stage_stats"]]
    assert sent[-1]["F"] == 0 and sent[0]["B"] == 0  # nothing leaves the ends of the pipeline
    assert all(s["F"] > 0 for s in sent[:-1]) and all(s["B"] > 0 for s in sent[1:])
