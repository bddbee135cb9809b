"""Every shipped config loads into its dataclass tree, and bad experiment values are refused."""
from pathlib import Path

import pytest

from grpo.config import ConfigError, load_config
from grpo.train_config import TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TRAIN_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("eval_"))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_train_config_loads(path):
    cfg = load_config(TrainConfig, path)
    assert cfg.grpo.G >= 2 and cfg.grpo.v >= 1


def test_paper_values():
    cfg = load_config(TrainConfig, CONFIGS / "gsm8k_qwen0.5b_v10-i1.yaml")
    assert (cfg.grpo.G, cfg.grpo.v, cfg.grpo.i, cfg.grpo.max_new_tokens, cfg.grpo.temperature) == (16, 10, 1, 200, 0.1)
    assert (cfg.optim.lr, cfg.objective.beta) == (5e-6, 0.1)
    mask = load_config(TrainConfig, CONFIGS / "gsm8k_qwen0.5b_v1-i1-mask.yaml")
    assert mask.objective.mask_zero_variance and mask.grpo.v == 1
    ds = load_config(TrainConfig, CONFIGS / "deepscaler_r1distill1.5b_v10-i1.yaml")
    assert (ds.optim.lr, ds.objective.beta, ds.grpo.max_new_tokens, ds.grpo.temperature, ds.grpo.v) == (1e-6, 0.001, 4096, 0.7, 10)


@pytest.mark.parametrize("override,message", [
    ("grpo.v=0", "grpo.v: must be >= 1, got 0"),
    ("grpo.G=1", "grpo.G: group size must be >= 2"),
    ("objective.eps_low=-0.1", "objective.eps_low: must be in [0, 1]"),
    ("objective.loss=ppo", "objective.loss: must be one of"),
    ("optim.lr=0", "optim.lr: must be > 0"),
    ("eval_every=5", "eval_every: must be 0 or a multiple of grpo.v=10"),
    ("grpo.vv=3", "unknown key grpo.vv"),
])
def test_bad_values_name_file_and_key(override, message):
    path = CONFIGS / "gsm8k_qwen0.5b_v10-i1.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path, [override])
    assert str(path) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("override", ["optim.lr=nan", "grpo.temperature=inf", "optim.grad_clip=nan",
                                      "objective.beta=nan", "objective.beta=-inf", "objective.is_cap=.nan"])
def test_non_finite_numbers_are_refused(override):
    """nan and inf passed every `x <= 0` check (a nan learning rate trained nothing, silently)."""
    path = CONFIGS / "gsm8k_qwen0.5b_v10-i1.yaml"
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path, [override])
    assert str(path) in str(e.value) and f"{key}: expected a finite number" in str(e.value)
