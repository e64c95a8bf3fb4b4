"""``pipeline.transport=compiled``: each segment runs as a Ray Compiled Graph, one graph per chunk shape.

An actor call per action costs Ray a task submission, an object-store round and a result store
(about 2 ms a hop on a 2-core CPU box, ``benchmarks.hops``); a compiled graph moves the same
tensors over pre-allocated channels (shared memory on a node) with no task per action. The graph
is static, so a segment is cut into chunks of one shape (``rayspec.exec.ray.compiled_plan``) and one
graph runs every chunk. A stage whose op raised does not raise into the graph (``CompiledEndpoint``),
so the driver waits for chunks with plain, sleeping actor calls instead of Ray's reader, which spins.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import ray

from rayspec.core.schedule import Schedule, ScheduleError
from rayspec.core.transports import TransportSpec, nccl_kind
from rayspec.exec.base import MicrobatchFeed
from rayspec.exec.ray.compiled_plan import plan_chunks
from rayspec.exec.ray.transport import LossSink, StageOps, Transport, TransportOptions
from rayspec.exec.ray.wire import own, to_wire

__all__ = ["CompiledEndpoint", "CompiledTransport", "warn_shared_cores"]

log = logging.getLogger(__name__)


class _Failed:
    """Passed downstream instead of a value once a stage's op has raised: later ops skip."""

    def __repr__(self) -> str:
        return "<failed upstream>"


FAILED = _Failed()


class CompiledEndpoint:
    """The actor side of one graph: runs the stage's ops of each chunk through ``ops``.

    An op that raises does not raise into the graph: the stage keeps the error, passes ``FAILED``
    on, skips the rest, and ``end`` reports it. So every actor ends every chunk, and the driver
    can wait for a chunk with a plain (sleeping) actor call instead of Ray's reader, which spins.

    Args:
        ops: the stage actor whose stage runs the ops.
        host: GPU tensors travel through host memory (stages that share a GPU, or CPU stages).
    """

    def __init__(self, ops: StageOps, host: bool = True) -> None:
        self.ops = ops
        self._host = host
        self._cond = threading.Condition()
        self._done = self._begun = 0
        self._error: BaseException | None = None
        self._carry: Any = None
        self._data: dict = {}
        self._params: tuple = ()

    def begin(self, chunk: tuple) -> Any:
        """Take the chunk's op parameters and data; hand on the carry of the last chunk."""
        ops, data = chunk
        self._params = ops
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self._data.update({m: own(v) for m, v in data.items()})
        carry, self._carry = self._carry, None
        with self._cond:
            self._begun += 1
            self._cond.notify_all()
        return carry

    def op(self, i: int, kind: str, carry: bool, prev: Any, src: Any) -> Any:
        """Op ``i`` of the chunk (``prev`` only orders it after the actor's previous op)."""
        p = self._params[i]
        out: Any = None
        if p is not None:
            if self._error is not None or isinstance(src, _Failed):  # a copy came through the channel
                out = FAILED
            else:
                try:
                    out = to_wire(self._compute(kind, p, own(src)), self._host)
                except Exception as err:
                    err.add_note(f"in {kind}{p[0]} on stage {self.ops.stage.index} "
                                 f"(compiled graph):\n{traceback.format_exc()}")
                    self._error, out = err, FAILED
        if carry:
            self._carry, out = out, None
        return out

    def _compute(self, kind: str, p: tuple, src: Any) -> Any:
        m, s, s_b, update = p
        if kind == "B":
            return self.ops.backward(m, src, s, update)
        x = self._data.pop(m) if src is None else src
        labels = self._data.pop(("y", m), None)
        if kind == "FB":
            return self.ops.forward_backward(m, x, labels, s, s_b, update)
        return self.ops.forward(m, x, labels, s)

    def end(self, prev: Any) -> tuple[BaseException | None, dict[int, float]]:
        """After the chunk's last op: count the chunk done; return this stage's error and the losses it made."""
        with self._cond:
            self._done += 1
            self._cond.notify_all()
        try:
            losses = self.ops.pop_losses()
        except Exception as err:  # a non-finite value found on the device: reported like an op's error
            self._error, losses = self._error or err, {}
        return self._error, losses

    def wait(self, count: int, timeout_s: float, begun: bool = False) -> int:
        """Chunks ended (``begun``: begun) on this actor, once ``count`` have or ``timeout_s`` passed: a plain,
        sleeping call."""
        def seen() -> int:
            return self._begun if begun else self._done

        with self._cond:
            self._cond.wait_for(lambda: seen() >= count, timeout=timeout_s)
            return seen()


class CompiledTransport(Transport):
    """Compiles the chunk graph over live stage actors and runs segments through it.

    Args:
        chunk: micro-batches per chunk (about; flushed schedules round to whole blocks).
        nccl: each stage holds a GPU of its own: send GPU tensors with NCCL (``with_tensor_transport``);
            otherwise (CPU stages, stages that share a GPU) tensors travel through host memory.
    """

    name = "compiled"

    def __init__(self, chunk: int = 16, nccl: bool = False) -> None:
        self.chunk = chunk
        self.to_gpu = nccl
        self.nccl = "ray" if nccl else None  # a compiled graph's NCCL group imports cupy
        self._dag: Any = None
        self._template: tuple | None = None
        # Ray logs every compile and teardown at INFO (several lines per segment); keep its warnings.
        logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)

    @classmethod
    def create(cls, spec: TransportSpec, options: TransportOptions) -> CompiledTransport:
        """NCCL between stages that hold a GPU each; a warning where CPU stages share cores."""
        if options.gpus_per_stage == 0 and options.cpus_per_stage < 1:
            warn_shared_cores(options.cpus_per_stage)
        return cls(options.chunk, nccl=nccl_kind(spec.name, options.gpus_per_stage) is not None)

    def _compile(self, template: tuple) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.stop()
        n = len(self.actors)
        with InputNode() as inp:
            begins = [self.actors[k].endpoint_call.bind("begin", inp[k]) for k in range(n)]
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
                        node = self.actors[k].endpoint_call.bind("op", pos[k], op.kind, op.carry, prev, value)
                        if self.to_gpu:
                            node = node.with_tensor_transport(transport="nccl")
                        nodes[k].append(node)
                        pos[k] += 1
                        progressed = True
                if not progressed:
                    raise ScheduleError("the chunk template deadlocks")  # plan_chunks rules this out
            outs = [self.actors[k].endpoint_call.bind("end", nodes[k][-1]) for k in range(n)]
            dag = MultiOutputNode(outs)
        self.open_endpoints(CompiledEndpoint, not self.to_gpu)  # before a new graph: no chunk done, no error, no carry
        self._dag = dag.experimental_compile(_max_inflight_executions=2)
        self._template = template
        self._executed = 0

    def start(self, actors: Sequence[Any]) -> None:
        super().start(actors)
        self.stop()  # the next segment compiles a graph over these actors

    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
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
                        data[0][p[0]] = to_wire(feed.input(p[0]))
                for i, op in enumerate(plan.template[last]):
                    p = plan.params[c][last][i]
                    if p is not None and op.kind != "B":
                        data[last][("y", p[0])] = to_wire(feed.labels(p[0]))
                if self._executed:
                    self._wait(self._executed, begun=True)  # the input channel is free once every actor took the last
                refs = self._dag.execute(*((plan.params[c][k], data[k]) for k in range(n)))
                self._executed += 1
                pending.append((self._executed, refs))
                if len(pending) >= 2:  # one chunk runs while the next one's input waits in the channel
                    self._finish(*pending.pop(0), on_losses)
            while pending:
                self._finish(*pending.pop(0), on_losses)
        except BaseException:
            self.stop()  # a failed graph is not reused: the next segment compiles a new one
            raise

    def _wait(self, index: int, begun: bool = False) -> None:
        """Sleep until every actor ended (``begun``: began) execution ``index`` (1-based)."""

        waiting = list(range(len(self.actors)))
        while waiting:  # each call returns within 1 s, so a dead actor's error is seen within 1 s
            seen = ray.get([self.actors[k].endpoint_call.remote("wait", index, 1.0, begun) for k in waiting])
            waiting = [k for k, d in zip(waiting, seen) if d < index]

    def _finish(self, index: int, refs: list, on_losses: LossSink) -> None:
        """Wait (asleep) until every actor ended execution ``index`` (1-based), then take its outputs."""
        self._wait(index)
        outs = [ref.get(timeout=-1) for ref in refs]
        for error, _ in outs:
            if error is not None:
                raise error
        on_losses(outs[-1][1])

    def stop(self) -> None:
        if self._dag is not None:
            dag, self._dag, self._template = self._dag, None, None
            try:
                dag.teardown()
            except Exception:  # a graph whose actor died may not tear down cleanly; it is dropped either way
                pass



@functools.cache  # once per process and setting, however many executors a study or benchmark creates
def warn_shared_cores(cpus_per_stage: float) -> None:
    """Say once that a compiled graph's stages spin while they wait, so stages that share cores slow each other."""
    log.warning("pipeline.transport=compiled with %.2g CPUs per stage: a compiled graph's stage spins a core while "
                "it waits, so stages that share cores slow each other down; give each stage a core "
                "(pipeline.cpus_per_stage=1) or use pipeline.transport=p2p", cpus_per_stage)
