# shellcheck shell=bash
# Sourced by scripts/main.sh and scripts/test.sh (and .ci/run): create the virtual environment
# .venv at the repository root if it is missing, install chainfuse (editable, with its dev tools
# and the benchmark's plotting) and PyTorch 2.13.0 into it, and activate it. A second run reuses
# .venv and skips the installs while pyproject.toml is unchanged and the packages still import.
#
#   PYTHON=python3.11 bash scripts/test.sh    # choose the interpreter that creates .venv
#   CHAINFUSE_VENV=/elsewhere bash scripts/test.sh
set -euo pipefail

CHAINFUSE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHAINFUSE_VENV="${CHAINFUSE_VENV:-$CHAINFUSE_ROOT/.venv}"
CHAINFUSE_TORCH="torch==2.13.0"  # the CPU build available here; not a newer (CUDA, multi-GB) one

_setup_log() { echo "setup: $*" >&2; }

if [[ ! -x "$CHAINFUSE_VENV/bin/python" ]]; then
    _python="${PYTHON:-python3}"
    if ! "$_python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        _setup_log "chainfuse needs Python >= 3.11; $_python is $("$_python" -V 2>&1)"
        _setup_log "set PYTHON=/path/to/python3.11 and run again"
        exit 1
    fi
    _setup_log "creating $CHAINFUSE_VENV with $("$_python" -V 2>&1)"
    "$_python" -m venv "$CHAINFUSE_VENV"
fi
# keep the environment out of git even without a .gitignore entry (Python >= 3.13 does this too)
[[ -f "$CHAINFUSE_VENV/.gitignore" ]] || echo '*' > "$CHAINFUSE_VENV/.gitignore"

# shellcheck disable=SC1091
source "$CHAINFUSE_VENV/bin/activate"

_stamp="$CHAINFUSE_VENV/.chainfuse-setup"
_want="$(sha256sum "$CHAINFUSE_ROOT/pyproject.toml" | cut -d' ' -f1) $CHAINFUSE_TORCH"
if [[ -f "$_stamp" && "$(cat "$_stamp")" == "$_want" ]] \
    && python -c 'import chainfuse, torch, pytest, ruff, mypy, matplotlib, transformers' 2>/dev/null; then
    _setup_log "reusing $CHAINFUSE_VENV"
else
    _setup_log "installing $CHAINFUSE_TORCH and chainfuse[dev,bench] into $CHAINFUSE_VENV"
    python -m pip install --no-input --quiet "$CHAINFUSE_TORCH"
    python -m pip install --no-input --quiet -e "$CHAINFUSE_ROOT[dev,bench]"
    python -c 'import chainfuse, torch; print("setup: chainfuse", chainfuse.__version__, "torch", torch.__version__)' >&2
    echo "$_want" > "$_stamp"
fi
cd "$CHAINFUSE_ROOT"
