"""Reward throughput: completions scored per second by the worker pool vs in-line in one process.

Workload: 1024 GSM8K-style completions (the test split's reference solutions with "#### N"
rewritten as \\boxed{N}), half paired with their own gold answer and half with another problem's,
all distinct, so neither the gold cache nor de-duplication makes the pool's work trivial.
The pool is warmed up first (start-up is reported separately), as in a trainer that reuses it.
The test split is the named set gsm8k_test: from the Hub (or its cache), or from --data-dir, a
folder written by `python -m grpo.data fetch gsm8k_test --out DIR`.

    .venv/bin/python bench/rewards.py [--workers 2] [--n 1024] [--repeats 3] [--data-dir DIR]

Final line: a JSON object with pool_per_s, inline_per_s and their ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo.data import DataConfig, DataError, read_rows  # noqa: E402
from grpo.rewards import Completion, RewardConfig, RewardScorer  # noqa: E402


def workload(n: int, data_dir: str | None) -> tuple[list[str], list[str], list[float]]:
    try:
        rows = [row for _, row in read_rows(DataConfig(dataset="gsm8k_test", data_dir=data_dir)).rows]
    except DataError as e:
        raise SystemExit(f"bench/rewards.py: {e}") from None
    rows = (rows * (n // len(rows) + 1))[:n]
    solutions = [re.sub(r"####\s*(.+)\s*$", lambda m: f"\\boxed{{{m.group(1).strip()}}}", r["answer"]) for r in rows]
    gold = [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows]
    rng = random.Random(0)
    shifted = gold[1:] + gold[:1]
    golds = [g if rng.random() < 0.5 else s for g, s in zip(gold, shifted)]
    expected = [1.0 if float(g) == float(t) else 0.0 for g, t in zip(gold, golds)]
    return solutions, golds, expected


def rate(scorer: RewardScorer, completions, golds, expected, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rewards, info = scorer.score([Completion(text, gold) for text, gold in zip(completions, golds)])
        best = min(best, time.perf_counter() - t0)
        if rewards != expected or info["timeouts"]:
            raise SystemExit(f"bench/rewards.py: wrong scores ({sum(r != e for r, e in zip(rewards, expected))} "
                             f"differ, {info['timeouts']} timeouts)")
    return len(completions) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", help="read gsm8k_test from DIR/gsm8k_test.jsonl instead of the Hub")
    args = parser.parse_args()
    completions, golds, expected = workload(args.n, args.data_dir)

    with RewardScorer(RewardConfig(workers=0)) as inline:
        inline_per_s = rate(inline, completions, golds, expected, args.repeats)
    print(f"in-line (1 process, main thread): {inline_per_s:8.1f} completions/s")

    t0 = time.perf_counter()
    with RewardScorer(RewardConfig(workers=args.workers)) as pool:
        pool.wait_ready()
        startup_s = time.perf_counter() - t0
        pool_per_s = rate(pool, completions, golds, expected, args.repeats)
    print(f"pool ({args.workers} workers):             {pool_per_s:8.1f} completions/s "
          f"(start-up {startup_s:.2f} s)")
    print(json.dumps({
        "bench": "rewards", "completions": args.n, "workers": args.workers,
        "pool_per_s": round(pool_per_s, 1), "inline_per_s": round(inline_per_s, 1),
        "pool_over_inline": round(pool_per_s / inline_per_s, 2), "pool_startup_s": round(startup_s, 2),
    }))


if __name__ == "__main__":
    main()
