"""The procedural arithmetic task ("What is 12 + 7?"): unlimited, seeded, the CPU demo's data.

Problems are addressed by index, so the training stream is reproducible and resumable from two ints
(grpo.data.sampler), and the held-out set is disjoint from it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from grpo.data.problem import Problem

ARITHMETIC_OPS = "+-*"


@dataclass
class ArithmeticConfig:
    """Procedural easy arithmetic, e.g. "What is 12 + 7?": unlimited, seeded, for the CPU demo."""

    n_terms_min: int = 2  # fewest operands in an expression
    n_terms_max: int = 2  # most operands in an expression
    min_operand: int = 1  # smallest operand value
    max_operand: int = 20  # largest operand value (1..20 sums: SmolLM2-135M-Instruct ~22% right, lenient reward)
    ops: str = "+"  # operators to draw from, any of "+-*" (usual precedence: * before + and -)
    seed: int = 0  # generator seed; the held-out set and the training stream derive from it
    eval_size: int = 100  # held-out problems (distinct); the training stream never yields these

    def __post_init__(self):
        if self.n_terms_min < 2:
            raise ValueError(f"n_terms_min: must be >= 2, got {self.n_terms_min}")
        if self.n_terms_max < self.n_terms_min:
            raise ValueError(f"n_terms_max: must be >= n_terms_min ({self.n_terms_min}), got {self.n_terms_max}")
        if self.min_operand < 0:
            raise ValueError(f"min_operand: must be >= 0, got {self.min_operand}")
        if self.max_operand < self.min_operand:
            raise ValueError(f"max_operand: must be >= min_operand ({self.min_operand}), got {self.max_operand}")
        if not self.ops or any(op not in ARITHMETIC_OPS for op in self.ops):
            raise ValueError(f"ops: must be a non-empty string of characters from {ARITHMETIC_OPS!r}, got {self.ops!r}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size: must be >= 0, got {self.eval_size}")


class ArithmeticTask:
    """Seeded arithmetic problems addressed by index: train_problem(seed, i), eval_problems().

    Each problem is drawn from its own Random seeded by a string (sha512 inside `random`, so the
    same on every machine and Python run). The held-out set comes from a separate stream; the
    training stream skips any expression that is in it, so train and eval are disjoint.
    """

    def __init__(self, cfg: ArithmeticConfig):
        self.cfg = cfg
        self._eval: Optional[list[Problem]] = None
        self._eval_questions: set[str] = set()

    def _draw(self, stream_key: str) -> tuple[str, int]:
        rng = random.Random(stream_key)
        cfg = self.cfg
        n_terms = rng.randint(cfg.n_terms_min, cfg.n_terms_max)
        operands = [rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(n_terms)]
        ops = [rng.choice(cfg.ops) for _ in range(n_terms - 1)]
        # Value with the usual precedence: a sum of signed products.
        total, product, sign = 0, operands[0], 1
        for op, x in zip(ops, operands[1:]):
            if op == "*":
                product *= x
            else:
                total += sign * product
                product, sign = x, (1 if op == "+" else -1)
        total += sign * product
        expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
        return expression, total

    def _problem(self, id: str, expression: str, value: int) -> Problem:
        return Problem(id=id, prompt=f"What is {expression}?", answer=str(value), source="arithmetic")

    def eval_problems(self) -> list[Problem]:
        """cfg.eval_size distinct held-out problems (the same list on every call and machine)."""
        if self._eval is None:
            problems, seen, index = [], set(), 0
            while len(problems) < self.cfg.eval_size:
                if index > 100 * self.cfg.eval_size + 1000:
                    raise ValueError(f"arithmetic: cannot find {self.cfg.eval_size} distinct problems; "
                                     f"widen the operand range or lower eval_size")
                expression, value = self._draw(f"arith:{self.cfg.seed}:eval:{index}")
                index += 1
                if expression not in seen:
                    seen.add(expression)
                    problems.append(self._problem(f"arithmetic-eval/{len(problems)}", expression, value))
            self._eval, self._eval_questions = problems, seen
        return self._eval

    def train_problem(self, seed: int, index: int) -> Optional[Problem]:
        """Problem `index` of the training stream for sampler seed `seed`; None if it is held out."""
        self.eval_problems()
        expression, value = self._draw(f"arith:{self.cfg.seed}:train:{seed}:{index}")
        if expression in self._eval_questions:
            return None
        return self._problem(f"arithmetic-train/{seed}/{index}", expression, value)
