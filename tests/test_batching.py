"""Packing a rank's share into micro-batches: positions, the token budget, equal counts over ranks."""
import warnings

import pytest
import torch

from grpo import batching
from grpo.batching import collate, equalize_micro_batches, plan_micro_batches
from grpo.rollout import Sample


def make(group, p, c):
    return Sample(group=group, prompt_ids=list(range(10, 10 + p)), completion_ids=list(range(100, 100 + c)),
                  logp_alpha=[-0.5] * c, truncated=False, adv=float(group), seq_weight=1.0)


def padded(plan, lengths):
    """Padded tokens of each micro-batch: rows x longest row."""
    return [max(lengths[j] for j in mb) * len(mb) if mb else 0 for mb in plan]


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


def test_skewed_lengths_stay_within_the_budget():
    # The case: re-chunking by count gave micro-batches of 300, 40 and 30 padded tokens.
    lengths = [100, 100, 100] + [10] * 7
    plan = plan_micro_batches(lengths, token_budget=200)
    # Longest first; a micro-batch is as wide as its first (longest) sequence.
    assert plan == [[0, 1], [2, 3], [4, 5, 6, 7, 8, 9]]
    assert padded(plan, lengths) == [200, 200, 60]
    # Grown to a larger count (another rank needs 5): split, never re-chunked past the budget.
    grown = equalize_micro_batches(plan, 5)
    assert len(grown) == 5 and sorted(j for mb in grown for j in mb) == list(range(10))
    assert max(padded(grown, lengths)) <= 200


def test_count_equalised_by_splitting_then_empty_micro_batches():
    lengths = [30, 30, 30]
    plan = plan_micro_batches(lengths, token_budget=1000)
    assert plan == [[0, 1, 2]]
    assert equalize_micro_batches(plan, 3) == [[0], [1], [2]]
    grown = equalize_micro_batches(plan, 5)
    assert sorted(len(mb) for mb in grown) == [0, 0, 1, 1, 1]  # nothing left to split: empty ones
    assert equalize_micro_batches([], 2) == [[], []]
    with pytest.raises(ValueError, match="count"):
        equalize_micro_batches(plan, 0)


def test_a_sequence_over_the_budget_goes_alone_with_one_warning(monkeypatch):
    monkeypatch.setattr(batching, "_warned_over_budget", False)
    lengths = [50, 300, 40, 400]
    with pytest.warns(UserWarning, match="optim.token_budget: a sequence of 400 tokens exceeds the budget of 100"):
        plan = plan_micro_batches(lengths, token_budget=100)
    assert [mb for mb in plan if len(mb) == 1 and lengths[mb[0]] > 100] == [[3], [1]]
    assert all(p <= 100 for mb, p in zip(plan, padded(plan, lengths)) if len(mb) > 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        plan_micro_batches(lengths, token_budget=100)


def test_empty_micro_batch_has_no_tokens():
    mb = collate([], pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.shape == (1, 1) and mb.completion_index.numel() == 0
    assert mb.completion_mask.shape == (0, 1) and mb.seq_weight.numel() == 0 and mb.logp_alpha.numel() == 0


def test_group_rows_cut_a_group_to_fit_the_budget():
    """Shared-prompt rows: longest completion first, as many slots as fit; a slot over the budget
    alone; groups never mixed; every sample exactly once."""
    group = [make(0, 5, c) for c in (10, 3, 8, 2, 30)]
    other = [make(1, 4, c) for c in (2, 2)]
    rows = batching.group_rows(group + other, token_budget=25)
    assert [[len(s.completion_ids) for s in row] for row in rows] == [[30], [10, 8], [3, 2], [2, 2]]
    assert [batching.group_row_length(row) for row in rows] == [35, 25, 11, 8]
    assert sorted(id(s) for row in rows for s in row) == sorted(id(s) for s in group + other)
    assert batching.group_rows(group, token_budget=10_000) == [sorted(group, key=lambda s: -len(s.completion_ids))]


def test_collate_groups_slots_see_the_positions_of_the_plain_layout():
    """One row per group: [prompt | slot | slot | pad]. Each completion token is predicted from a
    position whose position id is the one it has in the plain layout (P + j - 1), from the prompt's
    last position for a slot's first token; the per-sequence fields are collate()'s."""
    groups = [[make(0, 3, 2), make(0, 3, 4)], [make(1, 2, 1)]]
    mb = batching.collate_groups(groups, pad_id=0, device=torch.device("cpu"))
    plain = collate([s for g in groups for s in g], pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.tolist() == [[10, 11, 12, 100, 101, 0, 0, 100, 101, 102, 103],
                                     [10, 11, 100, 0, 0, 0, 0, 0, 0, 0, 0]]
    # plain ints: no tensor among the forward's inputs for FSDP2 to move to the GPU, so the attention
    # of every layer reads them without a device-to-host synchronisation
    assert mb.segments == ((3, 4, 2), (2, 1, 1))
    assert all(type(x) is int for row in mb.segments for x in row)
    width = mb.input_ids.shape[1]
    assert mb.completion_index.tolist() == [2, 3, 2, 7, 8, 9, width + 1]
    assert mb.position_ids.view(-1)[mb.completion_index].tolist() == [2, 3, 2, 3, 4, 5, 1]
    assert mb.completion_tokens.tolist() == plain.completion_tokens.tolist()
    for name in ("completion_mask", "logp_alpha", "adv", "seq_of_token"):
        assert torch.equal(getattr(mb, name), getattr(plain, name)), name
    with pytest.raises(ValueError, match="group 0"):
        batching.collate_groups([[make(0, 3, 2), make(0, 4, 2)]], pad_id=0, device=torch.device("cpu"))
