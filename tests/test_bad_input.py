"""The bad-input table: settings, data files, model targets, checkpoints and cluster addresses that cannot work.

Each case runs ``rayspec.run([...overrides...], run_dir)`` with ``pipeline.executor=ray`` and expects an error of
rayspec's family (a ``ValueError``) whose message names the value and the fix, raised before Ray starts, with
nothing written or overwritten in the run directory (which already holds an earlier run's file).

``python tests/test_bad_input.py`` prints the table (case, message) as markdown: docs/bad-input.md.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rayspec
import rayspec.errors
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.training.checkpoint import CheckpointStore, payload

ERRORS = getattr(rayspec.errors, "RayspecError", ValueError)
"""rayspec's error family: every user-facing error derives from it."""

BASE = ["pipeline.executor=ray", "pipeline.stages=2", "pipeline.cpus_per_stage=0.5", "train.max_steps=2",
        "train.batch_size=16", "train.train_samples=256", "train.val_samples=64"]
"""A run that would start Ray and train, were its input good (with ``model.size=tiny`` for a registry model)."""

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    """settings, data, model, checkpoint or cluster."""
    overrides: tuple[str, ...]
    """Hydra overrides after ``BASE``; ``{inputs}`` is the folder of input files, ``{port}`` a closed port."""
    value: str
    """A regex the message must match where it names the value."""
    fix: str
    """A regex the message must match where it says what to do."""
    earlier_checkpoint: bool = False
    """The run directory also holds an earlier run's checkpoint."""


CASES = [
    # settings: types, ranges, unknown keys, incompatible combinations
    Case("stages not an integer", "settings", ("pipeline.stages=abc",), r"pipeline\.stages='abc'", "integer"),
    Case("zero stages", "settings", ("pipeline.stages=0",), r"pipeline\.stages=0", ">= 1"),
    Case("stages beyond the model's blocks", "settings", ("pipeline.stages=9",), r"9", r"lower pipeline\.stages"),
    Case("negative learning rate", "settings", ("optim.lr=-1",), r"optim\.lr=-1", r"e\.g\. optim\.lr="),
    Case("unknown method", "settings", ("pipeline.method=pipedreamz",), r"pipeline\.method='pipedreamz'",
         "choose one of"),
    Case("unknown precision", "settings", ("train.precision=fp8",), r"train\.precision='fp8'", "choose one of"),
    Case("unknown transport", "settings", ("pipeline.transport=carrier_pigeon",),
         r"pipeline\.transport='carrier_pigeon'", "choose one of"),
    Case("keep no checkpoint", "settings", ("checkpoint.keep=0",), r"checkpoint\.keep=0", "keep at least"),
    Case("negative restarts", "settings", ("fault.max_restarts=-1",), r"fault\.max_restarts=-1", "use 0"),
    Case("elastic not a boolean", "settings", ("fault.max_restarts=1", "fault.elastic=sometimes"),
         r"fault\.elastic='sometimes'", "true or false"),
    Case("elastic without restarts", "settings", ("fault.elastic=true",), r"fault\.max_restarts=0",
         r"set fault\.max_restarts to 1 or more"),
    Case("zero connect timeout", "settings", ("ray.connect_timeout_s=0",), r"ray\.connect_timeout_s=0",
         "positive number"),
    Case("adaptive predictor without its probe", "settings", ("pipeline.predictor=adaptive", "pipeline.probe=0"),
         r"pipeline\.predictor=adaptive.*pipeline\.probe=0", r"set pipeline\.probe to a sample size"),
    Case("misspelt key", "settings", ("+pipeline.stagez=3",), r"pipeline\.stagez", r"known: .*stages"),
    Case("unknown top-level key", "settings", ("+seeed=1",), r"seeed", r"top-level keys are .*seed"),
    Case("unknown model option", "settings", ("+model.widht=64",), r"model\.widht=64", r"options are .*width"),
    Case("batch not divisible into micro-batches", "settings",
         ("pipeline.method=gpipe", "pipeline.microbatches=4", "train.batch_size=18"),
         r"train\.batch_size=18 is not divisible by pipeline\.microbatches=4", "pick a multiple"),
    Case("batch larger than the training set", "settings", ("train.batch_size=512",), r"train\.batch_size=512",
         "lower it"),
    Case("balance of the wrong length", "settings", ("pipeline.balance=[1,1,1]",), r"\[1, 1, 1\]|balance",
         r"stages|blocks"),
    Case("checkpoint.dir and checkpoint.storage both", "settings",
         ("checkpoint.dir={inputs}/a", "checkpoint.storage={inputs}/b"), r"checkpoint\.dir=.*checkpoint\.storage=",
         "set one"),
    Case("storage of an unknown scheme", "settings", ("checkpoint.storage=nosuch://bucket/runs",),
         r"checkpoint\.storage=nosuch://bucket/runs", r"pyarrow knows \(file://, s3://"),
    Case("storage that is not a URI", "settings", ("checkpoint.storage=://runs",), r"checkpoint\.storage=://runs",
         r"file:///"),
    Case("run directory with an earlier run's checkpoints", "settings", (), r"step_00000004\.pt",
         r"checkpoint\.resume=auto", earlier_checkpoint=True),
    # data files
    Case("unknown data set", "data", ("data.name=nosuch",), r"data='nosuch'", "choose one of"),
    Case("truncated IDX file", "data", ("data=fashion_mnist", "data.root={inputs}/idx_truncated"),
         r"idx_truncated/train-images-idx3-ubyte(\.gz)? is not an IDX file of images", "replace it with the original"),
    Case("IDX file with a wrong magic number", "data", ("data=fashion_mnist", "data.root={inputs}/idx_magic"),
         r"idx_magic/train-labels-idx1-ubyte(\.gz)? is not an IDX file of labels", "replace it with the original"),
    Case("IDX labels outside 0..9", "data", ("data=fashion_mnist", "data.root={inputs}/idx_labels"),
         r"labels outside 0\.\.9 \(0\.\.12\)", "replace it with the original"),
    Case("IDX files missing", "data", ("data=fashion_mnist", "data.root={inputs}/nothing"),
         r"data\.root=.*nothing", "download"),
    Case("CSV without the named column", "data", ("data=text_csv", "data.path={inputs}/no_column.csv"),
         r"no_column\.csv has no column text", r"set data\.text_column"),
    Case("empty CSV", "data", ("data=text_csv", "data.path={inputs}/empty.csv"), r"empty\.csv has no column",
         r"none: the file is empty"),
    Case("CSV with undecodable bytes", "data", ("data=text_csv", "data.path={inputs}/latin1.csv"),
         r"latin1\.csv near line \d+ \(UnicodeDecodeError", r"data\.encoding=utf-8"),
    Case("CSV labels outside data.labels", "data",
         ("data=text_csv", "data.path={inputs}/reviews.csv", "data.labels=[good,bad]"),
         r"reviews\.csv is empty .*good, bad", r"check data\.labels"),
    Case("CSV file missing", "data", ("data=text_csv", "data.path={inputs}/absent.csv"), r"absent\.csv not found",
         r"set data\.path"),
    # model targets
    Case("model target not importable", "model", ("model=custom", "model._target_=nosuch_package.build"),
         r"model\._target_=nosuch_package\.build cannot be imported", "give the dotted path"),
    Case("model target returns the wrong type", "model", ("model=custom", "model._target_=builtins.dict"),
         r"model\._target_=builtins\.dict returned a builtins\.dict", "expected"),
    Case("model target with keys it does not take", "model",
         ("model=custom", "model._target_=torch.nn.Linear", "+model.widht=3"),
         r"model\._target_=torch\.nn\.Linear cannot be called .*widht", "make the model config's keys match"),
    # checkpoints
    Case("foreign checkpoint", "checkpoint", ("checkpoint.resume={inputs}/foreign.pt",),
         r"foreign\.pt is not a rayspec checkpoint", r"checkpoint\.resume=auto"),
    Case("truncated checkpoint", "checkpoint", ("checkpoint.resume={inputs}/truncated/step_00000004.pt",),
         r"step_00000004\.pt is not a readable rayspec checkpoint", r"checkpoint\.resume=auto"),
    Case("checkpoint of another model", "checkpoint", ("checkpoint.resume={inputs}/other_model",),
         r"model=\{'name': 'mlp', 'size': 'small'\}", r"resume with the same model"),
    Case("checkpoint path that does not exist", "checkpoint", ("checkpoint.resume={inputs}/absent",),
         r"checkpoint\.resume=.*absent", r"checkpoint\.resume=auto"),
    # cluster addresses
    Case("unreachable cluster", "cluster", ("ray.address=127.0.0.1:{port}", "ray.connect_timeout_s=1"),
         r"127\.0\.0\.1:\d+", r"ray start --head"),
    Case("cluster address of a wrong scheme", "cluster", ("ray.address=http://127.0.0.1:8265",),
         r"ray\.address=http://127\.0\.0\.1:8265: its scheme http://", r"ray://HOST:PORT"),
    Case("cluster address without a port", "cluster", ("ray.address=headnode",), r"ray\.address=headnode",
         r"HOST:PORT"),
    Case("cluster size for a cluster to join", "cluster", ("ray.address=127.0.0.1:6379", "ray.num_cpus=2"),
         r"ray\.num_cpus=2", "remove it"),
]


def _idx(kind: str, values: list[int], magic: int | None = None) -> bytes:
    """An IDX file of uint8 images (N, 28, 28) or labels (N,)."""
    if kind == "images":
        n = len(values)
        head = struct.pack(">IIII", magic or 0x0803, n, 28, 28)
        return head + bytes(v % 256 for v in values for _ in range(28 * 28))
    return struct.pack(">II", magic or 0x0801, len(values)) + bytes(values)


def _write_idx(folder: Path, **broken: bytes) -> None:
    folder.mkdir(parents=True)
    files = {"train-images-idx3-ubyte": _idx("images", list(range(8))), "train-labels-idx1-ubyte": _idx("labels", [1] * 8),
             "t10k-images-idx3-ubyte": _idx("images", list(range(4))), "t10k-labels-idx1-ubyte": _idx("labels", [2] * 4)}
    files.update({k.replace("_", "-"): v for k, v in broken.items()})
    for name, data in files.items():
        (folder / f"{name}.gz").write_bytes(gzip.compress(data))


def make_inputs(inputs: Path) -> None:
    """The bad files the cases read, outside any run directory."""
    good_images = _idx("images", list(range(8)))
    _write_idx(inputs / "idx_truncated", train_images_idx3_ubyte=good_images[: len(good_images) // 2])
    _write_idx(inputs / "idx_magic", train_labels_idx1_ubyte=_idx("labels", [1] * 8, magic=0x0999))
    _write_idx(inputs / "idx_labels", train_labels_idx1_ubyte=_idx("labels", [0, 12] * 4))
    (inputs / "nothing").mkdir()
    (inputs / "no_column.csv").write_text("review,label\ngreat film,pos\ndull film,neg\n")
    (inputs / "empty.csv").write_text("")
    (inputs / "latin1.csv").write_bytes(b"text,label\n" + b"caf\xe9 cr\xe8me,pos\n" * 3)
    (inputs / "reviews.csv").write_text("text,label\n" + "great film,pos\ndull film,neg\n" * 4)
    torch.save({"0.weight": torch.ones(2, 2)}, inputs / "foreign.pt")
    other = from_mapping(compose([*BASE, "model.size=small"]))  # the cases' runs: model.size=tiny
    CheckpointStore(inputs / "other_model", keep=1).save(4, payload(other, [3, 2], [], 1.0, {}))
    store = CheckpointStore(inputs / "truncated", keep=1)
    path = store.save(4, payload(other, [3, 2], [{"w": torch.zeros(4096)}], 1.0, {}))
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def free_port() -> int:
    """A loopback port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def attempt(case: Case, inputs: Path, run_dir: Path) -> BaseException | None:
    """Run ``case`` in ``run_dir``; the error it raised, or None."""
    overrides = [o.format(inputs=inputs, port=free_port()) for o in case.overrides]
    if "model=custom" not in overrides:
        overrides.insert(0, "model.size=tiny")
    try:
        rayspec.run([*BASE, *overrides], run_dir)
    except Exception as err:  # noqa: BLE001 - the cases check what was raised
        return err
    return None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    make_inputs(folder)
    return folder


def test_the_table_covers_every_kind_of_input():
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 30 and kinds == {"settings", "data", "model", "checkpoint", "cluster"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_by_name_before_ray_and_writes_nothing(case, inputs, tmp_path):
    import ray

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "earlier.txt").write_text("an earlier run's file")
    if case.earlier_checkpoint:
        CheckpointStore(run_dir / "checkpoints").save(4, {"x": torch.zeros(1)})
    before, ray_before = snapshot(run_dir), ray.is_initialized()
    if case.kind == "cluster" and ray_before:
        pytest.skip("Ray runs in this process already, so no cluster is joined")
    err = attempt(case, inputs, run_dir)
    assert err is not None, f"{case.id}: accepted"
    assert isinstance(err, ERRORS) and isinstance(err, ValueError), f"{case.id}: {type(err).__name__}: {err}"
    message = str(err)
    assert re.search(case.value, message), f"{case.id}: the value is not named in: {message}"
    assert re.search(case.fix, message), f"{case.id}: no fix in: {message}"
    if not ray_before:
        assert not ray.is_initialized(), f"{case.id}: Ray started before the error"
    assert snapshot(run_dir) == before, f"{case.id}: the run directory changed"


def test_the_docs_list_every_case():
    text = DOC.read_text()
    missing = [c.id for c in CASES if f"| {c.id} |" not in text]
    assert not missing, f"docs/bad-input.md lacks {missing}: regenerate it with python tests/test_bad_input.py"


def table(inputs: Path, work: Path) -> str:
    """The cases and their messages as a markdown page (paths shown as ``<inputs>``)."""
    lines = ["# What rayspec does with bad input", "",
             "Each row is a case of `tests/test_bad_input.py`: `rayspec.run` with `pipeline.executor=ray` and the "
             "input of the row. Every one raises an error of rayspec's family (a `ValueError`) whose message names "
             "the value and the fix, before Ray starts, and writes nothing into the run directory (`python -m "
             "rayspec.train` raises the same; there Hydra itself has made the run directory's `.hydra/` before "
             "rayspec reads the config). `<inputs>` is the folder of the bad files. Regenerate with "
             "`python tests/test_bad_input.py > docs/bad-input.md`.", "",
             f"{len(CASES)} cases.", "",
             "| kind | case | input | error | message |", "|---|---|---|---|---|"]
    for n, case in enumerate(CASES):
        run_dir = work / f"run{n}"
        run_dir.mkdir()
        if case.earlier_checkpoint:
            CheckpointStore(run_dir / "checkpoints").save(4, {"x": torch.zeros(1)})
        err = attempt(case, inputs, run_dir)
        message = "(accepted)" if err is None else str(err).splitlines()[0]
        message = message.replace(str(inputs), "<inputs>").replace(str(run_dir), "<run>")
        message = re.sub(r"127\.0\.0\.1:(?!6379\b|8265\b)\d+", "127.0.0.1:PORT", message)
        shown = " ".join(case.overrides).replace("{inputs}", "<inputs>").replace("{port}", "PORT")
        lines.append(f"| {case.kind} | {case.id} | `{shown or '(a run directory holding checkpoints)'}` | "
                     f"{type(err).__name__} | {message.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import logging
    import tempfile

    logging.getLogger("rayspec").setLevel(logging.ERROR)  # the page holds the table only, not the runs' warnings
    with tempfile.TemporaryDirectory() as tmp:
        make_inputs(Path(tmp) / "inputs")
        sys.stdout.write(table(Path(tmp) / "inputs", Path(tmp)))
