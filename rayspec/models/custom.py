"""A user's own model: what counts as a list of blocks, and the model a ``model._target_`` builder returns.

[Note: blocks] rayspec trains a chain of blocks: block ``i + 1`` takes what block ``i`` returns, the first
takes the input batch, the last returns the logits ``(B, num_classes)`` that the loss (cross-entropy against
integer labels) and ``val_accuracy`` read. A block is any ``nn.Module`` whose ``forward`` takes one argument, a
tensor or a tuple of tensors, and returns one. The partitioner cuts only between blocks, so a model needs at
least as many blocks as ``pipeline.stages``. Accepted as a list of blocks:

- an ``nn.Sequential``: its entries are the blocks;
- an ``nn.ModuleList``, a list or a tuple of modules: the blocks, in order;
- any ``nn.Module`` with a ``blocks`` attribute that is one of those, and no parameters or buffers outside it:
  rayspec trains the chain of its blocks and never calls the module's own ``forward``.

The trained weights (``model.pt``) are those of ``nn.Sequential(*blocks)``: names ``0.weight``, ``1.bias``, ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError
from rayspec.targets import call_target

__all__ = ["as_blocks", "build_target_model", "EXPECTED"]

EXPECTED = ("an nn.Sequential of blocks, an nn.ModuleList or list of blocks, or a module whose `blocks` attribute "
            "is one of those (README: Your own model)")


def as_blocks(obj: Any, where: str) -> nn.Sequential:
    """``obj`` as the ``nn.Sequential`` of its blocks ([Note: blocks]); ``ModelError`` naming ``where`` otherwise."""
    blocks = _listed(obj)
    held = _listed(getattr(obj, "blocks", None)) if blocks is None and isinstance(obj, nn.Module) else None
    if held is not None:
        blocks = held
        inside = {id(t) for t in nn.Sequential(*held).state_dict(keep_vars=True).values()}
        outside = [name for name, t in obj.state_dict(keep_vars=True).items() if id(t) not in inside]
        if outside:
            raise ModelError(
                f"{where} returned a {type(obj).__name__} with parameters or buffers outside its blocks "
                f"({', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''}); rayspec trains only the chain of "
                "its `blocks` and never calls its forward: make those layers blocks of their own"
            )
    if blocks is None:
        raise ModelError(f"{where} returned {_kind(obj)}; expected {EXPECTED}")
    if not blocks:
        raise ModelError(f"{where} returned no blocks; expected {EXPECTED}, with at least one block")
    return blocks if isinstance(blocks, nn.Sequential) else nn.Sequential(*blocks)


def build_target_model(cfg: Mapping[str, Any], info: DataInfo | None) -> nn.Sequential:
    """The blocks that ``cfg["_target_"]`` builds from ``cfg``'s other keys (and ``info=`` if it takes it)."""
    built = call_target("model", cfg, ModelError, info=info)
    return as_blocks(built, f"model._target_={cfg['_target_']}")


def _listed(obj: Any) -> nn.Sequential | list[nn.Module] | None:
    """The blocks of a Sequential, ModuleList, list or tuple of modules; None for anything else."""
    if isinstance(obj, nn.Sequential):
        return obj
    if isinstance(obj, (nn.ModuleList, list, tuple)) and all(isinstance(b, nn.Module) for b in obj):
        return list(obj)
    return None


def _kind(obj: Any) -> str:
    if isinstance(obj, (list, tuple)):
        wrong = next((b for b in obj if not isinstance(b, nn.Module)), None)
        return f"a {type(obj).__name__} holding a {type(wrong).__name__}, not only modules"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"
