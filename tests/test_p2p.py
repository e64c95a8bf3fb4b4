"""Chunk plans of the p2p data path: each stage replays its schedule, and stages that block on their neighbours
never deadlock; the message format round-trips. Ray's side is in test_ray_executor and test_fault."""

from __future__ import annotations

import pytest
import torch

from rayspec.core.schedule import Action, Schedule, ScheduleError, build_schedule
from rayspec.exec.ray.p2p_plan import plan_p2p, tag
from rayspec.exec.ray.p2p_wire import (
    HEADER_BYTES,
    MIN_PAYLOAD,
    Buffers,
    encode,
    pack,
    payload_bytes,
    read_header,
    split_sizes,
    views,
)
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
                src = k - 1 if op.kind in ("F", "FB") else k + 1 if op.kind in ("B", "I") else -1  # W: none
                if 0 <= src < n:
                    if (src, k, op.m) not in sent:
                        continue
                    sent.remove((src, k, op.m))
                    for tag in op.retire:
                        assert (src, tag // 2) in held[k] and (k, src, tag // 2) not in sent, (k, op, tag)
                        held[k].remove((src, tag // 2))
                else:
                    assert not op.retire
                dst = k + 1 if op.kind == "F" else k - 1 if op.kind != "W" else -1
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
    schedule = build_schedule("1f1b-flushed", 2, 40, group=8)
    chunks = plan_p2p(schedule, None, 16)
    assert len(chunks) == 3 and all(ops for per_stage in chunks for ops in per_stage)
    assert runs_without_deadlock(chunks, 2)


@pytest.mark.parametrize("name,n,m", [("zb1p", 2, 8), ("zb1p", 4, 8), ("zb1p", 4, 16), ("1f1b-flushed", 4, 8),
                                       ("zb1p", 3, 2)])
@pytest.mark.parametrize("width", [1, 4, 16])
def test_split_backward_chunks_replay_the_schedule_and_never_deadlock(name, n, m, width):
    """ZB-H1's I sends the input gradient as B does and W sends nothing: the chunks keep each stage's order."""
    schedule = build_schedule(name, n, 3 * m, group=m)
    chunks = plan_p2p(schedule, None, width)
    replayed = [[(kind, op.m, op.update and kind != "F") for per_stage in chunks for op in per_stage[k]
                 for kind in (("F", "B") if op.kind == "FB" else (op.kind,))] for k in range(n)]
    assert replayed == [[(a.kind, a.microbatch, a.update) for a in acts] for acts in schedule.actions]
    assert runs_without_deadlock(chunks, n)


def test_a_schedule_whose_stages_take_messages_out_of_order_is_refused():
    """Stage 0 runs B1 before B0, stage 1 sends B0 before B1: NCCL would match B0's gradient to B1's receive, so
    p2p refuses the schedule (every built-in schedule keeps one order per pair of stages: the cases above)."""
    acts0 = (Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1, True), Action(0, "B", 0, True))
    acts1 = (Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0, True), Action(1, "B", 1, True))
    schedule = Schedule("custom", 2, 2, 1, (acts0, acts1))
    for width in (1, 2):
        with pytest.raises(ScheduleError, match=r"stage 0 take stage 1's B messages in the order \[1, 0\], not the "
                                                r"order \[0, 1\] they are sent in"):
            plan_p2p(schedule, None, width)


VALUES = [
    torch.randn(4, 3),
    torch.tensor(2.5),
    torch.randn(3, 4).t(),  # not contiguous: sent as its contiguous copy
    (torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool), None),
    (torch.randint(0, 9, (3, 7)), torch.randn(3, 7).bfloat16(), torch.empty(0, 4), torch.arange(3, dtype=torch.int8)),
    (None,),
]


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("value", VALUES)
def test_messages_round_trip(value):
    header, parts = pack(value)
    assert header.dtype == torch.uint8 and header.numel() == HEADER_BYTES
    is_tuple, specs, size, starts = read_header(header)
    assert read_header(header.clone())[:3] == (is_tuple, specs, size)  # the second read of a layout: the same answer
    assert size == payload_bytes(parts) >= MIN_PAYLOAD and size % 64 == 0
    flat = value if isinstance(value, tuple) else (value,)
    assert [b.nbytes for b in parts] == [t.numel() * t.element_size() for t in flat if t is not None]
    buffer = torch.full((size + 1000,), 7, dtype=torch.uint8)  # a pooled buffer is often larger
    payload = encode(parts, buffer)
    assert payload.numel() == size
    got = views(payload, is_tuple, specs, starts)
    assert same(got, value) and same(views(payload, is_tuple, specs), value)
    for t in got if isinstance(got, tuple) else (got,):  # views into the buffer, no copy
        assert t is None or t.numel() == 0 or t.untyped_storage().data_ptr() == buffer.data_ptr()


def test_both_ends_agree_on_each_data_message_size():
    assert split_sizes(256, None) == (256, 0)  # a link's first message: its own size, once the header is read
    assert split_sizes(256, 256) == (256, 0)
    assert split_sizes(128, 256) == (256, 0)  # smaller: padded to what the receiver posted
    assert split_sizes(384, 256) == (256, 128)  # larger: what was posted, then the rest


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    pool = Buffers(4096)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    a = pool.take()
    first = ptr(a)
    assert ptr(pool.take()) != first  # `a` is held: another buffer
    header, parts = pack(torch.randn(4, 8))
    x = views(encode(parts, a), *read_header(header)[:2]).requires_grad_()
    loss = (x * x).sum()  # autograd saves `x`, a view into the first buffer
    del a
    assert ptr(pool.take()) == ptr(pool.buffers[1])  # the second is free again; the first is still saved
    assert ptr(pool.take()) == ptr(pool.buffers[1])
    loss.backward()
    del x, loss
    assert {ptr(pool.take()) for _ in range(3)} <= {first, ptr(pool.buffers[1])}
    assert len(pool.buffers) == 2
    big = pool.take(10_000)  # larger than any: a new buffer of that size
    assert big.numel() == 10_000 and len(pool.buffers) == 3
    assert pool.take(5000).numel() == 5000  # `big` is held: the 4096-byte ones are too small
    del big
    assert pool.take(5000).numel() == 10_000


def test_a_fenced_buffer_waits_for_its_copy():
    class Event:
        done = False

        def query(self):
            return self.done

    pool = Buffers(64)
    a = pool.take()
    event = Event()
    pool.fence(a[:8], event)
    del a
    assert pool.take().untyped_storage().data_ptr() != pool.buffers[0].untyped_storage().data_ptr()
    event.done = True
    assert pool.take().untyped_storage().data_ptr() == pool.buffers[0].untyped_storage().data_ptr()


def test_without_torchs_use_count_every_message_gets_a_new_buffer(monkeypatch):
    monkeypatch.setattr("rayspec.exec.ray.p2p_wire.USE_COUNT", None)
    pool = Buffers(64)
    a, b = pool.take(), pool.take()
    assert a.numel() == b.numel() == 64 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert pool.buffers == []


def test_a_message_with_an_unsupported_tensor_is_a_clear_error():
    assert torch.complex64 not in DTYPES
    with pytest.raises(TypeError, match="pipeline.transport=p2p sends tensors of"):
        pack(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="use pipeline.transport=object_store"):
        pack(tuple(torch.zeros(1, 1, 1, 1, 1, 1) for _ in range(10)))


@pytest.mark.parametrize("nccl_rules", [False, True], ids=["gloo", "nccl-rules"])
def test_payloads_that_change_size_train_the_same(ray_session, tiny, nccl_rules):
    """Micro-batches of 32, 16 and 48 samples in turn: each activation and gradient is padded to what its receiver
    posted ahead, or goes as that and the rest; with the smallest buffers the numbers stay the local executor's;
    on gloo's protocol and on NCCL's (headers apart, a group per link), run on gloo."""
    from conftest import assert_same_weights, make_stages

    from rayspec.exec import LocalExecutor
    from rayspec.exec.ray import RayExecutor
    from rayspec.exec.ray.p2p import P2PTransport

    model, data = tiny
    x, y = data.train.tensors
    sizes = [32, 16, 48] * 4
    cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    mbs = [(x[a:b], y[a:b]) for a, b in zip(cuts, cuts[1:])]
    ex = RayExecutor(make_stages(model, "spectrain", 3), "spectrain", transport="p2p", cpus_per_stage=0.5, chunk=4)
    try:
        ex.link = P2PTransport(4, capacity=0, nccl_rules=nccl_rules)  # buffers of exactly the size asked for
        ex.link.start(ex.actors)
        losses = ex.run(build_schedule("1f1b", 3, len(mbs)), iter(mbs))
        ref = LocalExecutor(make_stages(model, "spectrain", 3), "spectrain")
        ref_losses = ref.run(build_schedule("1f1b", 3, len(mbs)), mbs)
        assert_same_weights(ex.state_dict(), ref.state_dict())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    finally:
        ex.close()


class _NcclLike:
    """``torch.distributed`` as NCCL behaves, for two endpoints in one process: a data group matches a pair's
    messages in the order the receives were posted, whatever their tags, and only at exactly the size sent; the
    header group (gloo) matches by tag. ``rank`` is the caller."""

    def __init__(self):
        self.rank = 0
        self.sent: dict = {}  # (group, src, dst[, tag]) -> [bytes sent, in order]
        self.posted: dict = {}  # the same key -> receives posted so far

    def new_group(self, **_):
        return object()

    def _key(self, peer, group, tag, sending):
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        return (None, src, dst, tag) if group is None else (group, src, dst)

    def isend(self, tensor, dst, group=None, tag=0):
        self.sent.setdefault(self._key(dst, group, tag, True), []).append(tensor.clone())
        return _Done()

    def irecv(self, tensor, src, group=None, tag=0):
        key = self._key(src, group, tag, False)
        index = self.posted.get(key, 0)
        self.posted[key] = index + 1
        return _Receive(self, key, index, tensor)

    def recv(self, tensor, src, group=None, tag=0):
        self.irecv(tensor, src, group, tag).wait()


class _Done:
    def wait(self):
        return True


class _Receive:
    def __init__(self, world, key, index, tensor):
        self.world, self.key, self.index, self.tensor = world, key, index, tensor

    def wait(self):
        message = self.world.sent[self.key][self.index]
        assert message.numel() == self.tensor.numel(), f"{self.key}: sent {message.numel()} B, posted {self.tensor.numel()} B"
        self.tensor.copy_(message)
        return True


@pytest.mark.parametrize("fold_bytes,nccl_rules", [(1 << 20, False), (150, False), (1 << 20, True)],
                         ids=["gloo", "gloo-folded-below-150-B", "nccl"])
def test_the_protocol_keeps_to_nccls_rules(monkeypatch, fold_bytes, nccl_rules):
    """Activations of changing sizes one way and gradients the other, with receives posted ahead: every data message
    is received at exactly its size, in posting order, one direction per group (what NCCL needs), and arrives whole;
    with the header in front of the payload, apart from it, and switching between the two as the size changes."""
    from rayspec.exec.ray import p2p, p2p_messages

    world = _NcclLike()
    for module in (p2p, p2p_messages):
        monkeypatch.setattr(module, "dist", world)
    monkeypatch.setattr(p2p_messages, "FOLD_BYTES", fold_bytes)
    a, b = p2p.P2PEndpoint(None), p2p.P2PEndpoint(None)
    for rank, end in enumerate((a, b)):
        end.groups = {(0, 1, "F"): "F", (1, 0, "B"): "B"}  # joined already: one group per directed link and direction
        end.nccl_rules = nccl_rules
        end.join("", 0, rank, 2, 1.0, capacity=0, nccl_rules=nccl_rules)
    shapes = [(4, 8), (4, 8), (2, 8), (6, 8), (6, 8), (1,), (6, 8)]
    for m, shape in enumerate(shapes):
        world.rank = 1
        b._post(0, tag("F", m))  # posted ahead, before the message is sent
        world.rank = 0
        x = torch.randn(shape)
        a.send((x, None) if m % 3 == 2 else x, 1, tag("F", m))
        world.rank = 1
        got = b.recv(0, tag("F", m))
        assert same(got, (x, None) if m % 3 == 2 else x)
        g = torch.randn(shape[::-1])
        b.send(g, 0, tag("B", m))
        world.rank = 0
        assert same(a.recv(1, tag("B", m)), g)
    data = {k: v for k, v in world.sent.items() if k[0] is not None}
    assert {(k[0], k[1], k[2]) for k in data} == {("F", 0, 1), ("B", 1, 0)}  # one direction per group
    assert all(world.posted[k] == len(v) for k, v in data.items())  # every message received, none left over
    # headers sent apart, both directions: each link's first message; below 150 B also the two after a 192 B payload
    headers_apart = sum(len(v) for k, v in world.sent.items() if k[0] is None)
    assert headers_apart == (2 * len(shapes) if nccl_rules else {1 << 20: 2, 150: 2 * 3}[fold_bytes])
