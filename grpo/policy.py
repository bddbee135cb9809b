"""The policy as the trainer sees it: token ids in; per-token log-probs, or the objective, out.

Wrapping the HF model in one module lets FSDP2 treat this wrapper as the root: its forward
unshards the root's parameters (embeddings, final norm, lm_head), so the fused LM-head kernels can
read the lm_head weight directly and the full [tokens, vocab] logits are never built. Only
completion positions go through the LM head; prompt positions stop at the last hidden state.

Two uses of the same forward:
- `policy(input_ids, index, tokens)` -> (logp, entropy): pi_ref's log-probs (no grad);
- `policy(input_ids, index, tokens, objective=ObjectiveInputs(...))` -> PolicyOutput with the loss
  of eq. 6/7 on those tokens, through `kernels.lm_head_objective`: the LM head and the objective in
  one call that computes the gradients during the forward (kernels.KernelConfig.objective_grads),
  on CUDA with the fused Triton loss kernel, on CPU with grpo.objective's torch maths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import kernels
from grpo.kernel_dispatch import objective_of_hidden
from grpo.objective import ObjectiveConfig


@dataclass
class ObjectiveInputs:
    """Per completion token (flat [N], aligned with the policy's completion_index)."""

    logp_alpha: torch.Tensor  # the sampler's log-probs (vLLM)
    logp_k: Optional[torch.Tensor]  # pi_k's log-probs; None on the first SGD iteration (pi = pi_k)
    logp_ref: Optional[torch.Tensor]  # pi_ref's log-probs; None when beta = 0
    adv: torch.Tensor  # eq. 2 advantage of the token's sequence
    weights: torch.Tensor  # aggregation weights (grpo.objective.token_weights); 0 = inactive
    cfg: ObjectiveConfig
    seq_index: Optional[torch.Tensor] = None  # each token's sequence in the micro-batch (sequence-level losses)


@dataclass
class PolicyOutput:
    loss: torch.Tensor  # 0-dim, to minimise (backward is a multiply: gradients come from the forward)
    stats: dict[str, torch.Tensor]  # additive objective statistics (grpo.objective.objective's)
    logp: torch.Tensor  # [N] fp32, detached: pi's log-probs (= pi_k's on the first SGD iteration)
    entropy: Optional[torch.Tensor]  # [N] fp32, detached, when asked for


class Policy(torch.nn.Module):
    """The HF model as the trainer uses it: per-token log-probs of completion tokens, or the loss of
    the objective on them (see the module docstring)."""

    def __init__(self, lm: torch.nn.Module, temperature: float, kernel_cfg: kernels.KernelConfig):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.kernel_cfg = kernel_cfg

    def forward(self, input_ids: torch.Tensor, completion_index: torch.Tensor, completion_tokens: torch.Tensor,
                objective: Optional[ObjectiveInputs] = None, with_entropy: bool = False,
                position_ids: Optional[torch.Tensor] = None, segments: Optional[tuple] = None):
        """input_ids [B, L] right-padded prompt+completion (no attention mask needed: with causal
        attention a real token never sees the padding after it), or with position_ids and segments
        the shared-prompt group rows (grpo.batching.collate_groups, grpo.shared_prompt).
        completion_index [N] flat indices (b * L + t) of the positions whose NEXT token is a
        completion token, completion_tokens [N] those tokens. Without `objective`: (logp [N] fp32,
        entropy [N] or None), differentiable. With it: a PolicyOutput."""
        layout = {} if segments is None else {"position_ids": position_ids, "segments": segments}
        hidden = self.lm.model(input_ids=input_ids, **layout).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, completion_index)
        weight = self.lm.lm_head.weight
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        if objective is None:
            return kernels.lm_head_logprobs(hidden, weight, completion_tokens, temperature=self.temperature,
                                            with_entropy=with_entropy, config=self.kernel_cfg)
        o = objective
        loss, stats, logp, entropy = objective_of_hidden(
            hidden, weight, completion_tokens, o.logp_alpha, o.logp_k, o.logp_ref, o.adv, o.weights, o.cfg,
            seq_index=o.seq_index, temperature=self.temperature, with_entropy=with_entropy,
            kernel_config=self.kernel_cfg)
        return PolicyOutput(loss, stats, logp, entropy)


@torch.no_grad()
def copy_policy(frozen: Policy, policy: Policy) -> None:
    """frozen <- pi_theta: pi_ref at the end of a stage, pi_push at a push. Same sharding on both,
    so a local copy of each shard."""
    # FSDP2 leaves the root's parameters unsharded after a forward it did not backprop through
    # (the no-grad reference pass); reshard so both sides are DTensor shards.
    frozen.reshard()
    policy.reshard()
    for p_frozen, p in zip(frozen.parameters(), policy.parameters()):
        p_frozen.copy_(p)
