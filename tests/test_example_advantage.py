"""docs/extending.md, an advantage: examples/trl_advantage.py (TRL's sample-std standardisation)
from the config's plugins, by hand, and through batch_advantages as sampling and replay run it."""
import math

from grpo.advantages import batch_advantages
from grpo.config import load_config
from grpo.train_config import TrainConfig
from hand_computed import close
from plugins import doc_holds, registered


def test_trl_group_by_hand():
    with registered("trl_advantage.py") as path:
        cfg = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "objective.advantage=trl_group",
                                                  "objective.trl_eps=0.01", "grpo.G=4"])
        adv, weight, _ = batch_advantages([1, 0, 0, 1, 0, 0, 0, 1], cfg, seed=0)
        s0 = math.sqrt((4 * 0.25) / 3)  # {1,0,0,1}: squares of the deviations sum to 1, over n - 1 = 3
        s1 = math.sqrt((3 * 0.0625 + 0.5625) / 3)  # {0,0,0,1}: 3/16 + 9/16 = 3/4, over 3
        close(adv, [0.5 / (s0 + 0.01), -0.5 / (s0 + 0.01), -0.5 / (s0 + 0.01), 0.5 / (s0 + 0.01),
                    -0.25 / (s1 + 0.01), -0.25 / (s1 + 0.01), -0.25 / (s1 + 0.01), 0.75 / (s1 + 0.01)])
        close(weight, [1.0] * 8)
        assert doc_holds("trl_advantage.py")
