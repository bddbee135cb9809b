"""Sequence-level losses: GSPO and GSPO-token (arXiv 2507.18071) against values worked out by hand in
float64 (written as arithmetic, never produced by the code under test), and the path the trainer
runs them on: log-probs, then `objective` with each token's sequence, then autograd."""
import math

import pytest
import torch

from grpo.advantages import group_advantages
from grpo.kernel_dispatch import check_objective_path, objective_fn_for, objective_of_hidden, objective_path
from grpo.losses import needs_sequences
from grpo.objective import ObjectiveConfig, finalize_stats, local_denominators, merge_stats, objective, token_weights
from hand_computed import D, L, close, t  # noqa: F401
from kernels import KernelConfig

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on padding lanes


# Four sequences (rows), lengths 2, 3, 2, 2 of T = 3; pi_k = alpha, so w = 1. Per-token ratios pi/pi_k
# chosen so that s_i = exp(mean_t log r_t) is round: 1.1 = sqrt(1.21 * 1), 2 = (2 * 2 * 2)^(1/3),
# 0.5 = sqrt(0.25 * 1), 1.3 = sqrt(1.69 * 1). Band [0.8, 1.2] (gspo_eps 0.2 / 0.2).
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
RATIOS = t([[1.21, 1.0, 1.0], [2.0, 2.0, 2.0], [0.25, 1.0, 1.0], [1.69, 1.0, 1.0]])
ADV = t([1.0, 1.0, -1.0, -1.0])
LOGP_K = t([[L(0.5), L(0.4), 0.0], [L(0.3), L(0.2), L(0.1), ], [L(0.6), L(0.6), 0.0], [L(0.5), L(0.5), 0.0]])
LENGTHS = (2, 3, 2, 2)


def seq_mean_weights(cfg, mask=MASK, seq_weight=None):
    seq_weight = torch.ones(mask.shape[0], dtype=D) if seq_weight is None else seq_weight
    num_seqs, num_tokens = local_denominators(mask, seq_weight, cfg)
    return token_weights(mask, seq_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=mask.shape[1])


def run(cfg, logp, logp_alpha, logp_k, adv, weights, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, stats = objective(lp, logp_alpha, logp_k, None, adv, weights, cfg, **kw)
    loss.backward()
    return loss.detach(), stats, lp.grad


def gspo_cfg(loss="gspo", **kw):
    return ObjectiveConfig(loss=loss, gspo_eps_low=0.2, gspo_eps_high=0.2, **kw)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
def test_gspo_values_gradients_and_clipping(loss):
    cfg = gspo_cfg(loss)
    w = seq_mean_weights(cfg)  # 1 / (L_b * 4)
    logp = LOGP_K + RATIOS.log()
    loss_value, stats, grad = run(cfg, logp, LOGP_K, LOGP_K, ADV, w)
    # seq 0: s = 1.1 inside, A = +1: l = -1.1         gradient per token (1/4) * (-A s / L) = -1.1 / 8
    # seq 1: s = 2 > 1.2, A = +1: clipped, l = -1.2   no gradient
    # seq 2: s = 0.5 < 0.8, A = -1: min(-0.5, -0.8) = -0.8 clipped, l = 0.8, no gradient
    # seq 3: s = 1.3, A = -1: min(-1.3, -1.2) = -1.3 the s A branch, l = 1.3, gradient 1.3 / 8
    close(loss_value, (-1.1 - 1.2 + 0.8 + 1.3) / 4)
    close(grad, [[-1.1 / 8, -1.1 / 8, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.3 / 8, 1.3 / 8, 0.0]])
    out = finalize_stats(stats)
    assert out["num_tokens"] == 9 and out["num_seqs"] == 4
    close(out["clip_high_frac"], 3 / 9)  # the three tokens of sequence 1
    close(out["clip_low_frac"], 2 / 9)
    close(out["seq_ratio_mean"], (1.1 + 2.0 + 0.5 + 1.3) / 4)
    close(out["ratio_mean"], (2 * 1.1 + 3 * 2.0 + 2 * 0.5 + 2 * 1.3) / 9)  # each token carries its s_i


def test_gspo_default_clip_range_is_the_papers():
    cfg = ObjectiveConfig(loss="gspo")
    assert (cfg.gspo_eps_low, cfg.gspo_eps_high) == (3e-4, 4e-4)
    mask = torch.ones(2, 2, dtype=torch.bool)
    w = seq_mean_weights(cfg, mask)
    # s_0 = sqrt(1.0002 * 1.0004) = 1.00029999 inside [0.9997, 1.0004]; s_1 = sqrt(1.001) = 1.0004999 above
    logp = t([[L(1.0002), L(1.0004)], [L(1.001), 0.0]])
    loss_value, _, grad = run(cfg, logp, torch.zeros(2, 2, dtype=D), torch.zeros(2, 2, dtype=D), t([1.0, 1.0]), w)
    s0 = math.sqrt(1.0002 * 1.0004)
    close(loss_value, (-s0 - 1.0004) / 2)
    close(grad, [[-s0 / 4, -s0 / 4], [0.0, 0.0]])


def test_gspo_exact_anchor_uses_the_sampler():
    # exact: s_i = exp(mean_t log(pi/alpha)), band around s'_i = exp(mean_t log(pi_k/alpha)).
    # pi_k/alpha = 4, 1 -> s' = 2 (band [1.8, 2.2]). pi/pi_k = 1, 1 (first step): s = 2, A = +1, l = -2,
    # gradient per token (1/2)(-A s / 2) = -1/2 with two sequences. Sequence 1: pi/pi_k = 1.69, 1 ->
    # s = 1.3 * 2 = 2.6 > 2.2: clipped, l = -2.2, no gradient.
    cfg = gspo_cfg(ratio_anchor="exact")
    mask = torch.ones(2, 2, dtype=torch.bool)
    w = seq_mean_weights(cfg, mask)
    logp_k = t([[L(0.4), L(0.3)], [L(0.4), L(0.3)]])
    logp_alpha = logp_k - t([[L(4.0), 0.0], [L(4.0), 0.0]])
    logp = logp_k + t([[0.0, 0.0], [L(1.69), 0.0]])
    loss_value, stats, grad = run(cfg, logp, logp_alpha, logp_k, t([1.0, 1.0]), w)
    close(loss_value, (-2.0 - 2.2) / 2)
    close(grad, [[-0.5, -0.5], [0.0, 0.0]])
    close(stats["seq_ratio_sum"], 2.0 + 2.6)
    # approx on the same tokens: s = 1 and 1.3, band [0.8, 1.2], w ignored (no correction)
    cfg = gspo_cfg()
    loss_value, _, grad = run(cfg, logp, logp_alpha, logp_k, t([1.0, 1.0]), w)
    close(loss_value, (-1.0 - 1.2) / 2)
    close(grad, [[-0.25, -0.25], [0.0, 0.0]])
    # approx with a correction weighs each token's loss by w_bar: sequence_truncate at 3 gives
    # w_bar = min(4 * 1, 3) = 3 on every token of both sequences
    cfg = gspo_cfg(is_correction="sequence_truncate", is_cap=3.0)
    loss_value, stats, grad = run(cfg, logp, logp_alpha, logp_k, t([1.0, 1.0]), w)
    close(loss_value, 3 * (-1.0 - 1.2) / 2)
    close(grad, [[-0.75, -0.75], [0.0, 0.0]])
    close(stats["seq_capped_sum"], 2)


def test_gspo_token_differs_from_gspo_with_per_token_advantages():
    # GSPO-token's point: s_{i,t} = sg[s_i] pi_t / sg[pi_t] gives token t the gradient s_i A_t, where
    # GSPO's one ratio mixes the advantages of the whole sequence. s = 1.1 (inside), A = (+1, -1).
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = t([[L(1.21), 0.0]])
    zeros = torch.zeros(1, 2, dtype=D)
    adv = t([[1.0, -1.0]])
    w = seq_mean_weights(gspo_cfg(), mask)  # 1/2 each
    _, _, g_token = run(gspo_cfg("gspo_token"), logp, zeros, zeros, adv, w)
    close(g_token, [[-1.1 / 2, 1.1 / 2]])  # w_t * (-A_t s)
    _, _, g_seq = run(gspo_cfg(), logp, zeros, zeros, adv, w)
    close(g_seq, [[0.0, 0.0]])  # sum_t w_t (-A_t) s / L = 0: the two advantages cancel


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "seq_sum_norm"])
def test_gspo_token_equals_gspo_with_one_advantage_per_sequence(aggregation):
    cfg = dict(aggregation=aggregation)
    w = seq_mean_weights(gspo_cfg(**cfg))
    logp = LOGP_K + RATIOS.log()
    a = run(gspo_cfg(**cfg), logp, LOGP_K, LOGP_K, ADV, w)
    b = run(gspo_cfg("gspo_token", **cfg), logp, LOGP_K, LOGP_K, ADV, w)
    close(a[0], b[0])
    close(a[2], b[2])


def test_gspo_masked_groups_truncated_sequences_and_padding_garbage():
    # Rewards: group 0 (seqs 0, 1) all equal -> eq. 8 masks it; group 1 (seqs 2, 3) mixed.
    # Sequence 3 is truncated and mask_truncated drops it. Padding holds garbage.
    cfg = gspo_cfg(mask_zero_variance=True, mask_truncated=True, advantage="none")
    adv, seq_weight, _ = group_advantages(t([1, 1, 1, 0]), 2, cfg)
    close(adv, [0.0, 0.0, 0.5, -0.5])
    truncated = torch.tensor([False, False, False, True])
    num_seqs, num_tokens = local_denominators(MASK, seq_weight, cfg, truncated)
    w = token_weights(MASK, seq_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=3, truncated=truncated)
    logp = LOGP_K + RATIOS.log()
    logp_alpha = LOGP_K.clone()
    for garbage in (float("nan"), float("inf")):
        logp[~MASK] = garbage
        logp_alpha[~MASK] = garbage
        loss_value, stats, grad = run(cfg, logp, logp_alpha, LOGP_K, adv, w)
        # only sequence 2 is active: s = 0.5 < 0.8, A = +0.5 > 0: min(0.25, 0.4) = 0.25, the s A branch:
        # l = -0.25 / 4 (num_seqs counts all four: count_masked); gradient per token (1/4)(-0.5 * 0.5 / 2)
        close(loss_value, -0.25 / 4)
        close(grad, [[0.0] * 3, [0.0] * 3, [-0.25 / 8, -0.25 / 8, 0.0], [0.0] * 3])
        assert float(stats["num_tokens"]) == 2 and float(stats["num_seqs"]) == 1
        close(stats["seq_ratio_sum"], 0.5)


def test_flat_tokens_with_seq_index_and_micro_batches_equal_the_rows():
    # The trainer's layout: flat [N] active tokens with seq_of_token; two micro-batches merge to the whole.
    cfg = gspo_cfg(beta=0.1)
    w = seq_mean_weights(cfg)
    logp = LOGP_K + RATIOS.log()
    logp_ref = LOGP_K - 0.1
    rows_lp = logp.clone().requires_grad_(True)
    want_loss, want_stats = objective(rows_lp, LOGP_K, LOGP_K, logp_ref, ADV, w, cfg)
    want_loss.backward()
    seq_of_token = torch.arange(4).repeat_interleave(3).view(4, 3)[MASK]
    parts, grads = [], []
    for rows in ([0, 1], [2, 3]):
        keep = torch.isin(seq_of_token, torch.tensor(rows))
        flat = lambda x: x[MASK][keep]  # noqa: E731
        lp = flat(logp).clone().requires_grad_(True)
        # any sequence ids will do: only which tokens share one matters
        loss, stats = objective(lp, flat(LOGP_K), flat(LOGP_K), flat(logp_ref), ADV[seq_of_token[keep]], flat(w), cfg,
                                seq_index=seq_of_token[keep] + 7)
        loss.backward()
        parts.append(stats)
        grads.append(lp.grad)
    close(torch.cat(grads), rows_lp.grad[MASK])
    want, got = finalize_stats(want_stats), finalize_stats(merge_stats(*parts))
    assert want["num_seqs"] == 4 and want["kl_mean"] > 0
    for key in want:
        close(got[key], want[key])


def test_sequence_configs_take_the_log_prob_path():
    cpu, triton = torch.device("cpu"), KernelConfig(backend="triton", loss_block=32)
    for cfg in (ObjectiveConfig(loss="gspo"), ObjectiveConfig(loss="gspo_token"),
                ObjectiveConfig(is_correction="sequence_truncate", is_cap=2.0)):
        assert needs_sequences(cfg)
        assert objective_path(cfg, cpu, KernelConfig()) == "sequence"
        with pytest.raises(ValueError, match="needs whole sequences"):
            objective_fn_for(cpu, KernelConfig(), cfg)
        with pytest.warns(UserWarning, match="needs whole sequences"):
            assert check_objective_path(cfg, cpu, triton) == "sequence"
    assert not needs_sequences(ObjectiveConfig(loss="cispo", is_correction="icepop", is_floor=0.5, is_cap=2.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_objective_of_hidden_is_the_head_then_objective(backend, loss):
    # What the policy runs: for GSPO the LM head's log-probs then `objective` with autograd; for a
    # per-token loss the fused head. Both equal the naive head followed by `objective`.
    torch.manual_seed(0)
    n_seqs, lengths, hidden_size, vocab, temperature = 3, [4, 1, 5], 8, 50, 0.9
    n = sum(lengths)
    seq_index = torch.repeat_interleave(torch.arange(n_seqs), torch.tensor(lengths))
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) / 3).requires_grad_()
    targets = torch.randint(0, vocab, (n,))

    def naive(h, wt):
        return torch.log_softmax((h @ wt.t()) / temperature, dim=-1).gather(1, targets[:, None])[:, 0]

    with torch.no_grad():
        logp_now = naive(hidden, weight)
    logp_k = logp_now + 0.05 * torch.randn(n)
    logp_alpha = logp_k + 0.1 * torch.randn(n)
    adv = torch.tensor([1.0, -0.5, 0.7])[seq_index]
    weights = torch.tensor([1 / 4, 1.0, 1 / 5])[seq_index] / n_seqs
    gspo_band = {"gspo_eps_low": 0.05, "gspo_eps_high": 0.05} if loss.startswith("gspo") else {}  # only GSPO reads it
    cfg = ObjectiveConfig(loss=loss, ratio_anchor="exact", beta=0.05, **gspo_band)
    config = KernelConfig(backend=backend, loss_block=32, rows_per_program=8, block_v=64, chunk_tokens=4)
    loss_value, stats, logp, entropy = objective_of_hidden(
        hidden, weight, targets, logp_alpha, logp_k, logp_now - 0.1, adv, weights, cfg, seq_index=seq_index,
        temperature=temperature, with_entropy=True, kernel_config=config)
    grads = torch.autograd.grad(2 * loss_value, (hidden, weight))
    want_loss, want_stats = objective(naive(hidden, weight), logp_alpha, logp_k, logp_now - 0.1, adv, weights, cfg,
                                      seq_index=seq_index)
    want = torch.autograd.grad(2 * want_loss, (hidden, weight))
    torch.testing.assert_close(loss_value, want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, logp_now, atol=1e-5, rtol=1e-5)
    assert not logp.requires_grad and entropy is not None and not entropy.requires_grad
    for key in want_stats:
        torch.testing.assert_close(stats[key], want_stats[key], atol=1e-4, rtol=1e-5, msg=key)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    if loss == "gspo":
        assert float(stats["num_seqs"]) == n_seqs


# ---------------------------------------------------------------------------------------------- conventions
# Two cases where GSPO's length-normalised ratio meets a correction (docs/objectives.md).

W_BAR_VARIES = t([[L(2.0), L(0.5), 0.0], [L(1.5), L(1.2), L(0.9)], [L(0.8), L(3.0), 0.0], [L(1.1), L(1.0), 0.0]])


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
@pytest.mark.parametrize("anchor,correction,equal", [
    ("approx", {}, True), ("approx", dict(is_correction="geometric_truncate", is_cap=1.2), True),
    ("approx", dict(is_correction="sequence_truncate", is_cap=1.2), True),
    ("exact", dict(is_correction="token_truncate", is_cap=1.2), True),
    ("approx", dict(is_correction="token_truncate", is_cap=1.2), False),
    ("approx", dict(is_correction="icepop", is_floor=0.6, is_cap=1.6), False)])
def test_gspo_token_equals_gspo_exactly_when_the_correction_is_constant_within_a_sequence(
        aggregation, anchor, correction, equal):
    """pi_k / alpha differs token by token (W_BAR_VARIES): a token-level correction under approx
    gives each token its own outer weight w_bar_t, which GSPO-token keeps and GSPO averages."""
    cfg = dict(aggregation=aggregation, ratio_anchor=anchor, **correction)
    w = seq_mean_weights(gspo_cfg(**cfg))
    logp = LOGP_K + RATIOS.log()
    logp_alpha = LOGP_K - W_BAR_VARIES
    a = run(gspo_cfg(**cfg), logp, logp_alpha, LOGP_K, ADV, w)
    b = run(gspo_cfg("gspo_token", **cfg), logp, logp_alpha, LOGP_K, ADV, w)
    close(a[0], b[0])  # the same value either way: each token carries its sequence's ratio
    assert torch.allclose(a[2], b[2], rtol=1e-12, atol=1e-12) == equal


@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
def test_gspo_refuses_a_sequence_level_correction_under_the_exact_anchor(loss):
    for name in ("sequence_truncate", "sequence_mask"):
        with pytest.raises(ValueError, match=rf"^is_correction: {name} under ratio_anchor exact .* use "
                                             rf"{name.replace('sequence_', 'geometric_')}"):
            gspo_cfg(loss, ratio_anchor="exact", is_correction=name, is_cap=2.0)
        gspo_cfg(loss, ratio_anchor="approx", is_correction=name, is_cap=2.0)  # a sequence IS weight: fine
    # the geometric level is consistent: a cap that never binds leaves the exact loss as uncorrected
    w = seq_mean_weights(gspo_cfg(loss))
    logp, logp_alpha = LOGP_K + RATIOS.log(), LOGP_K - W_BAR_VARIES
    plain = run(gspo_cfg(loss, ratio_anchor="exact"), logp, logp_alpha, LOGP_K, ADV, w)
    capped = run(gspo_cfg(loss, ratio_anchor="exact", is_correction="geometric_truncate", is_cap=100.0),
                 logp, logp_alpha, LOGP_K, ADV, w)
    close(plain[0], capped[0])
    close(plain[2], capped[2])
