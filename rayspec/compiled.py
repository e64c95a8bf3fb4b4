"""A pipeline segment as a Ray Compiled Graph: one compiled DAG per chunk shape, executed chunk after chunk.

An actor call per action costs Ray a task submission, an object-store round and a result store
(about 2 ms a hop on a 2-core CPU box, ``benchmarks.hops``); a compiled graph moves the same
tensors over pre-allocated channels (shared memory on a node) with no task per action. The
graph is static, so a segment is cut into *chunks* that all have the same shape and one graph
runs every chunk, with ``m = base + offset``; actions whose ``m`` falls outside the segment
are masked (the op is skipped), which is how the pipeline fills and drains.

[Note: chunks of 1F1B] Asynchronous 1F1B never flushes, so a value crosses from one chunk to the
next. Each stage's chunk pairs ``B(base+j-1), F(base+j+warm)`` (the last stage: fused
``FB(base+j)``), so what crosses is always the producer's *last* op of the chunk: the stage keeps
it (the carry) and hands it on in the next chunk's first op (``begin``), right after it was made.
Two stages, chunk P = 3, stage 0 warms up with 1 forward (chunk base -3 masks the rest)::

    chunk -3: stage 0 | .  .  .  .  .  F0 |   stage 1 | .   .   .
    chunk  0: stage 0 | .  F1 B0 F2 B1 F3 |   stage 1 | FB0 FB1 FB2     (F3 -> carry -> chunk 3)
    chunk  3: stage 0 | B2 F4 B3 F5 B4 .  |   stage 1 | FB3 FB4 FB5     (FB2's gradient: carry)

Flushed schedules (``gpipe``, ``vanilla``, any schedule that drains at every update) repeat one
block of ``group`` micro-batches; a chunk is several blocks and nothing crosses.

Per stage, the ops run in exactly the segment schedule's order (``plan_chunks`` checks it), so
this path computes what ``LocalExecutor`` computes.
"""

from __future__ import annotations

import logging
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rayspec.schedule import Schedule, ScheduleError

__all__ = ["ChunkPlan", "plan_chunks", "CompiledPipeline"]

# One op of the chunk template: kind ("F", "B", "FB"), the micro-batch offset from the chunk's base,
# its data source ("op", stage, index) | ("begin", stage) | None, and whether it becomes the carry.
Source = tuple | None


@dataclass(frozen=True)
class TemplateOp:
    kind: str
    offset: int
    source: Source
    carry: bool = False


@dataclass(frozen=True)
class ChunkPlan:
    """A segment as chunks of one shape.

    Attributes:
        template: per stage, the ops of every chunk (the compiled graph's shape).
        bases: the base micro-batch of each chunk, in order.
        params: ``params[c][k][i]`` is ``(m, s, s_b, update)`` of op ``i`` of stage ``k`` in chunk ``c``,
            or ``None`` where the op is masked.
    """

    template: tuple[tuple[TemplateOp, ...], ...]
    bases: tuple[int, ...]
    params: tuple[tuple[tuple[tuple[int, int, int, bool] | None, ...], ...], ...]


def _flushed_block(schedule: Schedule) -> bool:
    """Whether every stage's list is its first ``group`` micro-batches' list repeated, shifted by ``group``."""
    g = schedule.group
    for acts in schedule.actions:
        per = 2 * g
        if len(acts) % per:
            return False
        first = [(a.kind, a.microbatch, a.update) for a in acts[:per]]
        if any(m >= g for _, m, _ in first):
            return False
        for b in range(len(acts) // per):
            block = [(a.kind, a.microbatch - b * g, a.update) for a in acts[b * per:(b + 1) * per]]
            if block != first:
                return False
    return True


def _fuse_last(kinds: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The last stage's ``F(m) B(m)`` pairs as one ``FB(m)``."""
    out: list[tuple[str, int]] = []
    for kind, off in kinds:
        if kind == "B" and out and out[-1] == ("F", off):
            out[-1] = ("FB", off)
        else:
            out.append((kind, off))
    return out


def _shape(schedule: Schedule, chunk: int) -> tuple[list[list[tuple[str, int]]], int, int]:
    """Per stage ``(kind, offset)`` ops of a chunk, the chunk's width in micro-batches and the first base."""
    n, last = schedule.stages, schedule.stages - 1
    if _flushed_block(schedule):
        g = schedule.group
        width = g * max(1, chunk // g)
        ops = []
        for k in range(n):
            one = [(a.kind, a.microbatch) for a in schedule.actions[k][: 2 * g]]
            kinds = [(kind, off + b * g) for b in range(width // g) for kind, off in one]
            ops.append(_fuse_last(kinds) if k == last else kinds)
        return ops, width, 0
    if schedule.name == "1f1b":
        width = max(1, chunk)
        ops = []
        for k in range(n):
            warm = n - k - 1
            if k == last:
                ops.append([("FB", j) for j in range(width)])
            else:
                ops.append([op for j in range(width) for op in (("B", j - 1), ("F", j + warm))])
        return ops, width, -width * -(-(n - 1) // width)  # enough masked chunks first to warm up
    raise ScheduleError(
        f"the compiled data path runs 1f1b and schedules that flush at every update; {schedule.name} "
        f"(group {schedule.group}) is neither: use pipeline.transport=object_store"
    )


def plan_chunks(schedule: Schedule, s: dict | None, chunk: int = 16) -> ChunkPlan:
    """Cut ``schedule`` into chunks of one shape (about ``chunk`` micro-batches each).

    Args:
        s: SpecTrain's version differences per action (``Schedule.version_differences``), or ``None``.

    Raises:
        ScheduleError: if the schedule has no such shape, or the chunks would not replay it exactly.
    """
    n, last, count = schedule.stages, schedule.stages - 1, schedule.microbatches
    ops, width, first = _shape(schedule, chunk)
    where = {(k, kind, off): i for k in range(n) for i, (kind, off) in enumerate(ops[k])}

    def producer(k: int, kind: str, off: int) -> Source:
        """The op that feeds ``kind(off)`` on stage ``k``: in this chunk, or the carry of the last chunk."""
        if kind != "B" and k == 0 or kind == "B" and k == last:
            return None
        src_k = k - 1 if kind in ("F", "FB") else k + 1
        src_kinds = ("F",) if kind in ("F", "FB") else ("B", "FB")
        for sk in src_kinds:
            if (src_k, sk, off) in where:
                return ("op", src_k, where[(src_k, sk, off)])
        for sk in src_kinds:
            i = where.get((src_k, sk, off + width))
            if i is not None and i == len(ops[src_k]) - 1:
                return ("begin", src_k)
        raise ScheduleError(f"stage {k}'s {kind}(base+{off}) has no producer one chunk apart at most")

    sources = [[producer(k, kind, off) for kind, off in ops[k]] for k in range(n)]
    carried = {src[1] for row in sources for src in row if src is not None and src[0] == "begin"}
    template = [tuple(TemplateOp(kind, off, sources[k][i], carry=k in carried and i == len(ops[k]) - 1)
                      for i, (kind, off) in enumerate(ops[k])) for k in range(n)]
    updates = {a.key: a.update for acts in schedule.actions for a in acts}
    bases, params = [], []
    replay: list[list[tuple[str, int, bool]]] = [[] for _ in range(n)]
    base = first
    while base < count + width:
        chunk_params = []
        for k in range(n):
            row: list[tuple[int, int, int, bool] | None] = []
            for op in template[k]:
                m = base + op.offset
                if not 0 <= m < count:
                    row.append(None)
                    continue
                b_key = (k, "B", m)
                s_f = 0 if s is None or op.kind == "B" else s[(k, "F", m)]
                s_b = 0 if s is None or op.kind == "F" else s[b_key]
                row.append((m, s_f if op.kind != "B" else s_b, s_b, updates[b_key] if op.kind != "F" else False))
                replay[k] += ([("F", m, False)] if op.kind != "B" else []) + (
                    [("B", m, updates[b_key])] if op.kind != "F" else [])
            chunk_params.append(tuple(row))
        if any(p is not None for row in chunk_params for p in row):
            bases.append(base)
            params.append(tuple(chunk_params))
        base += width
    for k in range(n):
        if replay[k] != [(a.kind, a.microbatch, a.update) for a in schedule.actions[k]]:
            raise ScheduleError(f"chunks of {width} would not replay stage {k}'s order of the {schedule.name} schedule")
    return ChunkPlan(tuple(template), tuple(bases), tuple(params))


def _wire(x: Any, host: bool = True) -> Any:
    """What goes into a channel: CPU tensors as numpy arrays (Ray's channels copy those about 25x faster
    than tensors, ``benchmarks.hops``); GPU tensors too when ``host`` (stages that share a GPU: NCCL
    refuses two ranks on one device), else as they are, for NCCL; other dtypes as they are."""
    if isinstance(x, torch.Tensor) and x.dtype in _NUMPY_DTYPES and (host or x.device.type == "cpu"):
        return x.detach().cpu().numpy()
    if isinstance(x, tuple):
        return tuple(_wire(t, host) for t in x)
    return x


def _as_tensors(x: Any) -> Any:
    """Numpy arrays that came over the wire as tensors (copied: Ray hands out read-only memory); the rest as is."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, tuple):
        return tuple(_as_tensors(t) for t in x)
    return x


def _own(x: Any) -> Any:
    """A private tensor copy of what a channel delivered: a channel's buffer is reused by its next write."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(_own(t) for t in x)
    return x


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


class _Failed:
    """Passed downstream instead of a value once a stage's op has raised: later ops skip."""

    def __repr__(self) -> str:
        return "<failed upstream>"


FAILED = _Failed()


class ChunkRunner:
    """The actor side: mixed into ``StageActor``; ``self.forward``/``backward``/``forward_backward`` run the ops.

    An op that raises does not raise into the graph: the stage keeps the error, passes ``FAILED``
    on, skips the rest, and ``cg_end`` reports it. So every actor ends every chunk, and the driver
    can wait for a chunk with a plain (sleeping) actor call instead of Ray's reader, which spins.
    """

    def cg_reset(self, host: bool = True) -> None:
        """Before a new graph: no chunk done, no error, no carry; ``host``: GPU tensors travel through host memory."""
        self._cg_host = host
        self._cg_cond = threading.Condition()
        self._cg_done = self._cg_begun = 0
        self._cg_error: BaseException | None = None
        self._cg_carry: Any = None
        self._cg_data: dict = {}

    def cg_begin(self, chunk: tuple) -> Any:
        """Take the chunk's op parameters and data; hand on the carry of the last chunk."""
        ops, data = chunk
        self._cg_ops = ops
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self._cg_data.update({m: _own(v) for m, v in data.items()})
        carry, self._cg_carry = self._cg_carry, None
        with self._cg_cond:
            self._cg_begun += 1
            self._cg_cond.notify_all()
        return carry

    def cg_op(self, i: int, kind: str, carry: bool, prev: Any, src: Any) -> Any:
        """Op ``i`` of the chunk (``prev`` only orders it after the actor's previous op)."""
        p = self._cg_ops[i]
        out: Any = None
        if p is not None:
            if self._cg_error is not None or isinstance(src, _Failed):  # a copy came through the channel
                out = FAILED
            else:
                try:
                    out = _wire(self._cg_compute(kind, p, _own(src)), self._cg_host)
                except Exception as err:
                    err.add_note(f"in {kind}{p[0]} on stage {self.stage.index} "  # type: ignore[attr-defined]
                                 f"(compiled graph):\n{traceback.format_exc()}")
                    self._cg_error, out = err, FAILED
        if carry:
            self._cg_carry, out = out, None
        return out

    def _cg_compute(self, kind: str, p: tuple, src: Any) -> Any:
        m, s, s_b, update = p
        if kind == "B":
            return self.backward(m, src, s, update)  # type: ignore[attr-defined]
        x = self._cg_data.pop(m) if src is None else src
        labels = self._cg_data.pop(("y", m), None)
        if kind == "FB":
            return self.forward_backward(m, x, labels, s, s_b, update)  # type: ignore[attr-defined]
        return self.forward(m, x, labels, s)  # type: ignore[attr-defined]

    def cg_end(self, prev: Any) -> tuple[BaseException | None, dict[int, float]]:
        """After the chunk's last op: count the chunk done; return this stage's error and the losses it made."""
        with self._cg_cond:
            self._cg_done += 1
            self._cg_cond.notify_all()
        return self._cg_error, self.pop_losses()  # type: ignore[attr-defined]

    def cg_wait(self, count: int, timeout_s: float, begun: bool = False) -> int:
        """Chunks ended (``begun``: begun) on this actor, once ``count`` have or ``timeout_s`` passed: a plain,
        sleeping call."""
        def seen() -> int:
            return self._cg_begun if begun else self._cg_done

        with self._cg_cond:
            self._cg_cond.wait_for(lambda: seen() >= count, timeout=timeout_s)
            return seen()


class CompiledPipeline:
    """Compiles the chunk graph over live stage actors and runs segments through it.

    Args:
        actors: the stage actors (``StageActor``), stage 0 first.
        chunk: micro-batches per chunk (about; flushed schedules round to whole blocks).
        nccl: each stage holds a GPU of its own: send GPU tensors with NCCL (``with_tensor_transport``);
            otherwise (CPU stages, stages that share a GPU) tensors travel through host memory.
    """

    def __init__(self, actors: Sequence[Any], chunk: int = 16, nccl: bool = False) -> None:
        self.actors = list(actors)
        self.chunk = chunk
        self.nccl = nccl
        self._dag: Any = None
        self._template: tuple | None = None
        # Ray logs every compile and teardown at INFO (several lines per segment); keep its warnings.
        logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)

    def _compile(self, template: tuple) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.teardown()
        n = len(self.actors)
        with InputNode() as inp:
            begins = [self.actors[k].cg_begin.bind(inp[k]) for k in range(n)]
            nodes: list[list[Any]] = [[] for _ in range(n)]
            pos = [0] * n
            while any(pos[k] < len(template[k]) for k in range(n)):
                progressed = False
                for k in range(n):
                    while pos[k] < len(template[k]):
                        op = template[k][pos[k]]
                        src = op.source
                        if src is not None and src[0] == "op" and len(nodes[src[1]]) <= src[2]:
                            break  # its producer is not bound yet
                        value = None if src is None else begins[src[1]] if src[0] == "begin" else nodes[src[1]][src[2]]
                        prev = nodes[k][-1] if nodes[k] else begins[k]
                        node = self.actors[k].cg_op.bind(pos[k], op.kind, op.carry, prev, value)
                        if self.nccl:
                            node = node.with_tensor_transport(transport="nccl")
                        nodes[k].append(node)
                        pos[k] += 1
                        progressed = True
                if not progressed:
                    raise ScheduleError("the chunk template deadlocks")  # plan_chunks rules this out
            outs = [self.actors[k].cg_end.bind(nodes[k][-1]) for k in range(n)]
            dag = MultiOutputNode(outs)
        import ray

        ray.get([a.cg_reset.remote(not self.nccl) for a in self.actors])
        self._dag = dag.experimental_compile(_max_inflight_executions=2)
        self._template = template
        self._executed = 0

    def run(self, schedule: Schedule, s: dict | None, feed: Any,
            on_chunk: Callable[[dict[int, float]], None]) -> None:
        """Run one segment; ``feed`` is a ``MicrobatchFeed``, ``on_chunk`` gets each chunk's losses in order."""
        plan = plan_chunks(schedule, s, self.chunk)
        if plan.template != self._template:
            self._compile(plan.template)
        n, last = schedule.stages, schedule.stages - 1
        pending: list[tuple[int, list]] = []
        try:
            for c, _ in enumerate(plan.bases):
                data: list[dict] = [{} for _ in range(n)]
                for i, op in enumerate(plan.template[0]):
                    p = plan.params[c][0][i]
                    if p is not None and op.kind != "B":
                        data[0][p[0]] = _wire(feed.input(p[0]))
                for i, op in enumerate(plan.template[last]):
                    p = plan.params[c][last][i]
                    if p is not None and op.kind != "B":
                        data[last][("y", p[0])] = _wire(feed.labels(p[0]))
                if self._executed:
                    self._wait(self._executed, begun=True)  # the input channel is free once every actor took the last
                refs = self._dag.execute(*((plan.params[c][k], data[k]) for k in range(n)))
                self._executed += 1
                pending.append((self._executed, refs))
                if len(pending) >= 2:  # one chunk runs while the next one's input waits in the channel
                    self._finish(*pending.pop(0), on_chunk)
            while pending:
                self._finish(*pending.pop(0), on_chunk)
        except BaseException:
            self.teardown()  # a failed graph is not reused: the next segment compiles a new one
            raise

    def _wait(self, index: int, begun: bool = False) -> None:
        """Sleep until every actor ended (``begun``: began) execution ``index`` (1-based)."""
        import ray

        waiting = list(range(len(self.actors)))
        while waiting:  # each call returns within 1 s, so a dead actor's error is seen within 1 s
            seen = ray.get([self.actors[k].cg_wait.remote(index, 1.0, begun) for k in waiting])
            waiting = [k for k, d in zip(waiting, seen) if d < index]

    def _finish(self, index: int, refs: list, on_chunk: Callable[[dict[int, float]], None]) -> None:
        """Wait (asleep) until every actor ended execution ``index`` (1-based), then take its outputs."""
        self._wait(index)
        outs = [ref.get(timeout=-1) for ref in refs]
        for error, _ in outs:
            if error is not None:
                raise error
        on_chunk(outs[-1][1])

    def teardown(self) -> None:
        if self._dag is not None:
            dag, self._dag, self._template = self._dag, None, None
            try:
                dag.teardown()
            except Exception:  # a graph whose actor died may not tear down cleanly; it is dropped either way
                pass

