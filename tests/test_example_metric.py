"""docs/extending.md, a metric: examples/length_by_correctness.py, by hand, in every batch's stats
and in a training row under its declared W&B section."""
import math

from grpo import metrics
from grpo.config import load_config
from grpo.progress import Progress
from grpo.rollout import Sample, batch_stats
from grpo.train_config import TrainConfig
from plugins import doc_holds, registered


def sample(length: int, correct: float) -> Sample:
    return Sample(group=0, prompt_ids=[1, 2], completion_ids=list(range(length)), logp_alpha=[-1.0] * length,
                  truncated=False, correct=correct, reward=correct)


def test_length_of_right_and_wrong_answers_by_hand():
    with registered("length_by_correctness.py") as path:
        load_config(TrainConfig, overrides=[f"plugins=[{path}]"])
        stats = batch_stats([sample(4, 1.0), sample(6, 1.0), sample(10, 0.0)])
        assert stats["completion_len_right"] == 5.0 and stats["completion_len_wrong"] == 10.0
        all_right = batch_stats([sample(4, 1.0)])
        assert math.isnan(all_right["completion_len_wrong"])  # no wrong answer: missing from the row
        row = metrics.train_row(progress=Progress(step=1), stage=0, iteration=0, sgd_iteration=0,
                                rollout_stats=all_right, train_stats={"loss": 0.0}, sampled_version=0,
                                entropy=0.5, grad_norm=0.0, lr=1e-6, time_train=0.1, time_sync=0.0,
                                sync_bytes=0.0, iteration_seconds=0.2)
        assert row["completion_len_right"] == 4.0 and "completion_len_wrong" not in row
        assert metrics.group_key("completion_len_right") == "rollout/completion_len_right"
        assert doc_holds("length_by_correctness.py")
