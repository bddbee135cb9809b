"""Every shipped config loads into its dataclass tree, and bad experiment values are refused."""
from pathlib import Path

import pytest

from grpo.config import ConfigError, load_config
from grpo.train_config import TrainConfig, eval_reads_training_data

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


ALIASED = [CONFIGS / "cpu_demo.yaml", CONFIGS / "cpu_fig2.yaml"]  # both write `eval_data: *data`


@pytest.mark.parametrize("path", ALIASED, ids=lambda p: p.name)
def test_an_override_of_data_leaves_the_eval_set_alone_and_the_reverse(path, tmp_path):
    """A YAML alias (`eval_data: *data`) made both sections one dict: `data.dataset=...` on the
    command line rewrote the held-out set too (and the reverse, and nested keys). Each section is
    its own value after loading: an override changes exactly the key it names."""
    assert "eval_data: *data" in path.read_text()
    shipped = load_config(TrainConfig, path)
    assert shipped.eval_data == shipped.data  # the alias still means "the same settings"
    train_file = tmp_path / "train.jsonl"
    train_file.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    cfg = load_config(TrainConfig, path, [f"data.dataset={train_file}"])
    assert cfg.data.dataset == str(train_file) and cfg.eval_data.dataset == shipped.eval_data.dataset == "arithmetic"
    cfg = load_config(TrainConfig, path, [f"eval_data.dataset={train_file}"])
    assert cfg.eval_data.dataset == str(train_file) and cfg.data.dataset == "arithmetic"
    cfg = load_config(TrainConfig, path, ["data.arithmetic.max_operand=7"])
    assert cfg.data.arithmetic.max_operand == 7
    assert cfg.eval_data.arithmetic.max_operand == shipped.eval_data.arithmetic.max_operand != 7
    cfg = load_config(TrainConfig, path, ["eval_data.arithmetic.max_operand=7"])
    assert cfg.eval_data.arithmetic.max_operand == 7 and cfg.data.arithmetic.max_operand != 7
    # the run's start-up lines say which data the eval reads while it is the training data's own
    assert "the eval reads the task's held-out problems" in eval_reads_training_data(shipped)
    assert eval_reads_training_data(load_config(TrainConfig, path, [f"data.dataset={train_file}"])) is None
    same_file = load_config(TrainConfig, path, [f"data.dataset={train_file}", f"eval_data.dataset={train_file}"])
    assert "the eval reads the training problems themselves" in eval_reads_training_data(same_file)
