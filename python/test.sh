#!/usr/bin/env bash
# The Python package's checks and tests: builds symmem._native into the Python named by
# SYMMEM_TORCH_PYTHON (a venv with torch, maturin, pytest and numpy; .ci/run makes one) and runs
# pytest. Without it, says SKIPPED and succeeds, so the README's test command works anywhere.
set -euo pipefail
cd "$(dirname "$0")"
cargo fmt --check
PY="${SYMMEM_TORCH_PYTHON:-}"
if [ -z "$PY" ] || ! "$PY" -c "import torch, maturin, pytest, numpy" >/dev/null 2>&1; then
    echo "SKIPPED python tests: set SYMMEM_TORCH_PYTHON to a venv python with torch, maturin, pytest and numpy"
    exit 0
fi
VENV="$(cd "$(dirname "$PY")/.." && pwd)"
PYO3_PYTHON="$PY" cargo clippy --locked -- -D warnings
VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" maturin develop --release --locked -q
"$PY" -m pytest -q tests
