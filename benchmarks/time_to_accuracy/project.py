"""Projected time to a target accuracy at N devices: measured stage costs replayed through the schedule simulator.

    python -m benchmarks.time_to_accuracy.project [--study reviews] [--stages 4,8] [--link-us 5] [--link-gbps 400] \\
        [--repeats 5] [--updates 8] [--seeds 0,1,2] [--out outputs/time_to_accuracy] [--set KEY=VALUE ...] [--quick]

A projection, not a measurement. For each method it

1. runs the method's own schedule on the local executor at one thread, every stage of the study's model (its
   overrides, partitioned at N) in this process, and reads each stage's action times from its clock
   (``StageClock``, ``LocalExecutor.timeline()``): F, B (or I and W), the B or W an update follows; the step is
   that one's time less the others' (where every backward updates, it stays inside B). SpecTrain's prediction and
   weight swap and PipeDream's stash live inside F and B, as the stage runs them. Means per segment of
   ``--updates`` updates, the median over ``--repeats`` segments after one of warm-up, the methods' segments in
   turn; as a check beside it, the projection from each action's least disturbed segment (its minimum);
2. replays ``build_schedule(...)`` of 32 updates, as the training loop builds it, through
   ``Schedule.timeline(durations, link)`` as if each rank had a device of its own, with a link cost per message
   between ranks: none, the measured CPU p2p hop (``benchmarks/results/hops.json``, a line through its two sizes),
   and an assumed link (``--link-us`` latency + bytes over ``--link-gbps`` gigabits per second);
3. multiplies the seconds per update by the updates to 95 % and 99 % of the sequential baseline's mean score
   (``rayspec.cli.study_stats``: the first evaluated update at or above it), per seed of the finished study
   (``benchmarks/results/studies/NAME/study_results.json``) or of runs made here for the methods it lacks.

``dataparallel`` is modelled as N replicas, each the whole model's F + B on batch / N (measured: a vanilla pipeline
of one micro-batch of batch / N, the step included), then a ring all-reduce of every gradient: 2 (N - 1) messages
of parameter bytes / N over the link. Left out everywhere: contention (a device's compute against its own copies,
several messages on one link), per-message overheads beyond the hop, memory limits (stashes, activations of
micro-batches in flight), Ray's per-call overheads, and that CPU times of one thread stand in for a device's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._shared.results import RESULTS, table, write
from benchmarks.time_to_accuracy._curves import median
from rayspec.cli.study_config import BASELINE, load_study_part, run_config, run_spec
from rayspec.cli.study_run import finished_record, train_run
from rayspec.cli.study_stats import score, updates_to
from rayspec.core.methods import METHODS
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages
from rayspec.data.loader import train_batches
from rayspec.errors import RayspecError
from rayspec.exec.local import LocalExecutor
from rayspec.partition.split import split
from rayspec.training.loop import split_batches
from rayspec.training.prepare import prepare, stage_spec

NAME = "time_to_accuracy_projected"
"""The results' name for ``reviews``; another study's adds ``_STUDY`` (``time_to_accuracy_projected_fashion``)."""
TARGETS = (0.95, 0.99)
"""Fractions of the sequential baseline's mean score."""
SIMULATED_UPDATES = 32
"""Updates in the replayed segment: its makespan over this is the steady-state time per update."""
PROJECTED = {  # name: (study method label, extra overrides, study label whose curves give its updates to target)
    "vanilla": ("vanilla", [], BASELINE),
    "gpipe": ("gpipe", [], "gpipe"),
    "1f1b": ("1f1b", [], "gpipe"),
    "zb1p": ("zb1p", [], "gpipe"),
    "interleaved": ("interleaved", [], "gpipe"),
    "async": ("async", [], "async"),
    "pipedream": ("pipedream", [], "pipedream"),
    "pipedream-2bw": ("pipedream-2bw", ["pipeline.accumulate=4"], None),
    "spectrain": ("spectrain-paper", [], "spectrain-paper"),
    "spectrain-acc4": ("spectrain-paper", ["pipeline.accumulate=4"], None),
    "dataparallel": ("vanilla", [], BASELINE),
}
"""``None``: not in the studies; trained here (``--seeds``). ``pipedream-2bw`` needs ``accumulate >= N - 1``: 4.
The synchronous schedules take ``gpipe``'s curves, at every seed the study ran: they make the same updates (a study
that trains them checks it bit for bit, possibly at fewer seeds: ``checks``)."""
SAME_UPDATES = {"vanilla": "vanilla with one micro-batch per update is sequential training",
                "interleaved": "synchronous: the same updates as gpipe (the study's 1f1b and zb1p equal gpipe)",
                "1f1b": "synchronous: the same updates as gpipe", "zb1p": "synchronous: the same updates as gpipe",
                "dataparallel": "N replicas of batch / N, gradients summed: sequential SGD on the global batch"}
LEFT_OUT = ["contention: a device computing while it copies, several messages sharing one link",
            "per-message overheads beyond the measured or assumed hop; Ray's per-call overheads",
            "memory limits: stashed weights and the activations of micro-batches in flight",
            "CPU times of one thread stand in for a device's: on a GPU the ratios of F, B, step and prediction differ",
            "the costs are medians of segment means on a 2-core CPU machine (see loadavg), not an idle device"]


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="reviews", help="reviews or fashion")
    ap.add_argument("--stages", default="4,8", help="device counts N (one stage per device)")
    ap.add_argument("--link-us", type=float, default=5.0, help="assumed link: latency per message, microseconds")
    ap.add_argument("--link-gbps", type=float, default=400.0, help="assumed link: gigabits per second (400: NDR)")
    ap.add_argument("--repeats", type=int, default=5, help="timed segments per method (their median)")
    ap.add_argument("--updates", type=int, default=8, help="updates per timed segment")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the runs trained here (methods the study lacks)")
    ap.add_argument("--out", default="outputs/time_to_accuracy", help="folder of the runs trained here")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a training override for every run, after the study's own (data.path=FILE: a copy of the "
                         "study's data file); repeatable")
    ap.add_argument("--quick", action="store_true", help="N=2, one short segment, no runs trained (a smoke test)")
    return ap.parse_args(argv)


class _Study:
    """The study's composed settings, one per extra override list (composing is slow)."""

    def __init__(self, name: str, overrides: Sequence[str] = ()) -> None:
        self.name, self.overrides, self.loaded, self.data = name, list(overrides), {}, None
        whole = prepare(self.config("vanilla", [], 1))
        self.data, self.blocks = whole.data, len(whole.model)

    def config(self, label: str, extra: list[str], stages: int, seed: int = 0, **changes: Any) -> Any:
        key = (label if extra else "", *extra)  # the study checks its methods under the overrides: only ours
        if key not in self.loaded:
            self.loaded[key] = load_study_part(self.name, [*self.overrides, *extra], seeds=[seed],
                                               **({"methods": [label]} if extra else {}))
        config = run_config(self.loaded[key], run_spec(self.loaded[key], label, stages, seed))
        for section, values in changes.items():
            setattr(config, section, replace(getattr(config, section), **values))
        return config


def measure(study: _Study, n: int, repeats: int, updates: int) -> dict[str, dict[str, Any]]:
    """Per method, per-stage action seconds at ``n`` stages (medians over ``repeats`` segments, the methods' segments
    taken in turn so that the machine's other load hits all alike) and the bytes each stage sends per micro-batch;
    ``{"skipped": why}`` where the model cannot be cut so."""
    runs = {name: _setup(study, name, n, updates) for name in PROJECTED}
    live = {name: r for name, r in runs.items() if "skipped" not in r}
    for r in live.values():
        r["segment"]()  # warm-up
    segments: dict[str, list[dict[str, float]]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, r in live.items():
            segments[name].append(r["segment"]())
    for name, r in live.items():
        del r["segment"]
        r.update(costs={key: statistics.median(seg[key] for seg in segments[name]) for key in segments[name][0]},
                 segments=segments[name], sent_bytes=r.pop("sent")())
    return runs


def _setup(study: _Study, name: str, n: int, updates: int) -> dict[str, Any]:
    """``name``'s stages at ``n`` on the local executor, with ``segment``: runs ``updates`` updates of its schedule
    and returns their costs (``_segment_costs``)."""
    label, extra, _ = PROJECTED[name]
    if name != "dataparallel" and n > study.blocks:
        return {"skipped": f"N={n} stages but the model has {study.blocks} blocks"}
    try:
        if name == "dataparallel":  # one replica's work: batch / n as one micro-batch through the whole model
            base = study.config(label, extra, 1)
            config = study.config(label, extra, 1, train={"batch_size": base.train.batch_size // n})
        else:
            config = study.config(label, extra, n)
    except RayspecError as err:  # a setting the method cannot take at n (interleaved's rounds of n)
        return {"skipped": str(err)}
    chunks = (1 if name == "dataparallel" else n) * config.pipeline.virtual_stages
    if chunks > study.blocks:
        return {"skipped": f"{chunks} stages (N={n} x {config.pipeline.virtual_stages} chunks per device) but the "
                           f"model has {study.blocks} blocks"}
    config.pipeline = replace(config.pipeline, probe=0)  # the prediction probe scores; it does not train
    prepared = prepare(config, data=study.data)
    method = METHODS[config.pipeline.method]
    assert method.schedule is not None
    spec = replace(stage_spec(config), trace=True)
    stages = make_stages(split(copy.deepcopy(prepared.model), prepared.balance), method.name, spec)
    executor = LocalExecutor(stages, method.name, config.pipeline.variant)
    group = config.pipeline.group
    stream = split_batches(train_batches(prepared.data.train, config.train.batch_size, config.seed), group)
    schedule = build_schedule(method.schedule, len(prepared.balance) // config.pipeline.virtual_stages,
                              updates * group, group=group, virtual=config.pipeline.virtual_stages)

    def segment() -> dict[str, float]:
        for st in stages:
            st.timeline.clear()
        executor.run(schedule, stream)
        return _segment_costs(schedule, executor.timeline())

    return {"segment": segment, "sent": lambda: [st.stats.sent_bytes["F"] / max(1, st.stats.actions["F"])
                                                 for st in stages],
            "param_bytes": sum(p.numel() * p.element_size() for st in stages for p in st.params), "group": group,
            "blocks": study.blocks, "balance": list(prepared.balance), "microbatch": config.train.batch_size // group,
            "virtual": config.pipeline.virtual_stages, "schedule": method.schedule}


def _segment_costs(schedule: Any, timeline: list[list[tuple[str, int, float, float]]]) -> dict[str, float]:
    """Mean seconds per ``"stage kind"`` of one segment, and ``"stage step"``: the update-flagged backward's time
    less the plain one's (0 where every backward updates: the step stays inside B)."""
    out: dict[str, float] = {}
    for k, acts in enumerate(timeline):
        flagged = {(a.kind, a.microbatch) for a in schedule.actions[k] if a.update}
        times: dict[tuple[str, bool], list[float]] = {}
        for kind, m, start, end in acts:
            times.setdefault((kind, (kind, m) in flagged), []).append(end - start)
        step = 0.0
        for kind in ("F", "B", "I", "W"):
            plain, updated = times.get((kind, False)), times.get((kind, True))
            if plain is None and updated is None:
                continue
            out[f"{k} {kind}"] = statistics.fmean(plain or updated or [])
            if plain and updated:
                step = statistics.fmean(updated) - statistics.fmean(plain)
        out[f"{k} step"] = max(0.0, step)
    return out


def _durations(costs: dict[str, float]) -> dict[Any, float]:
    return {(int(key.split()[0]), key.split()[1]): v for key, v in costs.items()}


def links(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Link models: ``(latency s, seconds per byte)``. The measured one: a line through ``hops.json``'s p2p hop at
    its two sizes (default workers)."""
    rows = [r for r in json.loads((RESULTS / "hops.json").read_text())["rows"] if r["workers"].startswith("default")]
    (k0, h0), (k1, h1) = sorted((r["kib"] * 1024, r["p2p_hop"] / 1e3) for r in rows)[:2]
    per_byte = (h1 - h0) / (k1 - k0)
    return {"none": (0.0, 0.0), "measured_cpu_hop": (h0 - k0 * per_byte, per_byte),
            "assumed_link": (args.link_us * 1e-6, 8 / (args.link_gbps * 1e9))}


def per_update(name: str, n: int, measured: dict[str, Any], link: tuple[float, float],
               costs: dict[str, float] | None = None) -> dict[str, float]:
    """Projected seconds per update of ``name`` at ``n`` devices under ``link``, and the busiest stage's work per
    update (a lower bound of the first)."""
    costs = costs or measured["costs"]
    latency, per_byte = link
    durations = _durations(costs)
    if name == "dataparallel":  # one replica's whole-model F + B (the step inside B) and the ring all-reduce
        work = sum(durations.values())
        messages = 2 * (n - 1)
        reduce = messages * (latency + measured["param_bytes"] / n * per_byte) if n > 1 else 0.0
        return {"seconds": work + reduce, "stage_work": work, "all_reduce": reduce}
    group, virtual = measured["group"], measured["virtual"]
    schedule = build_schedule(measured["schedule"], n, SIMULATED_UPDATES * group, group=group, virtual=virtual)
    hop = {b: latency + size * per_byte for b, size in enumerate(measured["sent_bytes"][:-1])}
    span = schedule.makespan(durations, hop)
    busy = [0.0] * n
    for (k, kind), t in durations.items():
        per = 1 if kind == "step" else group
        busy[k % n] += per * t
    return {"seconds": span / SIMULATED_UPDATES, "stage_work": max(busy)}


def study_curves(name: str) -> tuple[dict[str, Any], Path] | None:
    path = RESULTS / "studies" / name / "study_results.json"
    return (json.loads(path.read_text()), path) if path.exists() else None


def updates_needed(records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Per seed the first evaluated update at ``target`` (None: never), and their median with a run that never
    reached counted as the slowest (``_curves.median``, as the measured benchmark counts them): None when the median
    falls on such a run."""
    per_seed = {r["seed"]: updates_to(r["curves"]["val"], target) if r.get("status") == "ok" else None
                for r in records}
    return {"per_seed": per_seed, "median": median(list(per_seed.values())),
            "not_reached": sum(u is None for u in per_seed.values())}


def own_runs(args: argparse.Namespace, name: str, n: int) -> list[dict[str, Any]]:
    """The records of ``name`` at ``n`` trained here (or found finished in ``args.out``), the study's overrides, then
    ``--set``'s, then the method's, as the study runner trains a run."""
    label, extra, _ = PROJECTED[name]
    study_name, seeds, out = args.study, args.seeds, Path(args.out)
    study = load_study_part(study_name, [*args.overrides, *extra], seeds=seeds, methods=[label])
    records = []
    for seed in seeds:
        spec = run_spec(study, label, n, seed)
        folder = out / study_name / f"{name}-n{n}-seed{seed}"
        record = finished_record(spec, folder)
        if record is None:
            print(f"training {name} N={n} seed {seed} ...", flush=True)
            record = train_run(study, spec, folder, None)
        records.append(record)
    return records


def accuracy(args: argparse.Namespace, n: int, names: list[str]) -> dict[str, Any]:
    """Updates to each target per method at ``n``: from the study's runs, or runs trained here."""
    found = study_curves(args.study)
    if found is None:
        return {"pending": f"benchmarks/results/studies/{args.study}/study_results.json does not exist yet"}
    results, path = found
    runs = [r for r in results["runs"] if "-lr" not in r["name"]]  # the study's own rate, not the sweep's
    base = [s for r in runs if r["label"] == BASELINE and (s := score(r)) is not None]
    mean = statistics.fmean(base)
    out: dict[str, Any] = {"source": str(path.relative_to(RESULTS.parent.parent)), "baseline_score": mean,
                           "baseline_seeds": len(base), "methods": {}}
    for name in names:
        _, _, source = PROJECTED[name]
        if source is None:
            records = [] if args.quick else own_runs(args, name, n)
            where = f"trained here, seeds {args.seeds}" if records else "not measured"
        else:
            at = 1 if source == BASELINE else n
            records = [r for r in runs if r["label"] == source and r["stages"] == at]
            where = f"study runs of {source} at N={at}" + (f" ({SAME_UPDATES[name]})" if name in SAME_UPDATES else "")
        entry: dict[str, Any] = {"curves": where}
        if source is None and records:  # kept here, as these runs live only in the ignored output folder
            entry["runs"] = {r["seed"]: {"status": r["status"], "score": score(r), "val": r["curves"]["val"]}
                             for r in records}
        if records:
            entry.update({f"{t:.2f}": updates_needed(records, t * mean) for t in TARGETS})
        out["methods"][name] = entry
    return out


def project(args: argparse.Namespace, n: int, link_models: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Costs, seconds per update and time to each target of every method at ``n`` devices."""
    study = _Study(args.study, args.overrides)
    measured = measure(study, n, args.repeats, args.updates)
    if all("skipped" in m for name, m in measured.items() if name != "dataparallel"):
        return {"skipped": measured["gpipe"]["skipped"]}
    names = [name for name, m in measured.items() if "skipped" not in m]
    speed = {}
    for name in names:
        m = measured[name]
        speed[name] = {}
        for link, model in link_models.items():
            seconds = [per_update(name, n, m, model, seg)["seconds"] for seg in m["segments"]]
            least = {key: min(seg[key] for seg in m["segments"]) for key in m["costs"]}
            speed[name][link] = {**per_update(name, n, m, model), "spread": [min(seconds), max(seconds)],
                                 "least_disturbed": per_update(name, n, m, model, least)["seconds"]}
    acc = accuracy(args, n, names)
    return {"measured": {k: {kk: vv for kk, vv in v.items() if kk != "segments"} for k, v in measured.items()},
            "per_update": speed, "accuracy": acc, "time_to_target": _time_to_target(speed, acc, link_models)}


def _time_to_target(speed: dict, acc: dict, link_models: dict) -> dict[str, Any]:
    """Per link and target: each method's projected seconds (the median over the seeds, a run that never reached
    counted as the slowest; the range of those that reached; the seeds that never did), the winner, and every
    median's ratio to the winner's."""
    if "methods" not in acc:
        return {}
    out: dict[str, Any] = {}
    for link in link_models:
        for t in TARGETS:
            rows = {}
            for name, entry in acc["methods"].items():
                need = entry.get(f"{t:.2f}")
                if need is None or need["median"] is None:
                    rows[name] = {"seconds": None, "why": entry["curves"] if need is None else
                                  f"not reached on {need['not_reached']} of {len(need['per_seed'])} seeds"}
                    continue
                s = speed[name][link]["seconds"]
                reached = [u * s for u in need["per_seed"].values() if u is not None]
                rows[name] = {"seconds": need["median"] * s, "range": [min(reached), max(reached)],
                              "least_disturbed": need["median"] * speed[name][link]["least_disturbed"],
                              "updates": need["median"], "not_reached": need["not_reached"],
                              "seeds": len(need["per_seed"])}
            full = {k: r for k, r in rows.items() if r["seconds"] is not None}
            best = min(full, key=lambda k: full[k]["seconds"]) if full else None
            for r in rows.values():
                if best is not None and r["seconds"] is not None:
                    r["ratio"] = r["seconds"] / rows[best]["seconds"]
                    r["ratio_least_disturbed"] = r["least_disturbed"] / rows[best]["least_disturbed"]
            out[f"{link} {t:.2f}"] = {"winner": best, "methods": rows}
    return out


def _print(n: int, result: dict[str, Any]) -> None:
    if "skipped" in result:
        print(f"\nN={n}: not projected: {result['skipped']}")
        return
    cost_rows = []
    for name, m in result["measured"].items():
        if "skipped" in m:
            print(f"N={n} {name}: not projected: {m['skipped']}")
            continue
        per_stage = {}
        for key, v in m["costs"].items():
            k, kind = key.split()
            per_stage.setdefault(int(k), {})[kind] = v
        for k, c in sorted(per_stage.items()):
            cost_rows.append({"method": name, "stage": k, "mb": m["microbatch"],
                              **{kind: f"{c[kind] * 1e3:.2f}" if kind in c else "-"
                                 for kind in ("F", "B", "I", "W", "step")},
                              "sent_KiB": f"{m['sent_bytes'][k] / 1024:.0f}" if k < len(m["sent_bytes"]) else "-"})
    print(f"\nN={n}: measured ms per action (one thread, this machine; step 0.00: inside B, every backward updates)")
    print(table(cost_rows, list(cost_rows[0])))
    speed_rows = [{"method": name, **{link: f"{v['seconds'] * 1e3:.2f} ({v['spread'][0] * 1e3:.2f}-"
                                            f"{v['spread'][1] * 1e3:.2f}; {v['least_disturbed'] * 1e3:.2f})"
                                      for link, v in links_.items()}}
                  for name, links_ in result["per_update"].items()]
    print(f"\nN={n}: projected ms per update, by link: from the median costs (from each timed segment's costs: "
          "their range; from each action's least disturbed segment)")
    print(table(speed_rows, list(speed_rows[0])))
    acc = result["accuracy"]
    if "pending" in acc:
        print(f"\nN={n}: updates to target: pending ({acc['pending']})")
        return
    for key, block in result["time_to_target"].items():
        link, t = key.split()
        rows = []
        for name, r in block["methods"].items():
            if r["seconds"] is None:
                rows.append({"method": name, "projected_s": "-", "range_s": "-", "updates": "-", "reached": "-",
                             "ratio": "-", "ratio_ld": "-", "note": r["why"]})
                continue
            rows.append({"method": name, "projected_s": f"{r['seconds']:.2f}",
                         "range_s": f"{r['range'][0]:.2f}-{r['range'][1]:.2f}", "updates": f"{r['updates']:g}",
                         "reached": f"{r['seeds'] - r['not_reached']}/{r['seeds']}",
                         "ratio": f"{r['ratio']:.2f}" if "ratio" in r else "-",
                         "ratio_ld": f"{r['ratio_least_disturbed']:.2f}" if "ratio" in r else "-", "note": ""})
        print(f"\nN={n}, link {link}: projected seconds to {float(t) * 100:.0f} % of the sequential score "
              f"({acc['baseline_score'] * float(t):.4f}); winner {block['winner']} (median over the seeds, a miss "
              "counted as the slowest; ratio_ld: from the least disturbed costs)")
        print(table(rows, list(rows[0])))


def main(argv: Sequence[str] | None = None) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per stage, as the studies train; the caller's count comes back after
    try:
        _project_all(_args(argv))
    finally:
        torch.set_num_threads(threads)


def _project_all(args: argparse.Namespace) -> None:
    if args.quick:
        args.stages, args.repeats, args.updates = "2", 1, 2
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    link_models = links(args)
    load_before = os.getloadavg()
    results = {}
    for n in (int(s) for s in args.stages.split(",")):
        results[str(n)] = project(args, n, link_models)
        _print(n, results[str(n)])
    print("\nA projection. Left out: " + "; ".join(LEFT_OUT))
    payload = {"projection": True, "config": {k: v for k, v in vars(args).items()}, "study": args.study,
               "links": {k: {"latency_us": v[0] * 1e6, "GBps": (1 / v[1] / 1e9) if v[1] else None}
                         for k, v in link_models.items()},
               "dataparallel_model": "N replicas: whole-model F + B on batch / N with one step, then a ring all-reduce "
                                     "of 2 (N - 1) messages of parameter bytes / N over the link",
               "same_updates": SAME_UPDATES, "left_out": LEFT_OUT, "simulated_updates": SIMULATED_UPDATES,
               "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "stages": results}
    name = NAME if args.study == "reviews" else f"{NAME}_{args.study}"
    print(f"wrote {write(name, payload, quick=args.quick)}")


if __name__ == "__main__":
    main()
