"""Fused LM head + token log-probs: hidden [N, H] and lm_head weight [V, H] -> logp [N], in chunks
of tokens so that the [N, V] logits never exist (at most one [chunk_tokens, V] block is alive).

Forward, per chunk c:   logits_c = hidden_c @ weight^T;   (logp, lse, entropy)_c = log-prob kernel.
Backward, per chunk c:  recompute logits_c (one extra matmul), overwrite it in place with
                        dlogits_c = g (onehot - p) / T (+ entropy term), then
                        grad_hidden_c  = dlogits_c @ weight
                        grad_weight   += dlogits_c^T @ hidden_c   (into one preallocated fp32 [V, H])

Why recompute instead of computing the gradients during the forward (as fused linear-cross-entropy
does): our output is a per-token logp whose upstream gradient g_i is not known at forward time, and
grad_weight = sum_i g_i (onehot_i - p_i)^T hidden_i / T mixes all tokens' g_i with [V]-sized rows,
so it cannot be prepared without keeping [N, V] of state. Recomputing costs one matmul of the three
of a plain forward+backward (~1.33x matmul time) and no memory.

The per-chunk matmuls are torch (cuBLAS / MKL); the log-prob part is `LogprobImpl` (torch or Triton).
"""
from __future__ import annotations

import torch

from .logprobs import LogprobImpl, merge_grads


def _chunks(n_rows: int, chunk_tokens: int):
    for c0 in range(0, n_rows, chunk_tokens):
        yield c0, min(n_rows, c0 + chunk_tokens)


class LMHeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logp [N] fp32, entropy [N] fp32 or None)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature, with_entropy, chunk_tokens, impl: LogprobImpl):
        n_rows = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp, lse = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
        entropy = torch.empty(n_rows, **f32) if with_entropy else None
        for c0, c1 in _chunks(n_rows, chunk_tokens):
            logits = hidden[c0:c1] @ weight.t()
            lp, ls, ent, _ = impl.forward(logits, targets[c0:c1], inv_temperature, with_entropy)
            logp[c0:c1], lse[c0:c1] = lp, ls
            if with_entropy:
                entropy[c0:c1] = ent
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temperature, ctx.chunk_tokens, ctx.impl = inv_temperature, chunk_tokens, impl
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = merge_grads(targets, grad_logp)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().contiguous()
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        # fp32 accumulator; for an fp32 weight it is the returned gradient itself (no copy).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for c0, c1 in _chunks(hidden.shape[0], ctx.chunk_tokens):
            g_c = g[c0:c1]
            ge_c = grad_entropy[c0:c1] if grad_entropy is not None else None
            # Chunks of padding (no gradient at all) cost nothing.
            if not bool(g_c.any()) and (ge_c is None or not bool(ge_c.any())):
                continue
            hidden_c = hidden[c0:c1]
            logits = hidden_c @ weight.t()
            ctx.impl.backward(logits, targets[c0:c1], lse[c0:c1], g_c,
                              entropy[c0:c1] if entropy is not None else None, ge_c,
                              ctx.inv_temperature, out=logits)
            dlogits = logits  # overwritten in place: the chunk's only [c, V] buffer
            if need_hidden:
                torch.mm(dlogits, weight, out=grad_hidden[c0:c1])
            if need_weight:
                if dlogits.dtype == torch.float32:
                    grad_weight.addmm_(dlogits.t(), hidden_c)
                else:  # CPU has no mixed-dtype addmm; a bf16 chunk is upcast (one chunk-size temporary)
                    grad_weight.addmm_(dlogits.t().float(), hidden_c.float())
            del logits, dlogits
        if need_weight and weight.dtype != torch.float32:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class LMHeadObjective(torch.autograd.Function):
    """hidden, weight -> (loss, stats vector, logp) of grpo.objective.objective, gradients computed
    chunk by chunk DURING the forward: the per-token objective gives d loss / d logp_i from token i
    alone, so each chunk's dlogits is known as soon as its logits are, and no recomputation is
    needed (3 matmuls, as a plain forward + backward, instead of 4). Backward only scales them.

    All per-token inputs are flat [N] fp32 (adv per token); objective_fn is loss.triton_objective or
    loss.torch_objective."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg,
                inv_temperature, chunk_tokens, impl: LogprobImpl, objective_fn, loss_block):
        from .loss import merge_stat_vectors

        n_rows = hidden.shape[0]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        logp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        loss, stats = None, None

        def part(t, c0, c1):
            return None if t is None else t[c0:c1]

        for c0, c1 in _chunks(n_rows, chunk_tokens):
            hidden_c = hidden[c0:c1]
            logits = hidden_c @ weight.t()
            logp_c, lse_c, _, _ = impl.forward(logits, targets[c0:c1], inv_temperature, False)
            logp[c0:c1] = logp_c
            loss_c, stats_c, g_c = objective_fn(logp_c, logp_alpha[c0:c1], part(logp_k, c0, c1),
                                                part(logp_ref, c0, c1), adv[c0:c1], weights[c0:c1], cfg, loss_block)
            loss = loss_c if loss is None else loss + loss_c
            stats = merge_stat_vectors(stats, stats_c)
            g_c = torch.where(targets[c0:c1] >= 0, g_c, 0.0).contiguous()
            if not bool(g_c.any()):
                continue
            impl.backward(logits, targets[c0:c1], lse_c, g_c, None, None, inv_temperature, out=logits)
            if need_hidden:
                torch.mm(logits, weight, out=grad_hidden[c0:c1])
            if need_weight:
                if logits.dtype == torch.float32:
                    grad_weight.addmm_(logits.t(), hidden_c)
                else:
                    grad_weight.addmm_(logits.t().float(), hidden_c.float())
            del logits
        if need_weight and weight.dtype != torch.float32:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(stats, logp)
        return loss, stats, logp

    @staticmethod
    def backward(ctx, grad_loss, grad_stats, grad_logp):
        if getattr(ctx, "used", False):
            raise RuntimeError("lm_head_objective: backward twice (retain_graph) is not supported: "
                               "its gradients are computed once in the forward and scaled in place")
        ctx.used = True
        grad_hidden, grad_weight = ctx.saved_tensors
        # The loss is a scalar: its gradients were computed for d loss = 1; rescale in place (a copy
        # of the weight gradient would cost another [V, H]) unless that is it.
        if float(grad_loss) != 1.0:
            for grad in (grad_hidden, grad_weight):
                if grad is not None:
                    grad.mul_(grad_loss.to(grad.dtype))
        return (grad_hidden, grad_weight) + (None,) * 12
