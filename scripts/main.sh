#!/usr/bin/env bash
# The main job: plan, compile and run a paper workload on this CPU, check it against the float64
# reference, and print the plan and the speedup over PyTorch/numpy (arguments go to the demo);
# then the quick benchmark of every suite (~2 minutes), which writes bench-out/report.md, the
# plots and results.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m chainfuse.bench.demo "$@"
echo
echo "==== chainfuse bench all --quick --out bench-out ===="
python -m chainfuse bench all --quick --out bench-out
