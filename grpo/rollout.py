"""Rollouts: G completions per prompt sampled from alpha, scored, with group advantages.

    rollout = sample_rollout(server, problems, tokenizer, cfg, scorer, seed)   # rank 0
    rollout = Rollout.from_json(broadcast_json(rollout.to_json()))              # every rank
    mine = shard_samples(rollout.samples, rank, world_size)

A `Sample` is JSON-able, so rank 0 (which talks to the inference server and scores) can broadcast
the batch to every rank without pickle. `seed` fixes the server's sampling and RED-Drop's choices,
so a batch is a function of (weights version, prompts, seed): a resumed run repeats exactly what
the uninterrupted run sampled.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from grpo.objective import group_advantages
from grpo.data import build_prompt, encode_prompt


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
    weights_version: int = 0  # the version of alpha that sampled it (the server's, per batch)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Rollout:
    samples: list[Sample]  # the global batch: B prompts x G completions, a group's samples adjacent
    stats: dict[str, float]  # rewards, advantages (group_advantages' stats), lengths, seconds
    table: list[dict] = field(default_factory=list)  # a few (prompt, completion, reward, gold) rows to log

    def to_json(self) -> dict:
        return {"samples": [s.to_json() for s in self.samples], "stats": self.stats, "table": self.table}

    @classmethod
    def from_json(cls, obj: dict) -> "Rollout":
        return cls([Sample(**s) for s in obj["samples"]], obj["stats"], obj["table"])

    @property
    def weights_version(self) -> int:
        """The version of alpha that sampled the batch (one server call: one version for all)."""
        versions = {s.weights_version for s in self.samples}
        if len(versions) != 1:
            raise ValueError(f"a batch sampled by several weights versions: {sorted(versions)}")
        return versions.pop()


def sample_rollout(server, problems, tokenizer, cfg, scorer, seed: int, expected_version: int,
                   engine_threads: Optional[int] = None) -> Rollout:
    """G completions per prompt from the server's policy alpha (with alpha's log-probs), rewards,
    advantages (eq. 2) and weights (eq. 8 mask, RED). cfg is the TrainConfig (grpo, data,
    objective sections); server is a grpo.serving.inference.InferenceServer that must be serving weights
    version `expected_version` (alpha): samples from any other policy would make every logged
    off-policy quantity wrong, so a mismatch stops the run. engine_threads: a CPU engine's thread
    count for this batch (None: all its cores; grpo/cpu/cores.py), part of what the samples are a
    function of. stats["engine"] holds what the engine reports of the batch (nothing on a GPU)."""
    G = cfg.grpo.G
    prompt_ids = [encode_prompt(tokenizer, build_prompt(tokenizer, p, cfg.data)) for p in problems]
    t0 = time.time()
    result = server.generate(prompt_ids, n=G, max_tokens=cfg.grpo.max_new_tokens,
                             temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, seed=seed,
                             engine_threads=engine_threads)
    t_generate = time.time() - t0
    if result.weights_version != expected_version:
        raise RuntimeError(f"the server sampled with weights version {result.weights_version}, the trainer "
                           f"pushed version {expected_version} as alpha")
    completions = [c for per_prompt in result.completions for c in per_prompt]
    golds = [p.answer for p in problems for _ in range(G)]
    t0 = time.time()
    rewards, reward_info = scorer.score([c.text for c in completions], golds)
    t_reward = time.time() - t0
    correct = reward_info.get("correct", rewards)
    adv, seq_weight, adv_stats = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, cfg.objective,
                                                    generator=torch.Generator().manual_seed(seed))
    samples = [
        Sample(group=j // G, prompt_ids=prompt_ids[j // G], completion_ids=list(c.token_ids),
               logp_alpha=[float(x) for x in c.logprobs], truncated=c.finish_reason == "length",
               reward=float(rewards[j]), correct=float(correct[j]), adv=float(adv[j]), seq_weight=float(seq_weight[j]),
               weights_version=result.weights_version)
        for j, c in enumerate(completions)
    ]
    stats = {**adv_stats, **batch_stats(samples, G), "reward_timeouts": float(reward_info.get("timeouts", 0)),
             "time_generate": t_generate, "time_reward": t_reward,
             "engine": {key: float(value) for key, value in result.engine.items()}}
    table = [{"prompt": problems[s.group].prompt, "completion": c.text, "reward": s.reward,
              "gold": problems[s.group].answer}
             for s, c in list(zip(samples, completions))[::G][:8]]
    return Rollout(samples, stats, table)


def batch_stats(samples: list[Sample], G: int) -> dict[str, float]:
    """What a batch's samples say of it: pass rate, lengths, truncation, token counts (the prompt
    counted once per completion, as the trainer runs it)."""
    lengths = [len(s.completion_ids) for s in samples]
    return {"pass_rate": sum(s.correct for s in samples) / len(samples),
            "completion_len_mean": sum(lengths) / len(lengths),
            "truncated_frac": sum(s.truncated for s in samples) / len(samples),
            "prompt_tokens": float(sum(len(s.prompt_ids) for s in samples[::G]) * G),
            "completion_tokens": float(sum(lengths))}


def shard_samples(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's contiguous share, whole groups only (the batch of prompts divides by world size)."""
    per_rank = len(samples) // world_size
    return samples[rank * per_rank:(rank + 1) * per_rank]
