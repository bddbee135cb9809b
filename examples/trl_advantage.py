"""TRL's group-standardised advantage: the sample std (n - 1) with eps outside the root, as
trl.GRPOTrainer computes it, to compare runs with TRL's numbers."""
import torch

from grpo.advantages import kept_moments, register_advantage
from grpo.registry import Knob, positive


@register_advantage("trl_group", paper="TRL GRPOTrainer (scale_rewards: group)",
                    knobs=(Knob("trl_eps", 1e-4, float, "TRL's epsilon, added to the std", positive),),
                    equation="A_i = (r_i - mean_g) / (std_g + trl_eps), std_g with n - 1 (0 when n = 1)")
def trl_group(r: torch.Tensor, keep: torch.Tensor, cfg) -> torch.Tensor:
    n, mean, var = kept_moments(r, keep)
    sample_std = torch.sqrt(var * n / (n - 1).clamp(min=1.0))
    return torch.where(n > 1, (r - mean) * keep / (sample_std + cfg.trl_eps), torch.zeros_like(r))
