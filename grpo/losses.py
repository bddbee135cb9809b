"""The policy losses and the IS-weight corrections of the objective: one registered torch function each.

This file is the one place that names a loss. A loss is a function over the tokens of a
(micro-)batch, registered with its name, the config knobs it adds (each with its check), whether it
works per token or needs whole sequences, its equation and its paper:

    @register_loss("my_loss", per="token", equation="-A * log pi", paper="...", preset="my_loss")
    def my_loss(x: LossInputs, cfg) -> PolicyTerms:
        return PolicyTerms(loss=-x.adv * x.logp, ratio=torch.exp(x.logp.detach() - x.logp_alpha),
                           clip_low=torch.zeros_like(x.w), clip_high=torch.zeros_like(x.w))

Everything else follows from the registry: the config's accepted names (ObjectiveConfig.loss and
.is_correction) and knobs (grpo.objective.ObjectiveConfig gets every knob as a field), the presets
check (configs/objectives/<preset>.yaml), the tables of docs/objectives.md (`python -m grpo.losses
--write docs/objectives.md`), and the kernel parity tests (tests/test_kernels_loss.py, for the names
in kernels.LOSS_CODES). grpo/objective.py does what is common to every loss: the masking of
inactive tokens (eq. 8, padding), the IS-weight correction, the KL term of eq. 7, the aggregation
weights and the statistics.

A loss returns the per-token policy loss (what to minimise before the KL term and the aggregation
weights: the objective is sum_t weights_t * (loss_t + beta * kl_t)) and three detached per-token
diagnostics. A per="sequence" loss gives every token of a sequence its sequence's value (so the
aggregation keeps its meaning: under seq_mean, sum_t weights_t * l_i = l_i / num_seqs) and reads
whole sequences through x.seqs (per-sequence sums, means and lengths of any per-token tensor);
such a loss runs through the log-prob path with autograd, as the fused LM head computes each
token's gradient from that token alone.

Symbols (paper names): alpha = the policy that sampled the batch (`logp_alpha`, from the inference
server), pi_k = the trainer's policy at the start of the iteration (`logp_k`), pi = the policy being
optimised (`logp`), w = pi_k/alpha the importance weight, w_bar = w after the configured correction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from grpo import registry
from grpo.registry import Knob, in_unit_interval, non_negative


# ----------------------------------------------------------------------------------------------
# What a loss receives and returns
# ----------------------------------------------------------------------------------------------

@dataclass
class Sequences:
    """The sequence of every token: per-sequence sums and lengths for losses and corrections that
    need whole sequences (all [N] tensors are flat over the tokens, [S] over the sequences)."""

    index: Tensor  # [N] int64: the token's sequence, 0 .. count-1
    count: int  # S
    active: Tensor  # [N] bool: the token counts (weight != 0); the others are left out of every sum
    length: Tensor  # [S] number of active tokens of each sequence

    @classmethod
    def of(cls, seq_index: Tensor, active: Tensor, dtype: torch.dtype) -> "Sequences":
        ids, index = torch.unique(seq_index, return_inverse=True)
        count = int(ids.numel())
        length = torch.zeros(count, dtype=dtype, device=active.device).index_add(0, index, active.to(dtype))
        return cls(index=index, count=count, active=active, length=length)

    def sum(self, x: Tensor) -> Tensor:
        """[S] sum over each sequence's active tokens (differentiable)."""
        return torch.zeros(self.count, dtype=x.dtype, device=x.device).index_add(
            0, self.index, torch.where(self.active, x, torch.zeros((), dtype=x.dtype, device=x.device)))

    def mean(self, x: Tensor) -> Tensor:
        """[S] mean over each sequence's active tokens (0 for a sequence without any)."""
        return self.sum(x) / self.length.clamp(min=1.0)

    def per_token(self, per_seq: Tensor) -> Tensor:
        """[N] each token's value of its sequence."""
        return per_seq[self.index]


@dataclass
class LossInputs:
    """Flat [N] per-token tensors in the work dtype (fp32 or wider); inactive tokens hold 0."""

    logp: Tensor  # log pi, requires grad
    logp_k: Tensor  # log pi_k, detached (logp.detach() on the first SGD iteration: pi = pi_k)
    logp_alpha: Tensor  # log alpha, the sampler's
    adv: Tensor  # A of the token's sequence (eq. 2)
    w: Tensor  # pi_k / alpha
    w_bar: Tensor  # w after the correction (CORRECTIONS); = w when none
    kept: Tensor  # 0 where the correction masked the token out, else 1
    corrected: bool  # a correction is on: the approx anchor then weighs the loss by w_bar
    seqs: Optional[Sequences]  # the tokens' sequences; given to per="sequence" losses


class PolicyTerms(NamedTuple):
    loss: Tensor  # [N] per-token policy loss to minimise (before the KL term and the aggregation weights)
    ratio: Tensor  # [N] detached: the ratio the loss clips or weighs (logged as ratio_*)
    clip_low: Tensor  # [N] 0/1: the ratio left the band below (its gradient clipped away; CISPO: its weight clipped)
    clip_high: Tensor  # [N] 0/1: ... above


class CorrectedWeight(NamedTuple):
    w_bar: Tensor  # [N] the IS weight the loss sees
    capped: Tensor  # [N] 0/1: truncated (its weight, or its sequence's, was above is_cap)
    masked: Tensor  # [N] 0/1: masked out (its weight, or its sequence's, outside [is_floor, is_cap])


# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Loss:
    name: str
    fn: Callable[[LossInputs, Any], PolicyTerms]
    per: str  # "token": elementwise (a fused kernel can compute it); "sequence": needs whole sequences
    equation: str
    paper: str
    preset: Optional[str]  # configs/objectives/<preset>.yaml selects this loss
    knobs: tuple = ()
    check: Optional[Callable[[Any], None]] = None  # cross-field checks, run when the loss is selected
    anchored: bool = False  # reads ratio_anchor (exact: old = alpha; approx: old = pi_k)
    corrections: Optional[tuple] = None  # the IS-weight corrections it takes (None: all)
    clips: bool = True  # its clip_low / clip_high can be nonzero (tests check their batches exercise them)


@dataclass(frozen=True)
class Correction:
    name: str
    fn: Callable[[Tensor, Optional[Sequences], Any], CorrectedWeight]
    level: str  # "none" | "token" | "sequence" | "geometric"; the last two need whole sequences
    equation: str
    paper: str
    preset: Optional[str]
    check: Optional[Callable[[Any], None]] = None


LOSSES: dict[str, Loss] = {}
CORRECTIONS: dict[str, Correction] = {}


def register_loss(name: str, *, per: str = "token", equation: str, paper: str, preset: Optional[str] = None,
                  knobs: tuple = (), check: Optional[Callable[[Any], None]] = None, anchored: bool = False,
                  corrections: Optional[tuple] = None, clips: bool = True):
    """Decorator: register fn(x: LossInputs, cfg) -> PolicyTerms as the loss `name`."""
    if per not in ("token", "sequence"):
        raise ValueError(f"per: 'token' or 'sequence', got {per!r}")

    def register(fn):
        # its knobs become fields of ObjectiveConfig, also when registered late; a colliding one is refused
        registry.register(LOSSES, name, Loss(name, fn, per, equation, paper, preset, tuple(knobs), check, anchored,
                                             corrections, clips), "loss")
        return fn
    return register


def register_correction(name: str, *, level: str, equation: str, paper: str, preset: Optional[str] = None,
                        check: Optional[Callable[[Any], None]] = None):
    """Decorator: register fn(log_w [N], seqs, cfg) -> CorrectedWeight as the correction `name`."""
    if level not in ("none", "token", "sequence", "geometric"):
        raise ValueError(f"level: none, token, sequence or geometric, got {level!r}")

    def register(fn):
        registry.register(CORRECTIONS, name, Correction(name, fn, level, equation, paper, preset, check), "correction")
        return fn
    return register


def knobs() -> list[Knob]:
    """Every knob of the registered losses, once each, in registration order."""
    return registry.unique_knobs(loss.knobs for loss in LOSSES.values())


def owners() -> list[registry.Owner]:
    """The losses as owners of their knobs: a loss's knobs have an effect only while it is objective.loss."""
    return [registry.Owner("loss", loss.name, loss.knobs, loss.fn.__module__,
                           lambda cfg, name=loss.name: cfg.loss == name, f"objective.loss: {loss.name}")
            for loss in LOSSES.values()]


def correction_name(cfg) -> str:
    """The correction cfg selects: is_correction, or when it is null the legacy meaning of is_cap
    (token_truncate when set, none otherwise)."""
    if cfg.is_correction is not None:
        return cfg.is_correction
    return "token_truncate" if cfg.is_cap is not None else "none"


def needs_sequences(cfg) -> bool:
    """Whether cfg's objective reads whole sequences (a per="sequence" loss, or a sequence / geometric
    correction): then it runs on the log-probs with autograd, never in the fused per-token path."""
    return LOSSES[cfg.loss].per == "sequence" or CORRECTIONS[correction_name(cfg)].level in ("sequence", "geometric")


def check_config(cfg) -> None:
    """The registry's part of ObjectiveConfig.__post_init__: names, the section's knobs (each knob's
    check, and none set without its owner selected: grpo.registry.check_section), the selected
    loss's and correction's own checks (a user's names its file). Raises ValueError("<field>: why")."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss: must be one of {sorted(LOSSES)}, got {cfg.loss!r}")
    if cfg.is_correction is not None and cfg.is_correction not in CORRECTIONS:
        raise ValueError(f"is_correction: must be one of {sorted(CORRECTIONS)} or null, got {cfg.is_correction!r}")
    registry.check_section(cfg)
    loss, name = LOSSES[cfg.loss], correction_name(cfg)
    if loss.check:
        with registry.blame("loss", loss.name, loss.fn.__module__):
            loss.check(cfg)
    if loss.corrections is not None and name not in loss.corrections:
        raise ValueError(f"is_correction: loss {cfg.loss} takes {list(loss.corrections)}, got {name!r}")
    if CORRECTIONS[name].check:
        with registry.blame("correction", name, CORRECTIONS[name].fn.__module__):
            CORRECTIONS[name].check(cfg)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------

def anchored_ratio(x: LossInputs, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """(r, r', outer) of eq. 6 per token, by ratio_anchor:
      exact:  r = (pi/pi_k) * w_bar, r' = w_bar (= pi/alpha, pi_k/alpha when uncorrected), outer = 1;
      approx: r = pi/pi_k, r' = 1 (the paper's practice, Sec. 3.2), outer = w_bar when a correction
              is on (truncated / masked IS against the sampler-learner mismatch), else 1."""
    one = torch.ones_like(x.w)
    if cfg.ratio_anchor == "exact":
        return torch.exp(x.logp - x.logp_k) * x.w_bar, x.w_bar, one
    return torch.exp(x.logp - x.logp_k), one, x.w_bar if x.corrected else one


def clipped_surrogate(ratio: Tensor, anchor: Tensor, outer: Tensor, adv: Tensor, eps_low: float,
                      eps_high: float) -> PolicyTerms:
    """-outer * f_eps(r, r', A) of eq. 6, f = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A)."""
    lower = torch.clamp(anchor - eps_low, min=0.0)
    upper = anchor + eps_high
    clipped = torch.minimum(torch.maximum(ratio, lower), upper)
    surrogate = outer * torch.minimum(ratio * adv, clipped * adv)
    dtype = ratio.dtype
    return PolicyTerms(-surrogate, ratio.detach(), ((adv < 0) & (ratio < lower)).to(dtype),
                       ((adv > 0) & (ratio > upper)).to(dtype))


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------

@register_loss("grpo", anchored=True, preset="grpo", paper="2505.22257 eq. 6/7 (GRPO: Shao et al. 2024)",
               equation="-outer * min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A); "
                        "exact: r = (pi/pi_k) w_bar, r' = w_bar; "
                        "approx: r = pi/pi_k, r' = 1, outer = w_bar if corrected")
def grpo(x: LossInputs, cfg) -> PolicyTerms:
    """The clipped off-policy surrogate f_eps of eq. 6. While pi = pi_k (the first optimizer step on
    a batch) r = r' under both anchors, so no token is clipped: with i = 1 the update is REINFORCE
    with the weight w_bar (exact) or 1 (approx)."""
    ratio, anchor, outer = anchored_ratio(x, cfg)
    return clipped_surrogate(ratio, anchor, outer, x.adv, cfg.eps_low, cfg.eps_high)


@register_loss("reinforce", preset="reinforce", corrections=("none", "token_truncate"), clips=False,
               paper="2509.24203 (group-relative REINFORCE)",
               equation="-A log pi (no clip, no IS weight; is_cap unused)")
def reinforce(x: LossInputs, cfg) -> PolicyTerms:
    zero = torch.zeros_like(x.w)
    return PolicyTerms(-x.adv * x.logp, torch.exp(x.logp.detach() - x.logp_alpha), zero, zero)


def _rec(x: LossInputs, cfg, rule: str, importance_sampled: bool) -> PolicyTerms:
    """2509.24203 REC: -A * c * keep * log pi with r = pi/alpha (the behaviour policy; ratio_anchor
    does not apply) held constant, band [1 - eps_low, 1 + eps_high], c = stopgrad(r) (IS variants;
    truncated at is_cap if set) or 1 (NoIS), keep 0/1. The gradient -A c keep grad(log pi) is the
    authors' (Trinity-RFT rec_policy_loss); with IS and the one-sided mask it equals GRPO's clipped
    gradient with ratio pi/alpha."""
    dtype = x.w.dtype
    ratio = torch.exp(x.logp.detach() - x.logp_alpha)
    pos, neg = x.adv > 0, x.adv < 0
    below, above = ratio < 1.0 - cfg.eps_low, ratio > 1.0 + cfg.eps_high
    if rule == "oneside":  # only the side that would push the ratio further out
        drop_low, drop_high = neg & below, pos & above
    elif rule == "twoside":  # the whole band, whatever the sign of A
        drop_low, drop_high = below, above
    else:  # ring: the band, plus outer margins where a token pushing the ratio back keeps its gradient
        rescued = (pos & (ratio <= 1.0 - cfg.ring_eps_low)) | (neg & (ratio >= 1.0 + cfg.ring_eps_high))
        drop_low, drop_high = below & ~rescued, above & ~rescued
    keep = (~(drop_low | drop_high)).to(dtype)
    if importance_sampled:
        coef = torch.clamp(ratio, max=cfg.is_cap) if cfg.is_cap is not None else ratio
    else:
        coef = torch.ones_like(ratio)
    return PolicyTerms(-x.adv * coef * keep * x.logp, ratio, drop_low.to(dtype), drop_high.to(dtype))


_REC_PAPER = "2509.24203 (REC)"
_REC_CORRECTIONS = ("none", "token_truncate")  # is_cap truncates the IS variants' weight pi/alpha


@register_loss("rec_oneside_is", preset="rec_oneside_is", corrections=_REC_CORRECTIONS, paper=_REC_PAPER,
               equation="-A sg(r) keep log pi, r = pi/alpha; drop A>0 with r > 1+eps_high, A<0 with r < 1-eps_low")
def rec_oneside_is(x: LossInputs, cfg) -> PolicyTerms:
    return _rec(x, cfg, "oneside", importance_sampled=True)


@register_loss("rec_oneside_nois", preset="rec_oneside_nois", corrections=_REC_CORRECTIONS, paper=_REC_PAPER,
               equation="-A keep log pi, keep as rec_oneside_is")
def rec_oneside_nois(x: LossInputs, cfg) -> PolicyTerms:
    return _rec(x, cfg, "oneside", importance_sampled=False)


@register_loss("rec_twoside_is", preset="rec_twoside_is", corrections=_REC_CORRECTIONS, paper=_REC_PAPER,
               equation="-A sg(r) keep log pi, keep = 1[1-eps_low <= r <= 1+eps_high]")
def rec_twoside_is(x: LossInputs, cfg) -> PolicyTerms:
    return _rec(x, cfg, "twoside", importance_sampled=True)


def _check_ring(cfg) -> None:
    # The outer margins lie beyond the inner band (1 - eps_low, 1 + eps_high).
    if not cfg.eps_low < cfg.ring_eps_low <= 1.0:
        raise ValueError(f"ring_eps_low: must be in (eps_low, 1] (outer margin beyond the inner band), "
                         f"got {cfg.ring_eps_low}")
    if not cfg.ring_eps_high > cfg.eps_high:
        raise ValueError(f"ring_eps_high: must be > eps_high (outer margin beyond the inner band), "
                         f"got {cfg.ring_eps_high}")


@register_loss("rec_ring_nois", preset="rec_ring_nois", corrections=_REC_CORRECTIONS, paper=_REC_PAPER,
               check=_check_ring,
               knobs=(Knob("ring_eps_low", 0.6, float, "outer margin: an A>0 token with pi/alpha <= 1 - ring_eps_low "
                           "keeps its gradient"),
                      Knob("ring_eps_high", 2.0, float, "outer margin: an A<0 token with pi/alpha >= 1 + ring_eps_high "
                           "keeps its gradient")),
               equation="-A keep log pi; keep: inside the band, or A>0 with r <= 1-ring_eps_low, "
                        "or A<0 with r >= 1+ring_eps_high")
def rec_ring_nois(x: LossInputs, cfg) -> PolicyTerms:
    return _rec(x, cfg, "ring", importance_sampled=False)


@register_loss("cispo", anchored=True, preset="cispo", paper="2506.13585 (MiniMax-M1, CISPO)",
               knobs=(Knob("eps_low_is", 1.0, float, "CISPO: lower clip of its IS weight, 1 - eps_low_is (1: no "
                           "lower bound, as the paper)", in_unit_interval),
                      Knob("eps_high_is", 0.28, float, "CISPO: upper clip of its IS weight, 1 + eps_high_is (the "
                           "paper tunes only this one)", non_negative)),
               equation="-outer * sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) A log pi, r and outer as grpo's "
                        "(exact: outer = 1 - masked)")
def cispo(x: LossInputs, cfg) -> PolicyTerms:
    """REINFORCE with a clipped, stopped-gradient IS weight: every token keeps a gradient (a clip
    bounds its weight instead of removing it, so rare tokens are never dropped). Use with
    aggregation: token_mean (the paper's). Under the exact anchor a masked token has r = 0, which
    the clip could raise back above 0: it is dropped explicitly."""
    ratio, _, outer = anchored_ratio(x, cfg)
    if cfg.ratio_anchor == "exact":
        outer = x.kept
    lower, upper = 1.0 - cfg.eps_low_is, 1.0 + cfg.eps_high_is
    coef = torch.clamp(ratio.detach(), min=lower, max=upper)
    dtype = ratio.dtype
    return PolicyTerms(-outer * coef * x.adv * x.logp, ratio.detach(), (ratio < lower).to(dtype),
                       (ratio > upper).to(dtype))


_GSPO_KNOBS = (
    Knob("gspo_eps_low", 3e-4, float, "GSPO: lower clip width of the sequence ratio s_i (the paper's 3e-4)",
         in_unit_interval),
    Knob("gspo_eps_high", 4e-4, float, "GSPO: upper clip width of the sequence ratio s_i (the paper's 4e-4)",
         non_negative),
)


def sequence_ratio(x: LossInputs, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """(s, s', outer) per token: GSPO's sequence ratio s_i, the geometric mean over the sequence's
    tokens of grpo's token ratio r_t (anchored_ratio), and its anchor s'_i, the same mean of r'_t:
      approx: s_i = exp(mean_t log(pi/pi_k)), s'_i = 1, outer = w_bar when corrected, else 1;
      exact:  s_i = exp(mean_t log(pi/pi_k)) * s'_i, s'_i = exp(mean_t log w_bar) (= (pi/alpha)^(1/|y|)
              and (pi_k/alpha)^(1/|y|) uncorrected), outer = 1; a token masked by a token-level
              correction has w_bar = 0, which zeroes its sequence's s and s' (the sequence drops out)."""
    seqs = x.seqs
    mean_log_ratio = seqs.mean(x.logp - x.logp_k)
    one = torch.ones_like(x.w)
    if cfg.ratio_anchor == "exact":
        log_anchor = seqs.mean(torch.log(x.w_bar))
        return seqs.per_token(torch.exp(mean_log_ratio + log_anchor)), seqs.per_token(torch.exp(log_anchor)), one
    return seqs.per_token(torch.exp(mean_log_ratio)), one, x.w_bar if x.corrected else one


def _check_gspo(cfg) -> None:
    """GSPO's ratio s_i is length-normalised (a geometric mean); under the exact anchor its anchor
    s'_i is the geometric mean of w_bar, which a sequence-level correction sets to min(rho_i, C) on
    every token: a product over the sequence, not length-normalised, so even a cap that never binds
    would change the loss (s'_i = rho_i instead of rho_i^(1/|y|)). The geometric level bounds the
    same length-normalised weight GSPO's ratio uses: that is the consistent choice."""
    name = correction_name(cfg)
    if cfg.ratio_anchor == "exact" and CORRECTIONS[name].level == "sequence":
        geometric = name.replace("sequence_", "geometric_")
        raise ValueError(f"is_correction: {name} under ratio_anchor exact gives {cfg.loss}'s anchor the product "
                         f"min(rho_i, is_cap), while its ratio is a per-token geometric mean; use {geometric} (the "
                         f"same bound on the length-normalised weight), or ratio_anchor approx")


@register_loss("gspo", per="sequence", anchored=True, preset="gspo", knobs=_GSPO_KNOBS, check=_check_gspo,
               paper="2507.18071 (GSPO)",
               equation="-outer * min(s_i A_i, clip(s_i, max(s'_i - gspo_eps_low, 0), s'_i + gspo_eps_high) A_i), "
                        "s_i = exp(mean_t log(pi/old)) per sequence")
def gspo(x: LossInputs, cfg) -> PolicyTerms:
    """Group Sequence Policy Optimization: eq. 6's clip on one length-normalised ratio per sequence,
    so a sequence is clipped whole (d s_i / d log pi_t = s_i / |y_i| for each of its tokens)."""
    s, anchor, outer = sequence_ratio(x, cfg)
    return clipped_surrogate(s, anchor, outer, x.adv, cfg.gspo_eps_low, cfg.gspo_eps_high)


@register_loss("gspo_token", per="sequence", anchored=True, preset="gspo_token", knobs=_GSPO_KNOBS, check=_check_gspo,
               paper="2507.18071 (GSPO-token)",
               equation="as gspo with s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)]")
def gspo_token(x: LossInputs, cfg) -> PolicyTerms:
    """GSPO-token: every token carries its sequence's ratio as value, sg[s_i] * pi_t / sg[pi_t], so
    its gradient is outer_t s_i grad log pi_t, where GSPO's spreads the sequence's mean of outer_t
    over its tokens. With one advantage per sequence the two are the same update exactly when outer
    is constant within each sequence: always under ratio_anchor exact (outer = 1), and under approx
    with no correction or a sequence / geometric one; a token-level correction under approx
    (outer = w_bar_t) makes them differ. The form admits per-token advantages."""
    s, anchor, outer = sequence_ratio(x, cfg)
    s_token = s.detach() * torch.exp(x.logp - x.logp.detach())
    return clipped_surrogate(s_token, anchor, outer, x.adv, cfg.gspo_eps_low, cfg.gspo_eps_high)


# ----------------------------------------------------------------------------------------------
# Corrections of the IS weight w = pi_k/alpha (the sampler-learner mismatch)
# ----------------------------------------------------------------------------------------------

def _bound(value: Tensor, cfg, mode: str) -> CorrectedWeight:
    """TIS (truncate: min(v, is_cap)) or MIS (mask: v * 1[is_floor <= v <= is_cap]) of a weight v."""
    zero = torch.zeros_like(value)
    if mode == "truncate":
        return CorrectedWeight(torch.clamp(value, max=cfg.is_cap), (value > cfg.is_cap).to(value.dtype), zero)
    kept = value <= cfg.is_cap
    if cfg.is_floor is not None:
        kept = kept & (value >= cfg.is_floor)
    return CorrectedWeight(torch.where(kept, value, zero), zero, (~kept).to(value.dtype))


def _check_needs_cap(cfg) -> None:
    if cfg.is_cap is None:
        raise ValueError(f"is_cap: is_correction {correction_name(cfg)} needs its upper threshold is_cap")


def _check_truncate(cfg) -> None:
    _check_needs_cap(cfg)
    if cfg.is_floor is not None:
        raise ValueError("is_floor: truncation has no lower threshold (the *_mask corrections have one)")


def _check_mask(cfg) -> None:
    _check_needs_cap(cfg)
    if cfg.is_floor is not None and not cfg.is_floor < cfg.is_cap:
        raise ValueError(f"is_floor: must be < is_cap, got {cfg.is_floor}")


def _check_none(cfg) -> None:
    if cfg.is_floor is not None:
        raise ValueError("is_floor: set, but no correction is selected (is_correction)")
    if cfg.is_correction == "none" and cfg.is_cap is not None:
        raise ValueError("is_cap: set, but is_correction is none")


_TIS = "Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training' (TIS)"
_MIS = "Liu, Li et al. 2025, 'When speed kills stability' (MIS, sequence and geometric levels)"


@register_correction("none", level="none", check=_check_none, paper="-", preset=None, equation="w_bar = w")
def no_correction(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    w = torch.exp(log_w)
    return CorrectedWeight(w, torch.zeros_like(w), torch.zeros_like(w))


@register_correction("token_truncate", level="token", check=_check_truncate, paper=_TIS, preset="tis",
                     equation="w_bar_t = min(w_t, is_cap) (is_cap alone selects it: today's truncated IS)")
def token_truncate(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _bound(torch.exp(log_w), cfg, "truncate")


@register_correction("token_mask", level="token", check=_check_mask, paper=_MIS, preset="mis",
                     equation="w_bar_t = w_t 1[is_floor <= w_t <= is_cap] (is_floor null: no lower bound)")
def token_mask(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _bound(torch.exp(log_w), cfg, "mask")


def _check_icepop(cfg) -> None:
    _check_mask(cfg)
    if cfg.is_floor is None:
        raise ValueError("is_floor: icepop masks on both sides: set is_floor (and is_cap)")


@register_correction("icepop", level="token", check=_check_icepop, preset="icepop",
                     paper="IcePop (inclusionAI Ling team 2025, the Ring-1T report)",
                     equation="w_bar_t = w_t 1[is_floor <= w_t <= is_cap], both bounds required: tokens whose "
                              "pi_k/alpha leaves the band drop out")
def icepop(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _bound(torch.exp(log_w), cfg, "mask")


def _sequence_level(value_per_seq: Tensor, seqs: Sequences, cfg, mode: str) -> CorrectedWeight:
    bounded = _bound(value_per_seq, cfg, mode)
    return CorrectedWeight(*(seqs.per_token(t) for t in bounded))


@register_correction("sequence_truncate", level="sequence", check=_check_truncate, paper=_MIS, preset="seq_tis",
                     equation="w_bar_t = min(rho_i, is_cap), rho_i = prod_t w_t over the sequence")
def sequence_truncate(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _sequence_level(torch.exp(seqs.sum(log_w)), seqs, cfg, "truncate")


@register_correction("sequence_mask", level="sequence", check=_check_mask, paper=_MIS, preset="seq_mis",
                     equation="w_bar_t = rho_i 1[is_floor <= rho_i <= is_cap], rho_i = prod_t w_t")
def sequence_mask(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _sequence_level(torch.exp(seqs.sum(log_w)), seqs, cfg, "mask")


@register_correction("geometric_truncate", level="geometric", check=_check_truncate, paper=_MIS, preset="geo_tis",
                     equation="w_bar_t = min(g_i, is_cap), g_i = exp(mean_t log w_t) over the sequence")
def geometric_truncate(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _sequence_level(torch.exp(seqs.mean(log_w)), seqs, cfg, "truncate")


@register_correction("geometric_mask", level="geometric", check=_check_mask, paper=_MIS, preset="geo_mis",
                     equation="w_bar_t = g_i 1[is_floor <= g_i <= is_cap], g_i = exp(mean_t log w_t)")
def geometric_mask(log_w: Tensor, seqs: Optional[Sequences], cfg) -> CorrectedWeight:
    return _sequence_level(torch.exp(seqs.mean(log_w)), seqs, cfg, "mask")


# ----------------------------------------------------------------------------------------------
# docs/objectives.md's tables, from the registry
# ----------------------------------------------------------------------------------------------

DOCS_BEGIN = "<!-- generated by `python -m grpo.losses --write docs/objectives.md`: begin -->"
DOCS_END = "<!-- generated: end -->"


def markdown() -> str:
    """The tables of docs/objectives.md: every registered loss and correction."""
    import kernels

    cell = registry.cell
    lines = ["### Losses (`objective.loss`)", "",
             "| loss | per | fused kernel | equation (per token, to minimise) | knobs | preset | paper |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for loss in LOSSES.values():
        knob_names = (["`ratio_anchor`"] if loss.anchored else []) + [f"`{k.name}`" for k in loss.knobs]
        preset = f"`objectives/{loss.preset}.yaml`" if loss.preset else "-"
        kernel = "yes" if loss.name in kernels.LOSS_CODES else "no (torch)"
        lines.append(f"| `{loss.name}` | {loss.per} | {kernel} | {cell(loss.equation)} "
                     f"| {', '.join(knob_names) or '-'} | {preset} | {cell(loss.paper)} |")
    lines += ["", "### Knobs the losses add (`objective.<knob>`)", "", "| knob | default | of | meaning |",
              "| --- | --- | --- | --- |"]
    for knob in knobs():
        owners = ", ".join(f"`{loss.name}`" for loss in LOSSES.values() if knob in loss.knobs)
        lines.append(f"| `{knob.name}` | {knob.default} | {owners} | {cell(knob.doc)} |")
    lines += ["", "### Corrections of the IS weight w = pi_k/alpha (`objective.is_correction`)", "",
              "| correction | level | fused kernel | equation | preset | paper |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in CORRECTIONS.values():
        preset = f"`objectives/{c.preset}.yaml`" if c.preset else "-"
        kernel = "yes" if c.name in kernels.CORRECTION_CODES else "no (torch)"
        lines.append(f"| `{c.name}` | {c.level} | {kernel} | {cell(c.equation)} | {preset} | {cell(c.paper)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.exit(registry.docs_main("grpo.losses"))  # [--write FILE] [--plugins P ...] [--config C]
