"""Run by the reference venv's python (bench.reference_venv), never imported by the suite: a
Hugging Face folder's logits from transformers' own model, fed one token at a time with its cache,
so longrope picks its factors by position as goinfer does (compiler/sources/rope_scaling.py).

usage: python transformers_logits.py FOLDER IDS_JSON OUT_NPY
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(folder: str, ids_json: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    rows, past = [], None
    with torch.no_grad():
        for token in json.loads(ids_json):
            step = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = step.past_key_values
            rows.append(step.logits[0, -1].numpy())
    np.save(out, np.stack(rows).astype(np.float32))


if __name__ == "__main__":
    main(*sys.argv[1:])
