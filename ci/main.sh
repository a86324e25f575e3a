#!/usr/bin/env bash
# The main job on a fresh clone: install, then serve the default zoo model over the OpenAI API on
# http://127.0.0.1:8080/v1. The first run fetches the model and builds its bundle (cached under
# ~/.cache/goinfer); later runs reuse both. Extra arguments go to `goinfer serve` (e.g. --api-key K).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup.sh
venv="${GOINFER_VENV:-$HOME/.cache/goinfer/venv}"
export PATH="$venv/bin:$PATH"

exec goinfer serve --addr 127.0.0.1:8080 "$@"
