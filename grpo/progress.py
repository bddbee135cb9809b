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

    def after_step(self, finite: bool) -> "Progress":
        """One optimizer step attempted (a non-finite gradient skips the update but counts)."""
        return replace(self, step=self.step + 1, nan_skips=self.nan_skips + (not finite))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Progress":
        return cls(**obj)
