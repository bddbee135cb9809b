"""grpo/objective.py against values worked out by hand (eq. 2, 6, 7, 8 of 2505.22257; REC/RED of
2509.24203). Expected numbers are written as arithmetic in the tests, never produced by the code
under test. Shapes are tiny: this file runs in about a second on CPU."""
import math
from pathlib import Path

import pytest
import torch

from grpo.advantages import ADVANTAGES, group_advantages
from grpo.config import read_yaml
from grpo.losses import CORRECTIONS, LOSSES
from grpo.objective import (
    ObjectiveConfig,
    finalize_stats,
    local_denominators,
    merge_stats,
    objective,
    per_token_loss,
    token_weights,
)

PRESETS = sorted((Path(__file__).resolve().parent.parent / "configs" / "objectives").glob("*.yaml"))

from hand_computed import D, L, close, t  # noqa: E402,F401
from hand_computed import (ADV_SIGN_ADV, ADV_SIGN_CONFIGS, ADV_SIGN_EXPECTED, ADV_SIGN_INDICATORS,  # noqa: E402
                           ADV_SIGN_RATIO, ADV_SIGN_WEIGHTS)


# ---------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("field,value", [
    ("eps_low", 1.5), ("eps_low", -0.1), ("eps_high", -0.2), ("ring_eps_low", 0.1), ("ring_eps_high", 0.1),
    ("is_cap", 0.0), ("beta", -1.0), ("adv_eps", 0.0), ("adv_eps", 1.0), ("max_len_norm", 0), ("red_tau", 0.0),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    extra = {"loss": "rec_ring_nois"} if field.startswith("ring_") else {}  # margins of the ring loss only
    with pytest.raises(ValueError, match=f"^{field}: "):
        ObjectiveConfig(**{field: value}, **extra)


def test_ring_margins_are_checked_for_the_ring_loss_only():
    # Bug: plain GRPO refused eps_low=0.9 (ring_eps_low 0.6 not above it) and eps_high=2 (ring_eps_high 2.0).
    assert ObjectiveConfig(loss="grpo", eps_low=0.9).eps_low == 0.9
    assert ObjectiveConfig(loss="grpo", eps_high=2.0).eps_high == 2.0
    with pytest.raises(ValueError, match="^ring_eps_low: "):
        ObjectiveConfig(loss="rec_ring_nois", eps_low=0.9)
    with pytest.raises(ValueError, match="^ring_eps_high: "):
        ObjectiveConfig(loss="rec_ring_nois", eps_high=2.0)


def test_presets_are_the_named_methods():
    # The papers' named methods, plus one preset per registered loss and correction (grpo/losses.py names
    # them; tests/test_loss_registry.py checks each selects its entry).
    papers = {"grpo", "grpo_zero_var_mask", "dr_grpo", "dapo", "reinforce", "rec_oneside_is", "rec_oneside_nois",
              "rec_twoside_is", "rec_ring_nois", "red_drop", "red_weight"}
    registered = {entry.preset for entry in [*LOSSES.values(), *CORRECTIONS.values(), *ADVANTAGES.values()]
                  if entry.preset}
    assert papers <= {p.stem for p in PRESETS}
    assert {p.stem for p in PRESETS} == papers | registered
    dapo = ObjectiveConfig(**read_yaml(PRESETS[[p.stem for p in PRESETS].index("dapo")])["objective"])
    assert (dapo.eps_low, dapo.eps_high, dapo.aggregation, dapo.count_masked) == (0.2, 0.28, "token_mean", False)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_is_reinforce_at_the_on_policy_first_step(path):
    # The whole pipeline of each named method, selected by config alone. At pi = pi_k = alpha nothing is
    # clipped and every IS weight is 1, so all of them reduce to d loss/d logp = -A * weight (2509.24203).
    cfg = ObjectiveConfig(**read_yaml(path)["objective"])
    rewards = t([1, 0, 0, 0, 1, 1, 1, 1])  # G = 4: one mixed group, one zero-variance group
    adv, seq_weight, _ = group_advantages(rewards, 4, cfg, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1]] * 4 + [[1, 1, 0]] * 4, dtype=torch.bool)
    num_seqs, num_tokens = local_denominators(mask, seq_weight, cfg)
    w = token_weights(mask, seq_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=3)
    logp = -torch.rand(8, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    lp = logp.clone().requires_grad_(True)
    loss, stats = objective(lp, logp.clone(), logp.clone(), None, adv, w, cfg)
    loss.backward()
    close(lp.grad, -adv[:, None] * w)
    assert float(stats["clip_low_sum"] + stats["clip_high_sum"]) == 0
    assert (lp.grad[:4, :].abs().sum() > 0)  # the mixed group learns (for every preset)


# ---------------------------------------------------------------------------------------------- eq. 2

def test_eq2_group_std_uses_population_variance_and_eps_under_the_root():
    # group 0: {1,0,0,1}: mean 1/2, var 1/4.  group 1: {0,0,0,1}: mean 1/4, var 1/4*3/4 = 3/16.
    cfg = ObjectiveConfig(advantage="group", adv_eps=1e-4)
    adv, w, stats = group_advantages(t([1, 0, 0, 1, 0, 0, 0, 1]), 4, cfg)
    s0, s1 = math.sqrt(0.25 + 1e-4), math.sqrt(3 / 16 + 1e-4)
    close(adv, [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.75 / s1])
    close(w, [1.0] * 8)
    close(stats["reward_mean"], 3 / 8)
    close(stats["reward_std"], math.sqrt(3 / 8 * 5 / 8))
    close(stats["group_std_mean"], (0.5 + math.sqrt(3 / 16)) / 2)


def test_eq2_population_not_sample_variance_for_g2():
    # {1, 0}: population var 1/4 (sample var would be 1/2)
    adv, _, _ = group_advantages(t([1, 0]), 2, ObjectiveConfig(adv_eps=1e-4))
    close(adv, [0.5 / math.sqrt(0.25 + 1e-4), -0.5 / math.sqrt(0.25 + 1e-4)])


def test_eq2_batch_std_and_no_scaling():
    rewards = t([1, 0, 0, 1, 0, 0, 0, 1])
    # batch: group means, batch std: rewards have mean 3/8, population var 3/8 * 5/8 = 15/64
    adv, _, _ = group_advantages(rewards, 4, ObjectiveConfig(advantage="batch", adv_eps=1e-4))
    sb = math.sqrt(15 / 64 + 1e-4)
    close(adv, [0.5 / sb, -0.5 / sb, -0.5 / sb, 0.5 / sb, -0.25 / sb, -0.25 / sb, -0.25 / sb, 0.75 / sb])
    adv, _, _ = group_advantages(rewards, 4, ObjectiveConfig(advantage="none"))
    close(adv, [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75])


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(t([1, 0, 1]), 2, ObjectiveConfig())
    with pytest.raises(ValueError, match="row 1"):
        group_advantages(t([1, float("nan")]), 2, ObjectiveConfig())


# ---------------------------------------------------------------------------------------------- eq. 8, M

def test_eq8_zero_variance_group_gets_weight_zero_and_is_reported():
    rewards = t([1, 1, 1, 1, 0, 0])  # group 0 all equal, group 1 mixed
    adv, w, stats = group_advantages(rewards, 3, ObjectiveConfig(mask_zero_variance=True))
    close(w, [0, 0, 0, 1, 1, 1])
    close(adv[:3], [0, 0, 0])
    assert stats["masked_frac"] == 0.5 and stats["zero_var_frac"] == 0.5
    _, w, stats = group_advantages(rewards, 3, ObjectiveConfig(mask_zero_variance=False))
    close(w, [1] * 6)
    assert stats["masked_frac"] == 0.0 and stats["zero_var_frac"] == 0.5


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_eq8_changes_the_update_only_through_the_kl_term_when_masked_samples_are_counted(beta):
    """A zero-variance group has A = 0 for every sample, so its clipped term f_eps(r, r', 0) is 0
    with or without eq. 8. With count_masked (eq. 8 read literally: the indicator multiplies the
    term, the denominators keep the group), masking therefore changes the update only through the
    group's KL term: at beta = 0 it is the same update (the CPU replica of Fig. 2 saw v1-i1 and
    v1-i1-mask give the same numbers), at beta > 0 it differs. count_masked=False (DAPO's dynamic
    sampling) changes the denominators, hence the step size, even at beta = 0."""
    rewards = t([1, 1, 1, 1, 0, 0])  # group 0 zero-variance, group 1 mixed
    mask = torch.ones(6, 3, dtype=torch.bool)
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(6, 3, generator=gen, dtype=D)
    logp_ref = logp + 0.2 * torch.rand(6, 3, generator=gen, dtype=D)

    def grad(mask_zero_variance, count_masked=True):
        cfg = ObjectiveConfig(beta=beta, ratio_anchor="approx", mask_zero_variance=mask_zero_variance,
                              count_masked=count_masked)
        adv, seq_w, _ = group_advantages(rewards, 3, cfg)
        num_seqs, num_tokens = local_denominators(mask, seq_w, cfg)
        w = token_weights(mask, seq_w, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=3)
        lp = logp.clone().requires_grad_(True)
        loss, _ = objective(lp, logp, logp, logp_ref if beta else None, adv, w, cfg)
        loss.backward()
        return lp.grad

    plain, masked = grad(False), grad(True)
    assert torch.equal(plain[3:], masked[3:])  # the mixed group's gradient is the same either way
    assert (masked[:3] == 0).all()
    if beta == 0:
        assert torch.equal(plain, masked)
    else:
        assert (plain[:3] != 0).all()  # only the KL term moves the zero-variance group
    dropped = grad(True, count_masked=False)
    assert torch.allclose(dropped[3:], 2 * masked[3:])  # half the sequences left the mean: twice the step


def test_bound_M_from_group_reward_variances():
    # group 0 var 1/4, group 1 var 0: sigma_eps = sqrt(0.2501) and sqrt(1e-4) = 0.01
    _, _, stats = group_advantages(t([1, 0, 0, 1, 1, 1, 1, 1]), 4, ObjectiveConfig(adv_eps=1e-4))
    s0 = math.sqrt(0.2501)
    term0 = (1 - s0) ** 2 / s0 ** 2
    term1 = 0.99 ** 2 / 1e-4  # = 9801: the zero-variance group dominates (Fig. 1 of the paper)
    close(stats["bound_M"], math.sqrt((term0 + term1) / 2))
    close(stats["bound_M_nonzero"], (1 - s0) / s0)


# ---------------------------------------------------------------------------------------------- RED

def test_red_weight_is_exp_of_advantage_over_tau():
    cfg = ObjectiveConfig(red="weight", red_tau=0.5, advantage="none")
    adv, w, _ = group_advantages(t([1, 0, 0, 0]), 4, cfg)
    close(adv, [0.75, -0.25, -0.25, -0.25])
    close(w, [math.exp(1.5), math.exp(-0.5), math.exp(-0.5), math.exp(-0.5)])


def test_red_drop_balances_negatives_and_recentres_on_kept():
    # group 0 {1,0,0,0}: 1 positive, 3 negatives -> 2 negatives dropped; kept {1, 0}: mean 1/2.
    # group 1 {1,1,0,1}: mean 3/4, 3 positives, 1 negative -> nothing dropped.
    cfg = ObjectiveConfig(red="drop", advantage="none")
    dropped_sets = set()
    for seed in range(8):
        adv, w, stats = group_advantages(t([1, 0, 0, 0, 1, 1, 0, 1]), 4, cfg,
                                         generator=torch.Generator().manual_seed(seed))
        assert w[0] == 1 and float(w[1:4].sum()) == 1.0  # one negative kept
        kept_neg = int(torch.nonzero(w[1:4]).item()) + 1
        expected = [0.5, 0.0, 0.0, 0.0, 0.25, 0.25, -0.75, 0.25]
        expected[kept_neg] = -0.5
        close(adv, expected)
        close(w[4:], [1, 1, 1, 1])
        assert stats["red_drop_frac"] == 2 / 8
        dropped_sets.add(kept_neg)
    assert len(dropped_sets) > 1  # the choice is random, not always the same rows


def test_red_drop_with_group_std_uses_kept_statistics():
    cfg = ObjectiveConfig(red="drop", advantage="group", adv_eps=1e-4)
    adv, w, _ = group_advantages(t([1, 0, 0, 0]), 4, cfg, generator=torch.Generator().manual_seed(0))
    kept = torch.nonzero(w).flatten().tolist()
    s = math.sqrt(0.25 + 1e-4)
    close(adv[kept], [0.5 / s, -0.5 / s])


# ---------------------------------------------------------------------------------------------- eq. 6

def _grad(loss_fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss = loss_fn(logp)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), g


def test_eq6_approx_both_branches_of_f_eps():
    # r' = 1, eps 0.2: band [0.8, 1.2].  logp_k = logp_alpha = 0 so r = exp(logp).
    cfg = ObjectiveConfig(loss="grpo", ratio_anchor="approx", eps_low=0.2, eps_high=0.2)
    r = t([1.5, 0.5, 0.5, 1.5])
    adv = t([1.0, 1.0, -1.0, -1.0])
    zeros = torch.zeros(4, dtype=D)
    loss, g = _grad(lambda lp: per_token_loss(lp, zeros, zeros, None, adv, cfg)[0], r.log())
    # A>0, r=1.5: min(1.5, 1.2) = 1.2, clipped (no gradient)
    # A>0, r=0.5: min(0.5, 0.8) = 0.5, the r*A branch: d(-rA)/dlogp = -rA = -0.5
    # A<0, r=0.5: min(-0.5, -0.8) = -0.8, clipped
    # A<0, r=1.5: min(-1.5, -1.2) = -1.5, the r*A branch: gradient -rA = 1.5
    close(loss, [-1.2, -0.5, 0.8, 1.5])
    close(g, [0.0, -0.5, 0.0, 1.5])
    _, diag = per_token_loss(r.log(), zeros, zeros, None, adv, cfg)
    close(diag["clip_high"], [1, 0, 0, 0])
    close(diag["clip_low"], [0, 0, 1, 0])
    close(diag["ratio"], [1.5, 0.5, 0.5, 1.5])


def test_eq6_exact_band_around_r_prime_and_floor_at_zero():
    cfg = ObjectiveConfig(loss="grpo", ratio_anchor="exact", eps_low=0.2, eps_high=0.2)
    # logp_alpha = 0, so r = pi/alpha = exp(logp) and r' = pi_k/alpha = exp(logp_k).
    r_prime = t([0.5, 0.5, 0.5, 0.5, 0.1])
    r = t([0.9, 0.1, 0.6, 0.2, 0.05])
    adv = t([1.0, -1.0, 1.0, 1.0, -1.0])
    zeros = torch.zeros(5, dtype=D)
    loss, g = _grad(lambda lp: per_token_loss(lp, zeros, r_prime.log(), None, adv, cfg)[0], r.log())
    # r'=0.5: band [0.3, 0.7]
    #   r=0.9, A=+1: min(0.9, 0.7) = 0.7 clipped high
    #   r=0.1, A=-1: clip -> 0.3, min(-0.1, -0.3) = -0.3 clipped low
    #   r=0.6, A=+1: inside, 0.6, gradient -0.6
    #   r=0.2, A=+1: min(0.2, 0.3) = 0.2, the r*A branch, gradient -0.2
    # r'=0.1: band [max(0.1-0.2, 0), 0.3] = [0, 0.3]
    #   r=0.05, A=-1: inside (a band [(1-0.2)*0.1, ...] = [0.08, ...] would clip it), -0.05, gradient 0.05
    close(loss, [-0.7, 0.3, -0.6, -0.2, 0.05])
    close(g, [0.0, 0.0, -0.6, -0.2, 0.05])
    _, diag = per_token_loss(r.log(), zeros, r_prime.log(), None, adv, cfg)
    close(diag["clip_high"], [1, 0, 0, 0, 0])
    close(diag["clip_low"], [0, 1, 0, 0, 0])


def test_truncated_is_cap_exact_and_approx():
    # pi_k/alpha = 1.5 capped at 1.3; pi/pi_k = 1.2; A = +1; eps 0.2
    logp_alpha, logp_k, logp = t([0.0]), t([L(1.5)]), t([L(1.5 * 1.2)])
    adv = t([1.0])
    exact = ObjectiveConfig(ratio_anchor="exact", is_cap=1.3)
    loss, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, logp_k, None, adv, exact)[0], logp)
    # r = 1.2 * 1.3 = 1.56, r' = 1.3, band [1.1, 1.5]: clipped at 1.5
    close(loss, [-1.5])
    close(g, [0.0])
    approx = ObjectiveConfig(ratio_anchor="approx", is_cap=1.3)
    loss, _ = _grad(lambda lp: per_token_loss(lp, logp_alpha, logp_k, None, adv, approx)[0], logp)
    # 1.3 * min(1.2, clip(1.2, 0.8, 1.2)) = 1.3 * 1.2
    close(loss, [-1.3 * 1.2])
    logp = t([L(1.5 * 1.1)])  # pi/pi_k = 1.1, inside: gradient -1.3 * 1.1
    _, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, logp_k, None, adv, approx)[0], logp)
    close(g, [-1.3 * 1.1])


def test_drift_diagnostics_per_token():
    logp_alpha, logp_k = t([0.0, 0.0]), t([L(1.5), L(0.5)])
    cfg = ObjectiveConfig(is_cap=1.2)
    _, diag = per_token_loss(logp_k.clone(), logp_alpha, logp_k, None, t([1.0, 1.0]), cfg)
    close(diag["is_weight"], [1.2, 0.5])
    close(diag["is_capped"], [1.0, 0.0])
    close(diag["tv"], [0.25, 0.25])  # |1.5 - 1| / 2, |0.5 - 1| / 2
    close(diag["kl_pik_alpha"], [0.5 - L(1.5), -0.5 - L(0.5)])  # w - 1 - log w


# ---------------------------------------------------------------------------------------------- eq. 7

@pytest.mark.parametrize("estimator,expected", [
    # logp = log 1/2, ref = log 1/4: d = ref - logp = log 1/2
    ("k3", 0.5 - L(0.5) - 1.0),        # e^d - d - 1 = 1/2 + log 2 - 1
    ("k1", L(2.0)),                    # logp - ref
    ("k2", 0.5 * L(2.0) ** 2),         # (logp - ref)^2 / 2
])
def test_eq7_kl_estimators_and_beta(estimator, expected):
    logp, ref, zero = t([L(0.5)]), t([L(0.25)]), t([L(0.5)])
    cfg = ObjectiveConfig(beta=0.1, kl_estimator=estimator)
    # A = 0: the surrogate is 0, the loss is beta * kl
    loss, diag = per_token_loss(logp, zero, zero, ref, t([0.0]), cfg)
    close(diag["kl"], [expected])
    close(loss, [0.1 * expected])
    # beta = 0: kl still reported, not in the loss
    loss, diag = per_token_loss(logp, zero, zero, ref, t([0.0]), ObjectiveConfig(kl_estimator=estimator))
    close(diag["kl"], [expected])
    close(loss, [0.0])


def test_eq7_kl_k3_gradient_by_hand():
    # d(e^d - d - 1)/dlogp with d = ref - logp: -e^d + 1 = 1 - pi_ref/pi = 1 - 0.5
    logp, ref = t([L(0.5)]), t([L(0.25)])
    cfg = ObjectiveConfig(beta=0.1)
    _, g = _grad(lambda lp: per_token_loss(lp, logp, logp, ref, t([0.0]), cfg)[0], logp)
    close(g, [0.1 * 0.5])


def test_beta_without_reference_is_an_error():
    x = t([0.0])
    with pytest.raises(ValueError, match="logp_ref"):
        per_token_loss(x, x, x, None, x, ObjectiveConfig(beta=0.1))


# ---------------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("anchor", ["exact", "approx"])
@pytest.mark.parametrize("is_cap", [None, 1.1])
@pytest.mark.parametrize("beta,estimator", [(0.0, "k3"), (0.3, "k3"), (0.3, "k1"), (0.3, "k2")])
def test_f_eps_gradient_matches_finite_differences(anchor, is_cap, beta, estimator):
    gen = torch.Generator().manual_seed(0)
    n = 24
    logp_alpha = -torch.rand(n, generator=gen, dtype=D) * 3
    logp_k = logp_alpha + 0.3 * torch.randn(n, generator=gen, dtype=D)
    logp = logp_k + 0.4 * torch.randn(n, generator=gen, dtype=D)
    logp_ref = logp_k + 0.2 * torch.randn(n, generator=gen, dtype=D)
    adv = torch.randn(n, generator=gen, dtype=D)
    weights = torch.rand(n, generator=gen, dtype=D)
    cfg = ObjectiveConfig(ratio_anchor=anchor, is_cap=is_cap, beta=beta, kl_estimator=estimator)
    # stay 1e-3 away from the kinks of min/clip so finite differences see one branch
    _, diag = per_token_loss(logp, logp_alpha, logp_k, logp_ref, adv, cfg)
    r_prime = torch.ones(n, dtype=D) if anchor == "approx" else torch.exp(logp_k - logp_alpha).clamp(max=is_cap or 1e9)
    for edge in (r_prime - 0.2, r_prime + 0.2):
        assert (diag["ratio"] - edge).abs().min() > 1e-3
    assert diag["clip_low"].sum() + diag["clip_high"].sum() > 0  # both regimes are exercised
    lp = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: objective(x, logp_alpha, logp_k, logp_ref if beta else None, adv, weights, cfg)[0], (lp,))


def test_masked_groups_and_padding_give_exactly_zero_gradient():
    # 3 sequences x 4 tokens; sequence 1 belongs to a masked group (seq_weight 0); padding holds garbage.
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    seq_weight = t([1.0, 0.0, 1.0])
    cfg = ObjectiveConfig(beta=0.1, ratio_anchor="exact")
    w = token_weights(mask, seq_weight, cfg, num_seqs=3, num_tokens=9, max_len=4)
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 4, generator=gen, dtype=D)
    logp_alpha, logp_k, logp_ref = logp + 0.1, logp - 0.1, logp + 0.05
    for garbage in (float("inf"), float("nan"), 1e4):
        for tensor in (logp, logp_alpha, logp_k, logp_ref):
            tensor[~mask] = garbage
        lp = logp.clone().requires_grad_(True)
        loss, stats = objective(lp, logp_alpha, logp_k, logp_ref, t([1.0, -2.0, 0.5]), w, cfg)
        loss.backward()
        assert torch.isfinite(loss)
        assert (lp.grad[~mask] == 0).all() and (lp.grad[1] == 0).all()
        assert (lp.grad[0, :3] != 0).all()
        assert float(stats["num_tokens"]) == 7  # 3 + 4 active tokens


# ---------------------------------------------------------------------------------------------- special cases

@pytest.mark.parametrize("anchor", ["exact", "approx"])
def test_on_policy_first_step_is_reinforce(anchor):
    # alpha = pi_k and pi = pi_k (one SGD iteration): d loss/d logp = -A * weight per token
    gen = torch.Generator().manual_seed(2)
    logp = -torch.rand(2, 5, generator=gen, dtype=D)
    adv = t([0.7, -1.3])
    weights = torch.rand(2, 5, generator=gen, dtype=D)
    lp = logp.clone().requires_grad_(True)
    loss, stats = objective(lp, logp.clone(), logp.clone(), None, adv, weights, ObjectiveConfig(ratio_anchor=anchor))
    loss.backward()
    close(lp.grad, -adv[:, None] * weights)
    assert float(stats["clip_low_sum"] + stats["clip_high_sum"]) == 0
    # logp_k = None means pi_k = current parameters: same thing
    lp2 = logp.clone().requires_grad_(True)
    objective(lp2, logp.clone(), None, None, adv, weights, ObjectiveConfig(ratio_anchor=anchor))[0].backward()
    close(lp2.grad, lp.grad)


def test_off_policy_first_step_exact_is_importance_weighted_reinforce():
    # pi = pi_k != alpha: exact gives -A * (pi_k/alpha) per token, approx -A
    logp_k, logp_alpha = t([L(0.5), L(0.4)]), t([L(0.4), L(0.5)])
    adv, w = t([1.0, -1.0]), t([1.0, 1.0])
    lp = logp_k.clone().requires_grad_(True)
    objective(lp, logp_alpha, logp_k, None, adv, w, ObjectiveConfig(ratio_anchor="exact"))[0].backward()
    close(lp.grad, [-1.0 * 0.5 / 0.4, 1.0 * 0.4 / 0.5])


def test_approx_equals_exact_when_r_prime_is_one():
    gen = torch.Generator().manual_seed(3)
    logp_k = -torch.rand(3, 6, generator=gen, dtype=D)
    logp = logp_k + 0.3 * torch.randn(3, 6, generator=gen, dtype=D)
    adv, weights = t([1.0, -0.5, 2.0]), torch.rand(3, 6, generator=gen, dtype=D)
    out = {}
    for anchor in ("exact", "approx"):
        lp = logp.clone().requires_grad_(True)
        loss, stats = objective(lp, logp_k.clone(), logp_k, None, adv, weights, ObjectiveConfig(ratio_anchor=anchor))
        loss.backward()
        out[anchor] = (loss.detach(), lp.grad, stats["clip_low_sum"], stats["clip_high_sum"])
    for a, b in zip(out["exact"], out["approx"]):
        close(a, b)
    assert float(out["exact"][2] + out["exact"][3]) > 0  # clipping happened in this example


# ---------------------------------------------------------------------------------------------- 2509.24203

def test_reinforce_is_minus_advantage_log_prob():
    logp, logp_alpha = t([L(0.5), L(0.2)]), t([L(0.1), L(0.9)])
    cfg = ObjectiveConfig(loss="reinforce", is_cap=1.5)  # no weights: is_cap unused
    loss, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, None, None, t([2.0, -1.0]), cfg)[0], logp)
    close(loss, [-2.0 * L(0.5), 1.0 * L(0.2)])
    close(g, [-2.0, 1.0])


# ratio r = pi/alpha per column; band [0.8, 1.2]; ring outer margins 1 - 0.6 = 0.4 and 1 + 2.0 = 3.0
REC_R = [0.3, 0.7, 1.0, 1.3, 3.5]
REC_KEEP = {  # (A > 0 keep, A < 0 keep), written out from the definitions
    "rec_oneside_is": ([1, 1, 1, 0, 0], [0, 0, 1, 1, 1]),    # A>0: r <= 1.2 ; A<0: r >= 0.8
    "rec_oneside_nois": ([1, 1, 1, 0, 0], [0, 0, 1, 1, 1]),
    "rec_twoside_is": ([0, 0, 1, 0, 0], [0, 0, 1, 0, 0]),    # 0.8 <= r <= 1.2 whatever A
    "rec_ring_nois": ([1, 0, 1, 0, 0], [0, 0, 1, 0, 1]),     # band, or A>0: r <= 0.4, or A<0: r >= 3.0
}


@pytest.mark.parametrize("loss_name", sorted(REC_KEEP))
def test_rec_masks_and_gradients(loss_name):
    cfg = ObjectiveConfig(loss=loss_name, eps_low=0.2, eps_high=0.2, ring_eps_low=0.6, ring_eps_high=2.0)
    r = t(REC_R)
    logp_alpha = t([L(0.5)] * 5)
    logp = logp_alpha + r.log()
    for sign, keep in zip((1.0, -1.0), REC_KEEP[loss_name]):
        adv = t([sign] * 5)
        loss, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, None, None, adv, cfg)[0], logp)
        coef = r if loss_name.endswith("_is") else torch.ones(5, dtype=D)
        # d/dlogp of -A * stopgrad(c) * keep * logp = -A c keep
        close(g, -sign * coef * t(keep))
        close(loss, -sign * coef * t(keep) * logp)
        _, diag = per_token_loss(logp, logp_alpha, None, None, adv, cfg)
        dropped = 1 - t(keep)
        close(diag["clip_low"] + diag["clip_high"], dropped)
        close(diag["clip_low"], dropped * (r < 1).to(D))
        close(diag["ratio"], r)


def test_rec_is_weight_respects_cap():
    cfg = ObjectiveConfig(loss="rec_oneside_is", is_cap=1.1)
    logp_alpha, logp = t([0.0]), t([L(1.15)])  # r = 1.15 inside band, IS weight capped to 1.1
    _, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, None, None, t([1.0]), cfg)[0], logp)
    close(g, [-1.1])


# ---------------------------------------------------------------------------------------------- CISPO (2506.13585)

def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # approx: r = pi/pi_k with pi_k = 1/2 on every token; eps_low_is = 1 (no lower bound), eps_high_is = 0.28.
    cfg = ObjectiveConfig(loss="cispo", eps_low_is=1.0, eps_high_is=0.28)
    logp_k = t([L(0.5)] * 4)
    pi = t([0.75, 0.25, 0.55, 1.0])          # r = 1.5, 0.5, 1.1, 2.0
    adv = t([1.0, 1.0, -1.0, -1.0])
    loss, g = _grad(lambda lp: per_token_loss(lp, logp_k, logp_k, None, adv, cfg)[0], pi.log())
    # clipped weights r_hat = min(r, 1.28) = 1.28, 0.5, 1.1, 1.28; loss = -r_hat A log pi, gradient -r_hat A
    close(loss, [-1.28 * L(0.75), -0.5 * L(0.25), 1.1 * L(0.55), 1.28 * L(1.0)])
    close(g, [-1.28, -0.5, 1.1, 1.28])  # the clipped tokens (0 and 3) keep a gradient, unlike eq. 6
    _, diag = per_token_loss(pi.log(), logp_k, logp_k, None, adv, cfg)
    close(diag["clip_high"], [1, 0, 0, 1])
    close(diag["clip_low"], [0, 0, 0, 0])
    close(diag["ratio"], [1.5, 0.5, 1.1, 2.0])
    # a lower bound: eps_low_is = 0.2 raises r = 0.5 to 0.8
    cfg = ObjectiveConfig(loss="cispo", eps_low_is=0.2, eps_high_is=0.28)
    _, g = _grad(lambda lp: per_token_loss(lp, logp_k, logp_k, None, adv, cfg)[0], pi.log())
    close(g, [-1.28, -0.8, 1.1, 1.28])


def test_cispo_exact_anchor_and_a_masked_token():
    # exact: r = pi/alpha. pi = pi_k (first step), pi_k/alpha = 0.5, 1.2, 3.0; A = +1.
    cfg = ObjectiveConfig(loss="cispo", ratio_anchor="exact", eps_low_is=0.2, eps_high_is=0.28)
    logp_k, logp_alpha = t([L(0.2), L(0.3), L(0.3)]), t([L(0.4), L(0.25), L(0.1)])
    loss, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, logp_k, None, t([1.0] * 3), cfg)[0], logp_k)
    close(g, [-0.8, -1.2, -1.28])  # clip(0.5) = 0.8 (the lower bound), 1.2 inside, clip(3) = 1.28
    close(loss, [-0.8 * L(0.2), -1.2 * L(0.3), -1.28 * L(0.3)])
    # token_mask [0.4, 2]: pi_k/alpha = 3 leaves the band; its r = 0 would be raised to 0.8 by the clip,
    # so CISPO drops the masked token explicitly.
    cfg = ObjectiveConfig(loss="cispo", ratio_anchor="exact", eps_low_is=0.2, eps_high_is=0.28,
                          is_correction="token_mask", is_floor=0.4, is_cap=2.0)
    _, g = _grad(lambda lp: per_token_loss(lp, logp_alpha, logp_k, None, t([1.0] * 3), cfg)[0], logp_k)
    close(g, [-0.8, -1.2, 0.0])


def test_cispo_token_mean_over_a_ragged_batch():
    # The preset's aggregation: every token of the batch weighs 1 / num_tokens, clipped or not.
    cfg = ObjectiveConfig(loss="cispo", aggregation="token_mean", eps_high_is=0.28)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    w = token_weights(mask, torch.ones(2, dtype=D), cfg, num_seqs=2, num_tokens=3, max_len=3)
    logp_k = torch.zeros(2, 3, dtype=D)
    logp = t([[L(2.0), L(1.1), 0.0], [L(0.5), 0.0, 0.0]])  # r = 2, 1.1 | 0.5
    lp = logp.clone().requires_grad_(True)
    loss, stats = objective(lp, logp_k, logp_k, None, t([1.0, -2.0]), w, cfg)
    loss.backward()
    close(lp.grad, [[-1.28 / 3, -1.1 / 3, 0.0], [2.0 * 0.5 / 3, 0.0, 0.0]])
    close(loss, (-1.28 * L(2.0) - 1.1 * L(1.1) + 2.0 * 0.5 * L(0.5)) / 3)
    assert float(stats["clip_high_sum"]) == 1 and float(stats["num_tokens"]) == 3


# ---------------------------------------------------------------------------------------------- aggregation

# ragged batch: lengths 3, 1, 2 (T = 4). With loss=reinforce and A = -1 the per-token loss is logp itself,
# so token values 1..6 make the aggregates easy to write out.
RAGGED_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
RAGGED_VALUES = t([[1, 2, 3, 99], [4, 99, 99, 99], [5, 6, 99, 99]])


def _aggregate(cfg, rows=slice(None), num_seqs=3, num_tokens=6, max_len=4, truncated=None):
    mask, values = RAGGED_MASK[rows], RAGGED_VALUES[rows]
    w = token_weights(mask, torch.ones(mask.shape[0], dtype=D), cfg, num_seqs=num_seqs, num_tokens=num_tokens,
                      max_len=max_len, truncated=None if truncated is None else truncated[rows])
    zeros = torch.zeros_like(values)
    loss, _ = objective(values, zeros, zeros, None, -torch.ones(mask.shape[0], dtype=D), w, cfg)
    return float(loss)


@pytest.mark.parametrize("aggregation,expected", [
    ("seq_mean", ((1 + 2 + 3) / 3 + 4 / 1 + (5 + 6) / 2) / 3),   # mean of per-sequence means
    ("token_mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),                  # over all 6 tokens
    ("seq_sum_norm", (1 + 2 + 3 + 4 + 5 + 6) / (3 * 4)),          # sums / (num_seqs * max_len 4)
])
def test_aggregation_modes_on_ragged_batch(aggregation, expected):
    cfg = ObjectiveConfig(loss="reinforce", aggregation=aggregation)
    close(_aggregate(cfg), expected)
    # two micro-batches with the global denominators add up to the full batch
    close(_aggregate(cfg, slice(0, 2)) + _aggregate(cfg, slice(2, 3)), expected)


def test_seq_sum_norm_constant_from_config_wins():
    cfg = ObjectiveConfig(loss="reinforce", aggregation="seq_sum_norm", max_len_norm=8)
    close(_aggregate(cfg, max_len=4), 21 / (3 * 8))


@pytest.mark.parametrize("count_masked,aggregation,expected", [
    (True, "seq_mean", ((1 + 2 + 3) / 3 + 4) / 3),   # truncated sequence 2 counts as a zero
    (False, "seq_mean", ((1 + 2 + 3) / 3 + 4) / 2),  # it leaves the batch
    (True, "token_mean", (1 + 2 + 3 + 4) / 6),
    (False, "token_mean", (1 + 2 + 3 + 4) / 4),
])
def test_truncated_masking_and_denominators(count_masked, aggregation, expected):
    truncated = torch.tensor([False, False, True])
    cfg = ObjectiveConfig(loss="reinforce", aggregation=aggregation, mask_truncated=True, count_masked=count_masked)
    num_seqs, num_tokens = local_denominators(RAGGED_MASK, torch.ones(3, dtype=D), cfg, truncated)
    assert (num_seqs, num_tokens) == ((3, 6) if count_masked else (2, 4))
    close(_aggregate(cfg, num_seqs=num_seqs, num_tokens=num_tokens, truncated=truncated), expected)
    with pytest.raises(ValueError, match="truncated"):
        token_weights(RAGGED_MASK, torch.ones(3), cfg, num_seqs=3, num_tokens=6, max_len=4)


def test_all_masked_batch_gives_zero_weights_not_an_error():
    cfg = ObjectiveConfig(aggregation="token_mean", count_masked=False)
    zero_weight = torch.zeros(3, dtype=D)
    num_seqs, num_tokens = local_denominators(RAGGED_MASK, zero_weight, cfg)
    assert (num_seqs, num_tokens) == (0, 0)
    w = token_weights(RAGGED_MASK, zero_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=4)
    assert (w == 0).all()
    with pytest.raises(ValueError, match="denominator"):
        token_weights(RAGGED_MASK, torch.ones(3, dtype=D), cfg, num_seqs=3, num_tokens=0, max_len=4)


def test_seq_weight_scales_whole_sequence():
    cfg = ObjectiveConfig(loss="reinforce", aggregation="token_mean")
    w = token_weights(RAGGED_MASK, t([2.0, 0.0, 1.0]), cfg, num_seqs=3, num_tokens=6, max_len=4)
    close(w, t([[2, 2, 2, 0], [0, 0, 0, 0], [1, 1, 0, 0]]) / 6)


# ---------------------------------------------------------------------------------------------- stats

def test_objective_stats_sums_merge_and_finalize():
    # the four tokens of test_eq6_approx_both_branches_of_f_eps, two per micro-batch
    cfg = ObjectiveConfig(is_cap=1.2)
    r, adv = t([1.5, 0.5, 0.5, 1.5]), t([1.0, 1.0, -1.0, -1.0])
    logp_alpha = t([0.0, 0.0, L(0.5), L(2.0)])  # pi_k/alpha = 1, 1, 2, 0.5
    zeros, w = torch.zeros(4, dtype=D), torch.full((4,), 0.25, dtype=D)
    parts = [objective(r.log()[s], logp_alpha[s], zeros[s], None, adv[s], w[s], cfg)[1]
             for s in (slice(0, 2), slice(2, 4))]
    out = finalize_stats(merge_stats(*parts))
    assert out["num_tokens"] == 4
    close(out["clip_low_frac"], 0.25)
    close(out["clip_high_frac"], 0.25)
    close(out["clip_frac"], 0.5)
    close(out["ratio_mean"], 1.0)
    close(out["ratio_std"], 0.5)
    close(out["ratio_max"], 1.5)
    close(out["ratio_min"], 0.5)
    # is_weight after cap: 1, 1, 1.2, 0.5
    close(out["is_weight_mean"], (1 + 1 + 1.2 + 0.5) / 4)
    close(out["is_weight_max"], 1.2)
    close(out["is_capped_frac"], 0.25)
    close(out["tv_mean"], (0 + 0 + 0.5 + 0.25) / 4)
    close(out["kl_pik_alpha_mean"], ((1 - L(2.0)) + (-0.5 - L(0.5))) / 4)
    # approx + is_cap: per-token loss of the f_eps example times w_bar = 1, 1, 1.2, 0.5
    close(out["loss"], 0.25 * (-1.2 * 1 - 0.5 * 1 + 0.8 * 1.2 + 1.5 * 0.5))
    assert out["kl_mean"] == 0.0


def test_effective_sample_size_of_the_importance_weights():
    """Kish's ESS over the active tokens, as a fraction: (sum w)^2 / (n sum w^2) with w = pi_k/alpha.
    Weights 1, 1, 2 (and a padding token that does not count): 16 / (3 * 6) = 8/9; all equal: 1."""
    cfg = ObjectiveConfig()
    logp_alpha = t([[-1.0, -2.0, -1.5, 0.0]])
    logp_k = logp_alpha + t([[0.0, 0.0, L(2.0), 5.0]])
    weights = t([[0.25, 0.25, 0.5, 0.0]])
    _, stats = objective(logp_k.clone(), logp_alpha, logp_k, None, t([0.5]), weights, cfg)
    close(finalize_stats(stats)["is_weight_ess"], 16.0 / 18.0)
    _, stats = objective(logp_alpha.clone(), logp_alpha, logp_alpha, None, t([0.5]), weights, cfg)
    close(finalize_stats(stats)["is_weight_ess"], 1.0)


@pytest.mark.parametrize("loss", sorted(ADV_SIGN_CONFIGS))
def test_clip_fraction_split_by_the_sign_of_the_advantage(loss):
    # tests/hand_computed.py's case worked out by hand: 7 active tokens, 3 with A > 0, 3 with A < 0,
    # one with A = 0, a padding token; grpo clips by the side the sign allows, cispo on both sides.
    cfg = ObjectiveConfig(**ADV_SIGN_CONFIGS[loss])
    want = ADV_SIGN_EXPECTED[loss]
    logp, adv, w = t(ADV_SIGN_RATIO).log(), t(ADV_SIGN_ADV), t(ADV_SIGN_WEIGHTS)
    zeros = torch.zeros(8, dtype=D)
    _, diag = per_token_loss(logp[:7], zeros[:7], zeros[:7], None, adv[:7], cfg)
    for key in ("adv_pos", "adv_neg"):
        close(diag[key], ADV_SIGN_INDICATORS[key])
    for key in ("clip_adv_pos", "clip_adv_neg"):
        close(diag[key], want[key])
    # additive over micro-batches: two parts, the padding token in the second
    parts = [objective(logp[s], zeros[s], zeros[s], None, adv[s], w[s], cfg)[1] for s in (slice(0, 3), slice(3, 8))]
    sums = merge_stats(*parts)
    assert [float(sums[k]) for k in ("num_tokens", "adv_pos_sum", "adv_neg_sum")] == [7, 3, 3]
    assert float(sums["clip_adv_pos_sum"]) == sum(want["clip_adv_pos"])
    assert float(sums["clip_adv_neg_sum"]) == sum(want["clip_adv_neg"])
    out = finalize_stats(sums)
    for key in ("clip_frac_adv_pos", "clip_frac_adv_neg", "clip_low_frac", "clip_high_frac", "clip_frac"):
        close(out[key], want[key])


def test_clip_fraction_of_an_absent_sign_is_nan():
    # Every active token has A > 0 (the padding token's A < 0 does not count): the A < 0 split is a
    # statistic of an empty set, NaN here and missing from the logged row (grpo.metrics.defined).
    cfg = ObjectiveConfig(loss="grpo", eps_low=0.2, eps_high=0.2)
    logp, zeros = t([L(1.5), L(1.1), L(0.5), L(0.5)]), torch.zeros(4, dtype=D)
    _, stats = objective(logp, zeros, zeros, None, t([1.0, 2.0, 1.0, -1.0]), t([0.25, 0.25, 0.5, 0.0]), cfg)
    out = finalize_stats(stats)
    close(out["clip_frac_adv_pos"], 1 / 3)  # r = 1.5 clipped high; 1.1 inside; 0.5 on the r A branch
    assert float(stats["adv_neg_sum"]) == 0 and math.isnan(out["clip_frac_adv_neg"])
    # A = 0 everywhere: both splits are missing, the overall clip fraction is not
    _, stats = objective(logp, zeros, zeros, None, torch.zeros(4, dtype=D), t([0.25, 0.25, 0.5, 0.0]), cfg)
    out = finalize_stats(stats)
    assert math.isnan(out["clip_frac_adv_pos"]) and math.isnan(out["clip_frac_adv_neg"]) and out["clip_frac"] == 0
