"""Staleness and engine mismatch: the two parts of alpha != pi_k, per batch.

The trainer logs how far the sampler alpha is from pi_k on each batch (tv_pik_alpha, kl_pik_alpha:
grpo/objective.py, from w = pi_k / alpha on alpha's tokens). Two different things make w differ
from 1, and this module logs them apart with pi_push, the trainer's policy at the push of the
weights that sampled the batch:

  mismatch   pi_push vs alpha: the same weights, computed by the engine and by the trainer
             (kernels, precision, batch shapes). w_push = pi_push / alpha.
  staleness  pi_k vs pi_push: the optimizer steps taken since that push (v > 1, sample-ahead).

Per active token (weights != 0, as every statistic of the objective):
  tv_mismatch  = |w_push - 1| / 2                  (tv_pik_alpha with pi_push in pi_k's place)
  kl_mismatch  = w_push - 1 - log w_push           (kl_pik_alpha likewise: KL(alpha || pi_push), k3)
  tv_staleness = |w - w_push| / 2                  (TV(pi_k, pi_push) estimated on alpha's tokens)
  kl_staleness = w - w_push - w_push log(w / w_push)   (KL(pi_push || pi_k), k3, importance-weighted
                                                    from alpha's tokens by w_push; >= 0)
On policy (the batch's first optimizer step is the step of its push: v = 1, or the first batch of
a v-window, no sample-ahead lag) pi_push is pi_k itself: the trainer passes the same log-probs, so
both staleness terms are exactly 0 and the mismatch terms equal tv_pik_alpha and kl_pik_alpha.
Otherwise the trainer scores the batch with a frozen copy of the weights it pushed
(grpo/instruments.py; log.split_staleness). The split is a registered instrument (`split_terms`,
per batch: grpo/instruments.py reduces its per-token terms over the active tokens of every
micro-batch and rank). The triangle inequality bounds the total, token by token:
tv_pik_alpha <= tv_mismatch + tv_staleness. The KL parts are not additive. With top-p < 1 every
estimate here, like tv_pik_alpha, covers alpha's nucleus only (alpha never samples outside it).
"""
from __future__ import annotations

import torch
from torch import Tensor

MEANINGS = {
    "tv_mismatch": "the part of alpha vs pi_k that is engine mismatch: `tv_pik_alpha` with pi_push (the trainer's "
                   "policy at the push that sampled the batch) in pi_k's place ([offpolicy.md](offpolicy.md))",
    "kl_mismatch": "the same for `kl_pik_alpha`: KL(alpha || pi_push), k3",
    "tv_staleness": "the part that is staleness: TV(pi_k, pi_push) on alpha's tokens; exactly 0 on policy",
    "kl_staleness": "KL(pi_push || pi_k) on alpha's tokens, importance-weighted; exactly 0 on policy",
}
SPLIT_KEYS = tuple(MEANINGS)


def split_terms(x) -> dict[str, Tensor]:
    """The instrument (grpo.instruments.Tokens of a batch's first pass, with pi_push's log-probs):
    the four per-token terms, in float64; the registry averages them over the active tokens."""
    return token_terms(x.logp_alpha, x.logp_push, x.logp_old, x.active)


def token_terms(logp_alpha: Tensor, logp_push: Tensor, logp_k: Tensor, active: Tensor) -> dict[str, Tensor]:
    """The four terms per token (flat [N] tensors); inactive tokens (padding, masked groups) may hold
    anything, so their log-probs are zeroed before the maths (torch.where, not indexing: no host sync
    on a GPU) and their terms never counted."""
    a = active.bool()
    logp_alpha, logp_push, logp_k = (torch.where(a, t.detach().double(), 0.0) for t in (logp_alpha, logp_push, logp_k))
    log_m = logp_push - logp_alpha
    log_w = logp_k - logp_alpha
    w_m, w = torch.exp(log_m), torch.exp(log_w)
    return {"tv_mismatch": 0.5 * (w_m - 1.0).abs(), "kl_mismatch": w_m - 1.0 - log_m,
            "tv_staleness": 0.5 * (w - w_m).abs(), "kl_staleness": w - w_m - w_m * (log_w - log_m)}
