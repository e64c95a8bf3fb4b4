#!/usr/bin/env bash
# Everything a GPU machine checks, in one go and in about 8 minutes, from the project root:
#
#   OUT=/some/folder benchmarks/gpu_check/gpu_run.sh          # CUDA (the default)
#   DEVICE=cpu OUT=/tmp/dry benchmarks/gpu_check/gpu_run.sh   # the same steps with CPU stages: a dry run without a GPU
#
# 1. env.txt: the GPUs, torch, CUDA, NCCL and cupy this machine has;
# 2. gpu_check.txt, gpu_check.json: python -m benchmarks.gpu_check (every transport and method the GPUs allow
#    against the local executor on the CPU, samples/s against torch.distributed.pipelining, stage memory);
# 3. train.txt, summary.json, trace.json: a short python -m rayspec.train on CUDA stages (a GPU each when there
#    are two, else sharing one) with evaluations, checkpoints and the trace;
# 4. pytest.txt: the suite's CUDA tests (pytest -m cuda).
#
# Results go to $OUT (at most 8 files). Where a .whl/ folder travels with the tree (a machine without Ray,
# Hydra or jsonschema installed), they are installed into /tmp/site first; without pytest there, step 4 needs
# its wheels in .whl/ too (pip download -d .whl pytest pluggy iniconfig). Ray starts as a fresh local instance
# in every step (never one already running here). Each step has its own time limit and the script goes on
# after a step that failed; it exits with the number of steps that failed.
set -uo pipefail
OUT=${OUT:-/tmp/rayspec-gpu-run}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export RAY_DEDUP_LOGS=1
failed=0
step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, output to LOG, note a failure
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'PY'
import torch
import torch.distributed as dist
from rayspec.core.device import nccl_problem
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("torch nccl", dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.nccl.version())
print("p2p_nccl:", nccl_problem("torch", "p2p_nccl") or "ok")
print("nccl (Ray's, cupy):", nccl_problem("ray", "nccl") or "ok")
PY
} >"$OUT/env.txt" 2>&1

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cpu ]; then
  GPS=0; CHECK=(--device cpu --transports "${TRANSPORTS:-p2p,object_store,nccl}" --torch on)
elif [ "$GPUS" -ge 2 ]; then
  GPS=1; CHECK=(--device cuda)
else
  GPS=0.5; CHECK=(--device cuda)
fi

step gpu_check 330 "$OUT/gpu_check.txt" "$PY" -m benchmarks.gpu_check "${CHECK[@]}" --out "$OUT"

RUN=$(mktemp -d)
step train 150 "$OUT/train.txt" "$PY" -m rayspec.train hydra.run.dir="$RUN" ray.address=local model.size=tiny \
  pipeline.stages=2 pipeline.gpus_per_stage="$GPS" pipeline.method=spectrain train.max_steps=60 \
  train.batch_size=64 train.log_every=10 train.eval_every=20 train.train_samples=8192 train.val_samples=512 \
  checkpoint.every=20 +trace=true
cp "$RUN/summary.json" "$RUN/trace.json" "$OUT/" 2>/dev/null
ls "$RUN/checkpoints" >>"$OUT/train.txt" 2>&1
rm -rf "$RUN"

if "$PY" -c "import pytest" 2>/dev/null; then
  step pytest 120 "$OUT/pytest.txt" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py tests/test_ray_executor.py
else
  echo "pytest: not installed; add its wheels to .whl/ (pip download -d .whl pytest pluggy iniconfig)" | tee -a "$OUT/env.txt"
  failed=$((failed + 1))
fi
echo "failed steps: $failed" | tee -a "$OUT/env.txt"
exit "$failed"
