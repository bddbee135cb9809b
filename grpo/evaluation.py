"""Evaluation: sample K completions per problem, score them, and summarise as Pass@1, pass@k, maj@k.

- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language
  Models Trained on Code", eq. 1), in its numerically stable product form.
- `maj_at_k(answers, correct, k)`: majority vote over the first k samples' extracted answers.
- `summarize(records, pass_k)`: one summary dict computed from the per-problem records alone, so a
  summary can always be recomputed from the JSONL that `eval.py` writes.
- `evaluate(server, tokenizer, problems, data_cfg, eval_cfg, scorer)`: the loop that both
  `eval.py` and the trainer's periodic evaluation call: prompts -> server -> scorer -> summary.

The paper reports "Pass@1 using 50 samples (frequency of success given 50 generations for each
question) using the same sampling configuration as in training" (Mroueh et al., Section 5): that
is `pass@1` here, the mean over problems of c/n, which equals pass_at_k(n, c, 1).
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from grpo import metrics


@dataclass
class EvalConfig:
    """How to sample and summarise an evaluation (the dataset itself is named in DataConfig)."""

    k: int = 4  # samples per problem (the paper: 50 on GSM8K, 32 on AIME24)
    temperature: float = 0.1  # sampling temperature (the paper samples at 0.1, as in training)
    top_p: float = 1.0  # nucleus sampling mass; 1.0 keeps the whole distribution
    max_tokens: int = 200  # completion length cap (the paper's context length on GSM8K: 200)
    n_problems: Optional[int] = None  # evaluate only this many problems (None: all of them)
    subset: str = "first"  # which problems when n_problems is set: "first" N, or "random" N (seeded)
    seed: int = 0  # seeds the random subset and the engine's sampling (batch b: seed + b), so evals of two
                   # checkpoints share their random numbers and a pass@1 difference is not sampling noise
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])  # k values for pass@k and maj@k; those > K are skipped
    batch_size: int = 32  # prompts per request to the server (each asks for K samples)

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k: samples per problem must be >= 1, got {self.k}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.n_problems is not None and self.n_problems < 1:
            raise ValueError(f"n_problems: must be >= 1 or null (all), got {self.n_problems}")
        if self.subset not in ("first", "random"):
            raise ValueError(f"subset: must be 'first' or 'random', got {self.subset!r}")
        if not self.pass_k or any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k: must be a non-empty list of integers >= 1, got {self.pass_k}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

    pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i):
    the product form never forms the huge binomials, so it is exact enough for n in the thousands.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        # Every k-subset holds at least one correct sample.
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def majority_answer(answers: Sequence[Optional[str]]) -> Optional[str]:
    """The most frequent non-empty answer; ties go to the one that appeared first. None if none."""
    votes = Counter(a for a in answers if a is not None and a != "")
    if not votes:
        return None
    best = max(votes.values())
    for a in answers:  # first occurrence among the tied answers wins: deterministic, order-based
        if a is not None and votes.get(a) == best:
            return a
    return None  # unreachable


def maj_at_k(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> float:
    """1.0 if the majority answer of the first k samples is a correct one, else 0.0.

    Answers are compared as the extracted strings (so "0.5" and "1/2" are two different votes);
    samples with no extracted answer (None) do not vote. The majority answer's correctness is read
    from the first sample that gave it.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj_at_k: need 1 <= k <= {len(answers)}, got k={k}")
    winner = majority_answer(answers[:k])
    if winner is None:
        return 0.0
    first = list(answers[:k]).index(winner)
    return 1.0 if correct[first] else 0.0


# How a training run logs the summary: eval_row puts every number under eval/ (grpo/metrics.py).
EVAL_KEYS = metrics.declare_many("eval", {
    "eval/pass@*": "pass@k for k in `eval.pass_k` up to K: unbiased per problem (Chen et al. 2021), then the mean; "
                   "pass@1 is the mean over problems of c/n (the paper's Pass@1 over K samples)",
    "eval/maj@*": "majority vote over the first k `\\boxed{}` answers (only where the reward requires a boxed answer)",
    "eval/n_problems": "problems evaluated",
    "eval/samples_per_problem": "K, samples per problem",
    "eval/n_samples": "completions scored",
    "eval/mean_completion_tokens": "mean completion length in tokens",
    "eval/truncation_rate": "fraction cut at `eval.max_tokens`",
    "eval/extraction_rate": "fraction with a final `\\boxed{}` answer",
    "eval/reward_mean": "mean reward (the run's `reward.terms`)",
    "eval/wall_time_s": "seconds the evaluation took",
    "eval/weights_version": "the server's weights version the evaluation sampled from",
})


def summarize(records: Sequence[dict], pass_k: Sequence[int], wall_time_s: Optional[float] = None,
              majority: bool = True) -> dict:
    """Summary of per-problem records (see `score_completions` for their fields).

    pass@1 is the mean over problems of c_j / n_j (the paper's Pass@1 over K samples);
    pass@k uses the unbiased estimator per problem, then the mean; maj@k votes over the first k.
    k values larger than the smallest per-problem sample count K are left out; 1 and K are always in.
    majority=False leaves maj@k out: evaluate() does so when the scorer does not require a \\boxed{}
    answer, since correctness then comes from an answer math-verify found anywhere in the text while
    the votes are \\boxed{} contents only, and maj@k would mix the two.
    """
    if not records:
        raise ValueError("summarize: no records (no problems were evaluated)")
    n_min = min(len(r["correct"]) for r in records)
    ks = sorted({k for k in pass_k if k <= n_min} | {1, n_min})  # pass@K (all samples) always
    n_samples = sum(len(r["correct"]) for r in records)
    summary: dict[str, Any] = {
        "n_problems": len(records),
        "samples_per_problem": n_min if all(len(r["correct"]) == n_min for r in records) else None,
        "n_samples": n_samples,
    }
    for k in ks:
        summary[f"pass@{k}"] = _mean(pass_at_k(len(r["correct"]), sum(r["correct"]), k) for r in records)
    for k in ks if majority else []:
        summary[f"maj@{k}"] = _mean(maj_at_k(r["extracted"], r["correct"], k) for r in records)
    lengths = [n for r in records for n in r["n_tokens"]]
    reasons = [f for r in records for f in r["finish_reasons"]]
    summary["mean_completion_tokens"] = sum(lengths) / len(lengths)
    summary["truncation_rate"] = sum(f == "length" for f in reasons) / len(reasons)
    # Samples with a non-empty final answer (the ones that vote in maj@k).
    summary["extraction_rate"] = sum(bool(a) for r in records for a in r["extracted"]) / n_samples
    summary["reward_mean"] = sum(x for r in records for x in r["rewards"]) / n_samples
    if wall_time_s is not None:
        summary["wall_time_s"] = wall_time_s
    return summary


def select_problems(problems: Sequence, eval_cfg: EvalConfig) -> list:
    """The problems to evaluate: all, the first n_problems, or n_problems drawn with eval_cfg.seed."""
    problems = list(problems)
    if eval_cfg.n_problems is None or eval_cfg.n_problems >= len(problems):
        return problems
    if eval_cfg.subset == "first":
        return problems[:eval_cfg.n_problems]
    chosen = sorted(random.Random(f"eval-subset:{eval_cfg.seed}").sample(range(len(problems)), eval_cfg.n_problems))
    return [problems[i] for i in chosen]


def score_completions(problems: Sequence, prompt_texts: Sequence[str], completions: Sequence[Sequence[Any]],
                      scorer, max_tokens: Optional[int] = None) -> list[dict]:
    """Per-problem records from sampled completions (objects with .text, .token_ids, .finish_reason),
    sampled under the budget `max_tokens`.

    The scorer is a grpo.rewards.RewardScorer: its info["correct"] (math-verify equivalence with the
    gold answer) decides correctness and info["extracted"] (last \\boxed{} content) is the vote in
    maj@k; the reward itself (which may include a format term) is kept as `rewards`.
    """
    if not len(problems) == len(prompt_texts) == len(completions):
        raise ValueError(f"score_completions: {len(problems)} problems, {len(prompt_texts)} prompts, "
                         f"{len(completions)} completion groups")
    from grpo.rewards import Completion

    rewards, info = scorer.score([
        Completion(text=c.text, gold=p.answer, num_tokens=len(c.token_ids), truncated=c.finish_reason == "length",
                   max_tokens=max_tokens, problem=p)
        for p, group in zip(problems, completions) for c in group])
    records, offset = [], 0
    for problem, prompt, group in zip(problems, prompt_texts, completions):
        span = slice(offset, offset + len(group))
        offset += len(group)
        correct = [bool(c) for c in info["correct"][span]]
        records.append({
            "id": problem.id,
            "source": problem.source,
            "prompt": prompt,
            "gold": problem.answer,
            "n_correct": sum(correct),
            "completions": [c.text for c in group],
            "extracted": info["extracted"][span],
            "correct": correct,
            "rewards": rewards[span],
            "n_tokens": [len(c.token_ids) for c in group],
            "finish_reasons": [c.finish_reason for c in group],
        })
    return records


def evaluate(server, tokenizer, problems: Sequence, data_cfg, eval_cfg: EvalConfig, scorer,
             progress: bool = False) -> tuple[dict, list[dict]]:
    """Sample eval_cfg.k completions for each selected problem from the server, score, summarise.

    server: grpo.serving.inference.InferenceServer (the trainer's, so eval sees the weights just pushed; any
    object with its `generate`);
    tokenizer: the policy's; problems: grpo.data.Problem list (a held-out set); data_cfg: the
    DataConfig whose system prompt and instruction build the prompts (as in training);
    scorer: grpo.rewards.RewardScorer. Returns (summary, per-problem records); the summary holds
    pass@k / maj@k for the k in eval_cfg.pass_k up to K (maj@k only with reward.require_boxed),
    mean_completion_tokens, truncation_rate,
    wall_time_s and the server's weights_version (None if batches disagreed: a push happened).
    """
    from grpo.data import build_prompt, encode_prompt

    t0 = time.monotonic()
    problems = select_problems(problems, eval_cfg)
    if not problems:
        raise ValueError("evaluate: no problems to evaluate")
    records: list[dict] = []
    versions = set()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(problems), unit="problem", desc=f"eval K={eval_cfg.k}", dynamic_ncols=True)
    try:
        for start in range(0, len(problems), eval_cfg.batch_size):
            batch = problems[start:start + eval_cfg.batch_size]
            prompt_texts = [build_prompt(tokenizer, p, data_cfg) for p in batch]
            prompt_ids = [encode_prompt(tokenizer, text) for text in prompt_texts]
            result = server.generate(prompt_ids, n=eval_cfg.k, max_tokens=eval_cfg.max_tokens,
                                     temperature=eval_cfg.temperature, top_p=eval_cfg.top_p,
                                     seed=(eval_cfg.seed * 1_000_003 + start // eval_cfg.batch_size) % 2**31)
            versions.add(result.weights_version)
            records.extend(score_completions(batch, prompt_texts, result.completions, scorer, eval_cfg.max_tokens))
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(pass1=f"{_mean(r['n_correct'] / len(r['correct']) for r in records):.3f}")
    finally:
        if bar is not None:
            bar.close()
    majority = bool(getattr(getattr(scorer, "cfg", None), "require_boxed", True))
    summary = summarize(records, eval_cfg.pass_k, wall_time_s=time.monotonic() - t0, majority=majority)
    summary["weights_version"] = versions.pop() if len(versions) == 1 else None
    return summary, records


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
