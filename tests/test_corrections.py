"""Corrections of the IS weight w = pi_k/alpha (the sampler-learner mismatch), against values worked
out by hand in float64: truncate (TIS) or mask (MIS) at the token level, the sequence level (product
of the ratios) and the geometric level (per-token mean), and IcePop's two-sided token mask.

At the first step on a batch (pi = pi_k) nothing is clipped, so GRPO's gradient is -A * w_bar * weight
per token under either anchor (exact: r = r' = w_bar; approx: the loss is weighted by w_bar): the
gradient shows the corrected weight directly."""
import math

import pytest
import torch

from grpo.objective import ObjectiveConfig, finalize_stats, objective

from hand_computed import D, L, close, t  # noqa: E402,F401


def first_step(cfg, w, adv, weights, garbage_at=None):
    """GRPO's objective at pi = pi_k with pi_k/alpha = w; returns (loss, finalized stats, gradient)."""
    logp_k = torch.full_like(w, L(0.3))
    logp_alpha = logp_k - torch.log(w)
    if garbage_at is not None:  # padding: its weight is 0, whatever its log-probs hold
        logp_alpha[garbage_at] = float("nan")
    lp = logp_k.clone().requires_grad_(True)
    loss, stats = objective(lp, logp_alpha, logp_k, None, adv, weights, cfg)
    loss.backward()
    return loss.detach(), finalize_stats(stats), lp.grad


TOKEN_W = t([3.0, 0.5, 1.5, 0.3])
ONES = torch.ones(4, dtype=D)


@pytest.mark.parametrize("anchor", ["approx", "exact"])
@pytest.mark.parametrize("settings,w_bar,capped,masked", [
    (dict(is_cap=2.0), [2.0, 0.5, 1.5, 0.3], [1, 0, 0, 0], [0, 0, 0, 0]),  # is_cap alone: TIS, as before
    (dict(is_correction="token_truncate", is_cap=2.0), [2.0, 0.5, 1.5, 0.3], [1, 0, 0, 0], [0, 0, 0, 0]),
    (dict(is_correction="token_mask", is_cap=2.0), [0.0, 0.5, 1.5, 0.3], [0, 0, 0, 0], [1, 0, 0, 0]),
    (dict(is_correction="token_mask", is_cap=2.0, is_floor=0.4), [0.0, 0.5, 1.5, 0.0], [0, 0, 0, 0], [1, 0, 0, 1]),
    (dict(is_correction="icepop", is_cap=2.0, is_floor=0.4), [0.0, 0.5, 1.5, 0.0], [0, 0, 0, 0], [1, 0, 0, 1]),
], ids=["is_cap", "tis", "mis", "mis_two_sided", "icepop"])
def test_token_level(anchor, settings, w_bar, capped, masked):
    cfg = ObjectiveConfig(ratio_anchor=anchor, **settings)
    adv = t([1.0, -1.0, 2.0, 1.0])
    loss, stats, grad = first_step(cfg, TOKEN_W, adv, ONES)
    close(grad, -adv * t(w_bar))
    close(loss, -(adv * t(w_bar)).sum())
    close(stats["is_capped_frac"], sum(capped) / 4)
    close(stats["is_masked_frac"], sum(masked) / 4)
    close(stats["is_weight_mean"], sum(w_bar) / 4)
    close(stats["tv_mean"], (1.0 + 0.25 + 0.25 + 0.35) / 4)  # of the raw w: the drift is reported unmasked
    assert math.isnan(stats["seq_masked_frac"]) and stats["num_seqs"] == 0  # per-token: no sequence counted


# Two sequences of a [2, 3] batch: lengths 2 (then padding) and 3. Products rho = 3 * 0.5 = 1.5 and
# 2 * 4 * 1 = 8; geometric means g = sqrt(1.5) and 8^(1/3) = 2.
SEQ_W = t([[3.0, 0.5, 1.0], [2.0, 4.0, 1.0]])
SEQ_WEIGHTS = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
SEQ_ADV = t([1.0, -1.0])
R15 = math.sqrt(1.5)


@pytest.mark.parametrize("anchor", ["approx", "exact"])
@pytest.mark.parametrize("settings,w_seq,seq_capped,seq_masked", [
    (dict(is_correction="sequence_truncate", is_cap=5.0), [1.5, 5.0], [0, 1], [0, 0]),
    (dict(is_correction="sequence_mask", is_cap=5.0, is_floor=0.5), [1.5, 0.0], [0, 0], [0, 1]),
    (dict(is_correction="sequence_mask", is_cap=10.0, is_floor=1.6), [0.0, 8.0], [0, 0], [1, 0]),
    (dict(is_correction="geometric_truncate", is_cap=1.5), [R15, 1.5], [0, 1], [0, 0]),
    (dict(is_correction="geometric_mask", is_cap=1.5, is_floor=0.9), [R15, 0.0], [0, 0], [0, 1]),
], ids=["seq_tis", "seq_mis", "seq_mis_floor", "geo_tis", "geo_mis"])
def test_sequence_and_geometric_levels(anchor, settings, w_seq, seq_capped, seq_masked):
    cfg = ObjectiveConfig(ratio_anchor=anchor, **settings)
    loss, stats, grad = first_step(cfg, SEQ_W.clone(), SEQ_ADV, SEQ_WEIGHTS, garbage_at=(0, 2))
    # every token of a sequence gets its sequence's weight; the padding token is left out of the product
    close(grad, [[-w_seq[0], -w_seq[0], 0.0], [w_seq[1], w_seq[1], w_seq[1]]])
    close(loss, -2 * w_seq[0] + 3 * w_seq[1])
    assert stats["num_seqs"] == 2
    close(stats["seq_capped_frac"], sum(seq_capped) / 2)
    close(stats["seq_masked_frac"], sum(seq_masked) / 2)
    close(stats["is_capped_frac"], (2 * seq_capped[0] + 3 * seq_capped[1]) / 5)  # tokens of the sequences
    close(stats["is_masked_frac"], (2 * seq_masked[0] + 3 * seq_masked[1]) / 5)


def test_token_level_flags_count_their_sequences_on_the_sequence_path():
    # GSPO sees whole sequences, so a token-level correction's flags are also counted per sequence:
    # a sequence with a masked token counts as masked. Only sequence 1's w = 4 leaves [0.4, 3.5].
    cfg = ObjectiveConfig(loss="gspo", is_correction="token_mask", is_floor=0.4, is_cap=3.5)
    _, stats, _ = first_step(cfg, SEQ_W.clone(), SEQ_ADV, SEQ_WEIGHTS)
    close(stats["seq_masked_frac"], 1 / 2)
    close(stats["is_masked_frac"], 1 / 5)


def test_exact_gspo_with_a_token_mask_drops_the_sequence():
    # exact GSPO: s'_i = exp(mean_t log w_bar); a masked token (w_bar = 0) zeroes it, and its sequence
    # drops out. w = (3, 0.5 | 2, 2, 2), token mask at 2.5: sequence 0 loses its w = 3 token.
    # Sequence 1: s = s' = 2 (pi = pi_k), inside [1.8, 2.2], A = -1: l = -min(-2, -2) = 2 on each of
    # its 3 tokens (weight 1 each): loss 6; d l / d log pi_u = -A s / 3 = 2/3, summed over the 3
    # tokens' weights: 2.
    cfg = ObjectiveConfig(loss="gspo", ratio_anchor="exact", is_correction="token_mask", is_cap=2.5,
                          gspo_eps_low=0.2, gspo_eps_high=0.2)
    w = t([[3.0, 0.5, 1.0], [2.0, 2.0, 2.0]])
    loss, stats, grad = first_step(cfg, w, SEQ_ADV, SEQ_WEIGHTS)
    close(grad, [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    close(loss, 3 * 2.0)
    close(stats["seq_ratio_mean"], (0.0 + 2.0) / 2)
    close(stats["seq_masked_frac"], 1 / 2)


@pytest.mark.parametrize("settings,message", [
    (dict(is_correction="token_mask"), "^is_cap: is_correction token_mask needs"),
    (dict(is_correction="sequence_truncate"), "^is_cap: "),
    (dict(is_correction="token_truncate", is_cap=2.0, is_floor=0.5), "^is_floor: truncation has no lower"),
    (dict(is_correction="icepop", is_cap=2.0), "^is_floor: icepop masks on both sides"),
    (dict(is_correction="token_mask", is_cap=2.0, is_floor=2.0), "^is_floor: must be < is_cap"),
    (dict(is_correction="none", is_cap=2.0), "^is_cap: set, but is_correction is none"),
    (dict(is_floor=0.5), "^is_floor: set, but no correction"),
    (dict(is_correction="token_mask", is_cap=2.0, is_floor=0.0), "^is_floor: must be > 0"),
    (dict(is_correction="tis"), "^is_correction: must be one of"),
    (dict(loss="reinforce", is_correction="token_mask", is_cap=2.0), "^is_correction: loss reinforce takes"),
    (dict(loss="rec_oneside_is", is_correction="sequence_truncate", is_cap=2.0), "^is_correction: loss rec_oneside_is"),
])
def test_bad_correction_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**settings)


def test_is_cap_keeps_its_meaning_for_every_loss():
    # is_cap alone is token_truncate: accepted (and unused) by reinforce, the IS weight's cap of rec_*_is.
    for loss in ("reinforce", "rec_oneside_is", "rec_twoside_is", "grpo", "cispo", "gspo"):
        assert ObjectiveConfig(loss=loss, is_cap=1.5).correction == "token_truncate"
    assert ObjectiveConfig().correction == "none"
