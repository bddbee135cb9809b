"""docs/extending.md, a loss: examples/dual_clip.py (PPO dual-clip) from the config's plugins, by hand,
on the torch path and inside the fused LM head."""
import math

import torch

from grpo.config import load_config
from grpo.kernel_dispatch import objective_of_hidden
from grpo.objective import objective
from grpo.train_config import TrainConfig
from hand_computed import close
from kernels import KernelConfig
from plugins import doc_holds, registered


def test_dual_clip_by_hand_and_in_the_fused_head():
    with registered("dual_clip.py") as path:
        cfg = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "objective.loss=dual_clip",
                                                  "objective.dual_clip_c=3", "objective.eps_high=0.2"]).objective
        # pi_k = alpha (approx anchor, no correction): r = pi/pi_k. A = -1 throughout; band [0.8, 1.2]
        # r = 4: ppo min(-4, -1.2) = -4, dual max(-4, -3) = -3: loss 3, no gradient (dual-clipped)
        # r = 2: min(-2, -1.2) = -2 > -3: loss 2, gradient -A r = 2; r = 1: inside, loss 1, gradient 1
        logp_k = torch.log(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
        logp = (logp_k + torch.log(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64))).requires_grad_()
        weights = torch.full((3,), 1 / 3, dtype=torch.float64)
        loss, stats = objective(logp, logp_k, logp_k, None, -torch.ones(3, dtype=torch.float64), weights, cfg)
        loss.backward()
        close(loss, (3 + 2 + 1) / 3)
        close(logp.grad, [0.0, 2 / 3, 1 / 3])
        assert float(stats["clip_low_sum"]) == 1.0  # the dual-clipped token counts as clipped

        # the fused LM head (its torch definition, as on CUDA without a kernel) equals head + objective
        torch.manual_seed(0)
        hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
        targets, adv = torch.randint(0, 20, (6,)), torch.tensor([1.0, -1.0, -2.0, 0.5, -1.0, 1.0])
        logp_alpha = torch.full((6,), math.log(0.05)) + torch.randn(6) * 0.3
        fused, _, _, _ = objective_of_hidden(hidden, weight, targets, logp_alpha, None, None, adv, torch.full((6,), 1 / 6),
                                             cfg, seq_index=None, temperature=1.0, with_entropy=False,
                                             kernel_config=KernelConfig(backend="torch"))
        plain = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None])[:, 0]
        want, _ = objective(plain, logp_alpha, None, None, adv, torch.full((6,), 1 / 6), cfg)
        torch.testing.assert_close(fused, want)
        torch.testing.assert_close(torch.autograd.grad(fused, hidden)[0], torch.autograd.grad(want, hidden)[0])
        assert doc_holds("dual_clip.py")
