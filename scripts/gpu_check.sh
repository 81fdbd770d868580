#!/usr/bin/env bash
# The GPU target on one CUDA GPU, in under 8 minutes: the Triton kernels' numerics tests compiled
# for the device (the same tests that run interpreted on a CPU; with CUDA present they run on
# it), the GPU plans' model-vs-simulator tests, then the quick GPU bench (fp16: GEMM chains vs two
# torch.bmm, attention vs SDPA flash / torch.compile, an MLP vs F.linear/gelu/F.linear).
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # needs torch with CUDA and triton==3.9.0
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-out-gpu}"
PYTHON="${PYTHON:-python}"
unset TRITON_INTERPRET CHAINFUSE_BACKEND
"$PYTHON" -c 'import torch, triton, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "triton", triton.__version__, "cuda", ok, torch.cuda.get_device_name(0) if ok else ""); sys.exit(0 if ok else 1)' \
    || { echo "gpu_check: no CUDA device (or torch/triton missing)" >&2; exit 2; }
start=$SECONDS
timeout 180 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/gpu tests/unit/test_gpu_plan.py
echo "gpu_check: tests $((SECONDS - start)) s"
start=$SECONDS
timeout 270 "$PYTHON" -m chainfuse bench --device cuda --quick --dtype fp16 --out "$out"
echo "gpu_check: bench $((SECONDS - start)) s; results in $out/results-gpu.json"
