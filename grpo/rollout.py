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

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from grpo import metrics
from grpo.advantages import batch_advantages
from grpo.data import build_prompt, encode_prompt
from grpo.rewards import Completion


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
    stats: dict[str, float]  # rewards, advantages (batch_advantages' stats), batch metrics, seconds: all logged
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
    scored = [Completion(text=c.text, num_tokens=len(c.token_ids), truncated=c.finish_reason == "length",
                         gold=problems[j // G].answer, problem=problems[j // G], max_tokens=cfg.grpo.max_new_tokens)
              for j, c in enumerate(completions)]
    t0 = time.time()
    rewards, reward_info = scorer.score(scored)
    t_reward = time.time() - t0
    adv, seq_weight, adv_stats = batch_advantages(rewards, cfg, seed)
    samples = [
        Sample(group=j // G, prompt_ids=prompt_ids[j // G], completion_ids=list(c.token_ids),
               logp_alpha=[float(x) for x in c.logprobs], truncated=s.truncated, reward=float(rewards[j]),
               correct=float(reward_info["correct"][j]), adv=adv[j], seq_weight=seq_weight[j],
               weights_version=result.weights_version)
        for j, (c, s) in enumerate(zip(completions, scored))
    ]
    stats = {**adv_stats, **batch_stats(samples), **reward_info["term_means"], **reward_info["failed"],
             "reward_timeouts": float(reward_info["timeouts"]), "time_generate": t_generate, "time_reward": t_reward,
             "engine": {key: float(value) for key, value in result.engine.items()}}
    table = [{"prompt": problems[s.group].prompt, "completion": c.text, "reward": s.reward,
              "gold": problems[s.group].answer}
             for s, c in list(zip(samples, completions))[::G][:8]]
    return Rollout(samples, stats, table)


SAMPLING = metrics.declare_many("rollout", {
    "reward_timeouts": "completions whose scoring timed out (scored their term's minimum; the worker is replaced)",
})
TIMES = metrics.declare_many("time", {
    "time_generate": "seconds sampling the batch on the server",
    "time_reward": "seconds scoring it",
    "time_wait_generate": "seconds the trainer still waited for the batch (with sample-ahead, what the overlap did "
                          "not hide)",
})

# ---------------------------------------------------------------------------------------------
# Batch metrics: what a batch's samples say of it, each a registered function

BATCH_METRICS: list[tuple[tuple[str, ...], Callable]] = []


def batch_metric(section: str, **meanings: str):
    """Decorator: register fn(samples: list[Sample]) -> {name: value} as metrics of every batch,
    sampled or replayed, declared here (name=one line of meaning, in `section`) and logged in each
    training row as named. A value of an empty set is NaN (missing from the row)."""

    def register(fn):
        names = metrics.declare_many(section, meanings, module=fn.__module__)
        BATCH_METRICS.append((names, fn))
        return fn
    return register


def batch_stats(samples: list[Sample]) -> dict[str, float]:
    """Every registered batch metric of these samples."""
    out: dict[str, float] = {}
    for names, fn in BATCH_METRICS:
        values = fn(samples)
        if set(values) != set(names):
            raise ValueError(f"batch metric {fn.__module__}.{fn.__name__}: returned {sorted(values)}, declared "
                             f"{sorted(names)}")
        out.update({name: float(values[name]) for name in names})
    return out


def mean(values) -> float:
    """The mean of a list; NaN (missing) for an empty one."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan


@batch_metric("rollout", pass_rate="fraction of completions whose answer is correct (the `correct` term's "
                                   "math-verify check, whatever the reward's weights)",
              completion_len_mean="completion length in tokens", truncated_frac="fraction cut at `grpo.max_new_tokens`")
def lengths_and_pass_rate(samples: list[Sample]) -> dict[str, float]:
    return {"pass_rate": mean(s.correct for s in samples),
            "completion_len_mean": mean(len(s.completion_ids) for s in samples),
            "truncated_frac": mean(s.truncated for s in samples)}


@batch_metric("time", prompt_tokens="the batch's prompt tokens, counted once per completion (as the trainer runs it)",
              completion_tokens="the batch's completion tokens")
def token_counts(samples: list[Sample]) -> dict[str, float]:
    return {"prompt_tokens": float(sum(len(s.prompt_ids) for s in samples)),
            "completion_tokens": float(sum(len(s.completion_ids) for s in samples))}


def shard_samples(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's contiguous share, whole groups only (the batch of prompts divides by world size)."""
    per_rank = len(samples) // world_size
    return samples[rank * per_rank:(rank + 1) * per_rank]
