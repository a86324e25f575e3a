"""The machine's read bandwidth: one parallel TVM kernel summing a 400 MB buffer, best of a few.

The roofline for decode is bytes-per-token / this. Run it with TVM_NUM_THREADS set to the thread
count being compared (python -m bench.bandwidth prints GB/s; `--mb N` reads an N MB buffer instead:
a model's size, where a large last-level cache holds part of it between passes).
"""

from __future__ import annotations

import time

import numpy as np

BYTES = 400_000_000
CHUNK = 4096  # floats per parallel task


def read_bandwidth_gbs(repeats: int = 5, nbytes: int = BYTES) -> float:
    import tvm
    from goinfer.compiler.tvm.targets import host_target
    from tvm.script import tirx as T

    n = max(1, nbytes // 4 // CHUNK) * CHUNK

    @T.prim_func
    def read(a: T.Buffer((n,), "float32"), out: T.Buffer((n // CHUNK, 16), "float32")):
        T.func_attr({"tirx.noalias": True, "global_symbol": "main"})
        for c in T.parallel(n // CHUNK):
            acc = T.alloc_buffer((4, 16), "float32")  # four independent sums: no add-latency chain
            for q in T.unroll(4):
                acc[q, T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for j in T.serial(CHUNK // 64):
                for q in T.unroll(4):
                    acc[q, T.ramp(0, 1, 16)] = (
                        acc[q, T.ramp(0, 1, 16)] + a[T.ramp(c * CHUNK + j * 64 + q * 16, 1, 16)]
                    )
            out[c, T.ramp(0, 1, 16)] = (
                acc[0, T.ramp(0, 1, 16)]
                + acc[1, T.ramp(0, 1, 16)]
                + acc[2, T.ramp(0, 1, 16)]
                + acc[3, T.ramp(0, 1, 16)]
            )

    lib = tvm.compile(tvm.IRModule({"main": read}), tvm.target.Target(host_target()))
    a = tvm.runtime.tensor(np.ones(n, np.float32))
    o = tvm.runtime.tensor(np.zeros((n // CHUNK, 16), np.float32))
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        lib["main"](a, o)
        best = max(best, n * 4 / (time.perf_counter() - t) / 1e9)
    return best


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.bandwidth")
    ap.add_argument("--mb", type=float, default=BYTES / 1e6, help="buffer size in MB (default 400)")
    print(f"{read_bandwidth_gbs(nbytes=int(ap.parse_args().mb * 1e6)):.2f}")
