"""Packing a rank's share of the rollout into padded micro-batches under a token budget.

Each rank trains on its share of the batch in micro-batches of at most `optim.token_budget`
padded tokens (rows x longest row), accumulating gradients. Every rank must run the SAME number of
micro-batches, because each forward and backward of an FSDP2 model is a collective. So the plan is
made once, by tokens, on each rank; then the counts are equalised to the largest one by splitting
micro-batches or, when nothing can be split, adding empty ones. Re-chunking by sample count
instead would break the budget (lengths [100, 100, 100, 10 x 7] with budget 200 would give chunks
of 300, 40 and 30 padded tokens).

Samples are packed longest first, so rows of similar length share a micro-batch and little of the
budget goes to padding. The budget is a bound, except for a single sequence longer than it: that
one goes alone (with a warning, once).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from grpo.rollout import Sample

_warned_over_budget = False


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices of the sequences (lengths = prompt + completion tokens) grouped into micro-batches
    of at most token_budget padded tokens, longest first."""
    global _warned_over_budget
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    plan: list[list[int]] = []
    for j in order:
        # Longest first: a micro-batch's padded width is its first (longest) sequence.
        if plan and lengths[plan[-1][0]] * (len(plan[-1]) + 1) <= token_budget:
            plan[-1].append(j)
            continue
        if lengths[j] > token_budget and not _warned_over_budget:
            warnings.warn(f"optim.token_budget: a sequence of {lengths[j]} tokens exceeds the budget of "
                          f"{token_budget}; it gets a micro-batch of its own (warned once)")
            _warned_over_budget = True
        plan.append([j])
    return plan


def equalize_micro_batches(plan: list[list[int]], count: int) -> list[list[int]]:
    """`plan` grown to `count` micro-batches (the largest count over ranks): split the micro-batch
    with the most sequences in two (a subset of a micro-batch stays within its budget), and when
    every one holds a single sequence, add empty micro-batches (a forward of no tokens)."""
    if count < len(plan):
        raise ValueError(f"count: {count} is less than the plan's {len(plan)} micro-batches")
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        widest = max(range(len(plan)), key=lambda b: len(plan[b])) if plan else None
        if widest is None or len(plan[widest]) < 2:
            plan.append([])
            continue
        mb = plan.pop(widest)
        half = (len(mb) + 1) // 2
        plan[widest:widest] = [mb[:half], mb[half:]]
    return plan


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    completion_index: torch.Tensor  # [N] flat positions (b*L + t) that predict a completion token
    completion_tokens: torch.Tensor  # [N] the completion tokens, row-major over the batch
    completion_mask: torch.Tensor  # [B, C] 1 for real completion tokens (C = longest completion)
    logp_alpha: torch.Tensor  # [N]
    adv: torch.Tensor  # [B]
    seq_weight: torch.Tensor  # [B]
    truncated: torch.Tensor  # [B] bool
    seq_of_token: torch.Tensor  # [N] sequence of each flat token
    token_version: torch.Tensor  # [N] the weights version that sampled each token (grpo.rollout.Sample.token_versions)
    versions: tuple[int, ...]  # the distinct versions among them, oldest first (plain ints: no device sync to read)
    # the shared-prompt layout (collate_groups; grpo.shared_prompt), None in the plain one:
    position_ids: Optional[torch.Tensor] = None  # [R, L] positions restart at P in every slot
    # (P, W, n) of each group row as plain ints: no tensor for FSDP2 to move to the GPU with the
    # forward's inputs, so the attention reads them without a device-to-host copy in every layer
    segments: Optional[tuple[tuple[int, int, int], ...]] = None


def _sequence_fields(samples: list[Sample], device: torch.device) -> dict[str, torch.Tensor]:
    """The per-sequence and per-token fields of a micro-batch, whatever its row layout: a sequence's
    completion tokens in sample order, flat."""
    longest_c = max([len(s.completion_ids) for s in samples] + [1])
    mask = torch.zeros(len(samples), longest_c, dtype=torch.float32)
    tokens, logp_alpha, rows, versions = [], [], [], []
    for b, s in enumerate(samples):
        mask[b, :len(s.completion_ids)] = 1.0
        tokens.extend(s.completion_ids)
        logp_alpha.extend(s.logp_alpha)
        rows.extend([b] * len(s.completion_ids))
        versions.extend(s.token_versions())
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    as_float = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    return dict(completion_tokens=as_long(tokens), completion_mask=mask.to(device), logp_alpha=as_float(logp_alpha),
                adv=as_float([s.adv for s in samples]), seq_weight=as_float([s.seq_weight for s in samples]),
                truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool, device=device),
                seq_of_token=as_long(rows), token_version=as_long(versions), versions=tuple(sorted(set(versions))))


def collate(samples: list[Sample], pad_id: int, device: torch.device) -> MicroBatch:
    """Right-padded tensors of `samples`; no samples gives an empty micro-batch (one pad token, no
    completion token), which runs the model's collectives and contributes nothing."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples] or [1]
    longest = max(lengths)
    input_ids = torch.full((max(len(samples), 1), longest), pad_id, dtype=torch.long)
    index = []
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[b, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        # The hidden state at position t predicts token t+1: completion token j sits at p+j.
        index.extend(b * longest + p - 1 + j for j in range(c))
    return MicroBatch(input_ids=input_ids.to(device), completion_index=torch.tensor(index, dtype=torch.long, device=device),
                      **_sequence_fields(samples, device))


def group_row_length(group: list[Sample]) -> int:
    """Tokens of a group's row in the shared-prompt layout: the prompt once, n slots of the longest."""
    return len(group[0].prompt_ids) + len(group) * max(len(s.completion_ids) for s in group)


def group_rows(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """The shared-prompt layout's rows (the planner's units): each group's samples, longest
    completion first, cut into as few rows as fit token_budget. A short-completion group is one
    row (GSM8K: ~110 + 8 x 128 tokens); a long one (DeepScaleR: 4096 tokens) gets a row per slot
    or few, each with its prompt again, so no row outgrows the micro-batch the plain layout would
    have (a single slot over the budget goes alone, as a single sequence does in the plain one)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    rows = []
    for group in groups.values():
        row: list[Sample] = []
        for s in sorted(group, key=lambda s: -len(s.completion_ids)):
            if row and group_row_length(row + [s]) > token_budget:  # longest first: row[0] sets the width
                rows.append(row)
                row = []
            row.append(s)
        rows.append(row)
    return rows


def collate_groups(groups: list[list[Sample]], pad_id: int, device: torch.device) -> MicroBatch:
    """The shared-prompt layout (grpo.shared_prompt): one row per group, [prompt | slot 1 | ... |
    slot n | padding], each slot a completion right-padded to the group's longest. The per-sequence
    and per-token fields are collate()'s (_sequence_fields) for the same samples in the same order, so the
    objective sees the same tensors; completion_index points into the rows (a slot's first token
    is predicted by the prompt's last position, which every slot shares). No groups gives an empty
    micro-batch (a one-token row)."""
    fields = _sequence_fields([s for g in groups for s in g], device)
    if not groups:
        return MicroBatch(input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device),
                          completion_index=torch.zeros(0, dtype=torch.long, device=device),
                          position_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                          segments=((1, 0, 0),), **fields)
    width = max(group_row_length(g) for g in groups)
    input_ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(groups), width), dtype=torch.long)
    segments, index = [], []
    for r, group in enumerate(groups):
        prompt = group[0].prompt_ids
        if any(s.prompt_ids != prompt for s in group):
            raise ValueError(f"group {group[0].group}: its samples do not share one prompt")
        p, w = len(prompt), max(len(s.completion_ids) for s in group)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :p] = torch.arange(p)
        for i, s in enumerate(group):
            start = p + i * w
            input_ids[r, start:start + len(s.completion_ids)] = torch.tensor(s.completion_ids, dtype=torch.long)
            position_ids[r, start:start + w] = torch.arange(p, p + w)
            # completion token j is predicted by the position before it: the prompt's last for j = 0
            index.extend(r * width + (p - 1 if j == 0 else start + j - 1) for j in range(len(s.completion_ids)))
        segments.append((p, w, len(group)))
    return MicroBatch(input_ids=input_ids.to(device), completion_index=torch.tensor(index, dtype=torch.long, device=device),
                      position_ids=position_ids.to(device), segments=tuple(segments), **fields)
