"""Prepare what tests/gpu/run.sh needs on a lent GPU machine, which can download nothing and
receives at most 64 MiB: built here, packed into tests/gpu/carry/payload.tar.xz.

    python tests/gpu/prepare.py          # then, in a session lent a device:
    run(command="bash tests/gpu/run.sh", carry=["tests/gpu/carry"])

The payload holds:
- bundles/: CUDA bundles of the tiny models, every family in every quant mode, and a synthetic
  one with Qwen2.5-0.5B's layer shapes (fewer layers, the tiny vocabulary) for speed;
- gguf/: the tiny checkpoints, for the numpy reference on the device;
- lib/: TVM's runtime libraries (the apache-tvm wheel is too big to carry; the runtime needs only
  these), and wheels/: the runtime's Python dependencies for CPython 3.12.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: tiny_gguf

from tiny_gguf import FAMILIES, Shape, write_tiny_gguf  # noqa: E402

QUANTS = ("f32", "int8", "int8int8", "int4", "gguf")  # gguf: built from the Q8_0 file
# Qwen2.5-0.5B's layers: hidden 896, 14 q / 2 kv heads of 64, intermediate 4864; 2 of its 24 (the
# payload must stay under the carry limit: a layer is ~9 MiB of int4 weights, incompressible).
SYNTHETIC = Shape(hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=4864, context=4096, layers=2)
# The runtime's imports, and the numpy reference's (gguf and what it imports).
WHEELS = (
    "apache-tvm-ffi",
    "numpy",
    "tokenizers",
    "llguidance",
    "jinja2",
    "markupsafe",
    "gguf",
    "pyyaml",
    "tqdm",
)
CARRY_LIMIT = 64 << 20


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_bundles(work: Path) -> list[dict]:
    from goinfer.compiler.build import BuildOptions, build

    (work / "gguf").mkdir()
    (work / "bundles").mkdir()
    cases = []
    for family in FAMILIES:
        for tensor_type in ("F32", "Q8_0"):
            write_tiny_gguf(work / "gguf" / f"{family}-{tensor_type}.gguf", family, tensor_type=tensor_type)
        for quant in QUANTS:
            tensor_type = "Q8_0" if quant == "gguf" else "F32"
            out = work / "bundles" / f"{family}-{quant}.giw"
            _say(f"prepare: {out.name}")
            options = BuildOptions(target="cuda", quant=quant, kv_dtype="float32", num_cores=2)
            build(work / "gguf" / f"{family}-{tensor_type}.gguf", out, options, progress=lambda _m: None)
            cases.append(
                {"family": family, "quant": quant, "bundle": out.name, "gguf": f"{family}-{tensor_type}.gguf"}
            )
    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_gguf(Path(tmp) / "synthetic.gguf", "qwen2", shape=SYNTHETIC)
        _say("prepare: synthetic-qwen2-0.5b-layers.giw (int4, float16 KV cache)")
        options = BuildOptions(target="cuda", quant="int4", num_cores=2)
        build(src, work / "bundles" / "synthetic-qwen2-0.5b-layers.giw", options, progress=lambda _m: None)
    return cases


def copy_runtime_libraries(work: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    (work / "lib").mkdir()
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(lib / name, work / "lib" / name)


def download_wheels(work: Path, python: str) -> None:
    """The same versions as here, for CPython `python` (the device's: 3.12) on x86-64 Linux."""
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    tags = ("manylinux_2_34", "manylinux_2_31", "manylinux_2_28", "manylinux_2_17", "manylinux2014")
    platforms = [x for tag in tags for x in ("--platform", f"{tag}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--python-version", python, *platforms, "-d", str(work / "wheels"), *pins]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "carry")
    ap.add_argument("--python", default="3.12", help="the device's Python (another one to try run.sh here)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        download_wheels(work, args.python)  # first: it is the step that can fail for want of a network
        copy_runtime_libraries(work)
        cases = build_bundles(work)
        (work / "cases.json").write_text(
            json.dumps({"tiny": cases, "synthetic": "synthetic-qwen2-0.5b-layers.giw"})
        )
        args.out.mkdir(parents=True, exist_ok=True)
        payload = args.out / "payload.tar.xz"
        with tarfile.open(payload, "w:xz") as tar:
            for item in sorted(work.iterdir()):
                tar.add(item, arcname=item.name)
    size = payload.stat().st_size
    _say(f"prepare: {payload} {size / 2**20:.1f} MiB (carry limit {CARRY_LIMIT >> 20} MiB)")
    if size > CARRY_LIMIT:
        sys.exit("prepare: the payload is over the carry limit")


if __name__ == "__main__":
    main()
