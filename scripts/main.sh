#!/usr/bin/env bash
# The main job: plan, compile and run a paper workload on this CPU, check it against the float64
# reference, and print the plan and the speedup over PyTorch/numpy. Arguments go to the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m chainfuse.demo "$@"
