"""Completion length of right and wrong answers, logged every step (rollout/ in W&B)."""
from grpo.rollout import batch_metric, mean


@batch_metric("rollout", completion_len_right="mean completion length of the correct answers",
              completion_len_wrong="mean completion length of the wrong answers")
def length_by_correctness(samples) -> dict:
    return {"completion_len_right": mean(len(s.completion_ids) for s in samples if s.correct),
            "completion_len_wrong": mean(len(s.completion_ids) for s in samples if not s.correct)}
