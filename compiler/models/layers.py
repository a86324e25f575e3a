"""Building blocks every family assembles: quantized linear/embedding, norms, RoPE, gated MLP.

Each block that owns weights names the checkpoint tensors it is built from (`sources`) and knows
how to turn them into its parameters (`pack`), so the build can fill a model without a name table
per family, and every parameter is accounted for.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from goinfer.artifacts.manifest import ModelSpec
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..kernels import device, encoder_ops, gated, norm
from ..quant.scheme import Scheme
from ..sources.base import SourceTensor

# Opaque: keep each quantized matmul one kernel so our schedule rule sees it whole.
# noalias: without it LLVM must assume the output aliases the weights and spills every
# accumulator to memory on each step (4x slower decode, measured).
_KERNEL_ATTRS = {"op_pattern": 8, "tirx.noalias": True}

# Whether the graph being exported is for a GPU: there, each block takes its plain form from
# kernels/device.py (or Relax's own op) for dlight's GPU rules, instead of the hand-scheduled CPU
# kernel. One model object exports both graphs; the parameters are the same in each.
_FOR_GPU = contextvars.ContextVar("goinfer_graph_for_gpu", default=False)


@contextlib.contextmanager
def gpu_graph(on: bool = True) -> Iterator[None]:
    token = _FOR_GPU.set(on)
    try:
        yield
    finally:
        _FOR_GPU.reset(token)


def for_gpu() -> bool:
    return _FOR_GPU.get()


# Picks the quant scheme for a weight from its checkpoint tensors, several where fused (int4mix
# looks at their bits, gguf at their block types). The models ask it part by part, and fuse the
# parts it gives one scheme (`scheme_runs`).
SchemePicker = Callable[[Sequence[SourceTensor]], Scheme]


class Weighted(nn.Module):
    """A module whose parameters are packed from named checkpoint tensors."""

    sources: tuple[str, ...]
    scheme: Scheme | None = None  # how its weight is stored; None: float32, as the checkpoint has it

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def _concat_rows(tensors: Mapping[str, SourceTensor], names: tuple[str, ...]) -> np.ndarray:
    parts = [tensors[n].load() for n in names]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


class QLinear(Weighted):
    """y = x @ W^T (+ b), W packed by a quant scheme; several sources are fused along `out`."""

    def __init__(self, scheme: Scheme, in_features: int, out_features: int, sources: tuple[str, ...]):
        super().__init__()
        self.scheme, self.sources = scheme, sources
        self.in_features, self.out_features = in_features, out_features
        self.params = {
            name: nn.Parameter(shape, dtype)
            for name, (shape, dtype) in scheme.param_specs(out_features, in_features).items()
        }
        for name, p in self.params.items():
            setattr(self, name, p)

    def parts(self, tensors: Mapping[str, SourceTensor]) -> list[SourceTensor]:
        """Its checkpoint tensors, checked to make its (out, in) weight with their rows concatenated."""
        parts = [tensors[n] for n in self.sources]
        rows, cols = sum(p.shape[0] for p in parts), {p.shape[-1] for p in parts}
        if (rows, *cols) != (self.out_features, self.in_features):
            want = (self.out_features, self.in_features)
            raise ValueError(f"{self.sources}: rows {rows}, columns {cols}, expected {want}")
        return parts

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        parts = self.parts(tensors)
        packed = self.scheme.transcode(parts)  # the checkpoint's own blocks, kept exactly (gguf)
        return packed if packed is not None else self.scheme.pack(_concat_rows(tensors, self.sources))

    def forward(self, x: Tensor) -> Tensor:
        """x (tokens, in) -> (tokens, out)."""
        if for_gpu():
            half = self.scheme.NAME != "f32"
            matmul = device.linear(self.scheme.take, self.out_features, self.in_features, half)
            return op.tensor_expr_op(matmul, self._kernel("linear"), [x, *self.params.values()])
        matmul = self.scheme.matmul(self.out_features, self.in_features)
        if isinstance(matmul, tirx.PrimFunc):  # a hand-scheduled TIR kernel
            return op.tensor_ir_op(
                matmul,
                self._kernel("linear"),
                [x, *self.params.values()],
                out=Tensor.placeholder((x.shape[0], self.out_features), "float32"),
            )
        return op.tensor_expr_op(
            matmul, self._kernel("linear"), [x, *self.params.values()], attrs=_KERNEL_ATTRS
        )

    def _kernel(self, what: str) -> str:
        """The kernel's name: a C identifier, as CUDA's and Metal's source need (gguf's scheme
        names, "gguf:u8-g32-...", are not)."""
        return re.sub(r"\W", "_", f"{self.scheme.NAME}_{what}")

    def take(self, ids: Tensor) -> Tensor:
        """Rows of W (the embedding view of a tied LM head)."""
        return op.tensor_expr_op(
            self.scheme.take,
            self._kernel("take"),
            [ids, *self.params.values()],
            attrs=_KERNEL_ATTRS,
        )


def scheme_runs(
    pick: SchemePicker, tensors: Mapping[str, SourceTensor], names: Sequence[str]
) -> list[tuple[Scheme, tuple[str, ...]]]:
    """A fused weight's parts (`names`, in order) as runs of neighbours whose schemes alone agree,
    each run with that scheme, which its parts fused take too: none is stored wider than alone.
    Fused, parts of different schemes would all take the widest (gguf: Qwen-1.5B's Q4_K q and k
    beside a Q6_K v, all at 6 bits in groups of 16), and decode reads every byte each token."""
    runs: list[tuple[Scheme, tuple[str, ...]]] = []
    for name in names:
        scheme = pick([tensors[name]])
        if runs and runs[-1][0] == scheme:
            runs[-1] = (scheme, (*runs[-1][1], name))
        else:
            runs.append((scheme, (name,)))
    return runs


class SplitLinear(nn.Module):
    """A fused weight stored as several QLinears, "0", "1", ..., their outputs concatenated along
    `out`: to the layers after it, the one fused matmul."""

    def __init__(self, linears: Sequence[QLinear]):
        super().__init__()
        self.count = len(linears)
        # Attributes, not an nn.ModuleList: the build finds weights with tvm's attribute finder
        # (graph.modules_of_type), which yields no list's items themselves.
        for i, linear in enumerate(linears):
            setattr(self, str(i), linear)

    @property
    def linears(self) -> list[QLinear]:
        return [getattr(self, str(i)) for i in range(self.count)]

    def forward(self, x: Tensor) -> Tensor:
        return op.concat([linear(x) for linear in self.linears], dim=1)


def fused_linear(
    pick: SchemePicker,
    tensors: Mapping[str, SourceTensor],
    in_features: int,
    out_features: int,
    names: tuple[str, ...],
) -> QLinear | SplitLinear:
    """The parts `names` (q, k and v; gate and up) fused along `out` in one matmul where they take
    one scheme, else one matmul per run of them that does (`scheme_runs`)."""
    runs = scheme_runs(pick, tensors, names)
    if len(runs) == 1:  # the usual case: one QLinear, as named before splits existed
        return QLinear(runs[0][0], in_features, out_features, names)
    rows = [sum(tensors[n].shape[0] for n in run) for _s, run in runs]
    if sum(rows) != out_features:
        raise ValueError(f"{names}: rows {sum(rows)}, expected {out_features}")
    return SplitLinear([QLinear(s, in_features, r, run) for (s, run), r in zip(runs, rows, strict=True)])


class Bias(Weighted):
    def __init__(self, size: int, sources: tuple[str, ...]):
        super().__init__()
        self.sources = sources
        self.weight = nn.Parameter((size,), "float32")

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        return {
            "weight": np.concatenate([tensors[n].load().reshape(-1) for n in self.sources]).astype(np.float32)
        }

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight


class RMSNorm(Weighted):
    """x / rms(x) * (offset + w) over the last axis; the offset is folded into w at pack time."""

    def __init__(self, size: int, eps: float, source: str, offset: float = 0.0):
        super().__init__()
        self.sources, self.eps, self.offset = (source,), eps, offset
        self.weight = nn.Parameter((size,), "float32")

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        return {"weight": (tensors[self.sources[0]].load().reshape(-1) + self.offset).astype(np.float32)}

    def forward(self, x: Tensor) -> Tensor:
        if len(x.shape) != 2 or for_gpu():  # per-head norms (qk-norm) and GPU graphs: relax's
            return op.rms_norm(x, self.weight, axes=[-1], epsilon=self.eps)
        return op.tensor_ir_op(
            norm.kernel(x.shape[-1], self.eps, residual=False),
            "rms_norm",
            [x, self.weight],
            out=Tensor.placeholder(x.shape, "float32"),
        )

    def add_then_norm(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x + delta, its norm) in one kernel (the residual add a pre-norm block does before each
        sublayer); with no delta, (x, its norm)."""
        if delta is None:
            return x, self(x)
        if for_gpu():
            s = x + delta
            return s, self(s)
        s, y = op.tensor_ir_op(
            norm.kernel(x.shape[-1], self.eps, residual=True),
            "add_rms_norm",
            [x, delta, self.weight],
            out=[Tensor.placeholder(x.shape, "float32"), Tensor.placeholder(x.shape, "float32")],
        )
        return s, y


class LayerNorm(Weighted):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis (the encoders' post-norms);
    `prefix` names its checkpoint tensors prefix.weight and prefix.bias."""

    def __init__(self, size: int, eps: float, prefix: str):
        super().__init__()
        self.sources, self.size, self.eps = (f"{prefix}.weight", f"{prefix}.bias"), size, eps
        self.weight = nn.Parameter((size,), "float32")
        self.bias = nn.Parameter((size,), "float32")

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        w, b = (tensors[n].load().reshape(-1).astype(np.float32) for n in self.sources)
        return {"weight": w, "bias": b}

    def forward(self, x: Tensor) -> Tensor:
        return op.layer_norm(x, [self.size], self.weight, self.bias, eps=self.eps)

    def add_then_norm(self, x: Tensor, y: Tensor, bias: Bias | None = None) -> Tensor:
        """LayerNorm(x + y [+ bias]) in one kernel: a post-norm block's residual add, with the
        sublayer's output bias, before its norm."""
        kernel = encoder_ops.add_layer_norm(self.size, self.eps, bias is not None)
        args = [x, y, *([bias.weight] if bias is not None else []), self.weight, self.bias]
        return op.tensor_ir_op(kernel, "add_layer_norm", args, out=Tensor.placeholder(x.shape, "float32"))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul where they share a scheme
    (phi3 stores them fused: its ffn_up holds the gate's rows, then the up's)."""

    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        gate, up, down = (f"blk.{layer}.ffn_{n}.weight" for n in ("gate", "up", "down"))
        self.inter, self.act = spec.intermediate_size, spec.activation
        parts = (gate, up) if gate in tensors else (up,)
        self.gate_up = fused_linear(pick, tensors, spec.hidden_size, 2 * self.inter, parts)
        self.down = QLinear(pick([tensors[down]]), self.inter, spec.hidden_size, (down,))

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up(x)
        if for_gpu():
            return self.down(op.tensor_expr_op(device.gated(self.inter, self.act), "gated", [gate_up]))
        a = op.tensor_ir_op(
            gated.kernel(self.inter, self.act),
            f"gated_{self.act}",
            [gate_up],
            out=Tensor.placeholder((gate_up.shape[0], self.inter), "float32"),
        )
        return self.down(a)


RopeTables = dict[float, tuple[Tensor, Tensor]]  # theta -> (cos, sin), each (tokens, head_dim / 2)


def rope_tables(positions: Tensor, thetas: set[float], d: int, linear_factor: float = 1.0) -> RopeTables:
    """cos and sin per (token, frequency) for each theta, computed once a forward pass and shared by
    every layer with that theta (per layer, they were computed 30 times a SmolLM2 decode step).

    positions: (b*s,) int32, each token's index in its sequence.
    """
    half = d // 2

    # Per (token, frequency), not per (token, head, dim): the libm calls are scalar, and this is
    # heads*2 times fewer of them (Qwen, 512-token prefill: 9 -> 1.3 ms a layer).
    def angles(pos: te.Tensor, theta: float, fn) -> te.Tensor:
        def f(t, j):
            freq = tirx.exp(j.astype("float32") * tirx.const(-2.0 * math.log(theta) / int(d), "float32"))
            return fn(pos[t].astype("float32") / tirx.const(linear_factor, "float32") * freq)

        return te.compute((pos.shape[0], half), f, name="rope_angle")

    return {
        theta: (
            op.tensor_expr_op(lambda pos, th=theta: angles(pos, th, tirx.cos), "rope_cos", [positions]),
            op.tensor_expr_op(lambda pos, th=theta: angles(pos, th, tirx.sin), "rope_sin", [positions]),
        )
        for theta in sorted(thetas)
    }


class RopeFrequencies(Weighted):
    """A scaled RoPE's inverse frequencies (llama3, yarn, longrope: artifacts/manifest.py
    RopeScaling), computed in numpy at build time from the spec and packed as a parameter:
    row 0 holds theta^(-2i/d) / freq_factors[i], row 1 the same over long_factors (longrope's, at
    positions from original_context on; row 0 again otherwise)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.sources, self.spec = (), spec
        self.weight = nn.Parameter((2, spec.rotary_dims // 2), "float32")

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        s, r = self.spec, self.spec.rope_scaling
        d = s.rotary_dims
        # float32 base frequencies, as transformers and convert_hf_to_gguf compute them
        base = 1.0 / (np.float32(s.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
        short = np.asarray(r.freq_factors, np.float32)
        long = np.asarray(r.long_factors or r.freq_factors, np.float32)
        return {"weight": np.stack([base / short, base / long]).astype(np.float32)}

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin) per (token, frequency), each scaled by attn_factor."""
        r = self.spec.rope_scaling
        switch = r.original_context if r.long_factors else 0
        scale = r.attn_factor

        def angles(pos: te.Tensor, inv: te.Tensor, fn) -> te.Tensor:
            def f(t, j):
                row = tirx.if_then_else(pos[t] >= switch, 1, 0) if switch else 0
                y = fn(pos[t].astype("float32") * inv[row, j])
                return y * tirx.const(scale, "float32") if scale != 1.0 else y

            return te.compute((pos.shape[0], inv.shape[1]), f, name="rope_angle")

        return (
            op.tensor_expr_op(
                lambda pos, inv: angles(pos, inv, tirx.cos), "rope_cos", [positions, self.weight]
            ),
            op.tensor_expr_op(
                lambda pos, inv: angles(pos, inv, tirx.sin), "rope_sin", [positions, self.weight]
            ),
        )


def rope(qkv: Tensor, table: tuple[Tensor, Tensor], rotated_heads: int, rotary_dims: int = 0) -> Tensor:
    """Half-split (NeoX) rotary embedding on the first `rotated_heads` heads of a fused qkv, over
    the first `rotary_dims` dims of each head (0: all of them; phi3 rotates a part).

    qkv: (tokens, heads, d); table: this layer's (cos, sin) from `rope_tables`.
    """
    d = qkv.shape[-1]
    rot = rotary_dims or int(d)
    half = rot // 2

    def compute(x: te.Tensor, cos: te.Tensor, sin: te.Tensor) -> te.Tensor:
        def f(t, hi, di):
            j = tirx.if_then_else(di < half, di, di - half)
            partner = tirx.if_then_else(di < half, -x[t, hi, di + half], x[t, hi, di - half])
            rotated = x[t, hi, di] * cos[t, j] + partner * sin[t, j]
            return tirx.if_then_else(hi < rotated_heads, rotated, x[t, hi, di])

        def partial(t, hi, di):
            inside = di < rot
            j = tirx.if_then_else(di < half, di, tirx.if_then_else(inside, di - half, 0))
            partner = tirx.if_then_else(di < half, -x[t, hi, di + half], x[t, hi, di - half])
            rotated = x[t, hi, di] * cos[t, j] + partner * sin[t, j]
            return tirx.if_then_else(tirx.all(hi < rotated_heads, inside), rotated, x[t, hi, di])

        return te.compute(x.shape, f if rot == int(d) else partial, name="rope")

    return op.tensor_expr_op(compute, "rope", [qkv, *table])
