"""From a Relax module or TIR kernels to a shared library: the lowering pipeline, and libraries
exported reproducibly. Written against TVM 0.27.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from . import passes, targets


def compile_module(mod: tvm.IRModule, target: Target, schedule_rules: list[dlight.ScheduleRule]):
    """Lower a Relax module for a CPU target and build it into an executable."""

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = passes.specialize(mod, target)
        pipeline_passes = [
            relax.backend.DispatchSampling(),
            relax.backend.DispatchSortScan(),
            relax.transform.LegalizeOps(),
            # Reshapes become views before fusion: fused, a chain of them (a linear's 2-D view of
            # a 3-D activation and back) was a copy kernel with a temporary, 3 a decode layer.
            relax.transform.RewriteDataflowReshape(),
            relax.transform.RemoveRedundantReshape(),  # a chain of views: one view
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
            dlight.ApplyDefaultSchedule(*schedule_rules),
            *([passes.cap_lanes(targets.METAL_MAX_LANES)] if target.kind.name == "metal" else []),
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
            relax.transform.StaticPlanBlockMemory(),
            relax.transform.LowerAllocTensor(),
            relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(),
            relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(),
            passes.order_shape_funcs(),
            relax.transform.AttachGlobalSymbol(),
        ]
        with target:
            return tvm.transform.Sequential(pipeline_passes)(mod)

    with target, targets.cuda_compiler() if target.kind.name == "cuda" else contextlib.nullcontext():
        return tvm.compile(mod, target, relax_pipeline=pipeline)


# Linked with an explicit content-derived build id: toolchains that default to none or to a random
# one would otherwise differ from the ones (Debian's gcc) that pass sha1.
_LINK_OPTIONS = ["-Wl,--build-id=sha1"]


def export_library(executable, path: str) -> None:
    """A shared library; for a path ending .tar, the unlinked objects (Metal: the host code is
    arm64 Mach-O, linked on the Mac that loads it), as a reproducible tar (`_reproducible_tar`).
    The same module exported twice, in two processes, gives the same bytes."""
    if path.endswith(".tar"):
        executable.export_library(path, fcompile=_reproducible_tar)
    else:
        executable.export_library(path, options=_LINK_OPTIONS)


def _reproducible_tar(output: str, files: list[str]) -> None:
    """`files` in an uncompressed tar at `output`, by base name in sorted order, with no time,
    owner or mode of this machine in it. (TVM's own `tar.tar` gzips the temp copies' listing in
    directory order, stamped with the time, user and group of the build: no two builds agree.)"""
    import io
    import tarfile

    names = [os.path.basename(f) for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate file names among {names}")
    with tarfile.open(output, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, file in sorted(zip(names, files, strict=True)):
            with open(file, "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


_reproducible_tar.output_format = "tar"  # what TVM's tar.tar declares


def compile_kernels(funcs: dict[str, tirx.PrimFunc], target: dict[str, Any], path: str) -> None:
    """Compile standalone TIR kernels (each callable by its name) into a shared library."""
    tgt = targets.make_target(target)
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    mod = passes.specialize(mod, tgt)
    with tgt:
        mod = dlight.ApplyDefaultSchedule(*_schedule_rules())(mod)
    export_library(tvm.compile(mod, tgt), path)


def _schedule_rules():
    from .schedules import cpu_rules

    return cpu_rules()
