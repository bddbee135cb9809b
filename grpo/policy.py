"""The policy as the trainer sees it: token ids in, per-token log-probs of the completion out.

Wrapping the HF model in one module lets FSDP2 treat this wrapper as the root: its forward
unshards the root's parameters (embeddings, final norm, lm_head), so the fused LM-head kernel can
read the lm_head weight directly and the full [tokens, vocab] logits are never built. Only
completion positions go through the LM head; prompt positions stop at the last hidden state.
"""
from __future__ import annotations

import torch

import kernels


class PolicyLogprobs(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, temperature: float, kernel_cfg: kernels.KernelConfig):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.kernel_cfg = kernel_cfg

    def forward(self, input_ids: torch.Tensor, completion_index: torch.Tensor, completion_tokens: torch.Tensor,
                with_entropy: bool = False):
        """input_ids [B, L] right-padded prompt+completion (no attention mask needed: with causal
        attention a real token never sees the padding after it). completion_index [N] flat indices
        (b * L + t) of the positions whose NEXT token is a completion token, completion_tokens [N]
        those tokens. Returns logp [N] fp32 and entropy [N] (or None)."""
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, completion_index)
        weight = self.lm.lm_head.weight
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        return kernels.lm_head_logprobs(hidden, weight, completion_tokens, temperature=self.temperature,
                                        with_entropy=with_entropy, config=self.kernel_cfg)
