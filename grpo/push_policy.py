"""When alpha <- pi_theta: Algorithm 1's every-v schedule, or a push driven by the measured drift.

Theorem 1 of 2505.22257 bounds the policy improvement below by the off-policy advantage minus
penalties in total variation, among them 2 E_x TV(pi_k, alpha): how far the policy that starts a
batch's SGD iterations has moved from the sampler. The run measures that distance on every batch,
split in two (docs/offpolicy.md): tv_mismatch, TV(pi_push, alpha), the engine's part, which no push
schedule changes, and tv_staleness, TV(pi_k, pi_push), the part the steps since the push add. A
push resets the second to 0. `drift` pushes when the staleness measured on the batch just trained
crosses `tv_threshold`, so the penalty term on the next batch is held near 2 (tv_mismatch +
tv_threshold) instead of growing with the window; `min_interval` and `max_interval` bound the
iterations between pushes. The decision is a function of logged numbers, so a rerun (and a resume,
which restores the last measurement) pushes at the same iterations.

    push:
      policy: drift          # every_v (default: grpo.v) | drift
      signal: tv_staleness   # or is_weight_ess (push when the IS weights' ESS falls below ess_threshold)
      tv_threshold: 0.02
      min_interval: 1
      max_interval: 10
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional


from grpo import metrics

POLICIES = ("every_v", "drift")
metrics.declare("push_reason", "", "why this iteration began with a push: `every v` (Algorithm 1), `drift` (the measured "
                "drift crossed push.tv_threshold or push.ess_threshold), `ceiling` (push.max_interval iterations since the "
                "last), `resume` (the asynchronous sampler restarts from pi_theta); only on a push's first row")
SIGNALS = ("tv_staleness", "is_weight_ess")


@dataclass
class PushConfig:
    policy: Literal["every_v", "drift"] = "every_v"  # every_v: every grpo.v iterations (Algorithm 1); drift: when the measured drift crosses a threshold
    signal: Literal["tv_staleness", "is_weight_ess"] = "tv_staleness"  # drift's measurement of the batch just trained
    tv_threshold: float = 0.02  # drift, tv_staleness: push once TV(pi_k, pi_push) on a batch reaches this
    ess_threshold: float = 0.9  # drift, is_weight_ess: push once the IS weights' ESS fraction falls to this
    min_interval: int = 1  # drift: iterations between pushes, at least
    max_interval: int = 10  # drift: at most (a push is then made whatever the drift)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal: must be one of {list(SIGNALS)}, got {self.signal!r}")
        if not (isinstance(self.tv_threshold, (int, float)) and 0 < self.tv_threshold <= 1):
            raise ValueError(f"tv_threshold: must be in (0, 1] (a total variation), got {self.tv_threshold!r}")
        if not (isinstance(self.ess_threshold, (int, float)) and 0 < self.ess_threshold <= 1):
            raise ValueError(f"ess_threshold: must be in (0, 1] (a fraction of the tokens), got {self.ess_threshold!r}")
        for name in ("min_interval", "max_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.min_interval > self.max_interval:
            raise ValueError(f"min_interval: must be <= max_interval ({self.max_interval}), got {self.min_interval}")
        if self.policy == "every_v":
            idle = [name for name, default in (("signal", "tv_staleness"), ("tv_threshold", 0.02), ("ess_threshold", 0.9),
                                               ("min_interval", 1), ("max_interval", 10))
                    if getattr(self, name) != default]
            if idle:
                raise ValueError(f"{idle[0]}: only push.policy: drift reads it; set push.policy: drift or drop the key")
        elif self.signal == "tv_staleness" and self.ess_threshold != 0.9:
            raise ValueError("ess_threshold: read with push.signal: is_weight_ess only; drop it or set the signal")
        elif self.signal == "is_weight_ess" and self.tv_threshold != 0.02:
            raise ValueError("tv_threshold: read with push.signal: tv_staleness only; drop it or set the signal")


@dataclass(frozen=True)
class PushDecision:
    push: bool
    reason: str  # why (logged with every push): "every v", "drift", "ceiling"; "" when no push


class PushSchedule:
    """The run's push decisions. `due(k, since)` before iteration k (k > 0; the server starts with
    pi_theta_0), `since` iterations after the last push; `measured(row)` after each batch's first
    step with its logged instruments. Its state (the last measurement) travels with checkpoints."""

    def __init__(self, cfg: PushConfig, v: int):
        self.cfg, self.v = cfg, v
        self.last: Optional[float] = None  # the signal on the batch just trained (None: not measured)

    def measured(self, row: dict) -> None:
        value = row.get(self.cfg.signal)
        self.last = float(value) if value is not None and math.isfinite(float(value)) else None

    def due(self, k: int, since: int) -> PushDecision:
        if self.cfg.policy == "every_v":
            return PushDecision(k % self.v == 0, "every v" if k % self.v == 0 else "")
        if since < self.cfg.min_interval:
            return PushDecision(False, "")
        if since >= self.cfg.max_interval:
            return PushDecision(True, "ceiling")
        if self.last is not None and self._crossed(self.last):
            return PushDecision(True, "drift")
        return PushDecision(False, "")

    def _crossed(self, value: float) -> bool:
        if self.cfg.signal == "tv_staleness":
            return value >= self.cfg.tv_threshold
        return value <= self.cfg.ess_threshold

    def state_dict(self) -> dict:
        return {"last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.last = state.get("last")
