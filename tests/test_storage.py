"""Checkpoints on storage (local paths, ``file://`` URIs), a writer killed during a write, and files under a
checkpoint's name that do not load."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import Stop, StopAfter

from rayspec.config import ConfigError, from_mapping
from rayspec.training import run_training as train
from rayspec.training.checkpoint import CheckpointStore, load_checkpoint, resolve_resume
from rayspec.training.storage import put_file

ROOT = Path(__file__).resolve().parents[1]


def settings(method: str = "spectrain", **checkpoint) -> dict:
    return {
        "model": {"name": "mlp", "size": "tiny"},
        "data": {"name": "synthetic_image", "train_size": 320, "val_size": 64},
        "pipeline": {"method": method, "stages": 3, "executor": "local", "microbatches": 2},
        "train": {"max_steps": 12, "batch_size": 16, "log_every": 1, "eval_every": 6},
        "optim": {"lr": 0.08, "weight_decay": 1e-3},
        "checkpoint": {"every": 4, "keep": 3, **checkpoint},
    }


def location(kind: str, folder: Path) -> str:
    """``folder`` as a plain path or as a ``file://`` URI."""
    return str(folder) if kind == "path" else folder.as_uri()


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# A run in a process of its own that is SIGKILLed while it writes the checkpoint of update KILL_AT: after the data
# is written and flushed under the temporary name, before the rename (the flush is the last step before it).
_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from rayspec.config import from_mapping
    from rayspec.training import run_training as train
    from rayspec.training import storage
    import json

    cfg, run_dir, kill_at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    flush = storage._fsync

    def killed_before_rename(path):
        flush(path)
        if f".step_{kill_at:08d}.pt." in path:
            os.kill(os.getpid(), signal.SIGKILL)

    storage._fsync = killed_before_rename
    train(from_mapping(cfg), run_dir)
""")


def run_killed_writer(cfg: dict, run_dir: Path, kill_at: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _KILLED_WRITER, json.dumps(cfg), str(run_dir), str(kill_at)],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("kind", ["path", "file"])
def test_a_writer_killed_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path, kind):
    """SIGKILL during the write of update 8's checkpoint: update 4's still loads, the half-done file is ignored
    and removed by the next write, and resume=auto goes on from update 4 to the uninterrupted run's weights."""
    storage = location(kind, tmp_path / "store")
    cfg = settings(storage=storage)
    done = run_killed_writer(cfg, tmp_path / "killed", kill_at=8)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    folder = tmp_path / "store" / "checkpoints"
    leftover = sorted(p.name for p in folder.iterdir())
    assert leftover[0].startswith(".step_00000008.pt.") and leftover[0].endswith(".tmp"), leftover
    assert leftover[1:] == ["step_00000004.pt"]
    assert [p if isinstance(p, str) else p.name for p in CheckpointStore(folder).paths()] == ["step_00000004.pt"]
    assert load_checkpoint(folder / "step_00000004.pt")["step"] == 4

    resumed = train(from_mapping(settings(storage=storage, resume="auto")), tmp_path / "resumed")
    assert resumed["resumed_from"] == 4 and resumed["updates"] == 12
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000004.pt", "step_00000008.pt", "step_00000012.pt"]
    train(from_mapping(settings(storage=str(tmp_path / "ref"))), tmp_path / "full")
    assert_same_weights(tmp_path / "full" / "model.pt", tmp_path / "resumed" / "model.pt")
    # The summary goes to the storage too, beside the checkpoints.
    assert json.loads((tmp_path / "store" / "summary.json").read_text())["resumed_from"] == 4


def test_storage_holds_checkpoints_and_summary_and_a_new_run_dir_resumes_from_it(tmp_path):
    """A run interrupted on one machine resumes from the storage in another run directory (as a new driver on
    another node would), and ends where the uninterrupted run ends."""
    store = (tmp_path / "store").as_uri()
    with pytest.raises(Stop):
        train(from_mapping(settings(storage=store)), tmp_path / "node_a", callbacks=[StopAfter(6)])
    assert not (tmp_path / "node_a" / "checkpoints").exists()  # nothing on the lost node's disk
    assert sorted(p.name for p in (tmp_path / "store" / "checkpoints").iterdir()) == ["step_00000004.pt"]
    resumed = train(from_mapping(settings(storage=store, resume="auto")), tmp_path / "node_b")
    assert resumed["resumed_from"] == 4 and resumed["checkpoint"] == f"{store}/checkpoints/step_00000012.pt"
    train(from_mapping(settings()), tmp_path / "full")
    assert_same_weights(tmp_path / "full" / "model.pt", tmp_path / "node_b" / "model.pt")
    assert json.loads((tmp_path / "store" / "summary.json").read_text())["updates"] == 12
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run"):  # never overwritten
        train(from_mapping(settings(storage=store)), tmp_path / "node_c")
    # resume=STORAGE (a root, a URI) from a run with its own storage
    longer = settings(resume=store)
    longer["train"]["max_steps"] = 16
    assert train(from_mapping(longer), tmp_path / "node_d")["resumed_from"] == 12


@pytest.mark.parametrize("kind", ["path", "file"])
def test_truncated_and_foreign_files_are_refused_by_name_and_auto_takes_the_newest_good_one(tmp_path, kind, caplog):
    folder = tmp_path / "checkpoints"
    store = CheckpointStore(location(kind, folder), keep=5)
    for step in (1, 2, 3):
        store.save(step, {"x": torch.full((256,), float(step))})
    good = (folder / "step_00000003.pt").read_bytes()
    (folder / "step_00000003.pt").write_bytes(good[: len(good) // 2])  # truncated by its storage
    torch.save({"weight": torch.ones(2)}, folder / "step_00000004.pt")  # another program's file
    (folder / "step_00000005.pt").write_bytes(b"\xff\xfe not a checkpoint")
    for step, why in ((3, "not a readable rayspec checkpoint"), (4, "not a rayspec checkpoint of format 1"),
                      (5, "not a readable rayspec checkpoint")):
        name = f"step_{step:08d}.pt"
        with pytest.raises(ConfigError, match=why) as info:
            load_checkpoint(store.paths()[step - 1])
        assert name in str(info.value) and "checkpoint.resume=auto" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="rayspec.training.checkpoint"):
        path, state = resolve_resume("auto", store.folder)  # type: ignore[misc]
    assert state["step"] == 2 and str(path).endswith("step_00000002.pt")
    assert [n for n in ("step_00000005", "step_00000004", "step_00000003") if n in caplog.text] == \
        ["step_00000005", "step_00000004", "step_00000003"]
    assert resolve_resume(location(kind, tmp_path), None)[1]["step"] == 2  # type: ignore[index]  # a run directory
    with pytest.raises(ConfigError, match="step_00000004.pt is not a rayspec checkpoint"):  # named: no fallback
        resolve_resume(location(kind, folder / "step_00000004.pt"), None)


def test_a_folder_whose_checkpoints_all_fail_to_load_is_refused(tmp_path):
    (tmp_path / "step_00000001.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"none of its checkpoints loads \(step_00000001.pt\)"):
        resolve_resume(str(tmp_path), None)
    assert resolve_resume("auto", tmp_path) is None  # nothing good to go on from: a fresh start


def test_put_file_and_unknown_schemes(tmp_path):
    put_file((tmp_path / "a").as_uri(), "summary.json", b"{}")
    assert (tmp_path / "a" / "summary.json").read_bytes() == b"{}"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["summary.json"]  # no temporary file left
    with pytest.raises(ConfigError, match=r"checkpoint.storage=nosuch://bucket/x cannot be opened by pyarrow.fs"):
        CheckpointStore("nosuch://bucket/x").paths()
