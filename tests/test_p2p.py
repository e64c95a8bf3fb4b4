"""Chunk plans of the p2p data path: each stage replays its schedule, and stages that block on their neighbours
never deadlock; the message format round-trips. Ray's side is in test_ray_executor and test_fault."""

from __future__ import annotations

import pytest
import torch

from benchmarks.peer_setup import flushed_1f1b
from rayspec.core.schedule import Action, Schedule, ScheduleError, build_schedule
from rayspec.exec.ray.p2p_plan import plan_p2p
from rayspec.exec.ray.p2p_wire import HEADER_BYTES, Buffers, encode, pack, read_header, views
from rayspec.exec.ray.wire import DTYPES

CASES = [("1f1b", n, m, g) for n in (1, 2, 3, 4, 6) for m, g in ((1, 1), (5, 1), (23, 1), (24, 4))] + [
    ("gpipe", 4, 16, 4), ("gpipe", 3, 12, 12), ("gpipe", 2, 9, 3), ("vanilla", 4, 7, 1), ("vanilla", 1, 3, 1)]


def replay(chunks, n):
    out = [[] for _ in range(n)]
    for per_stage in chunks:
        for k in range(n):
            for op in per_stage[k]:
                out[k] += ([("F", op.m, False)] if op.kind != "B" else []) + (
                    [("B", op.m, op.update)] if op.kind != "F" else [])
    return out


def simulate(chunks, n) -> int | None:
    """Stage actors that take one chunk call at a time, block on each receive (matched by sender, direction and
    micro-batch), never on a send; the driver submits chunk c+2 only after chunk c ended on every stage.

    Every wait on a send (``retire``) must find it received already. Returns the most sends one stage held
    unwaited at once, or ``None`` on a deadlock.
    """
    sent = set()  # (src, dst, micro-batch) sent and not yet received
    held = [set() for _ in range(n)]  # per stage: (dst, micro-batch) sent and not waited on
    peak = 0
    submitted = min(2, len(chunks))
    at = [[0, 0] for _ in range(n)]  # per stage: chunk, op index
    while True:
        moved = False
        for k in range(n):
            c, i = at[k]
            if c >= submitted:
                continue
            op = chunks[c][k][i] if i < len(chunks[c][k]) else None
            if op is not None:
                src = k - 1 if op.kind != "B" else k + 1
                if 0 <= src < n:
                    if (src, k, op.m) not in sent:
                        continue
                    sent.remove((src, k, op.m))
                    for tag in op.retire:
                        assert (src, tag // 2) in held[k] and (k, src, tag // 2) not in sent, (k, op, tag)
                        held[k].remove((src, tag // 2))
                else:
                    assert not op.retire
                dst = k + 1 if op.kind == "F" else k - 1
                if 0 <= dst < n:
                    sent.add((k, dst, op.m))
                    held[k].add((dst, op.m))
                    peak = max(peak, len(held[k]))
                at[k][1] += 1
            else:
                at[k] = [c + 1, 0]
                if c == len(chunks) - 1:
                    held[k].clear()  # the segment's last chunk waits on every send
            moved = True
        while submitted < len(chunks) and all(at[k][0] > submitted - 2 for k in range(n)):
            submitted += 1
        if all(at[k][0] == len(chunks) for k in range(n)):
            return peak if not sent else None
        if not moved:
            return None


def runs_without_deadlock(chunks, n) -> bool:
    return simulate(chunks, n) is not None


@pytest.mark.parametrize("name,n,m,group", CASES)
@pytest.mark.parametrize("width", [1, 3, 16])
@pytest.mark.parametrize("method", ["gpipe", "spectrain"])
def test_chunks_replay_the_schedule_and_never_deadlock(name, n, m, group, width, method):
    schedule = build_schedule(name, n, m, group=group)
    chunks = plan_p2p(schedule, schedule.differences(method, "paper"), width)
    assert replay(chunks, n) == [[(a.kind, a.microbatch, a.update) for a in acts] for acts in schedule.actions]
    peak = simulate(chunks, n)
    assert peak is not None
    # sends are waited on as soon as they are known received: a stage holds at most one batch's (GPipe), the
    # micro-batches in flight (1F1B) or one (vanilla), never the whole segment's (2·m per stage)
    assert peak <= {"gpipe": group, "1f1b": n, "vanilla": 1}[name], peak
    s = schedule.version_differences("paper")
    for per_stage in chunks:  # s travels with each op: F its own, B and the fused FB's backward the backward's
        for k, ops in enumerate(per_stage):
            for op in ops:
                if method == "gpipe":
                    assert op.s == op.s_b == 0
                else:
                    assert op.s == s[(k, "B" if op.kind == "B" else "F", op.m)]
                    assert op.kind != "FB" or op.s_b == s[(k, "B", op.m)]
    if name == "gpipe":  # a flushed schedule's chunks hold whole updates
        for per_stage in chunks:
            for ops in per_stage:
                backwards = sorted(op.m for op in ops if op.kind != "F")
                assert backwards == list(range(backwards[0], backwards[0] + len(backwards)))
                assert backwards[0] % group == 0 and len(backwards) % group == 0


def test_flushed_1f1b_and_every_chunk_has_work_for_every_stage():
    schedule = flushed_1f1b(2, 8, 5)
    chunks = plan_p2p(schedule, None, 16)
    assert len(chunks) == 3 and all(ops for per_stage in chunks for ops in per_stage)
    assert runs_without_deadlock(chunks, 2)


def test_a_schedule_that_needs_a_later_chunk_is_refused():
    """Stage 0 runs B1 before B0, stage 1 B0 before B1: cut after B0, stage 0's chunk 0 needs stage 1's chunk 1."""
    acts0 = (Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1, True), Action(0, "B", 0, True))
    acts1 = (Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0, True), Action(1, "B", 1, True))
    schedule = Schedule("custom", 2, 2, 1, (acts0, acts1))
    with pytest.raises(ScheduleError, match="cannot run in chunks of 1"):
        plan_p2p(schedule, None, 1)
    assert runs_without_deadlock(plan_p2p(schedule, None, 2), 2)


VALUES = [
    torch.randn(4, 3),
    torch.tensor(2.5),
    (torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool), None),
    (torch.randint(0, 9, (3, 7)), torch.randn(3, 7).bfloat16(), torch.empty(0, 4), torch.arange(3, dtype=torch.int8)),
]


def decode(message):
    return views(message, *read_header(message)[:2])


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("value", VALUES)
def test_messages_round_trip_whole_and_in_two_parts(value):
    message = encode(*pack(value))
    assert message.dtype == torch.uint8 and message.dim() == 1
    assert same(decode(message), value)
    # a larger receive buffer, as the receiver posts: the header says where the message ends
    padded = torch.cat([message, torch.full((1000,), 7, dtype=torch.uint8)])
    assert same(decode(padded), value)
    header, payload = pack(value)  # what travels apart when the message is over the capacity
    assert torch.equal(header, message[:HEADER_BYTES])
    flat = value if isinstance(value, tuple) else (value,)
    assert [b.numel() for b in payload] == [t.numel() * t.element_size() for t in flat if t is not None]
    got = decode(padded)
    for t in got if isinstance(got, tuple) else (got,):  # views into the message, no copy
        assert t is None or t.numel() == 0 or t.untyped_storage().data_ptr() == padded.data_ptr()


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    pool = Buffers(4096)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    a = pool.take()
    first = ptr(a)
    assert ptr(pool.take()) != first  # `a` is held: another buffer
    x = decode(encode(*pack(torch.randn(4, 8)), a)).requires_grad_()
    loss = (x * x).sum()  # autograd saves `x`, a view into the first buffer
    del a
    assert ptr(pool.take()) == ptr(pool.buffers[1])  # the second is free again; the first is still saved
    assert ptr(pool.take()) == ptr(pool.buffers[1])
    loss.backward()
    del x, loss
    assert {ptr(pool.take()) for _ in range(3)} <= {first, ptr(pool.buffers[1])}
    assert len(pool.buffers) == 2


def test_without_torchs_use_count_every_message_gets_a_new_buffer(monkeypatch):
    monkeypatch.setattr("rayspec.exec.ray.p2p_wire.USE_COUNT", None)
    pool = Buffers(64)
    a, b = pool.take(), pool.take()
    assert a.numel() == b.numel() == 64 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert pool.buffers == []


def test_a_message_with_an_unsupported_tensor_is_a_clear_error():
    assert torch.complex64 not in DTYPES
    with pytest.raises(TypeError, match="pipeline.transport=p2p sends CPU tensors"):
        pack(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="use pipeline.transport=object_store"):
        pack(tuple(torch.zeros(1, 1, 1, 1, 1, 1) for _ in range(10)))


def test_messages_over_the_capacity_travel_in_parts_and_train_the_same(ray_session, tiny):
    """With a receive capacity of only the header, every activation and gradient goes as the header and then
    the tensor's bytes; the numbers stay the local executor's (whole messages: test_ray_executor)."""
    from conftest import assert_same_weights, make_stages, microbatches, run_local

    from rayspec.exec.ray import RayExecutor
    from rayspec.exec.ray.p2p import P2PTransport

    model, data = tiny
    ex = RayExecutor(make_stages(model, "spectrain", 3), "spectrain", transport="p2p", cpus_per_stage=0.5, chunk=4)
    try:
        ex.link = P2PTransport(4, capacity=0)  # the same gloo group, another receive size
        ex.link.start(ex.actors)
        losses = ex.run(build_schedule("1f1b", 3, 12), iter(microbatches(data, 12, 32)))
        ref, ref_losses, _ = run_local(model, data, "spectrain", 3, updates=12)
        assert_same_weights(ex.state_dict(), ref.state_dict())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    finally:
        ex.close()
