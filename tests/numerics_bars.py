"""The bars compiled models are held to against the numpy reference, on the tiny random-weight
models: one place, read by the CPU tests (tests/compiler/test_model_numerics.py) and by the GPU
check a lent device runs (tests/gpu/device_check.py), so both targets meet the same bars."""

# f32 against the reference: min cosine of the logits at every position.
F32_MIN_COSINE = 0.9999
# (min cosine of logits vs f32, min top-1 agreement vs f32) on random-weight tiny models, where
# nothing is smooth: real checkpoints quantize far more gracefully (see the slow tests).
INT_BARS = {"int8": (0.995, 0.9), "int8int8": (0.99, 0.8), "int4": (0.75, 0.35)}
# gguf mode against the reference of its own file: (min cosine, min top-1 agreement).
GGUF_BAR = (0.998, 0.9)
