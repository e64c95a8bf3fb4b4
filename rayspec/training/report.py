"""What a run reports at evaluations and at its end: validation figures, per-stage lines, ``summary.json``."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayspec.config import Config
from rayspec.data.loader import eval_batches
from rayspec.models import MODELS
from rayspec.partition import human_bytes
from rayspec.training.prepare import Prepared
from rayspec.training.storage import put_file

__all__ = ["evaluate", "report_stages", "write_summary", "model_size"]

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model: nn.Module, state: dict[str, torch.Tensor], dataset: Any, batch_size: int) -> dict[str, float]:
    """Loss and accuracy of the merged weights on a split, on the driver."""
    model = copy.deepcopy(model).eval()
    model.load_state_dict(state)
    total, loss, correct = 0, 0.0, 0
    for x, y in eval_batches(dataset, batch_size):
        out = model(x)
        loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(-1) == y).sum().item()
        total += len(y)
    return {"val_loss": loss / total, "val_accuracy": correct / total}


def report_stages(stats: list[dict], seconds: float, who: str = "stage", sent: str = "sent") -> float:
    """Add ``busy_fraction`` (busy share of ``seconds``) to each stage's stats, log one line per stage,
    and return the mean busy fraction."""
    fractions = []
    for st in stats:
        busy = st["busy_s"]["F"] + st["busy_s"]["B"]
        per = busy / max(1, st["actions"]["F"] + st["actions"]["B"]) * 1e3
        st["busy_fraction"] = busy / max(seconds, 1e-9)
        fractions.append(st["busy_fraction"])
        scored = st.get("prediction") or {}
        quality = (f"  prediction quality {scored['quality']:.3f} (best scale {scored['best_scale']:.2f}, "
                   f"{scored['actions']} scored)" if scored.get("quality") is not None else "")
        log.info("%s %s: busy %.0f%%  %.2f ms/action  version %s  %s %s%s", who, st["stage"], st["busy_fraction"] * 100,
                 per, st["version"], sent, human_bytes(sum(st["sent_bytes"].values())), quality)
    return max(0.0, min(1.0, sum(fractions) / max(len(fractions), 1)))


def write_summary(prepared: Prepared, run_dir: Path, *, transport: str, updates: int,
                  last_loss: float, evals: dict[str, float], train_s: float, wall_s: float, bubble: float,
                  bytes_per_update: float, stats: list[dict], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's ``summary.json`` (docs/design.md §5), the same keys for every method; written, logged and returned."""
    c, p = prepared.config, prepared.config.pipeline
    summary = {
        "method": p.method, "variant": p.variant, "stages": p.stages, "model": c.model_name,
        "model_size": model_size(c), "dataset": c.data_name, "executor": p.executor,
        "transport": transport, "balance": prepared.balance, "updates": updates,
        "final_train_loss": last_loss, "val_loss": evals.get("val_loss"), "val_accuracy": evals.get("val_accuracy"),
        "samples_per_s": updates * c.train.batch_size / max(train_s, 1e-9), "train_s": train_s,
        "wall_s": wall_s, "bubble_fraction": max(0.0, bubble), "bytes_per_update": bytes_per_update,
        "seed": c.seed, **(extra or {}), "stage_stats": stats, "config": asdict(c),
    }
    text = json.dumps(summary, indent=2, default=str)
    (run_dir / "summary.json").write_text(text)
    if c.checkpoint.storage is not None:  # beside the checkpoints, where a run on another node finds it
        put_file(c.checkpoint.storage, "summary.json", text.encode())
    log.info("done: %d updates, final loss %.4f, val_accuracy %s, %.1f samples/s; wrote %s", updates, last_loss,
             summary["val_accuracy"], summary["samples_per_s"], run_dir)
    return summary


def model_size(config: Config) -> str | None:
    """``model.size`` of a registry model (``full`` when unset); a model of one's own has a size only if its
    config gives one."""
    if config.model.get("name") in MODELS:
        return config.model.get("size", "full")
    return config.model.get("size")
