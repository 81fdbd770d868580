#!/usr/bin/env bash
# The AMX checks in one command. On a host whose CPU and kernel allow AMX: the real-vs-emulated
# bit-exact tests (TDPBF16PS vectors on the unit, generated kernels on the unit against their
# emulated build), the AMX micro-kernel against the TDPBF16PS probe, then the AMX speed lines
# (bf16 GEMM chains vs torch.bmm x 2, attention vs SDPA, BERT/ViT-base MLPs vs F.linear/gelu/
# F.linear, ResNet-50's 1x1 -> 3x3 chains vs F.conv2d/relu/F.conv2d, weights packed once and per
# call; 1 and 2 threads, interleaved, % of the AMX peak) as one table. Elsewhere: says there is
# no AMX, runs the emulated correctness smoke and exits 0. Arguments go to the speed lines.
#
#   bash scripts/amx_check.sh                      # everything this host can run
#   bash scripts/amx_check.sh --rounds 25 --out amx.json
#   bash scripts/amx_check.sh --smoke              # tiny shapes through the emulation, any host
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -x "$root/.venv/bin/python" && -z "${VIRTUAL_ENV:-}" && -z "${PYTHON:-}" ]]; then
    # shellcheck disable=SC1091
    source "$root/.venv/bin/activate"
fi
py="${PYTHON:-python}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

if [[ "${1:-}" == "--smoke" ]]; then
    CHAINFUSE_AMX=emulate "$py" -m chainfuse.bench.amx_check --smoke
    exit 0
fi

echo "==== chainfuse hw ===="
"$py" -m chainfuse hw | grep '^AMX'
if ! "$py" -c 'from chainfuse.kernels.amx import amx_status; raise SystemExit(not amx_status()[0])'
then
    echo "no AMX on this host: the AMX speed lines are not measured here."
    echo "==== emulated correctness smoke ===="
    CHAINFUSE_AMX=emulate "$py" -m chainfuse.bench.microkernel --isa amx --emulate --kc 64
    CHAINFUSE_AMX=emulate "$py" -m chainfuse.bench.amx_check --smoke
    exit 0
fi

echo "==== real vs emulated, bit for bit ===="
"$py" -m pytest -q tests/unit/test_amx_emulation.py tests/numerics/test_amx.py
echo "==== the AMX micro-kernel against the TDPBF16PS probe ===="
CHAINFUSE_AMX=auto "$py" -m chainfuse.bench.microkernel --isa amx
echo "==== the AMX speed lines (CHAINFUSE_AMX=auto) ===="
CHAINFUSE_AMX=auto "$py" -m chainfuse.bench.amx_check --threads 1,2 "$@"
