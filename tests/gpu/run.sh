#!/usr/bin/env bash
# On a lent GPU machine (see tests/gpu/prepare.py, which builds what this needs, here):
#   run(command="bash tests/gpu/run.sh", carry=["tests/gpu/carry"])
# Unpacks the payload, installs the carried wheels into a private site folder, points the runtime
# at the carried TVM libraries, and runs tests/gpu/device_check.py. Its JSON lands in $OUT (the
# device tool's output folder) or bench/results/; copy it to bench/results/cuda-h200.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
repo="$PWD"
work="${TMPDIR:-/tmp}/goinfer-gpu"
rm -rf "$work" && mkdir -p "$work/site/goinfer" "$work/site/tvm"
tar -xJf "${PAYLOAD:-tests/gpu/carry/payload.tar.xz}" -C "$work"
# A wheel is a zip: extracting it is installing it (no pip, no network).
python3 - "$work" <<'PY'
import glob, sys, zipfile
work = sys.argv[1]
for wheel in sorted(glob.glob(f"{work}/wheels/*.whl")):
    zipfile.ZipFile(wheel).extractall(f"{work}/site")
PY
# The runtime finds libtvm_runtime in <the tvm package>/lib: a namespace package with only that.
mv "$work/lib" "$work/site/tvm/lib"
touch "$work/site/goinfer/__init__.py"
for part in runtime artifacts; do ln -s "$repo/$part" "$work/site/goinfer/$part"; done
out="${OUT:-$repo/bench/results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
PYTHONPATH="$work/site:$repo/tests" python3 tests/gpu/device_check.py "$work" --json "$out/cuda-h200.json"
