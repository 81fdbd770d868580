#!/usr/bin/env bash
# The tests: unit, numerics, golden and e2e (pyproject deselects the `slow` marker; add `-m slow`
# to run only those). Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest -q "$@"
