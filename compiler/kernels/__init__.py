"""Every hand-written TIR kernel, and the te computes a quant scheme's weights are read back with.

One module per kernel family: affine (the grouped W4A8 and W8A8 matmuls: our int4 and every
GGUF block type kept value-exact) and int8int8 (the W8A8 matmul), both on the row-block
scaffolding of rowblock.py; f32 and int8 (te matmuls the QuantMatmul schedule takes, on
lanes.py); attention and kv_append (in place of TVM's paged KV cache's stock CPU kernels, on the
manifest's PAGE_SIZE); norm, gated and vector_math; and device (plain te computes for GPU
targets). Of the compiler, kernels import only tvm/ (passes' intrinsics and ISA forms, targets,
schedules' SERIAL_MAX); the quant schemes and the models import them. Each module with
TVMScript kernels installs tvm/tvmscript.py's parsing memos.
"""
