"""llama.cpp as the reference: built from the source that the llama-cpp-python sdist vendors.

PyPI is the one source reachable here, and the llama-cpp-python sdist carries a full llama.cpp tree
under ``vendor/llama.cpp``. ``build()`` downloads that sdist, extracts it and compiles the tools we
compare against, into ``<cache>/llama.cpp/<version>/``::

    sdist/     the downloaded .tar.gz
    src/       the extracted tree
    build/     cmake's build folder
    bin/       llama-server, llama-bench, llama-tokenize, llama-cli (self-contained: static libs)
    build-info.json

A build that already exists elsewhere (a folder holding those binaries) can be adopted instead of
compiling again: ``python -m bench.llama_cpp adopt DIR``. Its shared libraries come along, and
``llama_env`` puts ``bin/`` on ``LD_LIBRARY_PATH`` since such binaries carry absolute RUNPATHs.
Adopt only a build made with ``CMAKE_FLAGS`` (the AMX note below): nothing here can tell.

CLI: ``python -m bench.llama_cpp build | adopt DIR | which NAME | baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from goinfer.artifacts.cache import folder as cache_folder

VERSION = "0.3.36"  # llama-cpp-python; its vendored llama.cpp is what we compare against
TARGETS = ("llama-server", "llama-bench", "llama-tokenize", "llama-cli", "llama-perplexity")
# GGML_NATIVE's -march=native turns AMX on for AMX CPUs whatever GGML_AMX_* say (those apply only
# without NATIVE), and AMX tiles fault where the kernel does not grant XTILEDATA (this sandbox):
# ldtilecfg segfaults in ggml_backend_amx_mul_mat. -mno-amx-* win over -march in GCC and Clang.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    # Static libs: bin/ then holds self-contained binaries that survive the build folder.
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # The prebuilt web UI is fetched from a hub we cannot reach; skip the attempt.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
if platform.machine().lower() in ("x86_64", "amd64"):
    CMAKE_FLAGS += (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}")


def _log(msg: str) -> None:
    print(f"llama.cpp: {msg}", file=sys.stderr, flush=True)


def version_dir(version: str = VERSION, cache: Path | None = None) -> Path:
    return cache_folder("llama.cpp", cache) / version


def _complete(bin_dir: Path) -> bool:
    return all((bin_dir / t).is_file() and os.access(bin_dir / t, os.X_OK) for t in TARGETS)


def _search_dirs(cache: Path | None = None) -> list[Path]:
    """bin/ folders to look in: the pinned version first, then other cached versions, newest first."""
    root = cache_folder("llama.cpp", cache)
    dirs = [version_dir(VERSION, cache) / "bin"]
    if root.is_dir():
        others = [p / "bin" for p in root.iterdir() if p.name != VERSION]
        dirs += sorted(others, key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    dirs += sorted(
        cache_folder("dl", cache).glob("llama_cpp_python-*/vendor/llama.cpp/build/bin"), reverse=True
    )
    return dirs


def find_llama_binary(name: str, cache: Path | None = None) -> Path | None:
    """A cached, executable llama.cpp tool (``llama-server``, ...), or None when none is built."""
    for d in _search_dirs(cache):
        path = d / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def llama_env(binary: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to run ``binary`` in: its folder first on LD_LIBRARY_PATH, for adopted builds
    whose shared libraries sit beside it."""
    env = dict(os.environ if base is None else base)
    prev = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(binary.parent) + (os.pathsep + prev if prev else "")
    return env


def _run(cmd: list[str], log_path: Path, cwd: Path | None = None) -> None:
    """Run one step, its output appended to ``log_path``; on failure show the log's tail."""
    _log(f"$ {' '.join(cmd)}  (log: {log_path})")
    with log_path.open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise SystemExit("\n".join([*tail, f"llama.cpp: step failed (exit {rc}): {' '.join(cmd)}"]))


def _extract(sdist: Path, dest: Path) -> Path:
    """Extract the sdist into ``dest``; returns the vendored llama.cpp folder."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        # The "data" filter refuses links and paths that escape `tmp`; older Pythons lack it.
        if hasattr(tarfile, "data_filter"):
            tf.extractall(tmp, filter="data")
        else:
            tf.extractall(tmp)
    (top,) = [p for p in tmp.iterdir() if p.is_dir()]
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(top, dest)
    shutil.rmtree(tmp, ignore_errors=True)
    src = dest / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise SystemExit(f"llama.cpp: {sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
    return src


def _tool_version(binary: Path) -> str:
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, env=llama_env(binary)
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return " ".join((proc.stdout + proc.stderr).split())


def _write_info(vdir: Path, **info: object) -> None:
    info = {
        "llama_cpp_python": vdir.name,
        "llama_cpp": _tool_version(vdir / "bin" / "llama-server"),
        "machine": platform.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **info,
    }
    (vdir / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")


def _install_bins(from_dir: Path, vdir: Path) -> Path:
    """Copy the built tools (and any shared libs beside them) into ``vdir/bin`` atomically."""
    staged = vdir / "bin.partial"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for p in from_dir.iterdir():
        if p.is_symlink() and ".so" in p.name:
            os.symlink(os.readlink(p), staged / p.name)  # keep libfoo.so -> libfoo.so.0 links as links
        elif p.name in TARGETS or ".so" in p.name:
            shutil.copy2(p, staged / p.name)
    if not _complete(staged):
        raise SystemExit(f"llama.cpp: {from_dir} lacks some of {', '.join(TARGETS)}")
    bin_dir = vdir / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)
    os.replace(staged, bin_dir)
    return bin_dir


def adopt(build_bin: Path, version: str = VERSION, cache: Path | None = None) -> Path:
    """Take an existing build's bin/ folder into the cache instead of compiling again."""
    vdir = version_dir(version, cache)
    vdir.mkdir(parents=True, exist_ok=True)
    bin_dir = _install_bins(build_bin, vdir)
    _write_info(vdir, adopted_from=str(build_bin))
    _log(f"adopted {build_bin} -> {bin_dir}")
    return bin_dir


def build(version: str = VERSION, cache: Path | None = None, jobs: int | None = None) -> Path:
    """Download, extract and compile; returns the bin/ folder. A no-op when it is already built."""
    vdir = version_dir(version, cache)
    bin_dir = vdir / "bin"
    if _complete(bin_dir):
        _log(f"already built: {bin_dir}")
        return bin_dir
    # A finished build inside an already extracted sdist (an earlier manual run): take it as is.
    for done in sorted(
        cache_folder("dl", cache).glob(f"llama_cpp_python-{version}/vendor/llama.cpp/build/bin")
    ):
        if _complete(done):
            return adopt(done, version, cache)
    for cmd in ("cmake", "c++"):
        if shutil.which(cmd) is None:
            raise SystemExit(f"llama.cpp: building needs `{cmd}` on PATH")
    vdir.mkdir(parents=True, exist_ok=True)
    log_path = vdir / "build.log"
    t0 = time.monotonic()

    sdist_dir = vdir / "sdist"
    sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        _log(f"downloading the llama-cpp-python {version} sdist")
        sdist_dir.mkdir(exist_ok=True)
        _run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                *("--no-cache-dir", "--disable-pip-version-check", "-d", str(sdist_dir)),
                f"llama-cpp-python=={version}",
            ],
            log_path,
        )
        sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise SystemExit(f"llama.cpp: pip left no sdist in {sdist_dir}")

    src = vdir / "src" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        _log(f"extracting {sdists[-1].name}")
        src = _extract(sdists[-1], vdir / "src")

    build_dir = vdir / "build"
    jobs = jobs or os.cpu_count() or 2
    _log("configuring (cmake)")
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], log_path)
    _log(f"compiling {', '.join(TARGETS)} with {jobs} jobs (tens of minutes on 2 cores)")
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], log_path)
    _install_bins(build_dir / "bin", vdir)
    _write_info(vdir, cmake_flags=list(CMAKE_FLAGS), seconds=round(time.monotonic() - t0))
    _log(f"built {bin_dir} in {time.monotonic() - t0:.0f} s")
    return bin_dir


def baseline(model: str, out: Path, threads: int = 2) -> Path:
    """``llama-bench -p 512 -n 128`` on a zoo model, written to ``out`` with the load it ran under."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from goinfer.compiler.sources import zoo

    gguf = zoo.fetch(model)
    binary = find_llama_binary("llama-bench")
    if binary is None:
        raise SystemExit("llama.cpp: llama-bench is not built; run `python -m bench.llama_cpp build`")
    args = ["-t", str(threads), "-p", "512", "-n", "128", "-o", "json"]
    load_before = os.getloadavg()
    _log(f"llama-bench {' '.join(args)} on {model} (a minute or two)")
    proc = subprocess.run(
        [str(binary), "-m", str(gguf), *args], capture_output=True, text=True, env=llama_env(binary)
    )
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp: llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    results = json.loads(proc.stdout)
    # Median and best of the repetitions: on a shared machine one disturbed run drags the mean far
    # off, and the best run is the closest to an idle machine.
    summary: dict[str, float] = {}
    for r in results:
        test = f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']}"
        summary[f"{test}_tok_s_median"] = statistics.median(r["samples_ts"])
        summary[f"{test}_tok_s_max"] = max(r["samples_ts"])
    report = {
        "model": model,
        "gguf_sha256": zoo.ZOO[model].sha256,
        "command": ["llama-bench", "-m", "<gguf>", *args],
        "llama_cpp": _tool_version(binary),
        "cpu": cpu_name(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "summary": summary,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"{summary} -> {out}")
    return out


def cpu_name() -> str:
    """The CPU's model name, for the JSON a benchmark writes."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, extract and compile (no-op when cached)")
    b.add_argument("--version", default=VERSION, help="llama-cpp-python version whose llama.cpp to build")
    b.add_argument("-j", "--jobs", type=int, default=None)
    a = sub.add_parser("adopt", help="copy an existing build's bin/ folder into the cache")
    a.add_argument("bin_dir", type=Path)
    a.add_argument("--version", default=VERSION)
    w = sub.add_parser("which", help="print the cached path of a tool")
    w.add_argument("name", choices=TARGETS)
    r = sub.add_parser("baseline", help="llama-bench a zoo model and save the numbers")
    r.add_argument("--model", default="qwen2.5-coder-0.5b")
    r.add_argument("-t", "--threads", type=int, default=2)
    r.add_argument(
        "-o", "--output", type=Path, default=Path(__file__).parent / "results" / "llama_bench_baseline.json"
    )
    args = ap.parse_args(argv)
    if args.cmd == "baseline":
        print(baseline(args.model, args.output, args.threads))
    elif args.cmd == "build":
        print(build(args.version, jobs=args.jobs))
    elif args.cmd == "adopt":
        print(adopt(args.bin_dir, args.version))
    else:
        path = find_llama_binary(args.name)
        if path is None:
            print(
                f"llama.cpp: {args.name} is not built; run `python -m bench.llama_cpp build`", file=sys.stderr
            )
            return 1
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
