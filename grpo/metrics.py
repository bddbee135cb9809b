"""Run logging: metrics.jsonl (the record scripts/plot.py reads), Weights & Biases, a progress bar.

Rank 0 does all I/O; every other rank gets a logger whose methods do nothing, so the training
loop calls the same code on every rank. This module is the one place that names logged keys:
`train_row` and `eval_row` build the rows from the components' statistics. One `log` call per
optimizer step, with flat keys
(`step`, `stage`, `iteration`, `weights_version`, `reward_mean`, `kl`, ..., `eval/pass@1`):
- metrics.jsonl gets them exactly as given, one JSON object per line, flushed at once;
- W&B gets them under a group prefix (KEY_GROUPS) so the default dashboard has one section per
  concern (rollout/, train/, time/, bound/), with `step` as the W&B step.
On resume the W&B run id stored in the run directory continues the same W&B run, and
`truncate_after(step)` drops rows logged after the checkpoint so no step appears twice.
"""
from __future__ import annotations

import fnmatch
import math
import json
import os
import re
import secrets
import string
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from grpo.progress import alpha_lag

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_run_id"

# W&B section of each flat key. Exact names first, then glob patterns in this order; a key that
# already holds a '/' (eval/pass@1) keeps its own section, and unmatched keys (step, stage,
# iteration, weights_version) stay at the top level.
KEY_GROUPS: dict[str, str] = {
    # rollout/: the sampled batch (rewards, which groups carry signal, lengths)
    "reward_*": "rollout",
    "group_std_*": "rollout",
    "pass_rate": "rollout",
    "masked_frac": "rollout",
    "zero_var_frac": "rollout",
    "completion_len_*": "rollout",
    "prompt_len_*": "rollout",
    "truncated_frac": "rollout",
    "red_*": "rollout",
    "seq_weight_*": "rollout",
    # train/: the optimizer step (objective terms, clipping, importance weights, gradients)
    "loss": "train",
    "loss_*": "train",
    "clip_*": "train",
    "kl": "train",
    "entropy": "train",
    "is_weight_*": "train",
    "is_capped_frac": "train",
    "is_masked_frac": "train",
    "seq_ratio_mean": "train",
    "seq_capped_frac": "train",
    "seq_masked_frac": "train",
    "ratio_*": "train",
    "grad_norm": "train",
    "lr": "train",
    "nan_skips": "train",
    # time/: where the wall clock went, throughput, bytes moved for weight sync
    "time_*": "time",
    "tokens_per_s": "time",
    "train_tokens": "time",
    "train_padded_tokens": "time",
    "server_*": "time",  # what the inference engine reports of a batch
    "sync_bytes": "time",
    # bound/: the off-policy quantities of the paper's improvement bound (TV and KL of pi_k vs
    # alpha, the reward bound M)
    "tv_*": "bound",
    "kl_pik_alpha": "bound",
    "M_*": "bound",
    "bound_*": "bound",
    # how stale alpha is: pushes and optimizer steps since the weights that sampled the batch
    "alpha_lag_*": "bound",
    # alpha vs pi_k split into engine mismatch and staleness (grpo/staleness.py); the parity probe
    # after a push (grpo/parity.py). tv_mismatch, tv_staleness fall under tv_* above.
    "kl_mismatch": "bound",
    "kl_staleness": "bound",
    "parity_*": "bound",
}

# Config keys whose string values are credentials. `max_tokens` or `pad_token_id` do not match
# (plural / not a string); `hf_token`, `api_key`, `wandb_secret` do.
_SECRET_KEY = re.compile(r"(^|[_\-.])(token|secret|password|passwd|api[_\-]?key|access[_\-]?key|auth|credentials?)"
                         r"($|[_\-.])", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|xox[abp]-)[A-Za-z0-9_\-]{16,}$")


@dataclass
class LogConfig:
    """The `log:` section."""

    project: str = "grpo"  # W&B project
    run_name: Optional[str] = None  # run directory and W&B name; the caller defaults it (config name + time)
    tags: list[str] = field(default_factory=list)  # W&B tags; also stamped on every metrics.jsonl row
    group: Optional[str] = None  # W&B group (scripts/sweep.py: one per grid point, so seeds aggregate); also on every row
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"  # offline: sync later with `wandb sync`
    out_dir: str = "runs"  # runs go to <out_dir>/<run_name>/
    sample_table_every: int = 10  # log a table of prompts/completions/rewards every N iterations (0: never)
    progress: bool = True  # a progress bar on rank 0's stderr
    save_rollouts: bool = False  # write each batch as trained on to <run>/rollouts/ (Parquet; docs/offpolicy.md)
    split_staleness: bool = True  # log alpha vs pi_k as engine mismatch + staleness; with v > 1 this keeps a
    #                               frozen copy of the pushed weights and scores lagged batches with it (grpo/staleness.py)

    def __post_init__(self):
        if not isinstance(self.project, str) or not self.project.strip():
            raise ValueError(f"project: must be a non-empty string, got {self.project!r}")
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name.strip()
                                          or "/" in self.run_name or self.run_name in (".", "..")):
            raise ValueError(f"run_name: must be a non-empty name without '/', got {self.run_name!r}")
        if not isinstance(self.tags, (list, tuple)) or not all(isinstance(t, str) and t for t in self.tags):
            raise ValueError(f"tags: must be a list of non-empty strings, got {self.tags!r}")
        if self.group is not None and (not isinstance(self.group, str) or not self.group.strip()):
            raise ValueError(f"group: must be a non-empty string or null, got {self.group!r}")
        if self.wandb_mode not in ("online", "offline", "disabled"):
            raise ValueError(f"wandb_mode: must be one of ['online', 'offline', 'disabled'], got {self.wandb_mode!r}")
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ValueError(f"out_dir: must be a non-empty path, got {self.out_dir!r}")
        if isinstance(self.sample_table_every, bool) or not isinstance(self.sample_table_every, int) \
                or self.sample_table_every < 0:
            raise ValueError(f"sample_table_every: must be an integer >= 0 (0: never), got {self.sample_table_every!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress: expected true/false, got {self.progress!r}")
        if not isinstance(self.save_rollouts, bool):
            raise ValueError(f"save_rollouts: expected true/false, got {self.save_rollouts!r}")
        if not isinstance(self.split_staleness, bool):
            raise ValueError(f"split_staleness: expected true/false, got {self.split_staleness!r}")


def group_key(key: str) -> str:
    """The W&B name of a flat metric key, e.g. reward_mean -> rollout/reward_mean."""
    if "/" in key:
        return key
    group = KEY_GROUPS.get(key)
    if group is None:
        group = next((g for pattern, g in KEY_GROUPS.items() if "*" in pattern and fnmatch.fnmatchcase(key, pattern)),
                     None)
    return f"{group}/{key}" if group else key


def redact_secrets(config: Any) -> Any:
    """A copy of a (nested) config without string values under credential-like keys."""
    if isinstance(config, dict):
        out = {}
        for k, v in config.items():
            if isinstance(v, str) and (_SECRET_KEY.search(str(k)) or _SECRET_VALUE.match(v)):
                continue
            out[k] = redact_secrets(v)
        return out
    if isinstance(config, (list, tuple)):
        return [redact_secrets(v) for v in config if not (isinstance(v, str) and _SECRET_VALUE.match(v))]
    return config


def _plain(key: str, value: Any) -> Any:
    """A JSON value for `value` (0-d tensors and numpy scalars become Python numbers)."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (list, dict, str)):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise ValueError(f"metrics: {key}: expected a number, got a tensor/array of shape "
                             f"{tuple(getattr(value, 'shape', ()))}") from None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"metrics: {key}: expected a number, got {type(value).__name__}")


def _read_jsonl(path: Path) -> list[tuple[str, Optional[dict]]]:
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        rows.append((line, row if isinstance(row, dict) else None))
    return rows


class _NullBar:
    """What `progress` returns where there is no bar: the tqdm calls train.py makes, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def wandb_payload(row: dict) -> dict:
    """A row as W&B gets it: grouped names, no step (W&B's own), no strings, and a NaN some caller
    passed left out as missing, so W&B's summary and charts skip it as the tables do."""
    return {group_key(k): v for k, v in row.items() if k != "step" and not missing(v) and not isinstance(v, str)}


class MetricsLogger:
    """metrics.jsonl + W&B + progress bar on rank 0; a logger that does nothing on other ranks."""

    def __init__(self, cfg: LogConfig, run_dir: Path, run_config: dict, rank: int, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.active = rank == 0
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        self._run = None
        self._wandb_step = -1
        self._bar = None
        self._closed = False
        self._labels = {**({"group": cfg.group} if cfg.group else {}), **({"tags": list(cfg.tags)} if cfg.tags else {})}
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume and self.metrics_path.is_file() and self.metrics_path.stat().st_size > 0:
            raise ValueError(f"{self.metrics_path} already holds metrics of an earlier run: resume it, or give "
                             f"this run another log.run_name / log.out_dir")
        if cfg.wandb_mode != "disabled":
            self._run = self._init_wandb(run_config, resume)

    def _init_wandb(self, run_config: dict, resume: bool):
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        if resume and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            if resume:
                warnings.warn(f"{id_file} not found: the resumed run logs to a new W&B run")
            # W&B's own id shape: 8 characters of [a-z0-9]
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            id_file.write_text(run_id + "\n")
        return wandb.init(
            project=self.cfg.project,
            name=self.cfg.run_name or self.run_dir.name,
            tags=list(self.cfg.tags),
            group=self.cfg.group,
            config=redact_secrets(run_config),
            dir=str(self.run_dir),
            mode=self.cfg.wandb_mode,
            id=run_id,
            resume="allow",
        )

    # -- per step ---------------------------------------------------------------------------

    def log(self, metrics: dict[str, float | int]) -> None:
        """Record one optimizer step's metrics (must hold an integer 'step')."""
        if not self.active:
            return
        step = _plain("step", metrics["step"]) if "step" in metrics else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"metrics: 'step' must be an integer, got {step!r} (keys: {sorted(metrics)})")
        row = {str(k): (step if k == "step" else _plain(str(k), v)) for k, v in metrics.items()}
        # Which sweep group and grid point the row belongs to travels with it (W&B has its own fields).
        line = json.dumps({**row, **self._labels})
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")
            f.flush()
        if self._wandb_step_ok(step, "log"):
            self._run.log(wandb_payload(row), step=step)

    def _wandb_step_ok(self, step: int, what: str) -> bool:
        """W&B steps only move forward: data for an earlier step would be dropped, so say so."""
        if self._run is None:
            return False
        if step < self._wandb_step:
            warnings.warn(f"{what}(step={step}) after step {self._wandb_step} was logged: W&B keeps steps "
                          f"increasing, so this goes to {METRICS_FILE}/{SAMPLES_FILE} only")
            return False
        self._wandb_step = step
        return True

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of sampled completions (prompt, completion, reward, ...) at `step`."""
        if not self.active:
            return
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("log_samples: rows must be a list of dicts (one per completion)")
        columns: list[str] = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
        with open(self.samples_path, "a") as f:
            for i, r in enumerate(rows):
                f.write(json.dumps({"step": step, **{k: _plain(f"rows[{i}].{k}", v) for k, v in r.items()}}) + "\n")
            f.flush()
        if rows and self._wandb_step_ok(step, "log_samples"):
            import wandb

            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self._run.log({"samples": table}, step=step)

    def truncate_after(self, step: int) -> int:
        """Drop rows with step > `step` from metrics.jsonl and samples.jsonl (resume); returns how many."""
        if not self.active:
            return 0
        dropped = 0
        for path in (self.metrics_path, self.samples_path):
            if not path.is_file():
                continue
            rows = _read_jsonl(path)
            # A line torn by a crash mid-write is not JSON: it goes too.
            keep = [line for line, row in rows if row is not None and isinstance(row.get("step"), (int, float))
                    and row["step"] <= step]
            dropped += len(rows) - len(keep)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)
        return dropped

    # -- progress bar and end -----------------------------------------------------------------

    def progress(self, total: int, initial: int = 0):
        """A tqdm bar over optimizer steps on rank 0 (update / set_postfix); a no-op bar elsewhere."""
        if not (self.active and self.cfg.progress):
            return _NullBar()
        from tqdm.auto import tqdm

        if self._bar is not None:
            self._bar.close()
        # tqdm shows s/it by itself once a step takes longer than a second.
        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                         smoothing=0.1)
        return self._bar

    def close(self) -> None:
        if not self.active or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._run is not None:
            import wandb

            self._run.finish()
            # finish() returns before wandb-core has flushed the run file; teardown waits for it.
            # Its atexit hook would too, but not reliably in torchrun's multiprocessing workers.
            wandb.teardown()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The logged rows: the one place where logged names are chosen


# Keys of the rollout's statistics (grpo.rollout.sample_rollout, grpo.objective.group_advantages),
# logged as they are named there.
ROLLOUT_KEYS = ("reward_mean", "reward_std", "group_std_mean", "pass_rate", "masked_frac", "zero_var_frac",
                "red_drop_frac", "seq_weight_mean", "completion_len_mean", "truncated_frac", "reward_timeouts",
                "bound_M", "bound_M_nonzero", "time_generate", "time_reward", "time_wait_generate")
# Logged name <- grpo.objective.finalize_stats name. kl is KL(pi || pi_ref) of eq. 7; tv_pik_alpha and
# kl_pik_alpha are the drift between the trainer's pi_k and the sampler alpha (Theorem 1's terms).
TRAIN_KEYS = {
    "loss": "loss", "clip_frac": "clip_frac", "clip_low_frac": "clip_low_frac", "clip_high_frac": "clip_high_frac",
    "clip_frac_adv_pos": "clip_frac_adv_pos", "clip_frac_adv_neg": "clip_frac_adv_neg",
    "kl": "kl_mean", "ratio_mean": "ratio_mean", "ratio_std": "ratio_std", "ratio_min": "ratio_min",
    "ratio_max": "ratio_max", "is_weight_mean": "is_weight_mean", "is_weight_std": "is_weight_std",
    "is_weight_min": "is_weight_min", "is_weight_max": "is_weight_max", "is_capped_frac": "is_capped_frac",
    "tv_pik_alpha": "tv_mean", "kl_pik_alpha": "kl_pik_alpha_mean",
    # the off-policy corrections and sequence-level losses (grpo/losses.py): what they masked or truncated
    "is_masked_frac": "is_masked_frac", "is_weight_ess": "is_weight_ess", "seq_ratio_mean": "seq_ratio_mean",
    "seq_capped_frac": "seq_capped_frac",
    "seq_masked_frac": "seq_masked_frac",
}


def missing(value: Any) -> bool:
    """A statistic of an empty set: NaN where it is computed (a float, a numpy scalar or a 0-d
    tensor). Infinities are values (a ratio that blew up), not missing."""
    if value is None:
        return True
    if isinstance(value, (bool, int, str)):
        return False
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def defined(stats: dict) -> dict:
    """The statistics that exist: one over an empty set (no active token, no counted sequence, no
    group with nonzero variance) is NaN where it is computed and is left out of the row, so a
    table's or a plot's mean over rows never turns NaN. Missing is the same everywhere: the key is
    absent from metrics.jsonl and from W&B."""
    return {key: value for key, value in stats.items() if not missing(value)}


def per_token(total: float, num_tokens: float) -> float:
    """A mean over active tokens: NaN (missing) when there is none, like grpo.objective.finalize_stats."""
    return total / num_tokens if num_tokens > 0 else math.nan


def train_row(progress, stage: int, iteration: int, sgd_iteration: int, rollout_stats: dict, train_stats: dict, *,
              sampled_version: int, entropy: float, grad_norm: float, lr: float, time_train: float, time_sync: float,
              sync_bytes: float, iteration_seconds: float, shape: Optional[dict] = None,
              instruments: Optional[dict] = None) -> dict:
    """The row of one optimizer step. progress: grpo.progress.Progress after the step;
    sampled_version: the weights version that sampled the batch (grpo.rollout.Rollout.weights_version),
    for alpha's lag (grpo.progress.alpha_lag); train_stats: grpo.objective.finalize_stats of the step's
    objective; entropy: of pi_k on the batch per active token (`per_token`: NaN, so missing, when no
    token is active); time_sync / sync_bytes: the push before this iteration (0 after its first
    step); iteration_seconds: wall time since the iteration began, push and eval included (logged as
    time_iteration, and the denominator of tokens_per_s); shape: train.plan_batch's train_tokens (the
    prompt + completion tokens the train part runs forward and backward, all ranks; masked groups
    are skipped) and train_padded_tokens (the same with the micro-batches' padding); instruments:
    the off-policy instruments of this step (grpo/staleness.py's split, grpo/parity.py's probe
    after a push), missing ones left out."""
    batch_tokens = rollout_stats["prompt_tokens"] + rollout_stats["completion_tokens"]
    # progress is after this step; the batch's first step began sgd_iteration + 1 steps ago
    lag_pushes, lag_steps = alpha_lag(progress, sampled_version, progress.step - sgd_iteration - 1)
    return {
        "step": progress.step, "stage": stage, "iteration": iteration, "sgd_iteration": sgd_iteration,
        "weights_version": progress.weights_version,
        "alpha_lag_pushes": lag_pushes, **defined({"alpha_lag_steps": lag_steps}),
        **defined({key: rollout_stats[key] for key in ROLLOUT_KEYS}),
        **defined(rollout_stats.get("engine", {})),  # as the engine reports them (CPU: its threads; GPU: none)
        **defined({key: train_stats[name] for key, name in TRAIN_KEYS.items()}),
        **defined({"entropy": entropy}), "grad_norm": grad_norm, "lr": lr, "nan_skips": progress.nan_skips,
        "time_train": time_train, "time_sync": time_sync, "sync_bytes": sync_bytes,
        "tokens_per_s": batch_tokens / max(iteration_seconds, 1e-9), "time_iteration": iteration_seconds,
        **(shape or {}), **defined(instruments or {}),
    }


def eval_row(step: int, summary: dict) -> dict:
    """The row of a held-out evaluation (grpo.evaluation.evaluate's summary): its numbers under eval/."""
    return {"step": step, **defined({f"eval/{k}": v for k, v in summary.items()
                                     if isinstance(v, (int, float))})}
