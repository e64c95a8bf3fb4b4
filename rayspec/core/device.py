"""What a stage's device can do and how it is set up: the NCCL check, deterministic settings, pinned host copies.

Ray-free: a stage actor runs these on the node and device it was given, which may differ from the driver's
(a CPU-only head submitting to a GPU cluster).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["GPU_EXTRA", "nccl_problem", "deterministic", "restore", "to_device", "pinned"]

GPU_EXTRA = "pip install 'rayspec[gpu]'"
"""The extra that brings cupy, which Ray's NCCL groups import (``pipeline.transport=nccl``, ``compiled`` on GPUs)."""
_CUPY_FIX = (f"{GPU_EXTRA} on every node (it installs cupy-cuda13x, for torch built with CUDA 13; with another "
             "CUDA install the cupy that matches torch.version.cuda instead, e.g. pip install cupy-cuda12x)")


def nccl_problem(kind: str | None, transport: str = "") -> str | None:
    """Why this process cannot run NCCL of ``kind`` (``torch``: ``torch.distributed``'s; ``ray``: Ray's collective
    groups, through cupy), with the fix; ``None`` when it can (or ``kind`` is ``None``)."""
    if kind is None:
        return None
    name = f"pipeline.transport={transport}" if transport else "NCCL"
    if not torch.cuda.is_available():
        return (f"{name} needs CUDA in the stage actor, but torch sees no GPU there (torch {torch.__version__}); "
                "check the node's driver and CUDA_VISIBLE_DEVICES, or use pipeline.transport=auto")
    if kind == "torch":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            return f"{name} needs torch.distributed's NCCL, which this torch build lacks; install a CUDA build of torch"
        return None
    try:
        importlib.import_module("cupy")
    except ImportError as err:
        return f"{name} uses Ray's NCCL, which needs cupy ({err}); {_CUPY_FIX}"
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
        nccl.get_version()
    except Exception as err:  # noqa: BLE001 - ImportError or cupy's own error when libnccl does not load
        return (f"{name} uses Ray's NCCL, but cupy cannot load NCCL ({type(err).__name__}: {err}); install the "
                "NCCL library for your CUDA (torch's wheels bring nvidia-nccl-cu13) or reinstall with " + _CUPY_FIX)
    return None


def deterministic(on: bool = True) -> dict[str, Any]:
    """Set this process up for bitwise-comparable numbers (``on``): no TF32 in matmuls and convolutions, cuDNN's
    deterministic algorithms, no cuDNN autotuning; returns the settings it replaced (pass them back to undo).

    TF32 rounds float32 matmul inputs to 10 mantissa bits on Ampere and later GPUs, so a GPU run and a CPU
    run differ by about 1e-3 and an equality check at 1e-4 fails for the wrong reason.
    """
    before = {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
              "cudnn_deterministic": torch.backends.cudnn.deterministic, "cudnn_benchmark": torch.backends.cudnn.benchmark,
              "float32_matmul_precision": torch.get_float32_matmul_precision()}
    torch.backends.cuda.matmul.allow_tf32 = not on and before["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = not on and before["cudnn_tf32"]
    torch.backends.cudnn.deterministic = on or before["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = not on and before["cudnn_benchmark"]
    if on:
        torch.set_float32_matmul_precision("highest")
    return before


def restore(settings: dict[str, Any]) -> None:
    """Undo ``deterministic`` with the settings it returned."""
    torch.backends.cuda.matmul.allow_tf32 = settings["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = settings["cudnn_tf32"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.set_float32_matmul_precision(settings["float32_matmul_precision"])


def pinned(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a CPU tensor) in page-locked memory when CUDA is there, so a copy to the GPU can run asynchronously;
    ``x`` itself otherwise. Torch's host allocator keeps the block until the copies that read it are done."""
    return x.pin_memory() if torch.cuda.is_available() and not x.is_pinned() else x


def to_device(x: Any, device: torch.device) -> Any:
    """Tensors (or tuples of them, ``None`` kept) on ``device``; from the host to a GPU through pinned memory,
    asynchronously (the stream orders the copy before the kernels that read it)."""
    if isinstance(x, tuple):
        return tuple(to_device(t, device) for t in x)
    if not isinstance(x, torch.Tensor) or x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return pinned(x).to(device, non_blocking=True)
    return x.to(device)
