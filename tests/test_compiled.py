"""Chunk plans of the compiled data path replay each stage's schedule exactly; Ray's side is in test_ray_executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks._shared.peer_setup import flushed_1f1b
from rayspec.core.schedule import Action, Schedule, ScheduleError, build_schedule
from rayspec.exec.ray.compiled_plan import plan_chunks


def replay(plan, stages):
    """Each stage's (kind, micro-batch, update) in the order the chunks run them; FB counts as F then B."""
    out = [[] for _ in range(stages)]
    for params in plan.params:
        for k in range(stages):
            for op, p in zip(plan.template[k], params[k]):
                if p is None:
                    continue
                m, _, _, update = p
                out[k] += ([("F", m, False)] if op.kind != "B" else []) + ([("B", m, update)] if op.kind != "F" else [])
    return out


CASES = [("1f1b", n, m, g) for n in (1, 2, 3, 4, 6) for m, g in ((1, 1), (5, 1), (23, 1), (24, 4))] + [
    ("gpipe", 4, 16, 4), ("gpipe", 3, 12, 12), ("gpipe", 2, 9, 3), ("vanilla", 4, 7, 1), ("vanilla", 1, 3, 1)]


@pytest.mark.parametrize("name,n,m,group", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunks_replay_the_schedule_and_share_one_shape(name, n, m, group, chunk):
    schedule = build_schedule(name, n, m, group=group)
    s = schedule.version_differences("paper")
    plan = plan_chunks(schedule, s, chunk)
    assert replay(plan, n) == [[(a.kind, a.microbatch, a.update) for a in acts] for acts in schedule.actions]
    for params in plan.params:  # every chunk fits the one template
        assert [len(row) for row in params] == [len(ops) for ops in plan.template]
    # s travels with each op: F gets its own, B (and the fused FB's backward) the backward's
    for params in plan.params:
        for k in range(n):
            for op, p in zip(plan.template[k], params[k]):
                if p is not None:
                    want = s[(k, "B" if op.kind == "B" else "F", p[0])]
                    assert p[1] == want and (op.kind == "F" or p[2] == s[(k, "B", p[0])])


def test_the_shape_does_not_depend_on_the_segment_length():
    """One compiled graph serves every segment of a run: the template depends on N and the chunk only."""
    for name, group in (("1f1b", 1), ("gpipe", 4)):
        shapes = {plan_chunks(build_schedule(name, 4, m, group=group), None, 16).template for m in (8, 16, 40, 100)}
        assert len(shapes) == 1, name


def test_1f1b_carries_only_a_stage_s_last_op_into_the_next_chunk():
    plan = plan_chunks(build_schedule("1f1b", 4, 40), None, 8)
    for k, ops in enumerate(plan.template):
        carried = [i for i, op in enumerate(ops) if op.carry]
        assert carried == [len(ops) - 1]
        assert ops[-1].kind == ("FB" if k == 3 else "F")
    sources = {op.source for ops in plan.template for op in ops if op.source and op.source[0] == "begin"}
    assert sources == {("begin", 0), ("begin", 1), ("begin", 2), ("begin", 3)}


def test_a_flushed_1f1b_runs_block_by_block():
    plan = plan_chunks(flushed_1f1b(2, 8, 5), None, 16)
    assert not any(op.carry or op.source and op.source[0] == "begin" for ops in plan.template for op in ops)
    assert plan.bases == (0, 16, 32)  # 40 micro-batches in chunks of two batches


def test_a_schedule_without_one_shape_is_refused():
    # all forwards, then all backwards, an update after each: no flush per update, and not 1F1B
    acts = tuple(tuple([Action(k, "F", m) for m in range(4)] + [Action(k, "B", m, True) for m in range(4)])
                 for k in range(2))
    odd = Schedule("custom", 2, 4, 1, acts)
    odd.validate()
    with pytest.raises(ScheduleError, match="use pipeline.transport=object_store"):
        plan_chunks(odd, None)
    bad = Schedule("1f1b", 1, 2, 1, ((Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0, True),
                                      Action(0, "B", 1, True)),))
    with pytest.raises(ScheduleError, match="would not replay stage 0"):
        plan_chunks(bad, None)


def test_channel_values_round_trip_as_private_copies():
    """What an op sends (``to_wire``) comes back (``own``) equal, same dtype, and not sharing memory."""
    from rayspec.exec.ray.wire import own, to_wire

    x = (torch.randn(3, 4), torch.arange(5), torch.ones(2, dtype=torch.bfloat16))
    wired = to_wire(x)
    assert isinstance(wired[0], np.ndarray) and isinstance(wired[1], np.ndarray)
    assert isinstance(wired[2], torch.Tensor)  # numpy has no bfloat16: sent as a tensor
    back = own(wired)
    for a, b in zip(x, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr()
    assert to_wire(None) is None and own(None) is None
