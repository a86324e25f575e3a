"""Schedules. On a CPU every kernel gets its loops parallelised across cores; none runs as written.
On a GPU, dlight's rules schedule the plain kernels of a GPU graph (`gpu_rules`).

- QuantMatmul: our quantized matmuls (block "qmatmul"): output rows split across cores, K innermost
  and read in storage order, so a weight is streamed once, dequantized in registers.
- SmallSerial: static, small kernels (a decode step's norms, adds, RoPE) stay serial.
- dlight's CPU rules for norms and softmax-like reductions.
- ParallelFallback: anything left (elementwise, gathers, small reductions) runs its outer spatial
  loop in parallel, so no kernel is left serial and unscheduled.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

ROW_TILE = 16  # output rows per parallel task
# Loop iterations below which a kernel is not worth a parallel launch: this schedule's, and the
# hand-written norm and KV-copy kernels' (kernels/norm.py, kernels/kv_append.py).
SERIAL_MAX = 8192


def _blocks(sch: s_tir.Schedule) -> list:
    return sch.get_child_blocks(sch.get_sblock("root") if _has_root(sch) else None)


def _has_root(sch: s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
    except Exception:
        return False
    return True


def _root_schedule(func) -> s_tir.Schedule | None:
    """A schedule of a PrimFunc with a root block (what the generic rules work on), else None."""
    if not isinstance(func, tirx.PrimFunc):
        return None
    sch = s_tir.Schedule(func)
    return sch if _has_root(sch) else None


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _parallel_outer(sch: s_tir.Schedule, block) -> None:
    """Fuse the leading spatial loops of a block and run them in parallel."""
    loops = sch.get_loops(block)
    if not loops:
        return
    stmt = sch.get(block)
    n_spatial = 0
    for iv in stmt.iter_vars:
        if iv.iter_type != tirx.IterVar.DataPar:
            break
        n_spatial += 1
    lead = loops[: max(1, min(n_spatial, len(loops)))]
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    sch.parallel(fused)


def _try_reverse_compute_at(sch: s_tir.Schedule, block, loop) -> bool:
    """Fuse an epilogue under `loop` when all its producers live there (int8: yes)."""
    try:
        sch.reverse_compute_at(block, loop)
    except s_tir.ScheduleError:
        return False
    return True


class QuantMatmul(dlight.ScheduleRule):
    """Our te matmuls (block "qmatmul", reduction split as (word, lane) by kernels/lanes.py).

    One accumulator per lane (rfactor), kept in registers; a task of ROW_TILE output rows per
    core; K streamed in storage order. The lane loop is unrolled so LLVM vectorizes it.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        try:
            mm = sch.get_sblock("qmatmul")
        except Exception:
            return None
        _i, _n, _ko, ki = sch.get_loops(mm)
        rf = sch.rfactor(ki, 2)
        i, n, lane_sum = sch.get_loops(mm)
        no, ni = sch.split(n, [None, ROW_TILE])
        sch.reorder(no, i, ni, lane_sum)
        sch.parallel(no)
        sch.compute_at(rf, ni)
        sch.set_scope(rf, 0, "local")
        *_, lane, word = sch.get_loops(rf)
        sch.reorder(word, lane)
        sch.decompose_reduction(rf, word)
        sch.unroll(lane)
        for block in _blocks(sch):
            name = sch.get(block).name_hint
            if name in ("qmatmul", "qmatmul_rf") or name.startswith("qmatmul_rf"):
                continue
            if name == "qmatmul_scale" and _try_reverse_compute_at(sch, block, ni):
                continue
            # Anything else in the function (an unfused epilogue): in parallel.
            _parallel_outer(sch, block)
        return sch


class SmallSerial(dlight.ScheduleRule):
    """A kernel whose loops are all static and small runs as written, on the calling thread: one
    decode step's norms, residual adds and RoPE are a few thousand elements, less work than
    waking the thread pool and waiting for its slowest thread."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        sch = _root_schedule(func)
        if sch is None or any(_static_extent(sch, b) > SERIAL_MAX for b in _blocks(sch)):
            return None
        return sch


def _static_extent(sch: s_tir.Schedule, block) -> float:
    """Iterations of a block's loop nest; infinite when any loop's extent is symbolic."""
    extent = 1
    for loop in sch.get_loops(block):
        n = sch.get(loop).extent
        if not isinstance(n, tirx.IntImm):
            return float("inf")
        extent *= int(n)
    return extent


class ParallelFallback(dlight.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        sch = _root_schedule(func)
        if sch is None:
            return None
        for block in _blocks(sch):
            _parallel_outer(sch, block)
        return sch


def cpu_rules() -> list[dlight.ScheduleRule]:
    return [QuantMatmul(), SmallSerial(), dlight.cpu.Reduction(), dlight.cpu.GEMV(), ParallelFallback()]


class DecodeGEMV(dlight.ScheduleRule):
    """A GPU decode step's dequant-fused GEMV: kernels/device.linear for one token (block
    "matmul" over (token, row, k), the token axis of extent 1).

    dlight's GEMV takes neither of our packed layouts: they store [row block, k word, row], k
    outside the 16 rows of a block, which it reads as an outer reduction it does not schedule,
    and a per-row scale counts for it as a second vector. Here: a thread block per ROWS rows,
    one row a thread on threadIdx.x (the ROWS words of one k are adjacent: one 64-byte read), K
    split over K_THREADS threads on threadIdx.y, each walking whole words (K_WORD values) with its
    partial sum in a register, then one cross-thread sum. The dequantization is inlined: the
    weights are read once, packed, and never written out.
    """

    ROWS = 16  # kernels/rowblock.ROW_BLOCK: the rows the packed layouts interleave
    K_THREADS = 16
    K_WORD = 8  # values a thread takes at a time: one int4 word, two int8 words

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name == "llvm":
            return None
        sch = s_tir.Schedule(func)
        try:
            block = sch.get_sblock("matmul")
        except Exception:
            return None
        loops = sch.get_loops(block)
        extents = [sch.get(loop).extent for loop in loops]
        if len(loops) != 3 or not all(isinstance(e, tirx.IntImm) for e in extents):
            return None
        tokens, rows, depth = (int(e) for e in extents)
        if tokens != 1 or rows % self.ROWS or depth % (self.K_THREADS * self.K_WORD):
            return None
        for producer in _blocks(sch):  # the dequantization and casts, into the dot product
            if sch.get(producer).name_hint != "matmul":
                sch.compute_inline(producer)
        token, row, k = sch.get_loops(block)
        row_block, row = sch.split(row, [None, self.ROWS])
        _ko, kt, _ki = sch.split(k, [None, self.K_THREADS, self.K_WORD])
        partial = sch.rfactor(kt, 0)
        token, row_block, row, kt = sch.get_loops(block)
        sch.bind(sch.fuse(token, row_block), "blockIdx.x")
        sch.bind(row, "threadIdx.x")
        sch.bind(kt, "threadIdx.y")
        sch.compute_at(partial, row)
        sch.set_scope(partial, 0, "local")
        kt_rf, ko_rf, _ki_rf = sch.get_loops(partial)[-3:]
        sch.bind(kt_rf, "threadIdx.y")
        sch.decompose_reduction(partial, ko_rf)
        return sch


class _Tolerant(dlight.ScheduleRule):
    """A dlight rule whose analysis may assert on a kernel it does not model (its GEMV check
    asserts every read is one element; a K-quant's two high-bit planes are two reads of one
    buffer): that means the rule does not apply, and the next one is tried."""

    def __init__(self, rule: dlight.ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except (AssertionError, s_tir.ScheduleError):
            return None


def gpu_rules() -> list[dlight.ScheduleRule]:
    """Decode's dequant-fused GEMV (ours, above), then dlight's GPU rules: a prefill matmul on
    tensor cores (float16 operands, sm_70+), the norms' reductions; anything else is bound to
    threads by Fallback. Kernels the KV cache brings are scheduled already."""
    gpu = dlight.gpu
    stock = [gpu.Matmul(), gpu.GEMV(), gpu.LowBatchGEMV(), gpu.Reduction(), gpu.GeneralReduction()]
    return [DecodeGEMV(), *(_Tolerant(rule) for rule in stock), gpu.Fallback()]


def rules_for(kind: str) -> list[dlight.ScheduleRule]:
    return cpu_rules() if kind == "llvm" else gpu_rules()
