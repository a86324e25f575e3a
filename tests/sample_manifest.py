"""A small, valid goinfer manifest for the tests of the bundle contract and its readers."""

from __future__ import annotations

from goinfer.artifacts.manifest import (
    ENTRY_POINTS,
    Build,
    CpuTier,
    KVCache,
    Manifest,
    ModelSpec,
    RopeScaling,
    SelfTest,
    SelfTestCase,
    Source,
    Tokens,
)


def sample() -> Manifest:
    spec = ModelSpec(
        family="llama",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        context_length=64,
        norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling("linear", 2.0),
        sliding_layers=(False,),
    )
    return Manifest(
        goinfer_version="0.0.0-test",
        tvm_version="0.0",
        model=spec,
        tokens=Tokens(bos_id=None, add_bos=False, stop_ids=(7,)),
        tokenizer_tensor="tokenizer.json",
        chat_template="{{ messages }}",
        chat_template_origin="checkpoint",
        params=("w",),
        weight_schemes={"lm_head": "f32"},
        kv_cache=KVCache(page_size=16, prefill_chunk=64),
        entry_points=ENTRY_POINTS,
        cpu_tiers=(CpuTier("avx2", "llvm", "selftest@avx2", {"kind": "llvm", "num-cores": 2}),),
        selftest=SelfTest(1e-5, (SelfTestCase("k", ("st.in0",), "st.want"),)),
        source=Source("tiny.gguf", "ab" * 32),
        build=Build(target="llvm", quant="f32"),
    )
