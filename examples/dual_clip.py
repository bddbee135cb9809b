"""PPO dual-clip (Ye et al. 2020, arXiv 1912.09729): for A < 0 the clipped surrogate is bounded
below by c * A, so a token whose ratio has grown far past the band cannot dominate the step."""
import torch

from grpo.losses import LossInputs, PolicyTerms, anchored_ratio, clipped_surrogate, register_loss
from grpo.registry import Knob


@register_loss("dual_clip", anchored=True, paper="1912.09729 (dual-clip PPO)",
               knobs=(Knob("dual_clip_c", 3.0, float, "dual-clip: lower bound c * A of the surrogate when A < 0",
                           lambda c: None if c > 1.0 else "must be > 1"),),
               equation="grpo's -outer * f_eps, and for A < 0 at most -outer * c * A")
def dual_clip(x: LossInputs, cfg) -> PolicyTerms:
    ratio, anchor, outer = anchored_ratio(x, cfg)
    ppo = clipped_surrogate(ratio, anchor, outer, x.adv, cfg.eps_low, cfg.eps_high)
    floor = outer * cfg.dual_clip_c * x.adv  # the surrogate never goes below c * A (A < 0)
    dual = (x.adv < 0) & (-ppo.loss < floor)
    return PolicyTerms(torch.where(dual, -floor, ppo.loss), ppo.ratio,
                       torch.maximum(ppo.clip_low, dual.to(ratio.dtype)), ppo.clip_high)
