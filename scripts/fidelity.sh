#!/usr/bin/env bash
# The model's fidelity before and after a change: the same bench run from a clone of REF (default
# main) and from this tree, each holding the bench lock, then the per-suite table (mean Spearman
# rho of each workload's top-10 plans, mean tuning gap) of the two. Arguments go to both runs:
#   bash scripts/fidelity.sh                       # every suite, every workload (~30 min quiet)
#   REF=main bash scripts/fidelity.sh gemm-chain --quick
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"  # one with chainfuse's dependencies (scripts/setup.sh makes .venv's)
ref="${REF:-main}"
out="${OUT:-$here/bench-out/fidelity}"
lock="${BENCH_LOCK:-/tmp/chainfuse-bench.lock}"  # (one benchmark at a time on this machine)
before="$(mktemp -d)"
trap 'rm -rf "$before"' EXIT
git -C "$here" worktree add --detach "$before/tree" "$ref" >/dev/null
trap 'git -C "$here" worktree remove --force "$before/tree"; rm -rf "$before"' EXIT
args=("${@:-all}" --top 10 --threads 1 --between relu)
run() {  # tree, output directory
    (cd "$1" && flock "$lock" env PYTHONPATH="$1" "$py" -m chainfuse bench "${args[@]}" --out "$2")
}
run "$before/tree" "$out/before"
run "$here" "$out/after"
PYTHONPATH="$here" "$py" -m chainfuse.bench.fidelity \
    --compare "$out/before/results.json" "$out/after/results.json"
