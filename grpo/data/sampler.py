"""The global batch order: a seeded permutation per epoch, resumable from two ints (epoch, position).

Rank 0 samples and scores the whole batch, and the trainer shards the rollout; a checkpoint keeps
the cursor so a resumed run draws the exact same stream.
"""
from __future__ import annotations

import random
from typing import Optional, Union

from grpo.data.arithmetic import ArithmeticTask
from grpo.data.load import DataConfig, load_problems
from grpo.data.problem import Problem


class PromptSampler:
    """Global batches in a seeded order; resumable from two ints.

    Over a list: each epoch is a fresh permutation seeded by (seed, epoch); a batch that reaches
    the end of an epoch continues into the next. Over an ArithmeticTask: the unlimited training
    stream (epoch stays 0, position counts drawn indices, held-out ones included).
    """

    def __init__(self, source: Union[list[Problem], ArithmeticTask], batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if isinstance(source, list) and not source:
            raise ValueError("source: no problems to sample from")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: Optional[list[int]] = None  # permutation of the current epoch

    @property
    def n_problems(self) -> int:
        """Number of problems per epoch; -1 for the unlimited arithmetic stream."""
        return len(self.source) if isinstance(self.source, list) else -1

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.source)))
            if self.shuffle:
                random.Random(f"sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order = order
        return self._order

    def _next_problem(self) -> Problem:
        if isinstance(self.source, ArithmeticTask):
            for _ in range(10_000):  # a non-degenerate space never needs this many
                problem = self.source.train_problem(self.seed, self.position)
                self.position += 1
                if problem is not None:
                    return problem
            raise RuntimeError("arithmetic: every training problem is held out; widen the operand range "
                               "or lower eval_size")
        if self.position >= len(self.source):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        problem = self.source[self._epoch_order()[self.position]]
        self.position += 1
        return problem

    def next_batch(self) -> list[Problem]:
        """The next global batch (batch_size problems)."""
        return [self._next_problem() for _ in range(self.batch_size)]

    def next_problem(self) -> Problem:
        """The next problem of the stream (the asynchronous sampler draws one group at a time)."""
        return self._next_problem()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_problems": self.n_problems, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "n_problems", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state: {key} is {state[key]} in the checkpoint but "
                                 f"{getattr(self, key)} here; resuming would give a different stream")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def make_sampler(cfg: DataConfig, batch_size: int, seed: int = 0) -> PromptSampler:
    """Training sampler for cfg.dataset (the unlimited stream for "arithmetic")."""
    source = ArithmeticTask(cfg.arithmetic) if cfg.dataset == "arithmetic" else load_problems(cfg)
    return PromptSampler(source, batch_size, seed=seed)
