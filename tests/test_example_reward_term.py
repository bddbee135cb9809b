"""docs/extending.md, a reward term: examples/answer_sentence.py weighted next to correctness, by
hand; the reward's range (the bound's M) widens with it, and its batch mean is logged."""
from grpo import metrics
from grpo.config import load_config
from grpo.rewards import Completion, RewardScorer, reward_range
from grpo.train_config import TrainConfig
from plugins import doc_holds, registered


def test_answer_sentence_bonus_by_hand():
    with registered("answer_sentence.py") as path:
        cfg = load_config(TrainConfig, overrides=[f"plugins=[{path}]", "reward.workers=0",
                                                  "reward.require_boxed=false",
                                                  "reward.terms={correct: 1.0, answer_sentence: 0.1}"])
        texts = ["7 + 5 = 12. The answer is 12.", "The answer is 13.", "It is 12", "The answer is 12."]
        completions = [Completion(t, "12", num_tokens=9, truncated=j == 3, max_tokens=9) for j, t in enumerate(texts)]
        with RewardScorer(cfg.reward) as scorer:
            rewards, info = scorer.score(completions)
        # correct: 1, 0, 1, 1; the sentence: 1, 1, 0, 0 (the last was cut at the budget)
        assert rewards == [1.1, 0.1, 1.0, 1.0]
        assert info["term_means"]["reward_term_answer_sentence"] == 0.5
        assert metrics.group_key("reward_term_answer_sentence") == "rollout/reward_term_answer_sentence"
        assert reward_range(cfg.reward) == (0.0, 1.1)
        assert doc_holds("answer_sentence.py")
