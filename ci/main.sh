#!/usr/bin/env bash
# The main job on a fresh clone: install, then generate with the default zoo model.
# The first run fetches the model and builds its bundle (cached under ~/.cache/goinfer); later runs reuse both.
# Extra arguments go to `goinfer generate` (e.g. --max-tokens 64 --temperature 0).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup.sh
venv="${GOINFER_VENV:-$HOME/.cache/goinfer/venv}"
export PATH="$venv/bin:$PATH"

exec goinfer generate qwen2.5-coder-0.5b "Write a Python function that reverses a string." --chat "$@"
