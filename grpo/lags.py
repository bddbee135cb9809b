"""The off-policy instruments by lag: how far behind each token's sampler was, and what that did.

Every sampling regime (grpo/batch_source.py) stamps each token with the weights version that
sampled it, so a batch's tokens fall into lags: pushes between that version and the newest one
(0 in Algorithm 1's windows; `grpo.lag` with one push per iteration puts every token at L; the
asynchronous sampler mixes several), and optimizer steps from its push to the batch's first step.
These registered instruments (grpo/instruments.py) report, per batch, the mean and largest lag and,
for the tokens at lag 0, 1 and 2 or more pushes, their share, TV(pi_k, alpha) and the effective
sample size of the importance weights w = pi_k / alpha; and, per SGD pass, the clip fractions by
the sign of A in each lag (the objective's own per-token diagnostics, grpo/objective.py).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

BUCKETS = (("lag0", 0.0, 0.5), ("lag1", 0.5, 1.5), ("lag2p", 1.5, math.inf))  # pushes behind: [lo, hi)

BATCH_MEANINGS = {
    "lag_steps_mean": "optimizer steps from the push of the weights that sampled a token to its batch's first step, "
                      "mean over the active tokens (alpha_lag_steps, per token: the asynchronous sampler mixes them)",
    "lag_steps_max": "the same, the largest",
    "lag_pushes_mean": "pushes between the weights that sampled a token and the newest, mean over the active tokens",
}
for name, _, _ in BUCKETS:
    behind = {"lag0": "0 pushes behind (the newest weights)", "lag1": "1 push behind",
              "lag2p": "2 or more pushes behind"}[name]
    BATCH_MEANINGS.update({
        f"tokens_{name}": f"fraction of the batch's active tokens sampled {behind}",
        f"tv_pik_alpha_{name}": f"`tv_pik_alpha` over the tokens sampled {behind}",
        f"is_weight_ess_{name}": f"`is_weight_ess` (of w = pi_k / alpha) over the tokens sampled {behind}",
    })
PASS_MEANINGS = {}
for name, _, _ in BUCKETS:
    PASS_MEANINGS.update({
        f"clip_frac_adv_pos_{name}": f"`clip_frac_adv_pos` over the tokens at {name} (this SGD pass)",
        f"clip_frac_adv_neg_{name}": f"`clip_frac_adv_neg` over the tokens at {name} (this SGD pass)",
    })
BATCH_RAW = ("lag_steps_mean", "lag_steps_max", "lag_pushes_mean") + tuple(
    f"{stat}_{name}" for name, _, _ in BUCKETS for stat in ("tokens", "tv_pik_alpha", "w", "w2"))


def _bucketed(value: Tensor, lag: Tensor, lo: float, hi: float) -> Tensor:
    """value where the token's lag is in [lo, hi), NaN elsewhere (left out of the mean)."""
    return torch.where((lag >= lo) & (lag < hi), value, math.nan)


def batch_terms(x) -> dict[str, Tensor]:
    """Per token, on the batch's first pass (grpo.instruments.Tokens): its lag and, per lag bucket,
    its share, TV term and importance weight (w and w^2: the ESS is made of their means)."""
    lag = x.lag_pushes.double()
    w = torch.exp(x.logp_old.double() - x.logp_alpha.double())
    out = {"lag_steps_mean": x.lag_steps.double(), "lag_steps_max": x.lag_steps.double(), "lag_pushes_mean": lag}
    for name, lo, hi in BUCKETS:
        inside = ((lag >= lo) & (lag < hi)).double()
        out[f"tokens_{name}"] = torch.where(torch.isnan(lag), math.nan, inside)
        out[f"tv_pik_alpha_{name}"] = _bucketed(0.5 * (w - 1.0).abs(), lag, lo, hi)
        out[f"w_{name}"] = _bucketed(w, lag, lo, hi)
        out[f"w2_{name}"] = _bucketed(w * w, lag, lo, hi)
    return out


def batch_finish(means: dict[str, float]) -> dict[str, float]:
    """The declared keys from the reduced means: the ESS fraction is mean(w)^2 / mean(w^2)."""
    out = {k: means[k] for k in ("lag_steps_mean", "lag_steps_max", "lag_pushes_mean")}
    for name, _, _ in BUCKETS:
        out[f"tokens_{name}"] = means[f"tokens_{name}"]
        out[f"tv_pik_alpha_{name}"] = means[f"tv_pik_alpha_{name}"]
        w, w2 = means[f"w_{name}"], means[f"w2_{name}"]
        out[f"is_weight_ess_{name}"] = w * w / w2 if w2 > 0 else math.nan
    return out


def pass_terms(x) -> dict[str, Tensor]:
    """Per token, on every SGD pass: whether the objective clipped it, among the tokens with A > 0
    (and A < 0) in each lag (the objective's per-token diagnostics of this pass's log-probs)."""
    from grpo.objective import per_token_loss

    # pi_ref's log-probs do not enter the clip: the policy's own stand in (a KL term of 0, unused)
    _, d = per_token_loss(x.logp, x.logp_alpha, x.logp_old, x.logp, x.adv, x.cfg.objective, active=x.active,
                          seq_index=x.seq_index)
    lag = x.lag_pushes.double()
    clipped = torch.maximum(d["clip_low"], d["clip_high"]).double()
    out = {}
    for name, lo, hi in BUCKETS:
        for sign, mask in (("pos", x.adv > 0), ("neg", x.adv < 0)):
            out[f"clip_frac_adv_{sign}_{name}"] = _bucketed(torch.where(mask, clipped, math.nan), lag, lo, hi)
    return out
