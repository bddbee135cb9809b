"""What the objective's torch maths (grpo/objective.py) and the fused loss kernel (kernels/loss.py)
agree on: the input checks, and the statistics' names, order and reductions.

Both import this module; kernels/ imports nothing from grpo/. Adding a statistic is one change
here (a name in DIAGNOSTIC_KEYS, SQ_KEYS, EXTREME_KEYS or SEQUENCE_KEYS) plus its value in each
implementation: slots, reductions and merges follow from the key list. A kernel that forgets to
store the new slot is caught at start-up (kernels.loss.check_stat_slots), not by garbage statistics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# Per-token diagnostics of the objective (see grpo.objective.per_token_loss), summed over active tokens.
# adv_pos / adv_neg (0/1: A > 0 / A < 0) and clip_adv_pos / clip_adv_neg (0/1: clipped, low or high,
# and A > 0 / A < 0) make the clip fraction split by the advantage's sign additive over micro-batches
# and ranks (finalize_stats divides the sums: clip_frac_adv_pos, clip_frac_adv_neg).
DIAGNOSTIC_KEYS = ("clip_low", "clip_high", "ratio", "is_weight", "is_capped", "kl", "tv", "kl_pik_alpha",
                   "is_masked", "adv_pos", "adv_neg", "clip_adv_pos", "clip_adv_neg")
SQ_KEYS = ("ratio", "is_weight")  # also summed squared, for a standard deviation
EXTREME_KEYS = ("ratio", "is_weight")  # also their maximum and minimum over active tokens
# Per-sequence statistics, summed over sequences with an active token. Only an objective that sees
# whole sequences (grpo.objective.needs_sequences) can count them; the per-token paths (the fused
# kernel, the chunked torch objective) store 0, and finalize_stats reports nan for 0 sequences.
SEQUENCE_KEYS = ("num_seqs", "seq_ratio_sum", "seq_capped_sum", "seq_masked_sum")

# The statistics of one (micro-)batch, in this order wherever they form a vector.
STAT_KEYS = (("num_tokens", "loss") + tuple(f"{k}_sum" for k in DIAGNOSTIC_KEYS)
             + tuple(f"{k}_sqsum" for k in SQ_KEYS)
             + tuple(f"{k}_{m}" for k in EXTREME_KEYS for m in ("max", "min"))
             + SEQUENCE_KEYS)
N_STATS = len(STAT_KEYS)
STAT_SLOT = {key: i for i, key in enumerate(STAT_KEYS)}


def reduction(key: str) -> str:
    """How a statistic combines over micro-batches and ranks: "max", "min" or "sum"."""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "sum"


def check_objective_inputs(logp: Tensor, logp_alpha: Tensor, logp_k: Optional[Tensor], logp_ref: Optional[Tensor],
                           adv: Tensor, beta: float) -> Tensor:
    """Shapes and options, with the same messages from every implementation; returns adv with a
    trailing token dim when it came per sequence."""
    if logp_alpha.shape != logp.shape:
        raise ValueError(f"logp_alpha: shape {tuple(logp_alpha.shape)} differs from logp {tuple(logp.shape)}")
    for name, t in (("logp_k", logp_k), ("logp_ref", logp_ref)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logp {tuple(logp.shape)}")
    if beta > 0 and logp_ref is None:
        raise ValueError("logp_ref: beta > 0 needs the reference policy's log-probs")
    if adv.dim() == logp.dim() - 1:
        adv = adv.unsqueeze(-1)
    if adv.dim() != logp.dim():
        raise ValueError(f"adv: shape {tuple(adv.shape)} does not broadcast per token over {tuple(logp.shape)}")
    return adv


def check_weights(weights: Tensor, logp: Tensor) -> None:
    if weights.shape != logp.shape:
        raise ValueError(f"weights: shape {tuple(weights.shape)} differs from logp {tuple(logp.shape)}")


def _kinds(device: torch.device) -> Tensor:
    """Per slot: 0 sum, 1 max, 2 min."""
    codes = {"sum": 0, "max": 1, "min": 2}
    return torch.tensor([codes[reduction(k)] for k in STAT_KEYS], device=device)


def reduce_partials(partials: Tensor) -> Tensor:
    """[programs, N_STATS] per-program partial statistics -> [N_STATS] (deterministic, no atomics)."""
    kinds = _kinds(partials.device)
    return torch.where(kinds == 1, partials.amax(0), torch.where(kinds == 2, partials.amin(0), partials.sum(0)))


def merge_stat_vectors(a: Optional[Tensor], b: Tensor) -> Tensor:
    """Statistics vectors of two disjoint sets of tokens -> those of their union."""
    if a is None:
        return b
    kinds = _kinds(b.device)
    return torch.where(kinds == 1, torch.maximum(a, b), torch.where(kinds == 2, torch.minimum(a, b), a + b))
