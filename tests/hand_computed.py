"""What the hand-computed float64 tests of the objective share: exact tensors and a tight comparison."""
import math

import torch

D = torch.float64
L = math.log


def t(values):
    return torch.tensor(values, dtype=D)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D),
                               rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- a case
# The clip fraction split by the sign of the advantage (finalize_stats' clip_frac_adv_pos / _neg).
# pi_k = alpha (logp_k = logp_alpha = 0), so r = pi/pi_k = pi/alpha = exp(logp) under both anchors.
# Eight tokens; the last is padding (weight 0: not counted, whatever its r and A).
#   tok  r    A     grpo, eps 0.2 (band [0.8, 1.2])          cispo, eps_low_is 0.2, eps_high_is 0.28 ([0.8, 1.28])
#   0    1.5  +1    min(1.5, 1.2): clipped high              clipped high
#   1    1.1  +2    inside                                   inside
#   2    0.5  +1    min(0.5, 0.8) = 0.5: r A branch, kept    clipped low (CISPO clips whatever the sign)
#   3    0.5  -1    min(-0.5, -0.8): clipped low             clipped low
#   4    1.5  -1    min(-1.5, -1.2) = -1.5: r A branch, kept clipped high
#   5    0.7  -0.5  min(-0.35, -0.4): clipped low            clipped low
#   6    1.5  0     A = 0: neither sign, never clipped       clipped high, but A = 0 is in neither split
#   7    1.5  +1    padding (weight 0)                       padding
# Active tokens: 7; A > 0: tokens 0, 1, 2 (3); A < 0: tokens 3, 4, 5 (3); A = 0: token 6.
#   grpo:  clipped with A > 0: token 0 -> 1/3;     with A < 0: tokens 3, 5 -> 2/3;
#          clip_low_frac 2/7, clip_high_frac 1/7, clip_frac 3/7.
#   cispo: clipped with A > 0: tokens 0, 2 -> 2/3; with A < 0: tokens 3, 4, 5 -> 3/3 = 1;
#          clip_low_frac 3/7 (2, 3, 5), clip_high_frac 3/7 (0, 4, 6), clip_frac 6/7.
ADV_SIGN_RATIO = (1.5, 1.1, 0.5, 0.5, 1.5, 0.7, 1.5, 1.5)
ADV_SIGN_ADV = (1.0, 2.0, 1.0, -1.0, -1.0, -0.5, 0.0, 1.0)
ADV_SIGN_WEIGHTS = (0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.0)
ADV_SIGN_CONFIGS = {"grpo": dict(loss="grpo", ratio_anchor="approx", eps_low=0.2, eps_high=0.2),
                    "cispo": dict(loss="cispo", ratio_anchor="approx", eps_low_is=0.2, eps_high_is=0.28)}
ADV_SIGN_EXPECTED = {
    # per active token (0..6): clip_adv_pos, clip_adv_neg; then the finalized fractions
    "grpo": dict(clip_adv_pos=(1, 0, 0, 0, 0, 0, 0), clip_adv_neg=(0, 0, 0, 1, 0, 1, 0),
                 clip_frac_adv_pos=1 / 3, clip_frac_adv_neg=2 / 3,
                 clip_low_frac=2 / 7, clip_high_frac=1 / 7, clip_frac=3 / 7),
    "cispo": dict(clip_adv_pos=(1, 0, 1, 0, 0, 0, 0), clip_adv_neg=(0, 0, 0, 1, 1, 1, 0),
                  clip_frac_adv_pos=2 / 3, clip_frac_adv_neg=1.0,
                  clip_low_frac=3 / 7, clip_high_frac=3 / 7, clip_frac=6 / 7),
}
ADV_SIGN_INDICATORS = dict(adv_pos=(1, 1, 1, 0, 0, 0, 0), adv_neg=(0, 0, 0, 1, 1, 1, 0))
