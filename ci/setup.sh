#!/usr/bin/env bash
# Idempotent installer: a venv (shared across clones) with this clone installed editable, plus test deps.
# Needs only python3 (3.10+) with venv/pip and PyPI. Safe to re-run; fast when nothing changed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GOINFER_VENV:-$HOME/.cache/goinfer/venv}"
log() { echo "setup: $*" >&2; }

if [[ ! -x "$venv/bin/python" ]]; then
  log "creating venv at $venv"
  mkdir -p "$(dirname "$venv")"
  # Debian-like systems without python3-venv lack ensurepip: make the venv bare, then bring pip in
  # with the system pip (its --python option installs into another interpreter).
  if ! python3 -m venv "$venv" 2>/dev/null; then
    log "python3 -m venv failed (no ensurepip?); bootstrapping pip with the system pip"
    rm -rf "$venv"
    python3 -m venv --without-pip "$venv"
    python3 -m pip --python "$venv/bin/python" install --quiet pip
  fi
else
  log "reusing venv at $venv"
fi

log "upgrading pip"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip

# --cuda adds what building CUDA bundles without nvcc needs (NVRTC, 135 MB); running them needs
# only libcudart, which the test extras bring.
extras="test"
if [[ "${1:-}" == "--cuda" ]]; then extras="test,cuda,cuda-build"; fi

# Re-run every time: the venv may be shared, and this points the editable install at this clone.
log "installing $repo [$extras] (editable)"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$repo[$extras]"

# A wheel install compiles the modules to bytecode; an editable one leaves that to the first import,
# which cannot write it where PYTHONDONTWRITEBYTECODE is set (CI, sandboxes), so every start
# compiled the runtime again: ~25 ms of a cold start (our modules: 20-26 ms to import, 42-53
# without their bytecode; -X importtime).
log "compiling the package to bytecode"
"$venv/bin/python" -m compileall -q "$repo/artifacts" "$repo/compiler" "$repo/runtime" "$repo/serve"

# The web page's browser test drives the Chromium Debian packages (Playwright's own browser download
# is not used). Installed here where it is missing and apt-get can run; otherwise that test says why
# it skips.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  sudo=""
  if [[ "$(id -u)" != 0 ]] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fi
  if command -v apt-get >/dev/null 2>&1 && { [[ "$(id -u)" == 0 ]] || [[ -n "$sudo" ]]; }; then
    log "installing chromium with apt-get (for tests/e2e/test_web_browser.py)"
    apt() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq "$@" >/dev/null 2>&1; }
    if ! apt install -y chromium; then
      apt update || true  # a fresh image's package lists may be empty or stale
      apt install -y chromium || log "apt-get could not install chromium: the browser test will skip"
    fi
  else
    log "no chromium, and no apt-get run as root to install it: the browser test will skip"
  fi
fi

log "ready: $venv/bin/goinfer"
