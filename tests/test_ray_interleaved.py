"""Interleaved 1F1B on Ray's p2p transport: a stage actor hosts ``pipeline.virtual_stages`` model chunks (actor k holds
chunks k, k+N, ...), and the run equals sequential SGD and the local executor; the chunk plan never deadlocks."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import Stop, StopAfter, assert_same_weights, make_stages, microbatches, plain_sgd, plain_torch

from rayspec.config import ConfigError, from_mapping
from rayspec.core.schedule import ScheduleError, build_schedule
from rayspec.core.schedule_text import load_schedule, to_csv
from rayspec.exec import LocalExecutor
from rayspec.exec.ray.p2p_plan import plan_p2p, source, target
from rayspec.models import build_model
from rayspec.training import run_training as train

UPDATES, GROUP, VIRTUAL = 4, 4, 2


def simulate(chunks, ranks, stages) -> bool:
    """Actors that take one chunk call at a time and block on each receive (matched by link, tag), never on a send;
    the driver submits chunk c+2 once chunk c ended everywhere. Every wait on a send (``retire``) must find it
    received. True when every op ran (no deadlock)."""
    sent, held = set(), [set() for _ in range(ranks)]
    submitted, at = min(2, len(chunks)), [[0, 0] for _ in range(ranks)]
    moved = True
    while moved:
        moved = False
        for k in range(ranks):
            c, i = at[k]
            if c >= submitted:
                continue
            if i == len(chunks[c][k]):
                at[k] = [c + 1, 0]
                moved = True
                continue
            op = chunks[c][k][i]
            got, out = source(op, ranks, stages), target(op, ranks, stages)
            if got is not None:
                key = (got.src, got.dst, got.tag)
                if key not in sent:
                    continue
                sent.remove(key)
                for t in op.retire:
                    assert (got.src, t) in held[k] and (k, got.src, t) not in sent, (k, op, t)
                    held[k].remove((got.src, t))
            if out is not None:
                sent.add((out.src, out.dst, out.tag))
                if not out.local:
                    held[k].add((out.dst, out.tag))
            at[k][1] += 1
            moved = True
        while submitted < len(chunks) and all(a[0] > submitted - 2 for a in at):
            submitted += 1
    return all(a[0] == len(chunks) for a in at) and not sent


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("virtual", [2, 3])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_interleaved_chunks_replay_the_rank_order_and_never_deadlock(n, virtual, width):
    schedule = build_schedule("interleaved", n, 4 * n, group=2 * n, virtual=virtual)
    chunks = plan_p2p(schedule, None, width)
    for r, acts in enumerate(schedule.rank_actions):
        ran = [(op.stage, kind, op.m) for c in chunks for op in c[r]
               for kind in (("F", "B") if op.kind == "FB" else (op.kind,))]
        assert ran == [a.key for a in acts]
    assert simulate(chunks, n, n * virtual)


@pytest.fixture(scope="module")
def deep(tiny):
    """The tiny MLP with 8 blocks: 4 stage actors of 2 chunks."""
    torch.manual_seed(0)
    return build_model("mlp", tiny[1].info, "tiny", depth=7), tiny[1]


def _run(ex, model, data, n, schedule=None, **settings):
    stages = make_stages(model, "interleaved", n * VIRTUAL, group=GROUP, **settings)
    schedule = schedule or build_schedule("interleaved", n, UPDATES * GROUP, group=GROUP, virtual=VIRTUAL)
    if ex is None:
        ex = LocalExecutor(stages, "interleaved")
    else:
        ex.load(stages)
    losses = ex.run(schedule, iter(microbatches(data, UPDATES, 32, GROUP)))
    return ex.state_dict(), losses


def _executor(model, n):
    """``n`` stage actors of 2 chunks, a quarter CPU each (the module's training runs place theirs beside them)."""
    from rayspec.exec.ray import RayExecutor

    return RayExecutor(make_stages(model, "interleaved", n * VIRTUAL, group=GROUP), "interleaved", transport="p2p",
                       cpus_per_stage=0.25, chunk=3, virtual=VIRTUAL)


def _equal_to_sgd_and_local(ex, model, data, n):
    got, losses = _run(ex, model, data, n)
    want, want_losses = _run(None, model, data, n)
    assert_same_weights(got, want)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    assert_same_weights(got, plain_sgd(model, data, UPDATES, 32))
    stats = ex.stage_stats()
    assert [st["stage"] for st in stats] == list(range(n * VIRTUAL))
    assert all(st["actions"]["F"] == UPDATES * GROUP and st["version"] == UPDATES for st in stats)


def test_interleaved_on_p2p_is_sgd_at_two_stage_actors(ray_session, deep):
    """Two actors of two chunks: stage 1 sends on to stage 2 on actor 0, activations and gradients go both ways
    between one pair of actors."""
    model, data = deep
    ex = _executor(model, 2)
    try:
        assert len(ex.actors) == 2
        _equal_to_sgd_and_local(ex, model, data, 2)
    finally:
        ex.close()


@pytest.mark.slow
def test_interleaved_on_one_stage_actor_keeps_its_chunks_values_local(ray_session, deep):
    """One actor of two chunks: stage 0's activation and stage 1's gradient never leave the actor."""
    model, data = deep
    ex = _executor(model, 1)
    try:
        _equal_to_sgd_and_local(ex, model, data, 1)
    finally:
        ex.close()


@pytest.fixture(scope="module")
def four(ray_session, deep):
    ex = _executor(deep[0], 4)
    yield ex
    ex.close()


@pytest.mark.slow
def test_interleaved_on_p2p_is_sgd_at_four_stage_actors(four, deep):
    """Four actors of two chunks: the last actor sends stage 3's activations to actor 0 (the ring closes)."""
    _equal_to_sgd_and_local(four, *deep, 4)


@pytest.mark.slow
def test_interleaved_on_p2p_clips_by_the_whole_models_norm(four, deep):
    model, data = deep
    got, _ = _run(four, model, data, 4, clip_grad_norm=0.05)
    assert_same_weights(got, plain_torch(model, data, UPDATES, 32, clip_grad_norm=0.05))


@pytest.mark.slow
def test_an_interleaved_csv_runs_on_p2p(four, deep, tmp_path):
    """torch's CSV of interleaved 1F1B read from a file runs on the stage actors and is the built schedule."""
    model, data = deep
    path = tmp_path / "interleaved.csv"
    path.write_text(to_csv(build_schedule("interleaved", 4, GROUP, virtual=VIRTUAL)))
    schedule = load_schedule(path, batches=UPDATES)
    assert (schedule.virtual, schedule.microbatches) == (VIRTUAL, UPDATES * GROUP)
    got, _ = _run(four, model, data, 4, schedule=schedule)
    assert_same_weights(got, plain_sgd(model, data, UPDATES, 32))


@pytest.mark.slow
def test_a_schedule_of_other_chunk_counts_is_refused(four, deep):
    with pytest.raises(ScheduleError, match="each stage actor hosts 2; create the executor with virtual=3"):
        four.run(build_schedule("interleaved", 4, 4, virtual=3), iter(microbatches(deep[1], 1, 32, 4)))


def _config(**pipeline):
    return {"model": {"name": "mlp", "size": "tiny", "depth": 7}, "data": {"name": "synthetic_image", "train_size": 320},
            "pipeline": {"method": "interleaved", "stages": 2, "virtual_stages": 2, "microbatches": 4,
                         "executor": "ray", "transport": "p2p", "cpus_per_stage": 0.5, **pipeline},
            "train": {"max_steps": 5, "batch_size": 16, "log_every": 1, "eval_every": 0},
            "optim": {"lr": 0.05}, "checkpoint": {"every": 2, "keep": 2}}


def test_config_refuses_interleaved_where_an_actor_hosts_one_stage():
    with pytest.raises(ConfigError, match="with pipeline.transport=object_store a stage actor hosts one stage; use "
                                          "pipeline.transport=auto or p2p or p2p_nccl"):
        from_mapping(_config(transport="object_store"))
    assert from_mapping(_config()).pipeline.virtual_stages == 2


@pytest.mark.slow
def test_an_interleaved_ray_run_checkpoints_and_resumes_as_local(ray_session, tmp_path):
    """The checkpoint holds the whole model in the usual format (one state per stage, stage 0 first): a Ray run
    stopped after update 3 and resumed from update 2, on Ray or on the local executor, ends where an uninterrupted
    local run ends."""
    local = _config(executor="local")
    train(from_mapping(local), tmp_path / "local")
    want = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    with pytest.raises(Stop):
        train(from_mapping(_config()), tmp_path / "ray", callbacks=[StopAfter(3)])
    shutil.copytree(tmp_path / "ray", tmp_path / "ray-local")
    for name, cfg in (("ray", _config()), ("ray-local", local)):
        cfg["checkpoint"]["resume"] = "auto"
        got = train(from_mapping(cfg), tmp_path / name)
        assert got["resumed_from"] == 2 and len(got["stage_stats"]) == 4
        assert_same_weights(torch.load(tmp_path / name / "model.pt", weights_only=True), want)
