"""Chat prompts: a problem, the system prompt and the instruction, through the tokenizer's template."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from grpo.data.problem import Problem

if TYPE_CHECKING:
    from grpo.data.load import DataConfig


def chat_messages(problem: Problem, cfg: DataConfig) -> list[dict]:
    user = f"{problem.prompt}\n{cfg.instruction}" if cfg.instruction else problem.prompt
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return messages + [{"role": "user", "content": user}]


_warned_no_template = False


def build_prompt(tokenizer, problem: Problem, cfg: DataConfig) -> str:
    """Prompt text through the tokenizer's chat template, ending where the assistant speaks.

    Tokenize it with add_special_tokens=False (see encode_prompt): the template already holds the
    special tokens the model expects.
    """
    messages = chat_messages(problem, cfg)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    global _warned_no_template
    if not _warned_no_template:
        warnings.warn("tokenizer has no chat template: using a plain 'system\\nuser\\nassistant:' prompt",
                      stacklevel=2)
        _warned_no_template = True
    return "\n".join(m["content"] for m in messages) + "\nassistant:"


def encode_prompt(tokenizer, prompt_text: str) -> list[int]:
    """Token ids of a prompt built by build_prompt (no extra BOS: the template wrote its own)."""
    return list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
