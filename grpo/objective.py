"""The objective: the policy loss, KL, aggregation, diagnostics.

Single source of truth for the maths of Mroueh et al. (arXiv 2505.22257, "Revisiting GRPO"), of the
REC / RED families of Yao et al. (arXiv 2509.24203), and of the peers' losses and off-policy
corrections (GSPO, CISPO, TIS / MIS / IcePop). Each policy loss and each IS-weight correction is
one registered torch function in grpo/losses.py (the registry: names, knobs, checks, equations),
each advantage estimator and its steps (RED, eq. 8) one in grpo/advantages.py; this module does
what is common to all of them: the aggregation weights, the masking of inactive tokens, the KL
term of eq. 7 and the statistics. Which path runs a config (the fused Triton kernel, the torch
definition inside the fused LM head, or whole sequences through autograd) is grpo/kernel_dispatch.py's.
What the objective and the kernel share (input checks, statistic names and reductions) is
kernels/contract.py.

Symbols (paper names): alpha = the policy that sampled the batch (its per-token log-probs
`logp_alpha` come from the inference server), pi_k = the trainer's policy at the start of the
iteration (`logp_k`), pi = the policy being optimised (`logp`, requires grad), pi_ref (`logp_ref`).

Pipeline, once per batch of B prompts x G completions:
  adv, seq_weight, stats = grpo.advantages.group_advantages(rewards, G, cfg)   # eq. 2, eq. 8, RED
  n_seqs, n_toks = local_denominators(mask, seq_weight, cfg)        # all-reduce over ranks
  then per micro-batch:
  w = token_weights(mask, seq_weight, cfg, num_seqs=..., num_tokens=..., max_len=...)
  loss, sums = objective(logp, logp_alpha, logp_k, logp_ref, adv, w, cfg, seq_index=...)   # eq. 6/7
  loss.backward(); accumulate sums (merge_stats), all-reduce, finalize_stats.

A sequence never spans two micro-batches or ranks, so per-sequence sums inside one call are whole.
The named methods are settings of ObjectiveConfig: configs/objectives/<name>.yaml.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from grpo import advantages, losses, metrics, registry
from grpo.losses import CORRECTIONS, LOSSES, LossInputs, Sequences, correction_name, needs_sequences
from kernels.contract import (DIAGNOSTIC_KEYS, EXTREME_KEYS, SEQUENCE_KEYS, SQ_KEYS, STAT_KEYS,
                              check_objective_inputs, reduction)


@dataclass
@registry.with_knobs(lambda: losses.owners() + advantages.owners())  # + every registered knob: gspo_eps_low, adv_eps, red...
class ObjectiveConfig:
    """The `objective:` section of the config. Each option names the equation it implements."""

    loss: str = "grpo"
    """the policy loss, one of grpo/losses.py's LOSSES (docs/objectives.md): grpo = clipped surrogate f_eps
    (eq. 6/7); reinforce = -A log pi (2509.24203); rec_* = REINFORCE with a clipping mask on pi/alpha
    (2509.24203 REC); cispo (2506.13585); gspo, gspo_token (2507.18071, sequence ratios)."""
    ratio_anchor: Literal["exact", "approx"] = "approx"
    """losses registered anchored (grpo, cispo, gspo, gspo_token). exact: r = pi/alpha, r' = pi_k/alpha
    (eq. 6). approx: r = pi/pi_k, r' = 1 (paper's practice, Sec. 3.2)."""
    eps_low: float = 0.2
    """lower clip width: band lower edge max(r' - eps_low, 0) (eq. 6); REC: 1 - eps_low."""
    eps_high: float = 0.2
    """upper clip width: band upper edge r' + eps_high (eq. 6); REC: 1 + eps_high."""
    is_correction: Optional[str] = None
    """correction of the IS weight pi_k/alpha against the sampler-learner mismatch, one of grpo/losses.py's
    CORRECTIONS: none, token_truncate (TIS), token_mask (MIS), sequence_truncate / sequence_mask (product of
    the ratios), geometric_truncate / geometric_mask (per-token mean), icepop (two-sided token mask).
    null: token_truncate when is_cap is set (truncated IS, as before this option existed), else none."""
    is_cap: Optional[float] = None
    """upper threshold C of the correction: truncated IS caps pi_k/alpha at C (None = off)."""
    is_floor: Optional[float] = None
    """lower threshold of the mask corrections (token_mask, sequence_mask, geometric_mask, icepop); null:
    no lower bound (icepop needs one)."""
    beta: float = 0.0
    """weight of KL(pi || pi_ref) in eq. 7."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL(pi||pi_ref) estimator: k1 = logp-ref, k2 = (logp-ref)^2/2, k3 = e^(ref-logp)-(ref-logp)-1."""
    advantage: str = "group"
    """the advantage estimator, one of grpo/advantages.py's ADVANTAGES (docs/objectives.md): group = eq. 2,
    batch (group mean, batch std), none (Dr. GRPO / REC: r - mean), rloo (leave-one-out), reinforce_pp
    (REINFORCE++'s batch-normalised baseline). Its knobs (adv_eps) and the steps around it (RED:
    red, red_tau; eq. 8: mask_zero_variance) are fields too, from that registry."""
    mask_truncated: bool = False
    """give weight 0 to completions cut at max_new_tokens (DAPO overlong filtering)."""
    aggregation: Literal["seq_mean", "token_mean", "seq_sum_norm"] = "seq_mean"
    """seq_mean: mean over tokens then over sequences (GRPO). token_mean: over all tokens of the batch (DAPO).
    seq_sum_norm: sum over tokens / (num_seqs * max_len), a constant (Dr. GRPO)."""
    max_len_norm: Optional[int] = None
    """the constant max_len of seq_sum_norm; None -> the caller's max_new_tokens."""
    count_masked: bool = True
    """True: masked / dropped / truncated-masked samples stay in num_seqs, num_tokens as zeros (eq. 8 read
    literally: E_x 1[sigma != 0](...)). False: they leave the batch (DAPO-style dynamic sampling)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low <= 1.0:
            raise ValueError(f"eps_low: must be in [0, 1] (the band's lower edge is a ratio >= 0), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high: must be >= 0, got {self.eps_high}")
        if self.is_cap is not None and not self.is_cap > 0.0:
            raise ValueError(f"is_cap: must be > 0 or null, got {self.is_cap}")
        if self.is_floor is not None and not self.is_floor > 0.0:
            raise ValueError(f"is_floor: must be > 0 or null, got {self.is_floor}")
        if self.beta < 0.0:
            raise ValueError(f"beta: must be >= 0, got {self.beta}")
        if self.max_len_norm is not None and self.max_len_norm < 1:
            raise ValueError(f"max_len_norm: must be >= 1 or null, got {self.max_len_norm}")
        # The advantage's, loss's and correction's names, every knob (its check, and none set while its
        # owner is not selected), the loss's and correction's own checks (the ring margins, is_cap for a
        # correction, ...): the registries'.
        advantages.check_config(self)
        losses.check_config(self)

    @property
    def correction(self) -> str:
        """The correction in force: is_correction, or from is_cap when it is null (losses.correction_name)."""
        return correction_name(self)


# ----------------------------------------------------------------------------------------------
# Aggregation over tokens: weights w with loss = sum(per_token_loss * w)
# ----------------------------------------------------------------------------------------------

def _effective_mask(completion_mask: Tensor, seq_weight: Tensor, cfg: ObjectiveConfig,
                    truncated: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(token mask [B,T] of real completion tokens, per-sequence weight [B] incl. truncation mask)."""
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask: expected [B, T], got shape {tuple(completion_mask.shape)}")
    if seq_weight.shape != completion_mask.shape[:1]:
        raise ValueError(f"seq_weight: expected shape [{completion_mask.shape[0]}], got {tuple(seq_weight.shape)}")
    mask = completion_mask.to(torch.float32 if not seq_weight.is_floating_point() else seq_weight.dtype)
    seq_w = seq_weight.to(mask.dtype)
    if cfg.mask_truncated:
        if truncated is None:
            raise ValueError("truncated: mask_truncated is on, so a [B] bool tensor of truncated completions is needed")
        if truncated.shape != seq_weight.shape:
            raise ValueError(f"truncated: expected shape {tuple(seq_weight.shape)}, got {tuple(truncated.shape)}")
        seq_w = seq_w * (~truncated.bool()).to(mask.dtype)
    return mask, seq_w


def local_denominators(completion_mask: Tensor, seq_weight: Tensor, cfg: ObjectiveConfig,
                       truncated: Optional[Tensor] = None) -> tuple[int, int]:
    """(num_seqs, num_tokens) of this rank's part of the batch; SUM them over ranks and micro-batches
    and pass the totals to token_weights. With count_masked=False, samples of weight 0 (eq. 8 masked,
    RED-dropped, truncated-masked) are not counted."""
    mask, seq_w = _effective_mask(completion_mask, seq_weight, cfg, truncated)
    counted = torch.ones_like(seq_w, dtype=torch.bool) if cfg.count_masked else seq_w != 0
    return int(counted.sum()), int((mask * counted.unsqueeze(1)).sum())


def contributing(completion_mask: Tensor, seq_weight: Tensor, cfg: ObjectiveConfig,
                 truncated: Optional[Tensor] = None) -> Tensor:
    """[B] bool: the sequences whose tokens can have nonzero weight. The others (eq. 8 masked
    groups, RED-dropped, truncated-masked) contribute exactly zero loss and gradient, KL included:
    eq. 8's indicator multiplies the whole per-prompt term, so a trainer may skip their forward."""
    _, seq_w = _effective_mask(completion_mask, seq_weight, cfg, truncated)
    return seq_w != 0


def token_weights(completion_mask: Tensor, seq_weight: Tensor, cfg: ObjectiveConfig, *, num_seqs: int,
                  num_tokens: int, max_len: int, truncated: Optional[Tensor] = None) -> Tensor:
    """[B, T] weights w such that the loss of a (micro-)batch is sum(per_token_loss * w).

    num_seqs / num_tokens are GLOBAL denominators (whole batch, all micro-batches and ranks; see
    local_denominators) so that gradient accumulation and data parallelism give exactly the loss of
    the full batch. With s_b = seq_weight_b (times 0 if truncated and mask_truncated), m_bt the mask,
    L_b = sum_t m_bt:
      seq_mean:     w_bt = s_b m_bt / (L_b * num_seqs)         (GRPO: token mean, then sequence mean)
      token_mean:   w_bt = s_b m_bt / num_tokens               (DAPO: all tokens of the batch)
      seq_sum_norm: w_bt = s_b m_bt / (max_len * num_seqs)     (Dr. GRPO; max_len = cfg.max_len_norm or
                                                                the caller's max_new_tokens)
    Padding (m = 0) gets 0.
    """
    mask, seq_w = _effective_mask(completion_mask, seq_weight, cfg, truncated)
    per_token = mask * seq_w.unsqueeze(1)
    denominator = num_tokens if cfg.aggregation == "token_mean" else num_seqs
    if denominator < 1:
        # Nothing counted in the whole batch (e.g. every group masked with count_masked=False): the loss is 0.
        if (per_token != 0).any():
            raise ValueError(f"num_seqs/num_tokens: global denominator is {denominator} but this micro-batch has "
                             f"tokens of nonzero weight; pass the totals from local_denominators")
        return per_token
    if cfg.aggregation == "seq_mean":
        lengths = mask.sum(dim=1, keepdim=True)
        return per_token / (lengths.clamp(min=1.0) * num_seqs)
    if cfg.aggregation == "token_mean":
        return per_token / num_tokens
    const_len = cfg.max_len_norm if cfg.max_len_norm is not None else max_len
    if const_len is None or const_len < 1:
        raise ValueError(f"max_len: seq_sum_norm needs a constant length >= 1, got {const_len}")
    return per_token / (const_len * num_seqs)


# ----------------------------------------------------------------------------------------------
# Per-token loss (eq. 6, 7 and the registered losses of grpo/losses.py)
# ----------------------------------------------------------------------------------------------

def _sequence_ids(shape: torch.Size, seq_index: Optional[Tensor], device: torch.device) -> Tensor:
    """[N] the sequence of each token of a `shape` tensor: seq_index flattened, or when it is None the
    last dimension is one sequence's tokens ([B, T]: row b is sequence b; [T]: one sequence)."""
    n = math.prod(shape)
    if seq_index is not None:
        if seq_index.numel() != n:
            raise ValueError(f"seq_index: expected {n} sequence ids (one per token), "
                             f"got shape {tuple(seq_index.shape)}")
        return seq_index.reshape(-1).to(device=device, dtype=torch.int64)
    tokens = shape[-1] if len(shape) else 1
    return torch.arange(n // max(tokens, 1), device=device).repeat_interleave(tokens)


def per_token_loss(logp: Tensor, logp_alpha: Tensor, logp_k: Optional[Tensor], logp_ref: Optional[Tensor],
                   adv: Tensor, cfg: ObjectiveConfig, *, active: Optional[Tensor] = None,
                   seq_index: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss to MINIMISE, = policy loss (cfg.loss, grpo/losses.py) + beta * kl, and diagnostics.

    Inputs: same shape (any); adv either that shape or one dim less (broadcast per token).
    logp requires grad. logp_alpha: the sampler's log-probs (vLLM). logp_k: pi_k, detached; None means
    pi_k = the current parameters (logp.detach()), right only for the first optimizer step on a batch
    (i = 1 in Algorithm 1). logp_ref: None when beta == 0. Work dtype: float32 or wider.
    active: which tokens count (default all); a loss or correction that reads whole sequences leaves
    the others out of its sums. seq_index: each token's sequence, for those that need whole sequences
    (default: the last dim is one sequence's tokens).

    w = pi_k/alpha = exp(logp_k - logp_alpha) is the importance weight; w_bar the weight after the
    correction (cfg.correction; is_cap alone truncates it, w_bar = min(w, is_cap), as before).

    loss = grpo (eq. 6, f_eps(r, r', A) = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A)):
      exact:  r = (pi/pi_k) * w_bar, r' = w_bar    (= pi/alpha, pi_k/alpha when uncorrected);
              surrogate = f_eps(r, r', A). A correction acts on the IS weight inside f.
      approx: r = pi/pi_k, r' = 1 (paper's practice: pi_k/alpha ~ 1 for small v);
              surrogate = f_eps(r, 1, A), times w_bar only if a correction is on (truncated IS against
              the numerical mismatch between inference engine and trainer: alpha = pi_k mathematically
              when on-policy, but vLLM's log-probs differ from the trainer's).
      With alpha = pi_k and pi = pi_k (i = 1), d loss / d logp = -A (REINFORCE).
      Note: while pi = pi_k (the first optimizer step on a batch) r = r' under both anchors, so no
      token is clipped; the clip acts only from the second optimizer step on the same batch (i > 1,
      or a batch split into several optimizer steps). With (v > 1, i = 1) the GRPO gradient is
      -A w grad(logp) (exact; w = pi_k/alpha) or -A grad(logp) (approx).
    loss = reinforce: -A * logp (2509.24203 vanilla group-relative REINFORCE; no clip, no weights;
      is_cap unused).
    loss = rec_* (2509.24203): ratio r = pi/alpha (the behaviour policy, their pi_old; ratio_anchor
      does not apply), band [1 - eps_low, 1 + eps_high], loss = -A * c * logp * keep with
      c = stopgrad(r) (IS variants; capped at is_cap if set) or 1 (NoIS), and keep (0/1, constant):
      oneside: drop A>0 tokens with r > 1+eps_high and A<0 tokens with r < 1-eps_low;
      twoside: drop tokens outside the band whatever the sign of A;
      ring:    keep tokens inside the band, and also A>0 tokens with r <= 1 - ring_eps_low and A<0
               tokens with r >= 1 + ring_eps_high (outer margins); drop the rest.
      The gradient -A c keep grad(logp) is the authors' (Trinity-RFT rec_policy_loss); with IS and the
      one-sided mask it equals GRPO's clipped gradient with ratio pi/alpha.
    loss = cispo, gspo, gspo_token and any other: see its registration in grpo/losses.py.
    kl (eq. 7) per token between pi and pi_ref, d = logp_ref - logp:
      k3 = exp(d) - d - 1 (default), k1 = -d, k2 = d^2 / 2; added as beta * kl when beta > 0.

    Diagnostics (detached, float, same shape): clip_low / clip_high (0/1: the token gets no policy
    gradient because its ratio left the band below / above; CISPO: its weight was clipped), ratio (r as
    above; for reinforce and rec pi/alpha; for gspo the sequence's s_i), is_weight (w_bar), is_capped
    (0/1: truncated, its weight or its sequence's above is_cap), is_masked (0/1: masked out by the
    correction), kl, tv = |w - 1| / 2 (per-token estimate of TV(pi_k, alpha): E_alpha |pi_k/alpha - 1| / 2),
    kl_pik_alpha = w - 1 - log w (k3 estimator of KL(alpha || pi_k) under samples from alpha: unbiased,
    >= 0). tv and kl_pik_alpha use the raw w. adv_pos / adv_neg (0/1: A > 0 / A < 0; A = 0 is
    neither), clip_adv_pos / clip_adv_neg (0/1: clipped, clip_low or clip_high, and A > 0 / A < 0;
    for grpo's f_eps and one-sided REC only clip_high can bite when A > 0 and only clip_low when
    A < 0, while CISPO and two-sided / ring REC clip whatever the sign): the clip fraction split by
    the sign of the advantage, as sums (finalize_stats' clip_frac_adv_pos, clip_frac_adv_neg). Where
    the config needs whole sequences (needs_sequences), also per-sequence [S] tensors: seq_active (the
    sequence has an active token), seq_ratio (geometric mean of its tokens' ratio: GSPO's s_i),
    seq_capped, seq_masked (a token of it, or the sequence itself, was truncated / masked).
    """
    adv = check_objective_inputs(logp, logp_alpha, logp_k, logp_ref, adv, cfg.beta)
    shape = logp.shape
    try:
        adv = adv.expand(shape)
    except RuntimeError:
        raise ValueError(f"adv: shape {tuple(adv.shape)} does not broadcast per token over {tuple(shape)}") from None

    dtype = torch.promote_types(logp.dtype, torch.float32)
    flat = lambda t: t.reshape(-1)  # noqa: E731 (the losses see flat [N] tensors)
    logp = flat(logp.to(dtype))
    logp_alpha = flat(logp_alpha.detach().to(dtype))
    logp_k = logp.detach() if logp_k is None else flat(logp_k.detach().to(dtype))
    adv = flat(adv.detach().to(dtype))
    active = torch.ones_like(logp, dtype=torch.bool) if active is None else flat(active.bool())
    seqs = (Sequences.of(_sequence_ids(shape, seq_index, logp.device), active, dtype)
            if needs_sequences(cfg) else None)

    log_w = logp_k - logp_alpha
    w = torch.exp(log_w)  # pi_k / alpha
    correction = CORRECTIONS[cfg.correction]
    corrected = correction.fn(log_w, seqs, cfg)
    x = LossInputs(logp=logp, logp_k=logp_k, logp_alpha=logp_alpha, adv=adv, w=w, w_bar=corrected.w_bar,
                   kept=1.0 - corrected.masked, corrected=correction.level != "none", seqs=seqs)
    terms = LOSSES[cfg.loss].fn(x, cfg)

    if logp_ref is not None:
        d = flat(logp_ref.detach().to(dtype)) - logp
        if cfg.kl_estimator == "k3":
            kl = torch.exp(d) - d - 1.0
        elif cfg.kl_estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = -d
    else:
        kl = torch.zeros_like(logp)
    loss = terms.loss + cfg.beta * kl if cfg.beta > 0 else terms.loss

    diagnostics = {
        "clip_low": terms.clip_low,
        "clip_high": terms.clip_high,
        "ratio": terms.ratio.detach(),
        "is_weight": corrected.w_bar,
        "is_capped": corrected.capped,
        "kl": kl.detach(),
        "tv": 0.5 * torch.abs(w - 1.0),
        "kl_pik_alpha": w - 1.0 - log_w,
        "is_masked": corrected.masked,
    }
    pos, neg = (adv > 0).to(dtype), (adv < 0).to(dtype)
    clipped = torch.maximum(terms.clip_low, terms.clip_high)  # 0/1 each: clipped below OR above
    diagnostics.update(adv_pos=pos, adv_neg=neg, clip_adv_pos=clipped * pos, clip_adv_neg=clipped * neg)
    diagnostics = {key: value.reshape(shape) for key, value in diagnostics.items()}
    if seqs is not None:
        diagnostics.update(
            seq_active=(seqs.length > 0).to(dtype),
            seq_ratio=torch.exp(seqs.mean(torch.log(terms.ratio.detach()))),
            seq_capped=(seqs.sum(corrected.capped) > 0).to(dtype),
            seq_masked=(seqs.sum(corrected.masked) > 0).to(dtype),
        )
    return loss.reshape(shape), diagnostics


# ----------------------------------------------------------------------------------------------
# The objective of one (micro-)batch and its additive statistics
# ----------------------------------------------------------------------------------------------

def objective(logp: Tensor, logp_alpha: Tensor, logp_k: Optional[Tensor], logp_ref: Optional[Tensor],
              adv: Tensor, weights: Tensor, cfg: ObjectiveConfig, *,
              seq_index: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = sum(per_token_loss * weights), a scalar to minimise (weights from token_weights).

    Tokens with weight 0 (padding, eq. 8 masked groups, RED-dropped or truncated-masked samples) are
    inactive: their log-probs are replaced by 0 before the maths, so they give exactly zero loss and
    zero gradient even when the padding holds garbage (inf, nan), and a loss that reads whole
    sequences leaves them out of its sums. seq_index [same shape as logp, or flat]: each token's
    sequence, for the losses and corrections that need whole sequences (needs_sequences); None: the
    last dim of logp is one sequence's tokens ([B, T] rows). The trainer's flat [N] micro-batch
    passes its seq_of_token.

    stats: 0-dim tensors (detached), all over ACTIVE tokens only (weights != 0), unweighted, keyed
    and ordered as kernels.contract.STAT_KEYS:
      num_tokens                      count of active tokens
      loss                            the loss value (weighted sum)
      <key>_sum for key in DIAGNOSTIC_KEYS (clip_low, clip_high, ratio, is_weight, is_capped, kl, tv,
                                      kl_pik_alpha, is_masked, adv_pos, adv_neg, clip_adv_pos,
                                      clip_adv_neg)   sums of the per-token diagnostics (adv_pos_sum:
                                      active tokens with A > 0; clip_adv_pos_sum: those of them
                                      clipped, low or high; _neg: the same with A < 0)
      ratio_sqsum, is_weight_sqsum    sums of squares
      ratio_max, is_weight_max        maxima (-inf when no active token)
      ratio_min, is_weight_min        minima (+inf when no active token)
      num_seqs, seq_ratio_sum, seq_capped_sum, seq_masked_sum    over the sequences with an active
                                      token, where the config needs whole sequences; 0 otherwise (the
                                      per-token paths cannot count sequences)
    Reduce keys ending in _max with MAX, _min with MIN, all others with SUM (merge_stats,
    all_reduce_stats), then finalize_stats. This function is what the fused Triton kernel reproduces.
    """
    if weights.shape != logp.shape:
        raise ValueError(f"weights: shape {tuple(weights.shape)} differs from logp {tuple(logp.shape)}")
    active = weights != 0

    def clean(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else torch.where(active, t, torch.zeros((), dtype=t.dtype, device=t.device))

    per_token, diag = per_token_loss(clean(logp), clean(logp_alpha), clean(logp_k), clean(logp_ref),
                                     adv, cfg, active=active, seq_index=seq_index)
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    # where, not a product alone: a sequence loss gives inactive tokens their sequence's value
    loss = torch.where(active, per_token * weights.to(per_token.dtype), zero).sum()

    act = active.to(per_token.dtype)
    stats: dict[str, Tensor] = {"num_tokens": act.sum(), "loss": loss.detach()}
    for key in DIAGNOSTIC_KEYS:
        stats[f"{key}_sum"] = (diag[key] * act).sum()
    for key in SQ_KEYS:
        stats[f"{key}_sqsum"] = (diag[key] ** 2 * act).sum()
    inf = torch.tensor(float("inf"), dtype=per_token.dtype, device=per_token.device)
    for key in EXTREME_KEYS:
        stats[f"{key}_max"] = torch.where(active, diag[key], -inf).amax() if active.numel() else -inf
        stats[f"{key}_min"] = torch.where(active, diag[key], inf).amin() if active.numel() else inf
    if "seq_active" in diag:
        seq_active = diag["seq_active"]
        stats["num_seqs"] = seq_active.sum()
        for key in ("seq_ratio", "seq_capped", "seq_masked"):
            stats[f"{key}_sum"] = torch.where(seq_active > 0, diag[key], zero).sum()
    else:
        stats.update({key: zero.clone() for key in SEQUENCE_KEYS})
    return loss, {key: stats[key] for key in STAT_KEYS}


def merge_stats(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    """Combine the stats of two micro-batches (each key by its kernels.contract.reduction)."""
    merge = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}
    return {key: merge[reduction(key)](a[key], b[key]) for key in a}


def all_reduce_stats(stats: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce objective stats across ranks in place (no-op without torch.distributed)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return stats
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
    for key in sorted(stats):
        dist.all_reduce(stats[key], op=ops[reduction(key)], group=group)
    return stats


def finalize_stats(sums: dict[str, Tensor]) -> dict[str, float]:
    """Means over active tokens from reduced stats: clip_low_frac, clip_high_frac, clip_frac,
    clip_frac_adv_pos (of the active tokens with A > 0, the fraction clipped, low or high:
    clip_adv_pos_sum / adv_pos_sum; nan when no active token has A > 0), clip_frac_adv_neg (the same
    over A < 0; tokens with A = 0 are in neither), ratio_{mean,std,max,min},
    is_weight_{mean,std,max,min}, is_capped_frac, is_masked_frac, kl_mean, tv_mean, kl_pik_alpha_mean,
    is_weight_ess (the importance weights' effective sample size over the active tokens, a fraction),
    plus loss and num_tokens (nan when there is no active token); and over sequences, where the
    config needs whole sequences: num_seqs, seq_ratio_mean (GSPO's mean s_i), seq_capped_frac,
    seq_masked_frac (nan when no sequence was counted: the per-token paths)."""
    n = float(sums["num_tokens"])

    def mean(key: str) -> float:
        return float(sums[key]) / n if n > 0 else float("nan")

    out = {"loss": float(sums["loss"]), "num_tokens": n,
           "clip_low_frac": mean("clip_low_sum"), "clip_high_frac": mean("clip_high_sum"),
           "is_capped_frac": mean("is_capped_sum"), "kl_mean": mean("kl_sum"), "tv_mean": mean("tv_sum"),
           "kl_pik_alpha_mean": mean("kl_pik_alpha_sum")}
    out["clip_frac"] = out["clip_low_frac"] + out["clip_high_frac"]
    for sign in ("pos", "neg"):  # the clip fraction among the tokens of one sign of A (missing: none of it)
        among = float(sums[f"adv_{sign}_sum"])
        out[f"clip_frac_adv_{sign}"] = float(sums[f"clip_adv_{sign}_sum"]) / among if among > 0 else float("nan")
    for key in SQ_KEYS:
        m = mean(f"{key}_sum")
        out[f"{key}_mean"] = m
        out[f"{key}_std"] = math.sqrt(max(mean(f"{key}_sqsum") - m * m, 0.0)) if n > 0 else float("nan")
        out[f"{key}_max"] = float(sums[f"{key}_max"]) if n > 0 else float("nan")
        out[f"{key}_min"] = float(sums[f"{key}_min"]) if n > 0 else float("nan")
    out["is_masked_frac"] = mean("is_masked_sum")
    # Kish's effective sample size of the importance weights, as a fraction of the active tokens:
    # (sum w)^2 / (n sum w^2), 1 when every weight is equal, small when a few tokens carry the batch
    sq = float(sums["is_weight_sqsum"])
    out["is_weight_ess"] = float(sums["is_weight_sum"]) ** 2 / (n * sq) if n > 0 and sq > 0 else float("nan")
    seqs = float(sums["num_seqs"])
    out["num_seqs"] = seqs
    for key, name in (("seq_ratio_sum", "seq_ratio_mean"), ("seq_capped_sum", "seq_capped_frac"),
                      ("seq_masked_sum", "seq_masked_frac")):
        out[name] = float(sums[key]) / seqs if seqs > 0 else float("nan")
    return out


# The logged names of finalize_stats' keys (grpo.metrics.train_row logs every other key as named).
# kl is KL(pi || pi_ref) of eq. 7; tv_pik_alpha and kl_pik_alpha are the drift between the
# trainer's pi_k and the sampler alpha (Theorem 1's terms). num_seqs is not logged: the per-token
# paths cannot count sequences (0 there), and num_tokens says how many tokens the step saw.
LOGGED_AS = {"kl_mean": "kl", "tv_mean": "tv_pik_alpha", "kl_pik_alpha_mean": "kl_pik_alpha", "num_seqs": None}

STEP_STATS = metrics.declare_many("train", {
    "loss": "the objective's value (what is minimised)",
    "num_tokens": "active tokens of the step (weight > 0), all ranks",
    "clip_frac": "fraction of active tokens whose ratio is clipped (below or above the band)",
    "clip_low_frac": "... below the band",
    "clip_high_frac": "... above the band",
    "clip_frac_adv_pos": "among the tokens with A > 0, the fraction clipped (below or above the band: grpo's f_eps "
                         "and one-sided REC clip them only above, CISPO and two-sided / ring REC on either side); "
                         "missing when no token has A > 0",
    "clip_frac_adv_neg": "the same among the tokens with A < 0 (grpo's f_eps and one-sided REC: only below); missing "
                         "when no token has A < 0. Tokens with A = 0 are in neither",
    "kl": "KL(pi || pi_ref) of eq. 7 per token, with `objective.kl_estimator`",
    "ratio_mean": "the ratio r the clip acts on (`ratio_anchor: approx`: pi/pi_k; `exact`: pi/alpha), mean",
    "ratio_std": "... std", "ratio_min": "... min", "ratio_max": "... max",
    "is_weight_mean": "the importance weight pi_k/alpha after its correction, mean",
    "is_weight_std": "... std", "is_weight_min": "... min", "is_weight_max": "... max",
    "is_capped_frac": "fraction of tokens whose importance weight was truncated",
    "is_masked_frac": "fraction of tokens the correction masked out",
    "is_weight_ess": "Kish's effective sample size of the importance weights over the active tokens, as a fraction: "
                     "(sum w)^2 / (n sum w^2); 1 when all are equal, small when a few tokens carry the batch",
    "seq_ratio_mean": "mean over sequences of the geometric-mean ratio (GSPO's s_i), where the config needs whole "
                      "sequences",
    "seq_capped_frac": "fraction of sequences with a truncated weight (sequence-level configs)",
    "seq_masked_frac": "fraction of sequences with a masked weight (sequence-level configs)",
})
DRIFT_STATS = metrics.declare_many("bound", {
    "tv_pik_alpha": "TV(pi_k, alpha), estimated per token from sampled-token log-probs as |pi_k/alpha - 1| / 2",
    "kl_pik_alpha": "KL(alpha || pi_k), the k3 estimator w - 1 - log w with w = pi_k/alpha",
})


def logged_stats(stats: dict[str, float]) -> dict[str, float]:
    """finalize_stats' keys as a training row logs them (LOGGED_AS)."""
    out = {}
    for key, value in stats.items():
        name = LOGGED_AS.get(key, key)
        if name is not None:
            out[name] = value
    return out
