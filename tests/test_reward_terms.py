"""Reward terms (grpo/rewards.py) against values worked out by hand, in this process (workers=0:
the pool's SIGALRM bound on the main thread; math-verify's worker processes are tests/test_rewards.py's):
a failing term handled alike here and in a worker, declared ranges checked and following the config."""
import math

import pytest

from grpo.config import ConfigError, load_config
from grpo.rewards import TERMS, Completion, RewardConfig, RewardError, RewardScorer, register_term, reward_range
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


FLAKY = '''
import math

from grpo.rewards import register_term


def _flaky(c, cfg):
    if c.text == "raise":
        raise ZeroDivisionError("one odd completion")
    return {"nan": math.nan, "inf": math.inf}.get(c.text, 0.5)


register_term("flaky_here", range=(0.0, 1.0), equation="0.5; raises or NaN/inf on odd text")(_flaky)
register_term("flaky_pooled", range=(0.0, 1.0), pool=True, equation="the same, in the worker pool")(_flaky)
register_term("too_big", range=(0.0, 1.0), equation="2 on 'big'")(lambda c, cfg: 2.0 if c.text == "big" else 0.0)
'''


@pytest.fixture
def flaky_terms(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    with registered(path):
        yield path


@pytest.mark.torchrun  # a worker process
def test_a_term_that_raises_or_returns_nan_scores_its_minimum_and_is_counted_alike_here_and_in_the_pool(flaky_terms):
    """Before: in this process a raising term ended the run with a traceback and a NaN went on into
    the advantages; in the pool both scored the minimum, uncounted. Now both paths alike."""
    cfg = load_config(TrainConfig, overrides=[f"plugins=[{flaky_terms}]", "reward.workers=1",
                                              "reward.terms={correct: 1.0, flaky_here: 1.0, flaky_pooled: 1.0}"])
    texts = [r"\boxed{4}", "raise", "nan", "inf", "fine"] + ["fine"] * 7
    with RewardScorer(cfg.reward) as scorer:
        rewards, info = scorer.score([completion(t) for t in texts])
    assert info["terms"]["flaky_here"] == info["terms"]["flaky_pooled"] == [0.5, 0.0, 0.0, 0.0] + [0.5] * 8
    assert info["failed"] == {"reward_failed_correct": 0, "reward_failed_flaky_here": 3,
                              "reward_failed_flaky_pooled": 3}
    assert rewards[:4] == [2.0, 0.0, 0.0, 0.0] and all(map(math.isfinite, rewards))


def test_failures_past_the_fraction_stop_naming_the_term(flaky_terms):
    cfg = load_config(TrainConfig, overrides=[f"plugins=[{flaky_terms}]", "reward.workers=0",
                                              "reward.terms={correct: 1.0, flaky_here: 1.0}", "reward.max_failed_frac=0.2"])
    with RewardScorer(cfg.reward) as scorer:
        _, info = scorer.score([completion(t) for t in ["raise"] + ["fine"] * 4])  # 1 of 5: at the fraction
        assert info["failed"]["reward_failed_flaky_here"] == 1
        with pytest.raises(RewardError, match=r"reward term flaky_here failed on 2 of 5 completions of a batch, more "
                                              r"than reward.max_failed_frac=0.2 \(first: failed: ZeroDivisionError: "
                                              r"one odd completion; .*flaky.py\)"):
            scorer.score([completion(t) for t in ["raise", "nan"] + ["fine"] * 3])


def test_a_value_outside_the_declared_range_names_the_term_and_the_value(flaky_terms):
    cfg = load_config(TrainConfig, overrides=[f"plugins=[{flaky_terms}]", "reward.workers=0",
                                              "reward.terms={correct: 1.0, too_big: 0.5}"])
    with RewardScorer(cfg.reward) as scorer:
        assert scorer.score([completion("small")])[0] == [0.0]
        with pytest.raises(RewardError, match=r"reward term too_big returned 2.0 for a completion, outside its declared "
                                              r"range \[0, 1\] \(max_tokens=100; .*flaky.py\)"):
            scorer.score([completion("small"), completion("big")])


LENGTH_PENALTY = '''
from grpo.registry import Knob
from grpo.rewards import register_term


def _range(cfg, max_tokens):
    """-1 at the budget; (0, 0) where the penalty cannot fire: it starts at or past the budget."""
    return (-1.0, 0.0) if cfg.penalty_from < max_tokens else (0.0, 0.0)


@register_term("long_penalty", range=_range, equation="-(|y| - from) / (L_max - from) past `penalty_from` tokens",
               knobs=(Knob("penalty_from", 96, int, "tokens before the penalty starts"),))
def long_penalty(c, cfg):
    return -max(c.num_tokens - cfg.penalty_from, 0) / max(c.max_tokens - cfg.penalty_from, 1)
'''


def test_a_range_follows_the_config_and_what_cannot_fire_leaves_the_bounds_M_alone(tmp_path):
    """A penalty that cannot fire at grpo.max_new_tokens (it starts past the budget) widened the
    reward's range all the same, and moved bound_M on the same rewards (1.16 -> 3.32 in the issue)."""
    from grpo.advantages import batch_advantages

    path = tmp_path / "long_penalty.py"
    path.write_text(LENGTH_PENALTY)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    plain = load_config(TrainConfig, overrides=["grpo.G=4", "grpo.max_new_tokens=64"])
    with registered(path):
        idle = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "grpo.G=4", "grpo.max_new_tokens=64",
                                                   "reward.terms={correct: 1.0, long_penalty: 1.0}"])
        firing = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "grpo.G=4", "grpo.max_new_tokens=128",
                                                     "reward.terms={correct: 1.0, long_penalty: 1.0}"])
        assert reward_range(idle.reward, 64) == (0.0, 1.0) and reward_range(firing.reward, 128) == (-1.0, 1.0)
        assert batch_advantages(rewards, idle, seed=0)[2]["bound_M"] == batch_advantages(rewards, plain, seed=0)[2]["bound_M"]
        assert batch_advantages(rewards, firing, seed=0)[2]["bound_M"] != batch_advantages(rewards, plain, seed=0)[2]["bound_M"]
        weightless = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "reward.terms={correct: 1.0, long_penalty: 0}"])
        assert reward_range(weightless.reward, 1024) == (0.0, 1.0)  # weight 0: it adds nothing
        with pytest.raises(ConfigError, match=r"reward.terms: the weighted reward has no range \(\[0, 0\]\) at "
                                              r"grpo.max_new_tokens=64"):
            load_config(TrainConfig, overrides=[f"plugins=[{path}]", "grpo.max_new_tokens=64",
                                                "reward.terms={correct: 0, long_penalty: 1.0}"])
