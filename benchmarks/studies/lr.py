"""The learning rate of each shipped accuracy study: its sequential baseline over a grid of learning rates.

    python -m benchmarks.studies.lr [--studies lstm_text,transformer_text,vgg16_image,snn_image]
                                    [--lrs 0.003,0.01,0.03,0.1,0.3,1.0] [--seed 0] [--quick]
    python -m benchmarks.studies.lr --real    # the studies on real data, into study_lr_real.json

Each study's baseline (``vanilla`` on one stage, i.e. sequential SGD, with every other setting of the
study: model, data, steps, momentum 0.9 and the poly schedule) trains once per learning rate on one
seed. No pipelined method runs here, so the choice cannot favour one.

The rule, fixed before the studies ran: take the **largest** learning rate whose final validation
accuracy is within ``--tolerance`` (1 point) of the best in the grid and whose run did not diverge. The
paper's regime is a large learning rate, where staleness matters; a smaller one would hide the
methods' differences, a larger one costs the baseline accuracy. The table and the chosen rate per
study go to ``benchmarks/results/study_lr.json`` (``--real``: ``study_lr_real.json``, or ``--results
NAME``); the chosen rate is then written into ``conf/study/NAME.yaml`` by hand. A ``choices`` entry of
the results file (the model and budget decisions of the studies, made on baseline runs too) is kept
as it is.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._shared.results import results_dir, write
from rayspec.cli.study import BASELINE, RunSpec, load_study, train_run
from rayspec.cli.study_config import with_overrides

STUDIES = ("lstm_text", "transformer_text", "vgg16_image", "snn_image")
REAL = ("vgg16_fashion", "snn_fashion", "lstm_rt", "transformer_rt")
"""The studies on real data (Fashion-MNIST, Rotten Tomatoes)."""
LRS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
QUICK_LRS = (0.03, 0.3)


def choose(rows: list[dict], tolerance: float) -> float | None:
    """The largest learning rate within ``tolerance`` of the best final accuracy, among runs that finished."""
    ok = [r for r in rows if r["status"] == "ok" and r["val_accuracy"] is not None]
    if not ok:
        return None
    best = max(r["val_accuracy"] for r in ok)
    return max(r["lr"] for r in ok if r["val_accuracy"] >= best - tolerance)


def sweep(name: str, lrs: list[float], seed: int, out: Path, extra: list[str]) -> list[dict]:
    rows = []
    for lr in lrs:
        study = load_study(name, [f"optim.lr={lr}", *extra], seeds=[seed], checks=False)
        record = train_run(study, with_overrides(study, RunSpec(BASELINE, 1, seed, None)), out / name / f"lr{lr}", None)
        f = record["final"]
        losses = [v for _, v in record["curves"]["loss"]]
        rows.append({"lr": lr, "seed": seed, "status": record["status"], "val_accuracy": f["val_accuracy"],
                     "val_loss": f["val_loss"], "train_loss": f["train_loss"] if record["status"] == "ok" else None,
                     "first_train_loss": losses[0] if losses else None, "seconds": round(record["seconds"], 1)})
        acc = "-" if f["val_accuracy"] is None else f"{100 * f['val_accuracy']:.2f}"
        print(f"{name:<17} lr {lr:<6} {record['status']:<9} val acc {acc:>6} %  val loss "
              f"{f['val_loss'] if f['val_loss'] is None else round(f['val_loss'], 4)}  ({record['seconds']:.0f} s)",
              flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--studies", default=None, help=f"comma-separated study names (default {','.join(STUDIES)})")
    ap.add_argument("--real", action="store_true", help=f"the studies on real data: {','.join(REAL)}")
    ap.add_argument("--results", default=None,
                    help="results file name in benchmarks/results (default study_lr; study_lr_real with --real)")
    ap.add_argument("--lrs", default=None, help=f"comma-separated (default {','.join(str(x) for x in LRS)}; "
                    f"--quick: {','.join(str(x) for x in QUICK_LRS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.01, help="accuracy (fraction) below the best still accepted")
    ap.add_argument("--out", default=None, help="where the runs' directories go (default outputs/study_lr)")
    ap.add_argument("--quick", action="store_true",
                    help="the first study only, 2 rates, 20 updates per run, into a scratch folder (a smoke test)")
    args = ap.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else list(QUICK_LRS if args.quick else LRS)
    names = args.studies.split(",") if args.studies else list(REAL if args.real else STUDIES)[: 1 if args.quick else None]
    out = Path(args.out or (results_dir(True) / "study_lr_runs" if args.quick else "outputs/study_lr"))
    results = args.results or ("study_lr_real" if args.real else "study_lr")
    extra = ["train.max_steps=20", "train.eval_every=10", "train.log_every=10"] if args.quick else []
    previous = results_dir(args.quick) / f"{results}.json"
    studies = {} if args.quick or not previous.exists() else json.loads(previous.read_text())["studies"]
    t0 = time.perf_counter()
    for name in names:
        # rows of learning rates swept earlier (same seed) stay, so a grid can be extended one rate at a time
        kept = [r for r in studies.get(name, {}).get("rows", []) if r["lr"] not in lrs and r.get("seed") == args.seed]
        rows = sorted(kept + sweep(name, lrs, args.seed, out, extra), key=lambda r: r["lr"])
        studies[name] = {"rows": rows, "chosen_lr": choose(rows, args.tolerance)}
        print(f"{name}: chosen lr {studies[name]['chosen_lr']}", flush=True)
        # written after each study, read again first: another process may sweep other studies
        fresh = json.loads(previous.read_text()) if previous.exists() and not args.quick else {}
        write(results, {"tolerance": args.tolerance, "studies": {**fresh.get("studies", {}), name: studies[name]},
                        "rule": "largest lr within tolerance of the best final val accuracy, not diverged",
                        **({"choices": fresh["choices"]} if "choices" in fresh else {})}, quick=args.quick)
    print(f"{time.perf_counter() - t0:.0f} s; results in {previous}")


if __name__ == "__main__":
    main()
