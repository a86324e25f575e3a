#!/usr/bin/env bash
# The whole suite: install, lint, then every test (the slow tier fetches the real models via the zoo).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup.sh
venv="${GOINFER_VENV:-$HOME/.cache/goinfer/venv}"
export PATH="$venv/bin:$PATH"

echo "test: ruff check ." >&2
ruff check .
echo "test: pytest" >&2
exec python -m pytest -q "$@"
