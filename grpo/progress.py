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
    # (version, step) of the last pushes, newest last, as many as a batch may still be sampled by
    # (grpo.lag, the async sampler's staleness bound): the lag of a batch sampled by an older push
    pushes: tuple[tuple[int, int], ...] = ((0, 0),)
    # why each push happened (grpo.push_policy): the last one's reason, logged on its first row
    push_reason: str = "start"
    pushed_at_batch: int = 0  # the batch index (stage * M + k) before which the last push happened

    def after_step(self, finite: bool) -> "Progress":
        """One optimizer step attempted (a non-finite gradient skips the update but counts)."""
        return replace(self, step=self.step + 1, nan_skips=self.nan_skips + (not finite),
                       nan_streak=0 if finite else self.nan_streak + 1)

    def after_push(self, version: int, weights_dir: str, reason: str = "every v",
                   batch: Optional[int] = None) -> "Progress":
        """alpha <- pi_theta: the server now serves `version`, pushed at this step, before batch
        `batch` (the loop's index; None: this iteration's)."""
        history = (self.pushes + ((version, self.step),))[-PUSH_HISTORY:]
        return replace(self, weights_version=version, weights_dir=weights_dir, pushed_at_step=self.step,
                       pushes=history, push_reason=reason,
                       pushed_at_batch=self.pushed_at_batch if batch is None else batch)

    def step_of_push(self, version: int) -> Optional[int]:
        """The optimizer step at which `version` was pushed (None: not known, too old or from a
        checkpoint that did not keep it)."""
        if version == self.weights_version:
            return self.pushed_at_step
        return next((step for v, step in self.pushes if v == version), None)

    def to_json(self) -> dict:
        out = asdict(self)
        out["pushes"] = [list(p) for p in self.pushes]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "Progress":
        # a checkpoint from before pushed_at_step: when its push happened is not known; from before
        # `pushes`: only the newest push's step is
        obj = {"pushed_at_step": None, **obj}
        if "pushes" in obj:
            obj["pushes"] = tuple((int(v), int(s)) for v, s in obj["pushes"])
        elif obj["pushed_at_step"] is not None:
            obj["pushes"] = ((obj["weights_version"], obj["pushed_at_step"]),)
        else:
            obj["pushes"] = ()
        return cls(**obj)


PUSH_HISTORY = 64  # pushes remembered: more than any lag or staleness bound a run can use


def alpha_lag(progress: Progress, sampled_version: int, first_step: int) -> tuple[int, Optional[int]]:
    """How far the sampler alpha of a batch (or a sequence) lags the policy trained on it: (pushes,
    optimizer steps). sampled_version: the weights version that sampled it; first_step:
    progress.step before the batch's first optimizer step. Pushes: versions pushed since
    sampled_version (0 in Algorithm 1 as written: a batch is sampled from the newest push; grpo.lag
    and the asynchronous sampler sample from older ones). Steps: optimizer steps between that push
    and the batch's first step (a v-window makes it (k mod v) * i). None where it is not known (a
    push older than the kept history, a checkpoint from before it was kept)."""
    pushes = progress.weights_version - sampled_version
    pushed = progress.step_of_push(sampled_version)
    return pushes, None if pushed is None else first_step - pushed
