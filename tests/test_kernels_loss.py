"""kernels.grpo_objective (fused Triton loss, run by the interpreter) against grpo.objective.objective,
the source of truth: loss, d loss / d logp and every stats sum. The cases come from the registries:
every loss and correction the kernel has a code for (kernels.LOSS_CODES, CORRECTION_CODES), with the
knobs and anchors grpo/losses.py registers for it; no loss name is written here."""
import math

import pytest
import torch

import kernels
from grpo.kernel_dispatch import check_objective_path, objective_fn_for, objective_with_grad
from grpo.losses import LOSSES
from grpo.objective import ObjectiveConfig, finalize_stats, objective
from hand_computed import (ADV_SIGN_ADV, ADV_SIGN_CONFIGS, ADV_SIGN_EXPECTED, ADV_SIGN_INDICATORS, ADV_SIGN_RATIO,
                           ADV_SIGN_WEIGHTS)
from kernels import KernelConfig
from kernels.contract import STAT_KEYS as CONTRACT_KEYS
from kernels.loss import STAT_KEYS, check_stat_slots, unwritten_stat_slots

TRITON = KernelConfig(backend="triton", loss_block=32)  # several programs with a ragged last one
# The option sweeps' batches (115 and 138 tokens) in two or three programs, the last ragged: the
# interpreter runs programs one after another, so this halves their time; the odd shapes below keep
# the 32-token program around its edges.
TRITON_SWEEP = KernelConfig(backend="triton", loss_block=64)
KERNEL_LOSSES = list(kernels.LOSS_CODES)
# The thresholds of each correction with a kernel, set so that the batches below cross them.
CORRECTION_SETTINGS = {"none": dict(is_cap=None), "token_truncate": dict(is_cap=1.1),
                       "token_mask": dict(is_correction="token_mask", is_cap=1.1, is_floor=0.9),
                       "icepop": dict(is_correction="icepop", is_cap=1.15, is_floor=0.8)}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def kernel_cases():
    """(loss, correction) for every pair the kernel computes and the loss takes."""
    assert set(CORRECTION_SETTINGS) == set(kernels.CORRECTION_CODES)  # a new kernel correction needs its settings
    return [(loss, correction) for loss in KERNEL_LOSSES for correction in kernels.CORRECTION_CODES
            if LOSSES[loss].corrections is None or correction in LOSSES[loss].corrections]


def batch(seed, n_seqs=5, seq_len=23, spread=0.3):
    """Log-probs of a drifting off-policy batch, with padding (weight 0) holding garbage."""
    g = torch.Generator().manual_seed(seed)
    logp_alpha = -torch.rand(n_seqs, seq_len, generator=g) * 3
    logp_k = logp_alpha + torch.randn(n_seqs, seq_len, generator=g) * spread
    logp = logp_k + torch.randn(n_seqs, seq_len, generator=g) * spread
    logp_ref = logp_k + torch.randn(n_seqs, seq_len, generator=g) * 0.2
    adv = torch.randn(n_seqs, generator=g)
    adv[1] = 0.0
    weights = torch.rand(n_seqs, seq_len, generator=g)
    weights[:, 17:] = 0.0  # padding
    weights[3] = 0.0       # a fully masked sequence (eq. 8)
    logp[:, 20:] = float("nan")
    logp_alpha[:, 21:] = float("inf")
    return logp, logp_alpha, logp_k, logp_ref, adv, weights


def run_both(cfg, logp, logp_alpha, logp_k, logp_ref, adv, weights, config=TRITON):
    x1 = logp.clone().requires_grad_()
    loss1, stats1 = objective(x1, logp_alpha, logp_k, logp_ref, adv, weights, cfg)
    (grad1,) = torch.autograd.grad(loss1, x1)
    x2 = logp.clone().requires_grad_()
    loss2, stats2 = kernels.grpo_objective(x2, logp_alpha, logp_k, logp_ref, adv, weights, cfg, config=config)
    (grad2,) = torch.autograd.grad(loss2, x2)
    return (loss1, stats1, grad1), (loss2, stats2, grad2)


def assert_same(want, got):
    (loss1, stats1, grad1), (loss2, stats2, grad2) = want, got
    assert list(stats2) == list(stats1)
    torch.testing.assert_close(loss2, loss1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad2, grad1, atol=1e-6, rtol=1e-5)
    for key in stats1:
        assert stats2[key].dim() == 0, key
        torch.testing.assert_close(stats2[key], stats1[key], atol=1e-4, rtol=1e-5, msg=key)


@pytest.mark.parametrize("loss,correction", kernel_cases())
def test_every_option_matches_objective(loss, correction):
    anchors = ["exact", "approx"] if LOSSES[loss].anchored else ["approx"]
    for anchor in anchors:
        for kl_estimator, beta, with_ref in [("k3", 0.0, False), ("k1", 0.05, True), ("k2", 0.05, True),
                                             ("k3", 0.05, True), ("k3", 0.0, True)]:
            cfg = ObjectiveConfig(loss=loss, ratio_anchor=anchor, beta=beta, kl_estimator=kl_estimator,
                                  eps_low=0.2, eps_high=0.28, **CORRECTION_SETTINGS[correction])
            assert cfg.correction == correction
            logp, logp_alpha, logp_k, logp_ref, adv, weights = batch(seed=2 * KERNEL_LOSSES.index(loss) + (anchor == "exact"))
            want, got = run_both(cfg, logp, logp_alpha, logp_k, logp_ref if with_ref else None, adv, weights,
                                 config=TRITON_SWEEP)
            assert_same(want, got)
            if LOSSES[loss].clips:  # the batch must exercise the clipping, else this test proves little
                assert want[1]["clip_low_sum"] + want[1]["clip_high_sum"] > 0
            if correction in ("token_mask", "icepop"):
                assert 0 < want[1]["is_masked_sum"] < want[1]["num_tokens"]
            if correction == "token_truncate":
                assert want[1]["is_capped_sum"] > 0


@pytest.mark.parametrize("loss,correction", kernel_cases())
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 33)], ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes_and_bf16_match_objective(loss, correction, shape):
    # Shapes around the 32-token program (one token, a ragged single program, a second program of one
    # token); bf16 log-probs: the kernel computes in fp32, its gradient comes back in bf16 as autograd's.
    g = torch.Generator().manual_seed(sum(shape))
    logp_alpha = -torch.rand(shape, generator=g) * 2
    logp_k = logp_alpha + 0.3 * torch.randn(shape, generator=g)
    logp = logp_k + 0.3 * torch.randn(shape, generator=g)
    adv, weights = torch.randn(shape[0], generator=g), torch.rand(shape, generator=g) + 0.1
    cfg = ObjectiveConfig(loss=loss, beta=0.05, ratio_anchor="exact" if LOSSES[loss].anchored else "approx",
                          **CORRECTION_SETTINGS[correction])
    for dtype in (torch.float32, torch.bfloat16):
        x = logp.to(dtype)
        want, got = run_both(cfg, x, logp_alpha, logp_k, logp_alpha, adv, weights)
        if dtype == torch.float32:
            assert_same(want, got)
            continue
        assert got[2].dtype == torch.bfloat16
        torch.testing.assert_close(got[0], want[0].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[2].float(), want[2].float(), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("loss", KERNEL_LOSSES)
def test_kernel_stores_every_statistic_slot(loss):
    # Partials start as torch.empty: a slot the kernel forgot would be garbage. Every LOSS branch
    # stores every slot, with and without the reference, for each correction branch.
    for correction in ("none", "token_truncate", "token_mask"):
        if (loss, correction) not in kernel_cases():
            continue
        cfg = ObjectiveConfig(loss=loss, **CORRECTION_SETTINGS[correction])
        for has_ref in (False, True):
            assert unwritten_stat_slots(cfg, has_ref, torch.device("cpu")) == []
            check_stat_slots(cfg, has_ref, torch.device("cpu"))


def test_statistic_slot_check_fails_on_a_slot_the_kernel_skips():
    # A statistic added to kernels/contract.py that the kernel does not store: its slot stays NaN.
    cfg = ObjectiveConfig()
    keys = CONTRACT_KEYS + ("new_stat_sum",)
    assert unwritten_stat_slots(cfg, False, torch.device("cpu"), keys) == ["new_stat_sum"]
    with pytest.raises(RuntimeError, match=r"does not store the statistics \['new_stat_sum'\]"):
        check_stat_slots(cfg, False, torch.device("cpu"), keys)
    # the trainer's start-up check runs the real one for its config, through the interpreter here
    assert check_objective_path(cfg, torch.device("cpu"), TRITON) == "kernel"


def test_hand_computed_grpo_tokens():
    # approx anchor, eps 0.2, pi_k = alpha: ratio = pi / pi_k.
    #   token 0: r = 1.5, A = +1 -> min(1.5, 1.2) = 1.2, clipped high, no gradient; weight 0.5
    #   token 1: r = 0.5, A = -1 -> min(-0.5, -0.8) = -0.8, clipped low, no gradient; weight 0.25
    #   token 2: r = 1.1, A = +2 -> inside the band: 2.2, d/dlogp = -A r = -2.2; weight 1
    # loss = -(0.5 * 1.2) - (0.25 * -0.8) - (1 * 2.2) = -2.6
    cfg = ObjectiveConfig(loss="grpo", ratio_anchor="approx", eps_low=0.2, eps_high=0.2)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1])).requires_grad_()
    zeros = torch.zeros(3)
    loss, stats = kernels.grpo_objective(logp, zeros, zeros, None, torch.tensor([1.0, -1.0, 2.0]),
                                         torch.tensor([0.5, 0.25, 1.0]), cfg, config=TRITON)
    assert loss.item() == pytest.approx(-2.6, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -2.2]), atol=1e-6, rtol=0)
    assert stats["num_tokens"].item() == 3
    assert stats["clip_low_sum"].item() == 1 and stats["clip_high_sum"].item() == 1
    assert stats["ratio_sum"].item() == pytest.approx(3.1, abs=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["tv_sum"].item() == 0 and stats["is_weight_sum"].item() == 3


@pytest.mark.parametrize("loss", sorted(ADV_SIGN_CONFIGS))
def test_hand_computed_clip_fraction_by_the_sign_of_the_advantage(loss):
    # tests/hand_computed.py's case (values by hand there) through the kernel: the A > 0 / A < 0
    # counts and their clipped tokens, grpo one-sided, cispo on both sides, A = 0 and padding in neither.
    cfg = ObjectiveConfig(**ADV_SIGN_CONFIGS[loss])
    want = ADV_SIGN_EXPECTED[loss]
    logp = torch.log(torch.tensor(ADV_SIGN_RATIO))
    zeros = torch.zeros(8)
    _, stats = kernels.grpo_objective(logp, zeros, zeros, None, torch.tensor(ADV_SIGN_ADV),
                                      torch.tensor(ADV_SIGN_WEIGHTS), cfg, config=TRITON)
    assert stats["num_tokens"].item() == 7
    for key in ("adv_pos", "adv_neg", "clip_adv_pos", "clip_adv_neg"):
        assert stats[f"{key}_sum"].item() == sum({**ADV_SIGN_INDICATORS, **want}[key]), key
    out = finalize_stats(stats)
    for key in ("clip_frac_adv_pos", "clip_frac_adv_neg", "clip_low_frac", "clip_high_frac", "clip_frac"):
        assert out[key] == pytest.approx(want[key], abs=1e-6), key


@pytest.mark.parametrize("loss,correction", kernel_cases())
def test_per_token_advantages_of_both_signs_match_objective(loss, correction):
    # The clip fraction split by the sign of A (adv_pos, adv_neg, clip_adv_pos, clip_adv_neg) for every
    # kernel case: the kernel reads A per token, so here its sign changes inside a sequence, a fifth of
    # the tokens have A = 0 (in neither split), and the drift is wide enough that tokens of both signs
    # are clipped (grpo's and one-sided REC's clip by the side the sign allows; cispo and two-sided REC's
    # whatever the sign).
    logp, logp_alpha, logp_k, logp_ref, _, weights = batch(seed=11, n_seqs=6, spread=0.5)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(12))
    adv[:, ::5] = 0.0
    for anchor in ["exact", "approx"] if LOSSES[loss].anchored else ["approx"]:
        cfg = ObjectiveConfig(loss=loss, ratio_anchor=anchor, eps_low=0.2, eps_high=0.28,
                              **CORRECTION_SETTINGS[correction])
        want, got = run_both(cfg, logp, logp_alpha, logp_k, None, adv, weights, config=TRITON_SWEEP)
        assert_same(want, got)
        stats = want[1]
        assert stats["adv_pos_sum"] > 0 and stats["adv_neg_sum"] > 0
        assert stats["adv_pos_sum"] + stats["adv_neg_sum"] < stats["num_tokens"]  # the A = 0 tokens
        if LOSSES[loss].clips:
            assert 0 < stats["clip_adv_pos_sum"] < stats["adv_pos_sum"], anchor
            assert 0 < stats["clip_adv_neg_sum"] < stats["adv_neg_sum"], anchor


def test_ties_split_the_gradient_like_torch():
    # eps = 0: on-policy tokens (pi = pi_k) sit exactly on both clip edges; torch's min/max give each
    # side half the gradient there, and the kernel must do the same.
    cfg = ObjectiveConfig(loss="grpo", eps_low=0.0, eps_high=0.0)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    adv, weights = torch.tensor([1.5]), torch.ones(1, 4)
    want, got = run_both(cfg, logp, logp, logp, None, adv, weights)
    assert_same(want, got)
    assert want[2].abs().sum() > 0  # the tie rule matters: a zero gradient here would hide a mismatch


def test_all_masked_and_logp_k_none_and_per_token_adv():
    cfg = ObjectiveConfig(loss="grpo", ratio_anchor="exact", is_cap=2.0, beta=0.1)
    logp, logp_alpha, logp_k, logp_ref, adv, weights = batch(seed=7)
    want, got = run_both(cfg, logp, logp_alpha, None, logp_ref, adv[:, None].expand(-1, 23).contiguous(), weights)
    assert_same(want, got)
    (loss, stats, grad) = run_both(cfg, logp, logp_alpha, logp_k, logp_ref, adv, torch.zeros_like(weights))[1]
    assert loss.item() == 0 and grad.abs().max() == 0 and stats["num_tokens"].item() == 0
    assert stats["ratio_max"].item() == -math.inf and stats["is_weight_min"].item() == math.inf


def test_bf16_logp_and_torch_backend_is_the_objective():
    cfg = ObjectiveConfig(loss="rec_ring_nois")
    logp, logp_alpha, logp_k, logp_ref, adv, weights = batch(seed=3)
    x = logp.bfloat16().requires_grad_()
    loss, stats = kernels.grpo_objective(x, logp_alpha, logp_k, None, adv, weights, cfg, config=TRITON)
    (grad,) = torch.autograd.grad(loss, x)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    want_loss, want_stats = objective(x.detach().float(), logp_alpha, logp_k, None, adv, weights, cfg)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    # On CPU (the torch backend) the trainer's objective is grpo.objective.objective itself, in the
    # fused kernel's contract; the Triton op refuses a backend it is not.
    assert objective_fn_for(torch.device("cpu"), KernelConfig()) is objective_with_grad
    assert objective_fn_for(torch.device("cpu"), TRITON) is kernels.triton_objective
    flat = [t.reshape(-1) for t in (logp, logp_alpha, logp_k, adv[:, None].expand(-1, 23), weights)]
    loss_t, stats_t, grad_t = objective_with_grad(flat[0], flat[1], flat[2], None, flat[3], flat[4], cfg)
    want_t, want_stats_t = objective(logp, logp_alpha, logp_k, None, adv, weights, cfg)
    assert loss_t.item() == want_t.item() and list(want_stats_t) == list(STAT_KEYS)
    assert stats_t.tolist() == [float(want_stats_t[k]) for k in STAT_KEYS]
    with pytest.raises(ValueError, match="grpo_objective is the Triton kernel"):
        kernels.grpo_objective(logp, logp_alpha, logp_k, None, adv, weights, cfg, backend="torch")


def test_bad_inputs_same_messages_as_objective():
    cfg = ObjectiveConfig(beta=0.1)
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"weights: shape \(2, 4\) differs"):
        kernels.grpo_objective(logp, logp, None, logp, torch.zeros(2), torch.ones(2, 4), cfg, config=TRITON)
    with pytest.raises(ValueError, match="logp_ref: beta > 0 needs"):
        kernels.grpo_objective(logp, logp, None, None, torch.zeros(2), torch.ones(2, 3), cfg, config=TRITON)
    with pytest.raises(ValueError, match="adv: shape"):
        kernels.grpo_objective(logp, logp, None, logp, torch.zeros(3), torch.ones(2, 3), cfg, config=TRITON)
