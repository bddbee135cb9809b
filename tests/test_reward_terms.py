"""Reward terms (grpo/rewards.py) against values worked out by hand, in this process (workers=0:
the pool's SIGALRM bound on the main thread; the worker processes are tests/test_rewards.py's)."""
import pytest

from grpo.config import ConfigError, load_config
from grpo.rewards import TERMS, Completion, RewardConfig, RewardScorer, register_term, reward_range
from grpo.train_config import TrainConfig
from plugins import registered


def completion(text: str, num_tokens: int = 10, max_tokens: int = 100, gold: str = "4", truncated: bool = False):
    return Completion(text=text, gold=gold, num_tokens=num_tokens, truncated=truncated, max_tokens=max_tokens)


def test_overlong_is_dapos_soft_penalty():
    cfg = RewardConfig(terms={"correct": 1.0, "overlong": 1.0}, overlong_buffer=20)
    overlong = TERMS["overlong"].fn
    # L_max = 100, L_cache = 20: 0 up to 80 tokens, then (80 - |y|) / 20 down to -1 at 100
    assert [overlong(completion("x", n), cfg) for n in (10, 80, 81, 90, 100, 101)] == \
        [0.0, 0.0, -1 / 20, -10 / 20, -1.0, -1.0]
    default = RewardConfig(terms={"correct": 1.0, "overlong": 1.0})  # null: a fifth of the budget
    assert overlong(completion("x", 90), default) == (80 - 90) / 20
    with pytest.raises(ValueError, match="max_tokens"):
        overlong(Completion("x", "4"), cfg)


def test_format_counts_exactly_one_balanced_box():
    fmt = TERMS["format"].fn
    texts = [r"\boxed{4}", r"\boxed{1} \boxed{4}", r"\boxed{4", "4", r"\boxed{a \boxed{b}}"]
    assert [fmt(completion(x), None) for x in texts] == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_the_reward_is_the_weighted_sum_and_each_term_is_logged():
    cfg = RewardConfig(workers=0, terms={"correct": 0.9, "format": 0.1, "overlong": 0.5}, overlong_buffer=20)
    texts = [(r"so \boxed{4}", 10), (r"\boxed{5}", 90), ("4", 100)]
    with RewardScorer(cfg) as scorer:
        rewards, info = scorer.score([completion(x, n) for x, n in texts])
    # correct (1, 0, 0), format (1, 1, 0), overlong (0, -1/2, -1)
    assert rewards == pytest.approx([0.9 + 0.1, 0.1 - 0.25, -0.5])
    assert info["terms"] == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0], "overlong": [0.0, -0.5, -1.0]}
    assert info["term_means"] == pytest.approx({"reward_term_correct": 1 / 3, "reward_term_format": 2 / 3,
                                                "reward_term_overlong": -0.5})
    assert info["correct"] == [1.0, 0.0, 0.0] and info["no_answer"] == 1 and info["extracted"] == ["4", "5", None]
    assert reward_range(cfg) == (-0.5, 1.0)


def test_correctness_is_checked_whatever_its_weight():
    with RewardScorer(RewardConfig(workers=0, terms={"format": 1.0})) as scorer:
        rewards, info = scorer.score([completion(r"\boxed{4}"), completion(r"\boxed{5}")])
    assert rewards == [1.0, 1.0] and info["correct"] == [1.0, 0.0] and set(info["terms"]) == {"format"}


def test_a_term_registered_from_a_users_file_with_its_knob(tmp_path):
    plugin = tmp_path / "my_terms.py"
    plugin.write_text(
        "from grpo.registry import Knob\n"
        "from grpo.rewards import register_term\n\n\n"
        "@register_term('concise', range=(0.0, 1.0), equation='1 - num_tokens / max_tokens',\n"
        "               knobs=(Knob('concise_power', 1.0, float, 'exponent'),))\n"
        "def concise(c, cfg):\n"
        "    return (1.0 - c.num_tokens / c.max_tokens) ** cfg.concise_power\n")
    with registered(plugin):
        cfg = load_config(TrainConfig, overrides=[f"plugins=[{plugin}]", "reward.terms={correct: 1.0, concise: 0.5}",
                                                  "reward.concise_power=2", "reward.workers=0"])
        with RewardScorer(cfg.reward) as scorer:
            rewards, _ = scorer.score([completion(r"\boxed{4}", num_tokens=50)])
        assert rewards == [1.0 + 0.5 * 0.25]
    assert "concise" not in TERMS and "concise_power" not in RewardConfig.__dataclass_fields__


def test_bad_terms_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"reward\.terms: unknown term 'fromat' \(registered: "):
        load_config(TrainConfig, overrides=["reward.terms={correct: 0.9, fromat: 0.1}"])
    with pytest.raises(ConfigError, match=r"reward\.terms: the weighted reward has no range"):
        load_config(TrainConfig, overrides=["reward.terms={correct: 0}"])
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer: must be >= 1 or null"):
        load_config(TrainConfig, overrides=["reward.overlong_buffer=0"])
    with pytest.raises(ValueError, match="range must be finite with lo < hi"):
        register_term("bad", range=(1.0, 0.0), equation="-")
