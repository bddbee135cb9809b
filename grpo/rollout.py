"""Rollouts: sampled completions as plain records, and their packing into padded micro-batches.

A `Sample` is JSON-able, so rank 0 (which talks to the inference server and scores) can broadcast
the batch to every rank without pickle. Each rank then packs its share into micro-batches of at
most `token_budget` padded tokens; every rank runs the same number of micro-batches, because each
forward of an FSDP2 model is a collective.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Sample:
    group: int  # index of the prompt in the global batch (its G samples share it)
    prompt_ids: list[int]
    completion_ids: list[int]
    logp_alpha: list[float]  # per completion token, from the server that sampled it (alpha)
    truncated: bool  # hit max_new_tokens without an end-of-sequence token
    reward: float = 0.0
    correct: float = 0.0  # the correctness part of the reward (pass_rate counts these)
    adv: float = 0.0  # eq. 2 advantage (after RED)
    seq_weight: float = 1.0  # eq. 8 mask / RED weights

    def to_json(self) -> dict:
        return asdict(self)


def shard_samples(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's contiguous share, whole groups only (the batch of prompts divides by world size)."""
    per_rank = len(samples) // world_size
    return samples[rank * per_rank:(rank + 1) * per_rank]


def plan_micro_batches(samples: list[Sample], token_budget: int, num_micro: int | None = None) -> list[list[int]]:
    """Split sample indices (in order) into micro-batches of <= token_budget padded tokens.

    Returns the index lists; with `num_micro` given (the max over ranks), splits into exactly that
    many near-equal contiguous chunks instead, so that all ranks step in lockstep.
    """
    if num_micro is not None:
        n = len(samples)
        num_micro = min(num_micro, n)
        bounds = [round(j * n / num_micro) for j in range(num_micro + 1)]
        return [list(range(bounds[j], bounds[j + 1])) for j in range(num_micro)]
    batches, current, longest = [], [], 0
    for idx, s in enumerate(samples):
        length = len(s.prompt_ids) + len(s.completion_ids)
        if current and max(longest, length) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(idx)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


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
    seq_of_token: torch.Tensor  # [N] row of each flat token

    @property
    def num_tokens(self) -> int:
        return int(self.completion_tokens.numel())


def collate(samples: list[Sample], pad_id: int, device: torch.device) -> MicroBatch:
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    longest, longest_c = max(lengths), max(max(len(s.completion_ids) for s in samples), 1)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), longest_c, dtype=torch.float32)
    index, tokens, logp_alpha, rows = [], [], [], []
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[b, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        mask[b, :c] = 1.0
        # The hidden state at position t predicts token t+1: completion token j sits at p+j.
        index.extend(b * longest + p - 1 + j for j in range(c))
        tokens.extend(s.completion_ids)
        logp_alpha.extend(s.logp_alpha)
        rows.extend([b] * c)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return MicroBatch(
        input_ids=input_ids.to(device),
        completion_index=as_long(index),
        completion_tokens=as_long(tokens),
        completion_mask=mask.to(device),
        logp_alpha=torch.tensor(logp_alpha, dtype=torch.float32, device=device),
        adv=torch.tensor([s.adv for s in samples], dtype=torch.float32, device=device),
        seq_weight=torch.tensor([s.seq_weight for s in samples], dtype=torch.float32, device=device),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool, device=device),
        seq_of_token=as_long(rows),
    )
