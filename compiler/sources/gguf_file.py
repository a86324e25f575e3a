"""The GGUF source: one memory-mapped file, or the shards of a split one (``name-00001-of-00003.gguf``
...), -> Checkpoint (spec, tokenizer, chat template, lazy tensors).

Tensors stay in the mmap until a ``SourceTensor.load()`` dequantizes one to float32 with
``gguf.quants``. llama-architecture files store Q/K rows permuted for interleaved RoPE (the
converter's ``permute``); ``load()`` undoes that so every family sees half-split (NeoX) rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from goinfer.artifacts.manifest import FAMILIES, Tokens

from ..checksum import sha256_files  # remembered by file identity (compiler/checksum.py)
from .base import Checkpoint, SourceError, SourceTensor
from .gguf_spec import ROPE_TENSORS, build_spec
from .gguf_vocab import read_vocab
from .tokenizer import build_tokenizer_json

_T = GGMLQuantizationType
# Dense weight encodings gguf.quants can dequantize (not the per-tensor-scaled or integer ones).
# fmt: off
SUPPORTED_TYPES = frozenset({
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    _T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S, _T.IQ4_NL, _T.IQ4_XS,
})
# fmt: on

_FLOAT_TYPES = frozenset({_T.F32, _T.F16, _T.BF16})
# llama.cpp's gguf-split names: the shard number and count, five digits each.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Family chat templates for checkpoints that carry none.
_DEFAULT_TEMPLATES = {"gemma3": "gemma3.jinja", "qwen2": "chatml.jinja", "llama": "chatml.jinja"}
# The architectures whose converter stores Q/K rows interleaved (its `permute`), undone at load.
_PERMUTED = ("llama", "mistral")


def load_gguf(path: str | Path) -> Checkpoint:
    """Read a GGUF checkpoint (any shard of a split one reads them all); a file we cannot use raises
    SourceError with a one-line reason."""
    path = Path(path)
    shards = shard_paths(path)
    readers = [_open(p) for p in shards]
    # The first shard holds the metadata; every shard holds its own tensors.
    meta = {name: field.contents() for name, field in readers[0].fields.items()}
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        supported = ", ".join(FAMILIES)
        raise SourceError(f"{path}: unsupported architecture {arch!r}; supported: {supported}")
    try:
        _check_split(meta, shards)
        reader_tensors = _tensors(readers)
        vocab = read_vocab(meta)
        shapes = {t.name: _numpy_shape(t) for t in reader_tensors}
        tables = {t.name: _rope_table(t) for t in reader_tensors if t.name in ROPE_TENSORS}
        spec = build_spec(arch, meta, shapes, vocab, tables)
        for t in reader_tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise SourceError(f"tensor {t.name} has unsupported type {t.tensor_type.name}")
        tokenizer_json = build_tokenizer_json(vocab)
    except SourceError as e:
        raise SourceError(f"{path}: {e}") from None
    template = meta.get("tokenizer.chat_template")
    if template:
        origin = "checkpoint"
    else:
        template = default_template(arch)
        origin = "family default: checkpoint has no tokenizer.chat_template"
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads} if arch in _PERMUTED else {}
    # RoPE tables are in the spec now, not weights.
    tensors = {t.name: _source_tensor(t, heads) for t in reader_tensors if t.name not in ROPE_TENSORS}
    return Checkpoint(
        spec=spec,
        tokens=Tokens(bos_id=vocab.bos_id, add_bos=vocab.add_bos, stop_ids=vocab.eog_ids),
        tokenizer_json=tokenizer_json,
        chat_template=template,
        chat_template_origin=origin,
        tensors=tensors,
        source=str(path),
        sha256=sha256_files(shards),
    )


def shard_paths(path: Path) -> list[Path]:
    """The files of the checkpoint at ``path``: itself, or every shard of its split, in order."""
    m = _SHARD.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if missing := [p.name for p in paths if not p.is_file()]:
        raise SourceError(f"{path}: missing shard {missing[0]} of a {count}-file split GGUF")
    return paths


def model_stem(path: str | Path) -> str:
    """A checkpoint's name without its suffix or shard number: ``m-00001-of-00003.gguf`` -> ``m``."""
    path = Path(path)
    m = _SHARD.match(path.name)
    return m["stem"] if m else path.stem


def _check_split(meta: dict[str, Any], shards: list[Path]) -> None:
    count = meta.get("split.count")
    if count is not None and int(count) != len(shards):
        raise SourceError(f"split.count is {count}, but the file name says {len(shards)} shards")
    if len(shards) > 1 and count is None:
        raise SourceError("named as a shard of a split GGUF, but the first shard has no split.count")


def _tensors(readers: list[GGUFReader]) -> list[ReaderTensor]:
    tensors, seen = [], set()
    for reader in readers:
        for t in reader.tensors:
            if t.name in seen:
                raise SourceError(f"tensor {t.name} appears in two shards")
            seen.add(t.name)
            tensors.append(t)
    return tensors


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap: the same mmap'd bytes, but slicing skips
    np.memmap's per-view bookkeeping, which otherwise makes a 262k-token vocabulary take seconds."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        # Check every tensor's bytes lie inside the file before numpy reshapes a short slice.
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            qtype = GGMLQuantizationType(int(raw_type[0]))
            block, type_size = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise SourceError(
                    f"truncated: tensor {bytes(name).decode()} ends at byte {end}, the file has {size}"
                )
        super()._build_tensors(start_offs, fields)


def _open(path: Path) -> GGUFReader:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SourceError(f"{path}: cannot read: {e.strerror}") from None
    if magic != b"GGUF":
        # what was wrong, never the bytes read: the path may name any file (a server's admin load)
        raise SourceError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        return _Reader(path)
    except SourceError as e:
        raise SourceError(f"{path}: {e}") from None
    except Exception as e:  # gguf raises assorted errors on a damaged header
        raise SourceError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None


def _rope_table(t: ReaderTensor) -> np.ndarray:
    if t.tensor_type not in _FLOAT_TYPES:
        raise SourceError(f"tensor {t.name} has type {t.tensor_type.name}; a RoPE table should be float")
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)


def _numpy_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _source_tensor(t: ReaderTensor, heads: dict[str, int]) -> SourceTensor:
    shape = _numpy_shape(t)
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    parts = t.name.split(".")
    n_head = heads.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None
    return SourceTensor(
        name=t.name,
        shape=shape,
        source_type=t.tensor_type.name,
        bits=type_size * 8 / block,
        load=_loader(t, shape, n_head),
        raw=None if t.tensor_type in _FLOAT_TYPES else _raw_loader(t, shape, n_head),
    )


def _loader(t: ReaderTensor, shape: tuple[int, ...], n_head: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if np.may_share_memory(w, t.data):
            w = w.copy()  # never hand out a view of the read-only mmap
        return _unpermute_rows(w, n_head) if n_head else w

    return load


def _raw_loader(t: ReaderTensor, shape: tuple[int, ...], n_head: int | None) -> Callable[[], np.ndarray]:
    def raw() -> np.ndarray:
        rows = int(np.prod(shape[:-1]))
        blocks = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        # a row's blocks move with it, so the llama Q/K row permutation undoes the same way;
        # otherwise the mmap's read-only view: the transcode only reads it (a Q8_0 head is read
        # twice, for its -128 check and its packing, and need not be copied for either)
        return _unpermute_rows(blocks, n_head) if n_head else blocks

    return raw


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's llama ``permute``: per head, rows go from interleaved pairs
    (x0, y0, x1, y1, ...) back to halves (x0, x1, ..., y0, y1, ...)."""
    pairs = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(w.shape)


def default_template(arch: str) -> str:
    """The chat template we use for a family whose checkpoint carries none."""
    name = _DEFAULT_TEMPLATES.get(arch, "chatml.jinja")
    return (resources.files(__package__) / "templates" / name).read_text(encoding="utf-8")
