"""The Hugging Face source: a checkpoint directory (config.json, tokenizer, *.safetensors) -> Checkpoint.

The directory is read in the order that refuses bad input cheapest: config.json (an unsupported
model_type is refused before any weight is touched), the tokenizer files, then the safetensors
headers. Tensors stay in a read-only mmap until ``SourceTensor.load()`` converts one to float32.

Names are translated to GGUF's and the config to GGUF metadata (hf_config), so gguf_spec checks
both sources alike. HF already stores Q/K rows half-split, so no permutation is undone here; Gemma 3
norms are stored as w where GGUF stores 1 + w, so the 1 is added at load.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from goinfer.artifacts.manifest import Tokens
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from ..checksum import sha256_files
from .base import Checkpoint, SourceError, SourceTensor
from .gguf_file import default_template
from .gguf_spec import build_spec
from .gguf_vocab import DETECTED_ROLES, EOG_TEXTS, Vocab
from .hf_config import TextConfig, read_config

# The safetensors dtypes we read, and their bits per weight.
_BITS = {"F32": 32, "F16": 16, "BF16": 16}
_SINGLE_FILE = "model.safetensors"
_INDEX = "model.safetensors.index.json"

# HF module names inside ``model.layers.N.`` -> GGUF's inside ``blk.N.``.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_FAMILY_LAYER_NAMES = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen2": {"post_attention_layernorm": "ffn_norm"},
    "qwen3": {
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
    # fused: q, k, v rows in qkv_proj; gate then up rows in gate_up_proj (GGUF's ffn_up)
    "phi3": {
        "post_attention_layernorm": "ffn_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    },
    "mistral": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Where multimodal Gemma 3 checkpoints keep the text model (older and newer transformers).
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.", ""),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def load_dir(path: str | Path) -> Checkpoint:
    """Read a Hugging Face checkpoint directory; one we cannot use raises SourceError with a one-line
    reason."""
    from . import hf_encoder

    path = Path(path)
    try:
        if hf_encoder.is_encoder(_optional_json(path / "config.json", [])):
            return hf_encoder.load(path)
        return _load(path)
    except SourceError as e:
        raise SourceError(f"{path}: {e}") from None


def _load(path: Path) -> Checkpoint:
    if not (path / "config.json").is_file():
        raise SourceError("no config.json: not a checkpoint directory")
    read: list[Path] = []  # every file the checkpoint is read from, for its digest
    cfg = read_config(_json(path / "config.json", read))  # refuses a model_type before any weight
    tok = _tokenizer_files(path, read)
    entries = _tensor_entries(path, read, cfg)
    # the RoPE tables the converter would write as tensors (Llama 3's, longrope's) join the shapes
    shapes = {name: e.shape for name, e in entries.items()} | {n: t.shape for n, t in cfg.rope_tables.items()}
    vocab = _vocab(tok, cfg)
    try:
        spec = build_spec(cfg.family, cfg.metadata, shapes, vocab, cfg.rope_tables)
    except SourceError as e:  # name the tensors as this checkpoint does
        raise SourceError(_GGUF_NAME.sub(lambda m: _hf_name(m[0], cfg.family), str(e))) from None
    _check_config(cfg, spec.vocab_size, spec.attention_bias)
    template, origin = _chat_template(path, tok.config, read, cfg.family)
    tensors = {name: _source_tensor(name, e, cfg.family) for name, e in entries.items()}
    return Checkpoint(
        spec=spec,
        tokens=Tokens(bos_id=vocab.bos_id, add_bos=vocab.add_bos, stop_ids=vocab.eog_ids),
        tokenizer_json=tok.tokenizer.to_str(),
        chat_template=template,
        chat_template_origin=origin,
        tensors=tensors,
        source=str(path),
        sha256=_digest(path, read),
    )


# ---------------------------------------------------------------------------------------- json files


def _text(file: Path, read: list[Path]) -> str:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise SourceError(f"{file.name}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # its message holds the byte: say what is wrong, not what is there
        raise SourceError(f"{file.name}: not UTF-8 text (at byte {e.start})") from None
    read.append(file)
    return text


def _json(file: Path, read: list[Path]) -> Any:
    try:
        value = json.loads(_text(file, read))
    except json.JSONDecodeError as e:
        raise SourceError(f"{file.name}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise SourceError(f"{file.name}: not a JSON object")
    return value


def _optional_json(file: Path, read: list[Path]) -> dict[str, Any]:
    return _json(file, read) if file.is_file() else {}


@dataclass(frozen=True)
class _TokenizerFiles:
    tokenizer: Tokenizer  # tokenizer.json without its post-processor, truncation and padding
    post_processor: Any  # the one it had: whether it adds BOS says add_bos where nothing else does
    config: dict[str, Any]  # tokenizer_config.json, {} where absent
    generation: dict[str, Any]  # generation_config.json, {} where absent


def _tokenizer_files(path: Path, read: list[Path]) -> _TokenizerFiles:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise SourceError("no tokenizer.json (only fast-tokenizer checkpoints are supported)")
    tok_json = _json(file, read)
    post_processor = tok_json.get("post_processor")
    # The runtime adds BOS itself (Tokens.add_bos), and must see every token of a long prompt.
    for key in ("post_processor", "truncation", "padding"):
        tok_json[key] = None
    try:
        tokenizer = Tokenizer.from_str(json.dumps(tok_json))
    except Exception as e:  # tokenizers raises plain Exceptions for a malformed file
        raise SourceError(f"tokenizer.json: cannot load: {e}") from None
    return _TokenizerFiles(
        tokenizer=tokenizer,
        post_processor=post_processor,
        config=_optional_json(path / "tokenizer_config.json", read),
        generation=_optional_json(path / "generation_config.json", read),
    )


def _chat_template(
    path: Path, tok_config: Mapping[str, Any], read: list[Path], family: str
) -> tuple[str, str]:
    """(template, origin): chat_template.jinja (newer transformers save it alone), else
    tokenizer_config.json's chat_template, else chat_template.json (multimodal processors')."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return _text(file, read), "checkpoint"
    template = _named_template(tok_config.get("chat_template"))
    if template is None and (path / "chat_template.json").is_file():
        template = _named_template(_json(path / "chat_template.json", read).get("chat_template"))
    if template:
        return template, "checkpoint"
    return default_template(family), "family default: checkpoint has no chat template"


def _named_template(value: Any) -> str | None:
    # A list holds named templates ({name, template}); generation uses the one named "default".
    if isinstance(value, list):
        value = next(
            (t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return value if isinstance(value, str) else None


# ------------------------------------------------------------------------------------------ tokens


def _vocab(tok: _TokenizerFiles, cfg: TextConfig) -> Vocab:
    """The vocabulary facts a Checkpoint needs, found where transformers looks for them. Only the
    fields build_spec and Tokens read are filled in: tokenizer.json itself is used as it is."""
    index = tok.tokenizer.get_vocab(with_added_tokens=True)
    n = max(index.values(), default=-1) + 1
    texts = [""] * n
    for text, i in index.items():
        texts[i] = text

    def token(key: str) -> int | None:  # a special token named in tokenizer_config.json
        value = tok.config.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str) and text not in index:
            raise SourceError(f"tokenizer_config.json: {key} {text!r} is not in the vocabulary")
        return index[text] if isinstance(text, str) else None

    gen_eos = _ids(tok.generation, "eos_token_id", "generation_config.json")
    eos_id = token("eos_token")
    if eos_id is None:
        eos_id = next(iter(cfg.eos_token_ids + gen_eos), None)
    bos_id = token("bos_token")
    if bos_id is None:
        bos_id = cfg.bos_token_id
    stops = {*cfg.eos_token_ids, *gen_eos, *_eog_by_text(index)} | ({eos_id} if eos_id is not None else set())
    if bad := sorted(i for i in (*stops, bos_id) if i is not None and not 0 <= i < n):
        raise SourceError(f"token id {bad[0]} (a bos or eos id) is not in the {n}-token vocabulary")
    return Vocab(
        model="tokenizer.json",
        pre="",
        tokens=tuple(texts),
        types=(),
        scores=None,
        merges=None,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=None,
        eog_ids=tuple(sorted(stops, key=lambda i: (i != eos_id, i))),
        add_bos=_add_bos(tok, texts, bos_id),
        add_space_prefix=False,
    )


def _ids(config: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    v = config.get(key)
    items = v if isinstance(v, list) else [] if v is None else [v]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise SourceError(f"{where}: {key} should be an integer or a list of them, not {v!r}")
    return tuple(items)


def _eog_by_text(index: Mapping[str, int]) -> set[int]:
    """The tokens llama.cpp ends generation at by their text (gguf_vocab's rules), so a model stops
    at the same tokens whichever source it was built from: <|im_end|>, <end_of_turn>, ..."""
    eog = {index[t] for t in EOG_TEXTS if t in index}
    for _, texts, ends in DETECTED_ROLES:
        matches = sorted(index[t] for t in texts if t in index)
        if ends and matches:
            eog.add(matches[0])
    return eog


def _add_bos(tok: _TokenizerFiles, texts: list[str], bos_id: int | None) -> bool:
    """tokenizer_config.json's add_bos_token where given (Gemma: true); else whether tokenizer.json's
    post-processor puts BOS first, as a fast tokenizer would (Llama 3: yes; Qwen2, SmolLM2: no)."""
    given = tok.config.get("add_bos_token")
    if isinstance(given, bool):
        return given
    if bos_id is None:
        return False
    return _prepends(tok.post_processor, texts[bos_id])


def _prepends(processor: Any, bos: str) -> bool:
    if not isinstance(processor, dict):
        return False
    if processor.get("type") == "Sequence":
        return any(_prepends(p, bos) for p in processor.get("processors") or ())
    if processor.get("type") == "TemplateProcessing":
        single = processor.get("single") or [{}]
        return single[0].get("SpecialToken", {}).get("id") == bos
    return False


# ----------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file, as its header describes it."""

    file: Path
    hf_name: str
    dtype: str
    shape: tuple[int, ...]


def _tensor_entries(path: Path, read: list[Path], cfg: TextConfig) -> dict[str, _Entry]:
    """Every tensor the text model uses, by GGUF name, with a dtype we read."""
    entries: dict[str, _Entry] = {}
    for file in _weight_files(path, read):
        for e in _read_header(file):
            name = _gguf_name(e.hf_name, cfg.family)
            if name is None:
                continue
            if name in entries:
                raise SourceError(
                    f"tensor {e.hf_name} appears twice ({entries[name].file.name}, {file.name})"
                )
            if e.dtype not in _BITS:
                raise SourceError(
                    f"{file.name}: tensor {e.hf_name} has unsupported dtype {e.dtype}; "
                    f"supported: {', '.join(_BITS)}"
                )
            entries[name] = e
    if cfg.tie_embeddings:
        entries.pop("output.weight", None)  # transformers ties it to the embedding whatever is stored
    elif "token_embd.weight" in entries and "output.weight" not in entries:
        raise SourceError("missing tensor lm_head.weight (config.json: tie_word_embeddings is false)")
    return entries


def _weight_files(path: Path, read: list[Path]) -> list[Path]:
    if (path / _INDEX).is_file():
        weight_map = _json(path / _INDEX, read).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{_INDEX}: no weight_map")
        if bad := [v for v in weight_map.values() if not isinstance(v, str) or "/" in v or "\\" in v]:
            raise SourceError(f"{_INDEX}: weight_map names {bad[0]!r}, not a file beside it")
        files = [path / name for name in sorted(set(weight_map.values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise SourceError(
                f"missing shard {missing[0]}" + (f" and {len(missing) - 1} more" if missing[1:] else "")
            )
    elif (path / _SINGLE_FILE).is_file():
        files = [path / _SINGLE_FILE]
    else:
        raise SourceError(f"no {_SINGLE_FILE} or {_INDEX}")
    read.extend(files)
    return files


def _read_header(file: Path) -> list[_Entry]:
    """The tensors a safetensors file holds. Opening it checks that the header's offsets cover the
    file exactly, so a truncated file is refused here, before anything is read from it."""
    try:
        with safe_open(file, framework="numpy") as f:
            return [
                _Entry(file, name, (t := f.get_slice(name)).get_dtype(), tuple(t.get_shape()))
                for name in f.keys()  # noqa: SIM118 (a safe_open handle is not a mapping)
            ]
    except SafetensorError as e:
        # (a header cut short reads as an invalid length, the data cut short as not covering the file)
        short = any(m in str(e) for m in ("not fully covered", "invalid header length"))
        why = "truncated or corrupt" if short else "corrupt safetensors file"
        raise SourceError(f"{file.name}: {why} ({e})") from None


def _gguf_name(hf_name: str, family: str) -> str | None:
    """The GGUF name of an HF tensor; None for tensors the text model does not use; an unknown
    tensor keeps its HF name, which check_tensors then refuses as unexpected."""
    if hf_name.endswith(".rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
        return None
    if family == "gemma3":
        if hf_name.startswith(_VISION_PREFIXES):
            return None
        for prefix, replacement in _TEXT_PREFIXES:
            if hf_name.startswith(prefix):
                hf_name = replacement + hf_name[len(prefix) :]
                break
    m = _LAYER.match(hf_name)
    if m:
        module = _FAMILY_LAYER_NAMES[family].get(m[2]) or _LAYER_NAMES.get(m[2])
        return f"blk.{m[1]}.{module}.{m[3]}" if module else hf_name
    stem, _, suffix = hf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}" if stem in _GLOBAL_NAMES and suffix == "weight" else hf_name


# GGUF tensor names in build_spec's messages, and the HF names they stand for.
_GGUF_NAME = re.compile(r"\b(?:token_embd|output_norm|output|blk\.\d+\.[a-z_]+)\.(?:weight|bias)\b")


def _hf_name(gguf_name: str, family: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return next(f"{hf}.{parts[-1]}" for hf, g in _GLOBAL_NAMES.items() if g == parts[0])
    names = {**_LAYER_NAMES, **_FAMILY_LAYER_NAMES[family]}
    module = next((hf for hf, g in names.items() if g == parts[2]), parts[2])
    return f"model.layers.{parts[1]}.{module}.{parts[3]}"


def _check_config(cfg: TextConfig, vocab_size: int, attention_bias: bool) -> None:
    """What config.json says, where the tensors could disagree with it."""
    if cfg.vocab_size is not None and cfg.vocab_size != vocab_size:
        raise SourceError(
            f"config.json: vocab_size is {cfg.vocab_size}, "
            f"but model.embed_tokens.weight has {vocab_size} rows"
        )
    if attention_bias != cfg.attention_bias:
        has = "has" if attention_bias else "lacks"
        raise SourceError(
            f"model.layers.0.self_attn.q_proj.bias: the checkpoint {has} it, config.json disagrees"
        )


def _source_tensor(name: str, e: _Entry, family: str) -> SourceTensor:
    # convert_hf_to_gguf stores 1 + w for every gemma3 norm; our gemma3 spec expects that.
    offset = 1.0 if family == "gemma3" and name.endswith("_norm.weight") else 0.0
    return SourceTensor(
        name=name, shape=e.shape, source_type=e.dtype, bits=_BITS[e.dtype], load=_loader(e, offset)
    )


def _loader(e: _Entry, offset: float) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        # safetensors maps the file and copies out the one tensor (bf16 through ml_dtypes), so
        # the float32 image is ours to change.
        with safe_open(e.file, framework="numpy") as f:
            w = f.get_tensor(e.hf_name).astype(np.float32)
        if offset:
            w += np.float32(offset)
        return w

    return load


def _digest(path: Path, read: list[Path]) -> str:
    """sha256 over "name sha256" lines of every file read, sorted: one digest for the directory."""
    lines = sorted(f"{f.relative_to(path).as_posix()} {sha256_files([f])}\n" for f in dict.fromkeys(read))
    return hashlib.sha256("".join(lines).encode()).hexdigest()
