"""The ratio tail: the fraction of tokens whose ratio pi_theta / pi_old passed 1.2, on each SGD pass
(0 on a batch's first pass, where pi_theta is pi_old), logged every step (train/ in W&B)."""
from grpo.instruments import Tokens, register_instrument


@register_instrument("ratio_tail", section="train", per="pass",
                     ratio_tail_frac="fraction of active tokens with pi_theta / pi_old > 1.2, on this SGD pass")
def ratio_tail(x: Tokens) -> dict:
    return {"ratio_tail_frac": (x.logp - x.logp_old).exp() > 1.2}
