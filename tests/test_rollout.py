"""Packing rollouts into micro-batches: positions, padding and equal micro-batch counts."""
import torch

from grpo.rollout import Sample, collate, plan_micro_batches, shard_samples


def make(group, p, c):
    return Sample(group=group, prompt_ids=list(range(10, 10 + p)), completion_ids=list(range(100, 100 + c)),
                  logp_alpha=[-0.5] * c, truncated=False, adv=float(group), seq_weight=1.0)


def test_collate_positions_predict_completion_tokens():
    samples = [make(0, 3, 2), make(1, 2, 4)]
    mb = collate(samples, pad_id=0, device=torch.device("cpu"))
    # Row 0: prompt at 0..2, completion at 3..4, predicted from positions 2, 3. L = 6.
    # Row 1: prompt at 0..1, completion at 2..5, predicted from positions 1..4 -> flat 6+1 .. 6+4.
    assert mb.input_ids.shape == (2, 6)
    assert mb.input_ids[0].tolist() == [10, 11, 12, 100, 101, 0]
    assert mb.completion_index.tolist() == [2, 3, 7, 8, 9, 10]
    assert mb.completion_tokens.tolist() == [100, 101, 100, 101, 102, 103]
    assert mb.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert mb.seq_of_token.tolist() == [0, 0, 1, 1, 1, 1]
    # The flat order equals the row-major order of the mask (how the trainer flattens weights).
    flat = torch.arange(8).view(2, 4)[mb.completion_mask.bool()]
    assert flat.tolist() == [0, 1, 4, 5, 6, 7]
    assert mb.input_ids.view(-1)[mb.completion_index + 1].tolist() == mb.completion_tokens.tolist()


def test_plan_respects_budget_and_forced_count():
    samples = [make(0, 4, 4), make(0, 4, 4), make(1, 4, 12), make(1, 4, 2)]
    plan = plan_micro_batches(samples, token_budget=16)
    assert plan == [[0, 1], [2], [3]]  # 2 x 8 = 16 fits; 16 alone; then a new batch
    assert plan_micro_batches(samples, token_budget=16, num_micro=2) == [[0, 1], [2, 3]]
    assert plan_micro_batches(samples, token_budget=16, num_micro=9) == [[0], [1], [2], [3]]
    assert sorted(i for b in plan_micro_batches(samples, 1000, num_micro=3) for i in b) == [0, 1, 2, 3]


def test_shard_samples_keeps_groups_whole():
    samples = [make(g, 1, 1) for g in range(4) for _ in range(3)]
    shards = [shard_samples(samples, r, 2) for r in range(2)]
    assert [s.group for s in shards[0]] == [0, 0, 0, 1, 1, 1]
    assert [s.group for s in shards[1]] == [2, 2, 2, 3, 3, 3]
