#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU (the device machine, or yours):
#   1. what the machine has (nvidia-smi) and what torch sees (CUDA build? bf16?);
#   2. tests/gpu: Ray Train's NCCL/gloo choice, fp16 GradScaler + bf16 autocast, the debug
#      pipeline on GPU with use_gpu auto and bf16 / fp16 stages, 2 GPU workers + SyncBatchNorm
#      (when there are 2 GPUs), the feature cache computed by GPU tasks, batched-sweep replicas
#      on CUDA (their configs' weights; one device copy of the frozen upstream for all of them);
#   3. the debug pipeline as a user runs it, with a bf16 features stage, printing test_accuracy;
#   4. GPU step throughput of run_stage vs a bare PyTorch loop (benchmarks/bench_step.py
#      --device cuda: the demo's first stage on Fashion-MNIST, which must be installed).
# Prints one RESULT line per part and exits non-zero if any failed.
#
#   bash scripts/gpu_check.sh                  # python: $PYTHON, else .venv/bin/python, else python3
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || true
[ -n "$PY" ] || PY=$(command -v python3)
export PATH="$(dirname "$PY"):$PATH"
failed=0
result() { echo "RESULT $1: $2"; [ "$2" = ok ] || failed=1; }

echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "(no nvidia-smi)"
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}), cuda available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
EOF
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  result torch-cuda "FAILED: torch cannot use a GPU here (a CPU build of torch, or no GPU): install a CUDA build of torch into $PY's environment"
  exit 1
fi
result torch-cuda ok

echo "== tests/gpu"
if "$PY" -m pytest -q -rA -p no:cacheprovider tests/gpu; then result tests/gpu ok; else result tests/gpu FAILED; fi

echo "== debug pipeline, bf16 features stage, use_gpu auto"
out=$(mktemp -d /tmp/cascade-gpu-check-XXXXXX)
if "$PY" pipelines/three_stage.py --config pipelines/configs/debug.yaml storage_path="$out/runs" \
    stages.features.solver.precision=bf16 stages.encoder.scaling.num_workers=1 2>&1 | tee "$out/log" \
    | grep -E "use_gpu auto|trained|test_accuracy="; then
  grep -q "^test_accuracy=" "$out/log" && result bf16-pipeline ok || result bf16-pipeline FAILED
else
  tail -30 "$out/log"
  result bf16-pipeline FAILED
fi
rm -rf "$out"

echo "== GPU step throughput: run_stage vs a bare loop (bench_step.py --device cuda)"
if "$PY" benchmarks/bench_step.py --device cuda --repeats 3 2>&1 | tee "$out.bench"; then
  grep -q "^P1 target" "$out.bench" && result gpu-step-throughput ok || result gpu-step-throughput FAILED
else
  result gpu-step-throughput FAILED
fi
rm -f "$out.bench"
exit $failed
