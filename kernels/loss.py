"""Fused per-token GRPO / REINFORCE / REC loss: one pass over the tokens gives the weighted loss,
d loss / d logp (kept for backward: the loss is a scalar, so backward is one multiply), and the
diagnostic sums of grpo.objective.objective.

The maths is grpo/objective.py's `per_token_loss` + `objective`, which stays the source of truth
(and the CPU path); every option of ObjectiveConfig that acts per token is a constexpr branch:
    LOSS          grpo | reinforce | rec_oneside_is | rec_oneside_nois | rec_twoside_is | rec_ring_nois
    EXACT_ANCHOR  grpo ratio anchor: exact r = pi/alpha, r' = pi_k/alpha (eq. 6) or approx r = pi/pi_k, r' = 1
    HAS_CAP       truncated importance weight min(pi_k/alpha, is_cap)
    KL            none (no logp_ref) | k1 | k2 | k3 estimator of KL(pi || pi_ref) (eq. 7)
Gradients follow torch's own rules for min / max (an exact tie splits the gradient evenly), so the
kernel's gradient equals autograd's through the reference, ties included.

Statistics: one partial vector per program, [programs, N_STATS], in kernels.contract's STAT_KEYS
order (each slot a constexpr derived from the key list), reduced by torch per each key's reduction
kind: deterministic, no atomics.

This module imports nothing from grpo/: the torch reference (grpo.objective.objective) is the
caller's to inject where a torch path is wanted (see lm_head_objective's objective_fn).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .contract import N_STATS, STAT_KEYS, STAT_SLOT, reduce_partials  # noqa: F401 (STAT_KEYS: re-exported)

LOSS_CODES = {"grpo": 0, "reinforce": 1, "rec_oneside_is": 2, "rec_oneside_nois": 3,
              "rec_twoside_is": 4, "rec_ring_nois": 5}
KL_CODES = {"none": 0, "k1": 1, "k2": 2, "k3": 3}

# Slots of a program's row of partials, as compile-time constants the kernel reads.
_N_STATS = tl.constexpr(N_STATS)
_NUM_TOKENS = tl.constexpr(STAT_SLOT["num_tokens"])
_LOSS = tl.constexpr(STAT_SLOT["loss"])
_CLIP_LOW_SUM = tl.constexpr(STAT_SLOT["clip_low_sum"])
_CLIP_HIGH_SUM = tl.constexpr(STAT_SLOT["clip_high_sum"])
_RATIO_SUM = tl.constexpr(STAT_SLOT["ratio_sum"])
_IS_WEIGHT_SUM = tl.constexpr(STAT_SLOT["is_weight_sum"])
_IS_CAPPED_SUM = tl.constexpr(STAT_SLOT["is_capped_sum"])
_KL_SUM = tl.constexpr(STAT_SLOT["kl_sum"])
_TV_SUM = tl.constexpr(STAT_SLOT["tv_sum"])
_KL_PIK_ALPHA_SUM = tl.constexpr(STAT_SLOT["kl_pik_alpha_sum"])
_RATIO_SQSUM = tl.constexpr(STAT_SLOT["ratio_sqsum"])
_IS_WEIGHT_SQSUM = tl.constexpr(STAT_SLOT["is_weight_sqsum"])
_RATIO_MAX = tl.constexpr(STAT_SLOT["ratio_max"])
_RATIO_MIN = tl.constexpr(STAT_SLOT["ratio_min"])
_IS_WEIGHT_MAX = tl.constexpr(STAT_SLOT["is_weight_max"])
_IS_WEIGHT_MIN = tl.constexpr(STAT_SLOT["is_weight_min"])


@triton.jit
def _tie_split(a, b):
    """d min(a, b) / d a as torch computes it: 1 if a < b, 1/2 on a tie, 0 otherwise."""
    return tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def grpo_loss_fwd_kernel(
    logp_ptr, logp_alpha_ptr, logp_k_ptr, logp_ref_ptr, adv_ptr, weights_ptr,
    grad_logp_ptr, partials_ptr, n_tokens,
    eps_low, eps_high, rec_lower, rec_upper, ring_lower, ring_upper, is_cap, beta,
    LOSS: tl.constexpr, EXACT_ANCHOR: tl.constexpr, HAS_CAP: tl.constexpr, KL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_bounds = offs < n_tokens
    weight = tl.load(weights_ptr + offs, mask=in_bounds, other=0.0)
    # Inactive tokens (weight 0, incl. lanes past the end) see zeros, as objective's clean():
    # exactly zero loss and gradient even if their padding holds inf / nan.
    active = weight != 0
    logp = tl.where(active, tl.load(logp_ptr + offs, mask=in_bounds, other=0.0), 0.0)
    logp_alpha = tl.where(active, tl.load(logp_alpha_ptr + offs, mask=in_bounds, other=0.0), 0.0)
    logp_k = tl.where(active, tl.load(logp_k_ptr + offs, mask=in_bounds, other=0.0), 0.0)
    adv = tl.load(adv_ptr + offs, mask=in_bounds, other=0.0)

    log_w = logp_k - logp_alpha
    w = tl.exp(log_w)  # importance weight pi_k / alpha
    if HAS_CAP:
        w_bar = tl.minimum(w, is_cap)
        is_capped = tl.where(w > is_cap, 1.0, 0.0)
    else:
        w_bar = w
        is_capped = tl.zeros_like(w)
    pos = adv > 0
    neg = adv < 0
    zero = tl.zeros_like(w)

    if LOSS == 0:  # grpo: -f_eps(r, r', A) of eq. 6, f = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A)
        if EXACT_ANCHOR:
            ratio = tl.exp(logp - logp_k) * w_bar
            anchor = w_bar
            outer = tl.full(w.shape, 1.0, tl.float32)
        else:
            ratio = tl.exp(logp - logp_k)
            anchor = tl.full(w.shape, 1.0, tl.float32)
            if HAS_CAP:
                outer = w_bar
            else:
                outer = tl.full(w.shape, 1.0, tl.float32)
        lower = tl.maximum(anchor - eps_low, 0.0)
        upper = anchor + eps_high
        raised = tl.maximum(ratio, lower)
        clipped = tl.minimum(raised, upper)
        unclipped_term = ratio * adv
        clipped_term = clipped * adv
        surrogate = outer * tl.minimum(unclipped_term, clipped_term)
        # d ratio / d logp = ratio; chain through max(., lower), min(., upper), min(rA, cA).
        d_clipped = ratio * (1.0 - _tie_split(ratio, lower)) * _tie_split(raised, upper)
        take_unclipped = _tie_split(unclipped_term, clipped_term)
        d_policy = -outer * adv * (take_unclipped * ratio + (1.0 - take_unclipped) * d_clipped)
        policy_loss = -surrogate
        clip_low = tl.where(neg & (ratio < lower), 1.0, 0.0)
        clip_high = tl.where(pos & (ratio > upper), 1.0, 0.0)
    elif LOSS == 1:  # reinforce: -A log pi
        ratio = tl.exp(logp - logp_alpha)
        policy_loss = -adv * logp
        d_policy = -adv
        clip_low = zero
        clip_high = zero
    else:  # rec_*: -A c keep log pi with r = pi / alpha held constant (2509.24203)
        ratio = tl.exp(logp - logp_alpha)
        below = ratio < rec_lower
        above = ratio > rec_upper
        if LOSS == 2 or LOSS == 3:  # one-sided: only the side that would push further out
            drop_low = neg & below
            drop_high = pos & above
        elif LOSS == 4:  # two-sided: the whole band
            drop_low = below
            drop_high = above
        else:  # ring: the band, plus the outer margins rescued
            rescued = (pos & (ratio <= ring_lower)) | (neg & (ratio >= ring_upper))
            drop_low = below & (~rescued)
            drop_high = above & (~rescued)
        keep = tl.where(drop_low | drop_high, 0.0, 1.0)
        if LOSS == 2 or LOSS == 4:  # importance-sampled variants
            if HAS_CAP:
                coef = tl.minimum(ratio, is_cap)
            else:
                coef = ratio
        else:
            coef = tl.full(w.shape, 1.0, tl.float32)
        d_policy = -adv * coef * keep
        policy_loss = d_policy * logp
        clip_low = tl.where(drop_low, 1.0, 0.0)
        clip_high = tl.where(drop_high, 1.0, 0.0)

    if KL == 0:
        kl = zero
        d_kl = zero
    else:
        logp_ref = tl.where(active, tl.load(logp_ref_ptr + offs, mask=in_bounds, other=0.0), 0.0)
        d = logp_ref - logp
        if KL == 1:
            kl = -d
            d_kl = tl.full(w.shape, 1.0, tl.float32)
        elif KL == 2:
            kl = 0.5 * d * d
            d_kl = -d
        else:
            exp_d = tl.exp(d)
            kl = exp_d - d - 1.0
            d_kl = 1.0 - exp_d
    loss_tok = tl.where(beta > 0, policy_loss + beta * kl, policy_loss)
    d_tok = tl.where(beta > 0, d_policy + beta * d_kl, d_policy)
    tl.store(grad_logp_ptr + offs, tl.where(active, weight * d_tok, 0.0), mask=in_bounds)

    act = tl.where(active, 1.0, 0.0)
    out = partials_ptr + pid * _N_STATS
    tl.store(out + _NUM_TOKENS, tl.sum(act, axis=0))
    tl.store(out + _LOSS, tl.sum(tl.where(active, loss_tok * weight, 0.0), axis=0))
    tl.store(out + _CLIP_LOW_SUM, tl.sum(clip_low * act, axis=0))
    tl.store(out + _CLIP_HIGH_SUM, tl.sum(clip_high * act, axis=0))
    tl.store(out + _RATIO_SUM, tl.sum(ratio * act, axis=0))
    tl.store(out + _IS_WEIGHT_SUM, tl.sum(w_bar * act, axis=0))
    tl.store(out + _IS_CAPPED_SUM, tl.sum(is_capped * act, axis=0))
    tl.store(out + _KL_SUM, tl.sum(kl * act, axis=0))
    tl.store(out + _TV_SUM, tl.sum(0.5 * tl.abs(w - 1.0) * act, axis=0))
    tl.store(out + _KL_PIK_ALPHA_SUM, tl.sum((w - 1.0 - log_w) * act, axis=0))
    tl.store(out + _RATIO_SQSUM, tl.sum(ratio * ratio * act, axis=0))
    tl.store(out + _IS_WEIGHT_SQSUM, tl.sum(w_bar * w_bar * act, axis=0))
    tl.store(out + _RATIO_MAX, tl.max(tl.where(active, ratio, float("-inf")), axis=0))
    tl.store(out + _RATIO_MIN, tl.min(tl.where(active, ratio, float("inf")), axis=0))
    tl.store(out + _IS_WEIGHT_MAX, tl.max(tl.where(active, w_bar, float("-inf")), axis=0))
    tl.store(out + _IS_WEIGHT_MIN, tl.min(tl.where(active, w_bar, float("inf")), axis=0))


def kernel_constexprs(cfg, has_ref: bool) -> dict:
    """The constexpr variant of grpo_loss_fwd_kernel that an ObjectiveConfig selects."""
    return dict(
        LOSS=LOSS_CODES[cfg.loss],
        EXACT_ANCHOR=cfg.loss == "grpo" and cfg.ratio_anchor == "exact",
        HAS_CAP=cfg.is_cap is not None,
        KL=KL_CODES[cfg.kl_estimator] if has_ref else 0,
    )


def triton_objective(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, block):
    """Flat fp32 inputs [n] (logp_k / logp_ref may be None) -> (loss 0-dim, stats [N_STATS], grad_logp [n])."""
    n_tokens = logp.numel()
    grad_logp = torch.empty_like(logp)
    n_programs = max(1, triton.cdiv(n_tokens, block))
    partials = torch.empty((n_programs, N_STATS), dtype=torch.float32, device=logp.device)
    grpo_loss_fwd_kernel[(n_programs,)](
        logp, logp_alpha, logp if logp_k is None else logp_k,  # pi_k = current policy when not given
        logp if logp_ref is None else logp_ref, adv, weights, grad_logp, partials, n_tokens,
        float(cfg.eps_low), float(cfg.eps_high),
        # REC thresholds computed in double then rounded once, as torch compares fp32 with a python float
        1.0 - cfg.eps_low, 1.0 + cfg.eps_high, 1.0 - cfg.ring_eps_low, 1.0 + cfg.ring_eps_high,
        float(cfg.is_cap) if cfg.is_cap is not None else math.inf, float(cfg.beta),
        BLOCK=block, **kernel_constexprs(cfg, logp_ref is not None),
    )
    stats = reduce_partials(partials)
    return stats[STAT_SLOT["loss"]].clone(), stats, grad_logp


class GRPOObjective(torch.autograd.Function):
    """objective(...) with the Triton kernel: forward computes the gradient too, backward scales it."""

    @staticmethod
    def forward(ctx, logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, block):
        flat = [None if t is None else t.detach().reshape(-1).float().contiguous()
                for t in (logp, logp_alpha, logp_k, logp_ref, adv, weights)]
        loss, stats, grad_logp = triton_objective(*flat, cfg, block)
        ctx.save_for_backward(grad_logp)
        ctx.logp_shape, ctx.logp_dtype = logp.shape, logp.dtype
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        (grad_logp,) = ctx.saved_tensors
        grad = (grad_logp * grad_loss).view(ctx.logp_shape).to(ctx.logp_dtype)
        return grad, None, None, None, None, None, None, None
