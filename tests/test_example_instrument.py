"""docs/extending.md, an instrument: examples/ratio_tail.py (the fraction of tokens with pi_theta /
pi_old > 1.2 per SGD pass) from the config's plugins, by hand through the registry's reduction, and
under its declared W&B section (a real run logs it: tests/test_train.py; two ranks reduce it as one:
tests/test_train_step.py)."""
import math

import torch

from grpo import metrics
from grpo.config import load_config
from grpo.instruments import INSTRUMENTS, Reduction, Tokens, active_instruments
from grpo.train_config import TrainConfig
from plugins import doc_holds, registered


def tokens(logp, logp_old, active) -> Tokens:
    t = torch.tensor
    return Tokens(logp=t(logp, dtype=torch.float64), logp_old=t(logp_old, dtype=torch.float64),
                  logp_alpha=t(logp_old, dtype=torch.float64), active=t(active), adv=torch.zeros(len(logp)),
                  seq_index=torch.zeros(len(logp), dtype=torch.long), cfg=None, sgd_iteration=1)


def test_the_ratio_tail_by_hand():
    with registered("ratio_tail.py") as path:
        cfg = load_config(TrainConfig, overrides=[f"plugins=[{path}]"])
        tail = INSTRUMENTS["ratio_tail"]
        assert tail in active_instruments(cfg, "pass")
        # ratios e^0.3 = 1.35 (over), e^0.1 = 1.11, e^-0.5, e^0.25 = 1.28 (over, but inactive); a second micro-batch
        # e^0.19 = 1.209 (over), and an empty one: 2 of the 4 active tokens
        reduction = Reduction([tail])
        reduction.add(tokens([-1.0, -1.2, -2.0, -0.75], [-1.3, -1.3, -1.5, -1.0], [True, True, True, False]))
        reduction.add(tokens([-0.81], [-1.0], [True]))
        reduction.add(tokens([], [], []))
        assert reduction.result(collective=False) == {"ratio_tail_frac": 0.5}
        none = Reduction([tail])
        none.add(tokens([-1.0], [-1.0], [False]))
        assert math.isnan(none.result(collective=False)["ratio_tail_frac"])  # no active token: missing
        assert metrics.group_key("ratio_tail_frac") == "train/ratio_tail_frac"
        assert doc_holds("ratio_tail.py")
    assert "ratio_tail" not in INSTRUMENTS
