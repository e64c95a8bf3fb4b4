"""The transports a Ray run can move tensors with (``pipeline.transport``), and where each can run.

The implementations live in ``rayspec.exec.ray``; this registry imports no Ray, so the config can check
a choice before Ray starts (docs/design.md §4). A placement is the GPUs each stage actor holds:
``0`` (CPU stages), a fraction (stages that share a GPU) or ``>= 1`` (a GPU of its own).

[Note: what auto picks]
    GPUs per stage   auto        why
    0                p2p         one actor call per chunk, gloo between the stage actors
    0 < g < 1        p2p         the same gloo path; GPU tensors through pinned host memory (NCCL refuses
                                 two ranks on one device)
    >= 1             p2p_nccl    one actor call per chunk, NCCL between the GPUs (torch's own NCCL, no cupy)

[Note: transports as plug-ins] A transport is its registry line here and one module in ``rayspec.exec.ray`` that
holds its driver side (a ``rayspec.exec.ray.transport.Transport``) and its actor side (an endpoint, which the stage
actor hosts without knowing its kind). The line names its implementation by a dotted path, ``factory``, which
``rayspec.exec.ray.transport.make_transport`` imports: this layer imports no Ray and nothing above it, and no
table elsewhere lists the transports, so adding one touches that one module and its line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayspec.errors import ConfigError

__all__ = ["TransportSpec", "TRANSPORTS", "resolve_transport", "check_placement", "nccl_kind", "placement_of",
           "check_global_norm"]

Placement = Literal["cpu", "shared_gpu", "gpu"]


@dataclass(frozen=True)
class TransportSpec:
    """One transport: its name, the placements it can run, the NCCL it uses on GPUs, what it does and where it is.

    Attributes:
        cpu: CPU stages.
        shared_gpu: stages that share a GPU (a fraction of one each).
        gpu: stages with a GPU (or more) each.
        nccl: the NCCL it uses for stages with a GPU each: ``torch`` (``torch.distributed``, shipped with torch),
            ``ray`` (Ray's collective groups, which need cupy: ``pip install 'rayspec[gpu]'``) or ``None``.
        global_norm: whether an update can wait for every stage's gradient norm (global clipping;
            ``rayspec.core.grads``).
        factory: ``module:Class`` of its implementation, a ``rayspec.exec.ray.transport.Transport`` whose
            ``create(spec, options)`` builds it ([Note: transports as plug-ins]); ``None`` for ``auto``, which
            stands for another.
    """

    name: str
    cpu: bool
    shared_gpu: bool
    gpu: bool
    nccl: Literal["torch", "ray"] | None
    summary: str
    global_norm: bool = True
    factory: str | None = None


_P2P, _CALLS = "rayspec.exec.ray.p2p:P2PTransport", "rayspec.exec.ray.object_store:ObjectStoreTransport"
_ALL = (
    TransportSpec("auto", True, True, True, None,
                  "p2p on CPU stages and on stages that share a GPU, p2p_nccl on a GPU each"),
    TransportSpec("p2p", True, True, True, None, "an actor call per chunk; stages send to their neighbours over a "
                  "gloo group (GPU tensors through host memory)", factory=_P2P),
    TransportSpec("p2p_nccl", False, False, True, "torch",
                  "an actor call per chunk; stages send to their neighbours over NCCL (torch.distributed)", factory=_P2P),
    TransportSpec("object_store", True, True, True, None, "an actor call per action; tensors through Ray's object store",
                  factory=_CALLS),
    TransportSpec("gloo", True, False, False, None,
                  "an actor call per action; CPU tensors by Ray Direct Transport over gloo", factory=_CALLS),
    TransportSpec("nccl", False, False, True, "ray",
                  "an actor call per action; GPU tensors by Ray Direct Transport over NCCL", factory=_CALLS),
    TransportSpec("compiled", True, True, True, "ray", "a Ray Compiled Graph per chunk shape (NCCL on a GPU per stage)",
                  global_norm=False, factory="rayspec.exec.ray.compiled:CompiledTransport"),
)
TRANSPORTS: dict[str, TransportSpec] = {t.name: t for t in _ALL}

_AUTO: dict[Placement, str] = {"cpu": "p2p", "shared_gpu": "p2p", "gpu": "p2p_nccl"}
_WHERE = {"cpu": "on CPU stages", "shared_gpu": "on stages that share a GPU", "gpu": "on a GPU per stage"}


def placement_of(gpus_per_stage: float) -> Placement:
    """``cpu`` for 0 GPUs per stage, ``shared_gpu`` for a fraction of one, ``gpu`` for one or more."""
    if gpus_per_stage <= 0:
        return "cpu"
    return "shared_gpu" if gpus_per_stage < 1 else "gpu"


def resolve_transport(name: str, gpus_per_stage: float) -> str:
    """The transport ``name`` stands for on stages with ``gpus_per_stage`` GPUs each ([Note: what auto picks]);
    raises ``ConfigError`` for an unknown name or a transport that cannot carry the stages' tensors."""
    if name not in TRANSPORTS:
        raise ConfigError(f"pipeline.transport={name!r} is unknown; choose one of {', '.join(TRANSPORTS)}")
    if name == "auto":
        name = _AUTO[placement_of(gpus_per_stage)]
    check_placement(name, gpus_per_stage)
    return name


def check_placement(name: str, gpus_per_stage: float) -> None:
    """Raise ``ConfigError`` when transport ``name`` cannot run stages with ``gpus_per_stage`` GPUs each, naming
    the transports that can."""
    where = placement_of(gpus_per_stage)
    t = TRANSPORTS[name]
    if getattr(t, where):
        return
    fits = ", ".join(n for n, o in TRANSPORTS.items() if getattr(o, where) and n != "auto")
    setting = f"pipeline.transport={name} with pipeline.gpus_per_stage={gpus_per_stage:g}"
    if where == "cpu":
        raise ConfigError(f"{setting}: {name} moves GPU tensors and the stages have none; use pipeline.transport=auto "
                          f"({_AUTO['cpu']}) or one of {fits}, or give each stage a GPU (pipeline.gpus_per_stage=1)")
    if where == "shared_gpu" and t.nccl:
        raise ConfigError(f"{setting}: stages that share a GPU would be two NCCL ranks on one device, which NCCL "
                          f"refuses; use pipeline.transport=auto ({_AUTO['shared_gpu']}, through host memory) or one "
                          f"of {fits}, or give each stage a GPU of its own (pipeline.gpus_per_stage=1)")
    raise ConfigError(f"{setting}: {name} moves CPU tensors only; use pipeline.transport=auto ({_AUTO[where]}) or "
                      f"one of {fits} {_WHERE[where]}, or pipeline.gpus_per_stage=0")


def nccl_kind(name: str, gpus_per_stage: float) -> Literal["torch", "ray"] | None:
    """Which NCCL the resolved transport ``name`` uses on stages with ``gpus_per_stage`` GPUs each, if any."""
    return TRANSPORTS[name].nccl if placement_of(gpus_per_stage) == "gpu" else None


def check_global_norm(name: str, method: str) -> None:
    """Raise ``ConfigError`` when transport ``name`` cannot clip ``method``'s updates by the global gradient norm."""
    if not TRANSPORTS[name].global_norm:
        able = ", ".join(t.name for t in _ALL if t.global_norm and t.name != "auto")
        raise ConfigError(
            f"optim.clip_grad_norm with pipeline.method={method} clips by the gradient norm over all stages, which "
            f"pipeline.transport={name} cannot gather before an update (a compiled graph's calls are fixed); use "
            f"pipeline.transport= one of {able}, or pipeline.executor=local, or optim.clip_grad_norm=null"
        )
