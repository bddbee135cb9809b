"""Where a run stands in Algorithm 1: the trainer's progress, saved in every checkpoint.

Immutable: the loop's steps return a new Progress (`dataclasses.replace`) instead of mutating a
shared dict, so what changed, and where, is visible in train.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class Progress:
    step: int = 0  # optimizer steps taken (the x axis of every log)
    stage: int = 0  # s of Algorithm 1: pi_ref was last set to pi_theta when this stage began
    iteration: int = 0  # k of Algorithm 1: the next iteration of the stage to run
    weights_version: int = 0  # the version alpha the server serves (0: the model directory = pi_theta_0)
    weights_dir: Optional[str] = None  # where alpha's weights were written (None: the model directory)
    nan_skips: int = 0  # optimizer steps skipped for a non-finite gradient
    nan_streak: int = 0  # of those, the ones in a row up to this step (optim.max_consecutive_skips bounds it)
    # `step` when weights_version was pushed (version 0, the model directory, is alpha from step 0);
    # None: unknown, in a checkpoint written before this field, until the next push
    pushed_at_step: Optional[int] = 0

    def after_step(self, finite: bool) -> "Progress":
        """One optimizer step attempted (a non-finite gradient skips the update but counts)."""
        return replace(self, step=self.step + 1, nan_skips=self.nan_skips + (not finite),
                       nan_streak=0 if finite else self.nan_streak + 1)

    def after_push(self, version: int, weights_dir: str) -> "Progress":
        """alpha <- pi_theta: the server now serves `version`, pushed at this step."""
        return replace(self, weights_version=version, weights_dir=weights_dir, pushed_at_step=self.step)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Progress":
        # a checkpoint from before pushed_at_step: when its push happened is not known
        return cls(**{"pushed_at_step": None, **obj})


def alpha_lag(progress: Progress, sampled_version: int, first_step: int) -> tuple[int, Optional[int]]:
    """How far the sampler alpha of a batch lags the policy trained on it: (pushes, optimizer
    steps). sampled_version: the weights version that sampled the batch; first_step: progress.step
    before the batch's first optimizer step. Pushes: versions pushed since sampled_version (0 in this
    loop: a batch is sampled from the newest push, and no push happens while it trains). Steps:
    optimizer steps between that push and the batch's first step (the v-window makes it
    (k mod v) * i; 0 on policy at v = 1). None where it is not known: only the newest push's step is
    kept, and a checkpoint from before pushed_at_step does not hold even that."""
    pushes = progress.weights_version - sampled_version
    if pushes != 0 or progress.pushed_at_step is None:
        return pushes, None
    return pushes, first_step - progress.pushed_at_step
