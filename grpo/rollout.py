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
from dataclasses import asdict, dataclass, field, replace
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
    weights_version: int = 0  # the version of alpha that sampled it (its first token, where several did)
    # [[version, start, end], ...] over its completion tokens where a push swapped the weights while it
    # was being sampled (in-flight updates: grpo.batch_source); None: weights_version sampled every token
    version_spans: Optional[list[list[int]]] = None

    def to_json(self) -> dict:
        out = asdict(self)
        if out["version_spans"] is None:  # recordings and broadcasts carry it only where it says something
            del out["version_spans"]
        return out

    def token_versions(self) -> list[int]:
        """The version that sampled each completion token."""
        if self.version_spans is None:
            return [self.weights_version] * len(self.completion_ids)
        out = [self.weights_version] * len(self.completion_ids)
        for version, start, end in self.version_spans:
            out[start:end] = [version] * (end - start)
        return out


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
    def versions(self) -> list[int]:
        """Every weights version that sampled a token of the batch, oldest first (one in Algorithm
        1's windows and with grpo.lag; several from the asynchronous sampler)."""
        return sorted({v for s in self.samples for v in (s.token_versions() if s.version_spans else
                                                          [s.weights_version])})

    @property
    def weights_version(self) -> int:
        """The oldest version of alpha that sampled the batch (its only one, but asynchronously)."""
        return self.versions[0]


@dataclass
class SampledGroups:
    """Groups sampled and scored, before a batch's advantages: rank 0's unit of sampling (one server
    call), which a batch is assembled from. samples' adv and seq_weight are not set yet."""

    samples: list[Sample]  # G per group, a group's samples adjacent, `group` counting from 0 in this call
    problems: list  # the prompts' Problems, one per group
    texts: list[str]  # each completion's text (the sample table)
    stats: dict[str, float]  # reward terms' means and failures, timeouts, times
    engine: dict[str, float]  # what the engine reports of the call
    sampler_state: Optional[dict] = None  # the prompt sampler's cursor before these prompts were drawn


def sample_groups(server, problems, tokenizer, cfg, scorer, seed: Optional[int], expected_version: Optional[int],
                  engine_threads: Optional[int] = None) -> SampledGroups:
    """G completions per prompt from the server's policy alpha (with alpha's log-probs) and their
    rewards. expected_version: the weights version the server must be serving (alpha): samples
    from any other policy would make every logged off-policy quantity wrong, so a mismatch stops the
    run; None: whatever it serves, stamped on each sample (the asynchronous sampler). seed: the
    engine's sampling seed (None: unseeded)."""
    G = cfg.grpo.G
    prompt_ids = [encode_prompt(tokenizer, build_prompt(tokenizer, p, cfg.data)) for p in problems]
    t0 = time.time()
    result = server.generate(prompt_ids, n=G, max_tokens=cfg.grpo.max_new_tokens,
                             temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, seed=seed,
                             engine_threads=engine_threads)
    t_generate = time.time() - t0
    if expected_version is not None and result.weights_version != expected_version:
        raise RuntimeError(f"the server sampled with weights version {result.weights_version}, the trainer "
                           f"pushed version {expected_version} as alpha")
    completions = [c for per_prompt in result.completions for c in per_prompt]
    scored = [Completion(text=c.text, num_tokens=len(c.token_ids), truncated=c.finish_reason == "length",
                         gold=problems[j // G].answer, problem=problems[j // G], max_tokens=cfg.grpo.max_new_tokens)
              for j, c in enumerate(completions)]
    t0 = time.time()
    rewards, reward_info = scorer.score(scored)
    t_reward = time.time() - t0
    samples = []
    for j, (c, s) in enumerate(zip(completions, scored)):
        spans = getattr(c, "version_spans", None)
        first = spans[0][0] if spans else result.weights_version
        samples.append(Sample(group=j // G, prompt_ids=prompt_ids[j // G], completion_ids=list(c.token_ids),
                              logp_alpha=[float(x) for x in c.logprobs], truncated=s.truncated,
                              reward=float(rewards[j]), correct=float(reward_info["correct"][j]),
                              weights_version=first, version_spans=spans if spans and len(spans) > 1 else None))
    stats = {**reward_info["term_means"], **reward_info["failed"], "reward_timeouts": float(reward_info["timeouts"]),
             "time_generate": t_generate, "time_reward": t_reward}
    return SampledGroups(samples, list(problems), [c.text for c in completions], stats,
                         {key: float(value) for key, value in result.engine.items()})


def assemble_rollout(parts: list[SampledGroups], cfg, seed: int) -> Rollout:
    """A batch from sampled groups (one server call, or the groups the asynchronous sampler queued):
    groups renumbered in order, advantages (eq. 2) and weights (eq. 8 mask, RED) over the whole
    batch (`seed`: RED-Drop's choices), its statistics. Reward terms' means and times are
    weighted by each part's completions (a part's sum where a count or a time)."""
    G = cfg.grpo.G
    samples, problems, texts = [], [], []
    for part in parts:
        offset = len(problems)
        samples += [replace(s, group=s.group + offset) for s in part.samples]
        problems += part.problems
        texts += part.texts
    rewards = [s.reward for s in samples]
    adv, seq_weight, adv_stats = batch_advantages(rewards, cfg, seed)
    samples = [replace(s, adv=a, seq_weight=w) for s, a, w in zip(samples, adv, seq_weight)]
    stats = {**adv_stats, **batch_stats(samples), **_merged_stats(parts),
             "engine": _merged_stats(parts, field="engine")}
    table = [{"prompt": problems[s.group].prompt, "completion": text, "reward": s.reward,
              "gold": problems[s.group].answer}
             for s, text in list(zip(samples, texts))[::G][:8]]
    return Rollout(samples, stats, table)


SUMMED = ("reward_timeouts", "time_generate", "time_reward")  # counts and times add up over a batch's calls


def _merged_stats(parts: list[SampledGroups], field: str = "stats") -> dict[str, float]:
    if len(parts) == 1:
        return dict(getattr(parts[0], field))
    total = sum(len(p.samples) for p in parts)
    out: dict[str, float] = {}
    for part in parts:
        for key, value in getattr(part, field).items():
            summed = field == "stats" and (key in SUMMED or key.startswith("reward_failed_"))
            share = value if summed else value * len(part.samples) / total
            out[key] = out.get(key, 0.0) + share
    return out


def sample_rollout(server, problems, tokenizer, cfg, scorer, seed: int, expected_version: int,
                   engine_threads: Optional[int] = None) -> Rollout:
    """A batch in one server call: G completions per prompt from alpha (`sample_groups`), then
    advantages (eq. 2) and weights (eq. 8 mask, RED) (`assemble_rollout`). cfg is the TrainConfig
    (grpo, data, objective sections); server a grpo.serving.inference.InferenceServer serving weights
    version `expected_version`. engine_threads: a CPU engine's thread count for this batch (None:
    all its cores; grpo/cpu/cores.py), part of what the samples are a function of. stats["engine"]
    holds what the engine reports of the batch (nothing on a GPU)."""
    return assemble_rollout([sample_groups(server, problems, tokenizer, cfg, scorer, seed, expected_version,
                                           engine_threads)], cfg, seed)


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
