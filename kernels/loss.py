"""Fused per-token loss: one pass over the tokens gives the weighted loss, d loss / d logp (kept for
backward: the loss is a scalar, so backward is one multiply), and the statistics of
grpo.objective.objective.

Torch is the definition of every loss (grpo/losses.py, one registered function each); this kernel is
an optional speed-up for the losses whose gradient at a token depends on that token alone, checked
against those definitions by tests/test_kernels_loss.py (generated from the registry). Which losses
and IS-weight corrections it has is the plain mapping LOSS_CODES / CORRECTION_CODES below; grpo's
registry checks them at import, and a loss without a code runs its torch definition on CUDA too
(grpo.kernel_dispatch.objective_fn_for). Every per-token option is a constexpr branch:
    LOSS          a LOSS_CODES value
    EXACT_ANCHOR  ratio anchor of grpo / cispo: exact r = pi/alpha, r' = pi_k/alpha (eq. 6) or approx r = pi/pi_k, r' = 1
    CORRECTION    the IS weight w = pi_k/alpha as the loss sees it: 0 w, 1 min(w, is_cap) (TIS),
                  2 w * 1[is_floor <= w <= is_cap] (MIS / IcePop)
    KL            none (no logp_ref) | k1 | k2 | k3 estimator of KL(pi || pi_ref) (eq. 7)
Gradients follow torch's own rules for min / max (an exact tie splits the gradient evenly), so the
kernel's gradient equals autograd's through the reference, ties included.

Statistics: one partial vector per program, [programs, N_STATS], in kernels.contract's STAT_KEYS
order (each slot a constexpr derived from the key list), reduced by torch per each key's reduction
kind: deterministic, no atomics. The partials start as torch.empty, so a slot the kernel forgets is
garbage: check_stat_slots (run at start-up by grpo.kernel_dispatch.check_objective_path, and by the
tests for every LOSS code) launches the kernel on NaN-filled partials and names any slot left NaN.

This module imports nothing from grpo/: the torch reference (grpo.objective.objective) is the
caller's to inject where a torch path is wanted (see lm_head_objective's objective_fn).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .contract import N_STATS, STAT_KEYS, STAT_SLOT, reduce_partials

# The losses and corrections this kernel implements (name -> constexpr code). grpo/losses.py
# registers the torch definition of each name and refuses, at import, a code without one.
LOSS_CODES = {"grpo": 0, "reinforce": 1, "rec_oneside_is": 2, "rec_oneside_nois": 3,
              "rec_twoside_is": 4, "rec_ring_nois": 5, "cispo": 6}
ANCHORED_LOSSES = ("grpo", "cispo")  # the losses whose kernel branch reads EXACT_ANCHOR
CORRECTION_CODES = {"none": 0, "token_truncate": 1, "token_mask": 2, "icepop": 2}  # icepop: token_mask, two-sided
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
_IS_MASKED_SUM = tl.constexpr(STAT_SLOT["is_masked_sum"])
_ADV_POS_SUM = tl.constexpr(STAT_SLOT["adv_pos_sum"])
_ADV_NEG_SUM = tl.constexpr(STAT_SLOT["adv_neg_sum"])
_CLIP_ADV_POS_SUM = tl.constexpr(STAT_SLOT["clip_adv_pos_sum"])
_CLIP_ADV_NEG_SUM = tl.constexpr(STAT_SLOT["clip_adv_neg_sum"])
_RATIO_SQSUM = tl.constexpr(STAT_SLOT["ratio_sqsum"])
_IS_WEIGHT_SQSUM = tl.constexpr(STAT_SLOT["is_weight_sqsum"])
_RATIO_MAX = tl.constexpr(STAT_SLOT["ratio_max"])
_RATIO_MIN = tl.constexpr(STAT_SLOT["ratio_min"])
_IS_WEIGHT_MAX = tl.constexpr(STAT_SLOT["is_weight_max"])
_IS_WEIGHT_MIN = tl.constexpr(STAT_SLOT["is_weight_min"])
# Sequence statistics: a per-token kernel never sees whole sequences, so it stores 0 (see contract).
_NUM_SEQS = tl.constexpr(STAT_SLOT["num_seqs"])
_SEQ_RATIO_SUM = tl.constexpr(STAT_SLOT["seq_ratio_sum"])
_SEQ_CAPPED_SUM = tl.constexpr(STAT_SLOT["seq_capped_sum"])
_SEQ_MASKED_SUM = tl.constexpr(STAT_SLOT["seq_masked_sum"])


@triton.jit
def _tie_split(a, b):
    """d min(a, b) / d a as torch computes it: 1 if a < b, 1/2 on a tie, 0 otherwise."""
    return tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def loss_and_grad_kernel(
    logp_ptr, logp_alpha_ptr, logp_k_ptr, logp_ref_ptr, adv_ptr, weights_ptr,
    grad_logp_ptr, partials_ptr, n_tokens,
    eps_low, eps_high, rec_lower, rec_upper, ring_lower, ring_upper, cispo_lower, cispo_upper,
    is_cap, is_floor, beta,
    LOSS: tl.constexpr, EXACT_ANCHOR: tl.constexpr, CORRECTION: tl.constexpr, KL: tl.constexpr,
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
    zero = tl.zeros_like(w)
    one = tl.full(w.shape, 1.0, tl.float32)
    # The IS-weight correction (grpo/losses.py CORRECTIONS, token level): w_bar is what the loss sees.
    if CORRECTION == 0:
        w_bar = w
        is_capped = zero
        is_masked = zero
    elif CORRECTION == 1:  # TIS: truncate at is_cap
        w_bar = tl.minimum(w, is_cap)
        is_capped = tl.where(w > is_cap, 1.0, 0.0)
        is_masked = zero
    else:  # MIS / IcePop: tokens with w outside [is_floor, is_cap] drop out
        kept = (w >= is_floor) & (w <= is_cap)
        w_bar = tl.where(kept, w, 0.0)
        is_capped = zero
        is_masked = tl.where(kept, 0.0, 1.0)
    pos = adv > 0
    neg = adv < 0

    if LOSS == 0 or LOSS == 6:  # grpo and cispo: the ratio r and its anchor r'
        if EXACT_ANCHOR:
            ratio = tl.exp(logp - logp_k) * w_bar
            anchor = w_bar
            outer = one
        else:
            ratio = tl.exp(logp - logp_k)
            anchor = one
            if CORRECTION == 0:
                outer = one
            else:
                outer = w_bar
    if LOSS == 0:  # grpo: -f_eps(r, r', A) of eq. 6, f = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A)
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
    elif LOSS == 6:  # cispo: -sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) A log pi, every token keeps a gradient
        if EXACT_ANCHOR:  # a masked token has r = 0, which the clip could raise: drop it explicitly
            outer = 1.0 - is_masked
        coef = tl.minimum(tl.maximum(ratio, cispo_lower), cispo_upper)
        d_policy = -outer * coef * adv
        policy_loss = d_policy * logp
        clip_low = tl.where(ratio < cispo_lower, 1.0, 0.0)
        clip_high = tl.where(ratio > cispo_upper, 1.0, 0.0)
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
        if LOSS == 2 or LOSS == 4:  # importance-sampled variants; is_cap truncates their weight pi/alpha
            if CORRECTION == 1:
                coef = tl.minimum(ratio, is_cap)
            else:
                coef = ratio
        else:
            coef = one
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
            d_kl = one
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
    # The clip fraction split by the sign of A (grpo.objective.per_token_loss): every branch above
    # sets clip_low / clip_high, so one place counts clipped-below OR clipped-above per sign.
    adv_pos = tl.where(pos, 1.0, 0.0)
    adv_neg = tl.where(neg, 1.0, 0.0)
    clipped = tl.maximum(clip_low, clip_high)
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
    tl.store(out + _IS_MASKED_SUM, tl.sum(is_masked * act, axis=0))
    tl.store(out + _ADV_POS_SUM, tl.sum(adv_pos * act, axis=0))
    tl.store(out + _ADV_NEG_SUM, tl.sum(adv_neg * act, axis=0))
    tl.store(out + _CLIP_ADV_POS_SUM, tl.sum(clipped * adv_pos * act, axis=0))
    tl.store(out + _CLIP_ADV_NEG_SUM, tl.sum(clipped * adv_neg * act, axis=0))
    tl.store(out + _RATIO_SQSUM, tl.sum(ratio * ratio * act, axis=0))
    tl.store(out + _IS_WEIGHT_SQSUM, tl.sum(w_bar * w_bar * act, axis=0))
    tl.store(out + _RATIO_MAX, tl.max(tl.where(active, ratio, float("-inf")), axis=0))
    tl.store(out + _RATIO_MIN, tl.min(tl.where(active, ratio, float("inf")), axis=0))
    tl.store(out + _IS_WEIGHT_MAX, tl.max(tl.where(active, w_bar, float("-inf")), axis=0))
    tl.store(out + _IS_WEIGHT_MIN, tl.min(tl.where(active, w_bar, float("inf")), axis=0))
    tl.store(out + _NUM_SEQS, tl.sum(zero, axis=0))
    tl.store(out + _SEQ_RATIO_SUM, tl.sum(zero, axis=0))
    tl.store(out + _SEQ_CAPPED_SUM, tl.sum(zero, axis=0))
    tl.store(out + _SEQ_MASKED_SUM, tl.sum(zero, axis=0))


def missing_kernel(cfg) -> Optional[str]:
    """Why no variant of loss_and_grad_kernel computes cfg's objective (None: one does)."""
    if cfg.loss not in LOSS_CODES:
        return f"loss {cfg.loss!r} has no fused kernel (kernels with one: {sorted(LOSS_CODES)})"
    if cfg.correction not in CORRECTION_CODES:
        return (f"is_correction {cfg.correction!r} has no fused kernel "
                f"(corrections with one: {sorted(CORRECTION_CODES)})")
    return None


def kernel_constexprs(cfg, has_ref: bool) -> dict:
    """The constexpr variant of loss_and_grad_kernel that an ObjectiveConfig selects."""
    why = missing_kernel(cfg)
    if why is not None:
        raise ValueError(f"{why}; grpo.kernel_dispatch.objective_fn_for(device, kernel_config, cfg) runs its torch "
                         "definition instead")
    return dict(
        LOSS=LOSS_CODES[cfg.loss],
        EXACT_ANCHOR=cfg.loss in ANCHORED_LOSSES and cfg.ratio_anchor == "exact",
        CORRECTION=CORRECTION_CODES[cfg.correction],
        KL=KL_CODES[cfg.kl_estimator] if has_ref else 0,
    )


def _scalars(cfg) -> tuple:
    """The kernel's float arguments, in its order. Thresholds are computed in double then rounded
    once, as torch compares an fp32 tensor with a python float."""
    return (float(cfg.eps_low), float(cfg.eps_high),
            1.0 - cfg.eps_low, 1.0 + cfg.eps_high, 1.0 - cfg.ring_eps_low, 1.0 + cfg.ring_eps_high,
            1.0 - cfg.eps_low_is, 1.0 + cfg.eps_high_is,
            float(cfg.is_cap) if cfg.is_cap is not None else math.inf,
            float(cfg.is_floor) if cfg.is_floor is not None else 0.0, float(cfg.beta))


def triton_objective(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, block):
    """Flat fp32 inputs [n] (logp_k / logp_ref may be None) -> (loss 0-dim, stats [N_STATS], grad_logp [n])."""
    n_tokens = logp.numel()
    grad_logp = torch.empty_like(logp)
    n_programs = max(1, triton.cdiv(n_tokens, block))
    partials = torch.empty((n_programs, N_STATS), dtype=torch.float32, device=logp.device)
    loss_and_grad_kernel[(n_programs,)](
        logp, logp_alpha, logp if logp_k is None else logp_k,  # pi_k = current policy when not given
        logp if logp_ref is None else logp_ref, adv, weights, grad_logp, partials, n_tokens,
        *_scalars(cfg), BLOCK=block, **kernel_constexprs(cfg, logp_ref is not None),
    )
    stats = reduce_partials(partials)
    return stats[STAT_SLOT["loss"]].clone(), stats, grad_logp


def unwritten_stat_slots(cfg, has_ref: bool, device, keys: tuple = STAT_KEYS) -> list[str]:
    """The keys whose slot cfg's kernel variant leaves unwritten: one program on 8 finite tokens,
    its row of partials filled with NaN first (every statistic of finite inputs is finite, so a
    slot still NaN was never stored). `keys` longer than STAT_KEYS is how a test plays "a statistic
    added to contract.py that the kernel does not store"."""
    g = torch.Generator().manual_seed(0)
    n = 8
    logp_alpha = -torch.rand(n, generator=g) - 0.1
    logp_k = logp_alpha + 0.1 * torch.randn(n, generator=g)
    logp = logp_k + 0.1 * torch.randn(n, generator=g)
    inputs = [t.to(device).contiguous() for t in (logp, logp_alpha, logp_k, logp_alpha + 0.05,
                                                 torch.randn(n, generator=g), torch.ones(n))]
    partials = torch.full((1, len(keys)), math.nan, dtype=torch.float32, device=device)
    grad = torch.empty(n, dtype=torch.float32, device=device)
    loss_and_grad_kernel[(1,)](*inputs[:6], grad, partials, n, *_scalars(cfg), BLOCK=16,
                               **kernel_constexprs(cfg, has_ref))
    return [key for key, value in zip(keys, partials[0].tolist()) if math.isnan(value)]


def check_stat_slots(cfg, has_ref: bool, device, keys: tuple = STAT_KEYS) -> None:
    """Raise if cfg's kernel variant leaves a statistic slot unwritten (see unwritten_stat_slots)."""
    missing = unwritten_stat_slots(cfg, has_ref, device, keys)
    if missing:
        raise RuntimeError(f"kernels/loss.py: loss_and_grad_kernel does not store the statistics {missing} "
                           f"(loss {cfg.loss!r}); their slots would be garbage: add a tl.store for each")


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
