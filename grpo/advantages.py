"""Advantages: one registered torch function per estimator, and the steps around it (RED, eq. 8).

A batch of B prompts x G completions has rewards r [B, G]. Its advantages and sequence weights
come from a pipeline of registered functions, each with its name, knobs, equation and paper:

  1. select steps   keep [B, G] bool: which samples the estimator sees (RED-Drop drops excess negatives)
  2. the estimator  A [B, G] from r and keep (`objective.advantage`: group, batch, none, rloo, reinforce_pp)
  3. weight steps   seq_weight [B, G]: eq. 8's zero-variance mask, RED-Weight's exp(A / tau)

    @register_advantage("my_adv", equation="A = r - median_g(r)", paper="...")
    def my_adv(r: Tensor, keep: Tensor, cfg) -> Tensor:          # [B, G] float64 -> [B, G]
        ...

A step runs when its switch in the config is on (`enabled`); steps run in registration order
within their phase. `group_advantages` runs the pipeline on a flat [B*G] tensor and adds the
batch's statistics (the bound's M among them); `batch_advantages` is the one function sampling
(grpo/rollout.py) and replay (grpo/recording.py) both call for a batch. The tables of
docs/objectives.md come from the registry (`python -m grpo.advantages --write docs/objectives.md`).

Variance: POPULATION variance (divide by G), sigma^2 = mean_i (r_i - mean)^2. Eq. 2 defines
sigma^2_{alpha,r} = E_{y~alpha}(r - mu)^2 and the plug-in estimate of that is the population
formula; with 0/1 rewards it equals p(1-p) of the Bernoulli used in the paper's discussion of
(1 - sigma)/sigma, and it keeps sigma <= 1/2 for rewards in [0, 1] as Theorem 1 needs. (TRL's
torch.std is the sample variance: a factor sqrt(G/(G-1)), 1.03 at G = 16.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from grpo import metrics, registry
from grpo.registry import Knob, positive

# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advantage:
    name: str
    fn: Callable[[Tensor, Tensor, Any], Tensor]  # (r [B, G] float64, keep [B, G] bool, cfg) -> A [B, G]
    equation: str
    paper: str
    preset: Optional[str]  # configs/objectives/<preset>.yaml selects it
    knobs: tuple = ()


@dataclass(frozen=True)
class Step:
    name: str
    fn: Callable  # select: (r, keep, cfg, generator) -> keep; weight: (r, adv, weight, cfg) -> weight
    phase: str  # "select" (before the estimator) or "weight" (after it)
    enabled: Callable[[Any], bool]  # cfg -> whether the step runs
    switch: str  # the config that turns it on, as the docs show it
    equation: str
    paper: str
    knobs: tuple = ()


ADVANTAGES: dict[str, Advantage] = {}
STEPS: dict[str, Step] = {}


def register_advantage(name: str, *, equation: str, paper: str, preset: Optional[str] = None, knobs: tuple = ()):
    """Decorator: register fn(r, keep, cfg) -> A as the estimator `name` (`objective.advantage`).
    r [B, G] float64 rewards, keep [B, G] bool (the samples the select steps kept); A must be 0
    where keep is False."""

    def register(fn):
        registry.register(ADVANTAGES, name, Advantage(name, fn, equation, paper, preset, tuple(knobs)), "advantage")
        return fn
    return register


def register_step(name: str, *, phase: Literal["select", "weight"], enabled: Callable[[Any], bool], switch: str,
                  equation: str, paper: str, knobs: tuple = ()):
    """Decorator: register a step of the pipeline. select: fn(r, keep, cfg, generator) -> keep (a
    random choice draws from `generator`, seeded per batch); weight: fn(r, adv, weight, cfg) ->
    weight, the sequence weight that multiplies a sample's whole loss (eq. 8)."""
    if phase not in ("select", "weight"):
        raise ValueError(f"phase: 'select' or 'weight', got {phase!r}")

    def register(fn):
        registry.register(STEPS, name, Step(name, fn, phase, enabled, switch, equation, paper, tuple(knobs)),
                          "advantage step")
        return fn
    return register


def knobs() -> list[Knob]:
    """Every knob of the registered estimators and steps, once each."""
    return registry.unique_knobs([*(a.knobs for a in ADVANTAGES.values()), *(s.knobs for s in STEPS.values())])


def owners() -> list[registry.Owner]:
    """The estimators and steps as owners of their knobs: an estimator's knobs have an effect while it
    is objective.advantage, a step's while it is on (its switch, a knob with selects=True, always)."""
    return [*(registry.Owner("advantage", a.name, a.knobs, a.fn.__module__,
                             lambda cfg, name=a.name: cfg.advantage == name, f"objective.advantage: {a.name}")
              for a in ADVANTAGES.values()),
            *(registry.Owner("advantage step", s.name, s.knobs, s.fn.__module__, s.enabled, "objective." + s.switch.strip("`"))
              for s in STEPS.values())]


def check_config(cfg) -> None:
    """The registry's part of ObjectiveConfig.__post_init__: the estimator's name (its knobs and the
    steps' are checked with the section's, grpo.registry.check_section)."""
    if cfg.advantage not in ADVANTAGES:
        raise ValueError(f"advantage: must be one of {sorted(ADVANTAGES)}, got {cfg.advantage!r}")


# ----------------------------------------------------------------------------------------------
# The pipeline and a batch's statistics
# ----------------------------------------------------------------------------------------------

STATS = metrics.declare_many("rollout", {
    "reward_mean": "reward over the batch",
    "reward_std": "reward's population std over the batch",
    "group_std_mean": "mean over groups of the group's reward std",
    "zero_var_frac": "fraction of groups whose G rewards are all equal",
    "masked_frac": "fraction of completions the weight steps gave weight 0 (eq. 8)",
    "red_drop_frac": "fraction of completions RED-Drop dropped (`objective.red: drop`)",
    "seq_weight_mean": "mean per-sequence weight (eq. 8 masking, RED)",
})
BOUND_STATS = metrics.declare_many("bound", {
    "bound_M": "M_{alpha,r,eps} = sqrt(mean_x (1 - sigma_eps(x))^2 / sigma_eps(x)^2) from the group variances of the "
               "rewards scaled to [0, 1] by the reward's range (after Corollary 1)",
    "bound_M_nonzero": "the same over groups with nonzero variance only (what eq. 8 masking leaves in the bound)",
})


def group_advantages(rewards: Tensor, group_size: int, cfg, *, generator: Optional[torch.Generator] = None,
                     reward_range: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, Tensor, dict]:
    """(A, seq_weight, stats) for a flat batch of B*G rewards, by cfg's estimator and steps.

    rewards [B*G], grouped consecutively (prompt b owns rows b*G .. b*G+G-1); pass the WHOLE batch
    (group and batch statistics are taken over what is passed). seq_weight [B*G] multiplies a
    sample's whole loss (surrogate and KL, as in eq. 8); a sample a select step dropped has A = 0
    and weight 0.

    stats (python floats): reward_mean, reward_std (batch, population), group_std_mean,
    zero_var_frac (fraction of groups with equal rewards), masked_frac (fraction of samples the
    weight steps gave weight 0: eq. 8), red_drop_frac (fraction the select steps dropped),
    seq_weight_mean, bound_M = M_{alpha,r,eps} = sqrt(mean_x (1 - sigma_eps(x))^2 / sigma_eps(x)^2)
    with sigma_eps = sqrt(var_g + adv_eps) (definition after Corollary 1; Theorem 1 takes rewards
    in [0, 1], so the variances are those of (r - lo) / (hi - lo) for the reward's `reward_range`
    [lo, hi], grpo.rewards.reward_range) and bound_M_nonzero, the same over groups with nonzero
    variance only (what eq. 8 masking leaves in the bound).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a flat [B*G] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size: {rewards.numel()} rewards do not split into groups of {group_size}")
    if rewards.numel() == 0:
        raise ValueError("rewards: empty batch")
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"rewards: non-finite value at row {bad}: {rewards[bad].item()}")
    lo, hi = reward_range
    if not hi > lo:
        raise ValueError(f"reward_range: expected lo < hi, got {reward_range}")
    out_device, out_dtype = rewards.device, torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to("cpu", torch.float64).view(-1, group_size)  # [B, G]

    keep = torch.ones_like(r, dtype=torch.bool)
    for step in _steps("select", cfg):
        keep = step.fn(r, keep, cfg, generator)
    adv = ADVANTAGES[cfg.advantage].fn(r, keep, cfg)
    seq_weight = keep.to(r.dtype)
    for step in _steps("weight", cfg):
        seq_weight = step.fn(r, adv, seq_weight, cfg)

    zero_var = r.max(dim=1).values == r.min(dim=1).values  # [B] exact equality: "all equal"
    stats = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "group_std_mean": float(r.var(dim=1, unbiased=False).sqrt().mean()),
        "zero_var_frac": float(zero_var.to(r.dtype).mean()),
        "masked_frac": float((keep & (seq_weight == 0)).to(r.dtype).mean()),
        "red_drop_frac": float((~keep).to(r.dtype).mean()),
        "seq_weight_mean": float(seq_weight.mean()),
        **bound_M((r - lo) / (hi - lo), zero_var, cfg.adv_eps),
    }
    return adv.flatten().to(out_device, out_dtype), seq_weight.flatten().to(out_device, out_dtype), stats


def _steps(phase: str, cfg) -> list[Step]:
    return [s for s in STEPS.values() if s.phase == phase and s.enabled(cfg)]


def bound_M(r01: Tensor, zero_var: Tensor, adv_eps: float) -> dict[str, float]:
    """M_{alpha,r,eps} of Theorem 1 / eq. 4 from the full groups of rewards in [0, 1] (the bound is
    about alpha's rewards, whatever the steps kept), and the same over nonzero-variance groups."""
    sigma_eps = torch.sqrt(r01.var(dim=1, unbiased=False) + adv_eps)
    m_terms = (1.0 - sigma_eps) ** 2 / sigma_eps ** 2
    nonzero = ~zero_var
    return {"bound_M": float(m_terms.mean().sqrt()),
            "bound_M_nonzero": float(m_terms[nonzero].mean().sqrt()) if nonzero.any() else float("nan")}


def batch_advantages(rewards: Sequence[float], cfg, seed: int) -> tuple[list[float], list[float], dict]:
    """A batch's advantages, sequence weights and statistics under the TrainConfig `cfg` (its
    grpo.G, objective and reward range): what sampling (grpo/rollout.py) and replay
    (grpo/recording.py) both call, so a replayed batch under the run's own config gets the numbers
    it was trained on. `seed` is the batch's (train.batch_seed): RED-Drop's choices repeat."""
    from grpo.rewards import reward_range

    adv, seq_weight, stats = group_advantages(torch.tensor(list(rewards), dtype=torch.float64), cfg.grpo.G,
                                              cfg.objective, generator=torch.Generator().manual_seed(seed),
                                              reward_range=reward_range(cfg.reward, cfg.grpo.max_new_tokens))
    return adv.tolist(), seq_weight.tolist(), stats


# ----------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------

def kept_moments(r: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(n, mean, population variance) [B, 1] of each group's kept rewards."""
    n = keep.sum(dim=1, keepdim=True).to(r.dtype)
    mean = (r * keep).sum(dim=1, keepdim=True) / n
    var = (((r - mean) ** 2) * keep).sum(dim=1, keepdim=True) / n
    return n, mean, var


ADV_EPS = Knob("adv_eps", 1e-4, float, "epsilon of eq. 2, under the square root: A = (r - mu) / sqrt(sigma^2 + eps); "
               "the theorem needs 0 < eps < 1 (also the floor of bound_M's sigma_eps)",
               lambda v: None if 0.0 < v < 1.0 else "must be in (0, 1) (Theorem 1 of 2505.22257)")
_GRPO = "2505.22257 eq. 2 (GRPO: Shao et al. 2024)"


@register_advantage("group", preset="grpo", knobs=(ADV_EPS,), paper=_GRPO,
                    equation="A_i = (r_i - mean_g) / sqrt(var_g + adv_eps), over the group's kept samples")
def group(r: Tensor, keep: Tensor, cfg) -> Tensor:
    _, mean, var = kept_moments(r, keep)
    return (r - mean) * keep / torch.sqrt(var + cfg.adv_eps)


@register_advantage("batch", knobs=(ADV_EPS,), paper="Liu et al. 2025, 'Tricks or Traps? A Deep Dive into RL for LLM Reasoning' (group mean, batch std)",
                    equation="A_i = (r_i - mean_g) / sqrt(var_batch + adv_eps), var_batch over every reward of the batch")
def batch(r: Tensor, keep: Tensor, cfg) -> Tensor:
    _, mean, _ = kept_moments(r, keep)
    return (r - mean) * keep / math.sqrt(float(r.var(unbiased=False)) + cfg.adv_eps)


@register_advantage("none", preset="dr_grpo", paper="2503.20783 (Dr. GRPO); 2509.24203 (REINFORCE / REC)",
                    equation="A_i = r_i - mean_g (no std)")
def none(r: Tensor, keep: Tensor, cfg) -> Tensor:
    _, mean, _ = kept_moments(r, keep)
    return (r - mean) * keep


@register_advantage("rloo", preset="rloo", paper="Ahmadian et al. 2024 (RLOO, 2402.14740); Kool et al. 2019",
                    equation="A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g), n kept samples (0 when n = 1)")
def rloo(r: Tensor, keep: Tensor, cfg) -> Tensor:
    n, mean, _ = kept_moments(r, keep)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1.0), torch.zeros_like(n))
    return (r - mean) * keep * scale


@register_advantage("reinforce_pp", preset="reinforce_pp", knobs=(ADV_EPS,),
                    paper="Hu et al. 2025 (REINFORCE++-baseline, 2501.03262)",
                    equation="c_i = r_i - mean_g; A_i = (c_i - mean_B c) / sqrt(var_B c + adv_eps), mean and var "
                             "over the batch's kept samples")
def reinforce_pp(r: Tensor, keep: Tensor, cfg) -> Tensor:
    """The group mean as baseline, then the batch's normalisation of the centred rewards (per
    sequence: each sample counts once, where the paper's token-level whitening counts its tokens)."""
    _, mean, _ = kept_moments(r, keep)
    c = (r - mean) * keep
    n = keep.sum().to(r.dtype)
    mu = c.sum() / n
    var = (((c - mu) ** 2) * keep).sum() / n
    return (c - mu) * keep / torch.sqrt(var + cfg.adv_eps)


# ----------------------------------------------------------------------------------------------
# Steps: RED (2509.24203) and eq. 8
# ----------------------------------------------------------------------------------------------

RED = Knob("red", "none", Literal["none", "drop", "weight"], "2509.24203 RED. drop: drop random excess negatives of a "
           "group so #neg <= #pos. weight: w_i = exp(A_i / red_tau)",
           lambda v: None if v in ("none", "drop", "weight") else "must be one of ['none', 'drop', 'weight']",
           selects=True)
_RED = "2509.24203 (RED)"


@register_step("red_drop", phase="select", enabled=lambda cfg: cfg.red == "drop", switch="`red: drop`", knobs=(RED,),
               paper=_RED, equation="a group with more negatives (r < mean) than positives (r >= mean) drops its "
                                    "excess negatives at random (A = 0, weight 0); the estimator sees the kept ones")
def red_drop(r: Tensor, keep: Tensor, cfg, generator: Optional[torch.Generator]) -> Tensor:
    """As the authors' Trinity-RFT code: the kept samples' mean (and std) are the estimator's."""
    keep = keep.clone()
    is_pos = r >= r.mean(dim=1, keepdim=True)
    for b in range(r.shape[0]):
        neg_idx = (~is_pos[b]).nonzero().flatten()
        excess = len(neg_idx) - int(is_pos[b].sum())
        if excess > 0:
            drop = neg_idx[torch.randperm(len(neg_idx), generator=generator)[:excess]]
            keep[b, drop] = False
    return keep


@register_step("zero_variance_mask", phase="weight", enabled=lambda cfg: cfg.mask_zero_variance,
               switch="`mask_zero_variance: true`", paper="2505.22257 eq. 8 (DAPO's filter, grounded by Theorem 1)",
               knobs=(Knob("mask_zero_variance", False, bool, "eq. 8: a group whose G rewards are all equal gets "
                           "weight 0 (DAPO's filter, grounded by Theorem 1)", selects=True),),
               equation="weight_i = 0 for every sample of a group whose G rewards are all equal")
def zero_variance_mask(r: Tensor, adv: Tensor, weight: Tensor, cfg) -> Tensor:
    zero_var = r.max(dim=1).values == r.min(dim=1).values
    return weight * (~zero_var).to(r.dtype).unsqueeze(1)


@register_step("red_weight", phase="weight", enabled=lambda cfg: cfg.red == "weight", switch="`red: weight`",
               paper=_RED, knobs=(RED, Knob("red_tau", 1.0, float, "temperature of RED-Weight", positive)),
               equation="weight_i = weight_i * exp(A_i / red_tau), A_i the estimator's")
def red_weight(r: Tensor, adv: Tensor, weight: Tensor, cfg) -> Tensor:
    return weight * torch.exp(adv / cfg.red_tau)


# ----------------------------------------------------------------------------------------------
# docs/objectives.md's advantage tables, from the registry
# ----------------------------------------------------------------------------------------------

DOCS_BEGIN = "<!-- generated by `python -m grpo.advantages --write docs/objectives.md`: begin -->"
DOCS_END = "<!-- generated by grpo.advantages: end -->"


def markdown() -> str:
    cell = registry.cell
    lines = ["### Advantages (`objective.advantage`)", "",
             "| advantage | equation | knobs | preset | paper |", "| --- | --- | --- | --- | --- |"]
    for a in ADVANTAGES.values():
        preset = f"`objectives/{a.preset}.yaml`" if a.preset else "-"
        knob_names = ", ".join(f"`{k.name}`" for k in a.knobs) or "-"
        lines.append(f"| `{a.name}` | {cell(a.equation)} | {knob_names} | {preset} | {cell(a.paper)} |")
    lines += ["", "### Steps around the estimator (select: before it; weight: after it, in this order)", "",
              "| step | phase | on with | equation | knobs | paper |", "| --- | --- | --- | --- | --- | --- |"]
    for s in STEPS.values():
        knob_names = ", ".join(f"`{k.name}`" for k in s.knobs) or "-"
        lines.append(f"| `{s.name}` | {s.phase} | {s.switch} | {cell(s.equation)} | {knob_names} | {cell(s.paper)} |")
    lines += ["", "### Knobs of the advantages and steps (`objective.<knob>`)", "",
              "| knob | default | meaning |", "| --- | --- | --- |"]
    for knob in knobs():
        lines.append(f"| `{knob.name}` | {knob.default} | {cell(knob.doc)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.exit(registry.docs_main("grpo.advantages"))  # [--write FILE] [--plugins P ...] [--config C]
