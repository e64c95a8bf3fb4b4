"""The transports a Ray run can move tensors with (``pipeline.transport``), and where each can run.

The implementations live in ``rayspec.exec.ray``; this registry imports no Ray, so the config can check
a choice before Ray starts (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayspec.errors import ConfigError

__all__ = ["Transport", "TRANSPORTS", "resolve_transport", "check_placement", "check_global_norm"]


@dataclass(frozen=True)
class Transport:
    """One transport: its name, whether its stages may sit on CPUs and on GPUs, what it does, and whether an update
    can wait for every stage's gradient norm (global clipping; ``rayspec.core.grads``)."""

    name: str
    cpu: bool
    gpu: bool
    summary: str
    global_norm: bool = True


_ALL = (
    Transport("auto", True, True, "p2p on CPU stages, nccl on GPUs"),
    Transport("p2p", True, False, "an actor call per chunk; stages send to their neighbours over a gloo group"),
    Transport("object_store", True, True, "an actor call per action; tensors through Ray's object store"),
    Transport("gloo", True, True, "an actor call per action; tensors by Ray Direct Transport over gloo"),
    Transport("nccl", False, True, "an actor call per action; tensors by Ray Direct Transport over NCCL"),
    Transport("compiled", True, True, "a Ray Compiled Graph per chunk shape", global_norm=False),
)
TRANSPORTS: dict[str, Transport] = {t.name: t for t in _ALL}


def resolve_transport(name: str, gpus_per_stage: float) -> str:
    """The transport ``name`` stands for on stages with ``gpus_per_stage`` GPUs each (``auto``: ``nccl`` on
    GPUs, ``p2p`` on CPUs); raises ``ConfigError`` for an unknown name or a transport that cannot carry the
    stages' tensors."""
    if name not in TRANSPORTS:
        raise ConfigError(f"pipeline.transport={name!r} is unknown; choose one of {', '.join(TRANSPORTS)}")
    if name == "auto":
        name = "nccl" if gpus_per_stage > 0 else "p2p"
    check_placement(name, gpus_per_stage)
    return name


def check_placement(name: str, gpus_per_stage: float) -> None:
    """Raise ``ConfigError`` when transport ``name`` cannot run stages with ``gpus_per_stage`` GPUs each."""
    if gpus_per_stage == 0 and not TRANSPORTS[name].cpu:
        raise ConfigError(
            f"pipeline.transport={name} needs a GPU per stage, but pipeline.gpus_per_stage=0; "
            "use pipeline.transport=auto (p2p on CPU) or gloo"
        )
    if gpus_per_stage > 0 and not TRANSPORTS[name].gpu:
        raise ConfigError(
            f"pipeline.transport={name} moves CPU tensors over gloo, but pipeline.gpus_per_stage={gpus_per_stage:g}; "
            "use pipeline.transport=nccl or compiled for stages on GPUs, or pipeline.gpus_per_stage=0"
        )


def check_global_norm(name: str, method: str) -> None:
    """Raise ``ConfigError`` when transport ``name`` cannot clip ``method``'s updates by the global gradient norm."""
    if not TRANSPORTS[name].global_norm:
        able = ", ".join(t.name for t in _ALL if t.global_norm and t.name != "auto")
        raise ConfigError(
            f"optim.clip_grad_norm with pipeline.method={method} clips by the gradient norm over all stages, which "
            f"pipeline.transport={name} cannot gather before an update (a compiled graph's calls are fixed); use "
            f"pipeline.transport= one of {able}, or pipeline.executor=local, or optim.clip_grad_norm=null"
        )
