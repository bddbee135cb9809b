"""Run logging: metrics.jsonl (the record scripts/plot.py reads), Weights & Biases, a progress bar.

Rank 0 does all I/O; every other rank gets a logger whose methods do nothing, so the training
loop calls the same code on every rank. A logged key is declared once, next to the code that
computes it (`declare`: its W&B section and one line of meaning; docs/metrics.md is generated
from the declarations); `train_row` and `eval_row` build the rows from the components'
statistics and leave nothing out but missing values. One `log` call per optimizer step, with flat
keys (`step`, `stage`, `iteration`, `weights_version`, `reward_mean`, `kl`, ..., `eval/pass@1`):
- metrics.jsonl gets them exactly as given, one JSON object per line, flushed at once;
- W&B gets them under their declared section (rollout/, train/, time/, bound/), with `step` as
  the W&B step.
On resume the W&B run id stored in the run directory continues the same W&B run, and
`truncate_after(step)` drops rows logged after the checkpoint so no step appears twice.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import string
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from grpo import registry
from grpo.progress import alpha_lag

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_run_id"

# ---------------------------------------------------------------------------------------------
# Declarations: a logged key is declared once, next to the code that computes it


SECTIONS = {
    "": "where the run stands",
    "rollout": "the sampled batch: rewards, which groups carry signal, lengths",
    "train": "the optimizer step: objective terms, clipping, importance weights, gradients",
    "time": "where the wall clock went, throughput, tokens and bytes moved",
    "bound": "the off-policy quantities of the paper's improvement bound, and the instruments that split them",
    "eval": "the held-out evaluation",
}


@dataclass(frozen=True)
class Metric:
    name: str  # the flat key; a family of keys named at run time ends in '*' (server_*, eval/pass@*)
    section: str  # its W&B section (SECTIONS); "" stays at the top level
    meaning: str  # one line: what it holds
    module: str  # where it is computed (the declaring module)


DECLARED: dict[str, Metric] = {}


def declare(name: str, section: str, meaning: str, *, module: Optional[str] = None) -> str:
    """Declare a logged key where it is computed: its W&B section and one line of meaning (also
    docs/metrics.md's, generated from the declarations). A key a row holds reaches metrics.jsonl
    and W&B whatever it is; an undeclared one is logged at the top level, with one warning."""
    if section not in SECTIONS:
        raise ValueError(f"metric {name}: section must be one of {sorted(SECTIONS)}, got {section!r}")
    module = module or sys._getframe(1).f_globals.get("__name__", "?")
    metric = Metric(name, section, meaning, module)
    known = DECLARED.get(name)
    if known is not None and (known.section, known.meaning) != (section, meaning):
        raise ValueError(f"metric {name} of {registry.origin(module)} is already declared in "
                         f"{registry.origin(known.module)} ({known.section}: {known.meaning})")
    DECLARED.setdefault(name, metric)
    return name


def declare_many(section: str, meanings: dict[str, str], *, module: Optional[str] = None) -> tuple[str, ...]:
    """declare() for several keys of one section; returns their names in order."""
    module = module or sys._getframe(1).f_globals.get("__name__", "?")
    return tuple(declare(name, section, meaning, module=module) for name, meaning in meanings.items())


def declared(key: str) -> Optional[Metric]:
    """The declaration of a key: its own, or its family's (the longest prefix before a '*')."""
    if key in DECLARED:
        return DECLARED[key]
    families = [m for name, m in DECLARED.items() if name.endswith("*") and key.startswith(name[:-1])]
    return max(families, key=lambda m: len(m.name), default=None)


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
    """The W&B name of a flat metric key, e.g. reward_mean -> rollout/reward_mean (its declared
    section); a key that holds a '/' (eval/pass@1) and an undeclared key keep their own name."""
    if "/" in key:
        return key
    metric = declared(key)
    return f"{metric.section}/{key}" if metric and metric.section else key


_warned_undeclared: set = set()


def warn_undeclared(keys) -> None:
    """One warning per key logged without a declaration (it goes to the top level of W&B)."""
    for key in keys:
        if key not in _warned_undeclared and declared(key) is None:
            _warned_undeclared.add(key)
            warnings.warn(f"metrics: {key} is logged but not declared: grpo.metrics.declare({key!r}, section, "
                          f"meaning) next to the code that computes it gives it a W&B section and a line in "
                          f"docs/metrics.md", stacklevel=3)


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
        # (what W&B keeps in TMPDIR, a SIGKILLed run leaves: train.py gives each rank a TMPDIR of its
        # own, grpo.fsutil.own_temp_dir, which the next start reclaims)
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
        warn_undeclared(row)
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


WHERE = declare_many("", {
    "step": "optimizer steps so far",
    "stage": "s < S of Algorithm 1",
    "iteration": "k < M within the stage",
    "sgd_iteration": "which of the i SGD iterations on this batch",
    "weights_version": "the server's weights: version n is the policy after n*v iterations of a stage; 0 is the "
                       "model directory",
})
STEP = declare_many("train", {
    "entropy": "entropy of pi_k per active token",
    "grad_norm": "global gradient norm before clipping (`optim.grad_clip`)",
    "lr": "learning rate",
    "nan_skips": "optimizer steps skipped for a non-finite gradient, so far",
})
TIMES = declare_many("time", {
    "time_train": "forward, backward and optimizer step",
    "time_sync": "the push before this iteration: seconds (0 after its first step)",
    "sync_bytes": "the push before this iteration: bytes (0 after its first step)",
    "time_iteration": "wall clock since the iteration began, push and eval included",
    "tokens_per_s": "the batch's prompt + completion tokens over `time_iteration`",
    "train_tokens": "tokens the train part ran forward and backward, all ranks (masked groups are skipped)",
    "train_padded_tokens": "the same with the micro-batches' padding",
})
LAG = declare_many("bound", {
    "alpha_lag_steps": "optimizer steps since the weights that sampled this batch were pushed, counted at the "
                       "batch's first step: (k mod v) * i, 0 on policy ([offpolicy.md](offpolicy.md))",
    "alpha_lag_pushes": "pushes since the weights that sampled this batch: 0 in this design (a batch is always "
                        "sampled from the newest push)",
})


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


def train_row(*, progress, stage: int, iteration: int, sgd_iteration: int, rollout_stats: dict, train_stats: dict,
              sampled_version: int, entropy: float, grad_norm: float, lr: float, time_train: float, time_sync: float,
              sync_bytes: float, iteration_seconds: float, shape: Optional[dict] = None,
              instruments: Optional[dict] = None) -> dict:
    """The row of one optimizer step. progress: grpo.progress.Progress after the step;
    rollout_stats: grpo.rollout.Rollout.stats, every key logged as named there (its "engine" dict:
    what the inference engine reports of the batch); train_stats: the step's objective statistics
    as grpo.objective.logged_stats names them;
    sampled_version: the weights version that sampled the batch (grpo.rollout.Rollout.weights_version),
    for alpha's lag (grpo.progress.alpha_lag); entropy: of pi_k on the batch per active token
    (`per_token`: NaN, so missing, when no token is active); time_sync / sync_bytes: the push before
    this iteration (0 after its first step); iteration_seconds: wall time since the iteration began,
    push and eval included (logged as time_iteration, and the denominator of tokens_per_s); shape:
    train.plan_batch's train_tokens and train_padded_tokens; instruments: the off-policy
    instruments of this step (grpo/staleness.py's split, grpo/parity.py's probe after a push).
    A statistic that is missing (NaN: of an empty set) is left out."""
    batch_tokens = rollout_stats["prompt_tokens"] + rollout_stats["completion_tokens"]
    # progress is after this step; the batch's first step began sgd_iteration + 1 steps ago
    lag_pushes, lag_steps = alpha_lag(progress, sampled_version, progress.step - sgd_iteration - 1)
    rollout = {key: value for key, value in rollout_stats.items() if key != "engine"}
    return {
        "step": progress.step, "stage": stage, "iteration": iteration, "sgd_iteration": sgd_iteration,
        "weights_version": progress.weights_version,
        "alpha_lag_pushes": lag_pushes, **defined({"alpha_lag_steps": lag_steps}),
        **defined(rollout),
        **defined(rollout_stats.get("engine", {})),  # as the engine reports them (CPU: its threads; GPU: none)
        **defined(train_stats),
        **defined({"entropy": entropy}), "grad_norm": grad_norm, "lr": lr, "nan_skips": progress.nan_skips,
        "time_train": time_train, "time_sync": time_sync, "sync_bytes": sync_bytes,
        "tokens_per_s": batch_tokens / max(iteration_seconds, 1e-9), "time_iteration": iteration_seconds,
        **(shape or {}), **defined(instruments or {}),
    }


def eval_row(step: int, summary: dict) -> dict:
    """The row of a held-out evaluation (grpo.evaluation.evaluate's summary): its numbers under eval/."""
    return {"step": step, **defined({f"eval/{k}": v for k, v in summary.items()
                                     if isinstance(v, (int, float))})}


# ---------------------------------------------------------------------------------------------
# docs/metrics.md's tables, from the declarations

DOCS_BEGIN = "<!-- generated by `python -m grpo.metrics --write docs/metrics.md`: begin -->"
DOCS_END = "<!-- generated by grpo.metrics: end -->"


def markdown() -> str:
    """A table per section of every declared key: name, meaning, where it is computed."""
    lines = []
    for section, about in SECTIONS.items():
        # by module (the order modules are imported in varies), in declaration order within one
        rows = sorted((m for m in DECLARED.values() if m.section == section), key=lambda m: m.module)
        if not rows:
            continue
        title = f"{section}/" if section else "top level"
        lines += [f"**{title}: {about}.**", "", "| key | meaning | computed in |", "| --- | --- | --- |"]
        for m in rows:
            lines.append(f"| `{m.name}` | {m.meaning.replace('|', chr(92) + '|')} | `{registry.origin(m.module)}` |")
        lines.append("")
    return "\n".join(lines)


def load_declarations() -> None:
    """Import every module that declares logged keys: those train.py imports (the run's own), and
    the CPU engine's, which a run imports only where an engine runs on a CPU."""
    import importlib

    for name in ("train", "grpo.cpu.serving"):
        importlib.import_module(name)


if __name__ == "__main__":
    # [--write FILE] [--plugins P ...] [--config C]: a user's declarations (their plugins) included
    sys.exit(registry.docs_main("grpo.metrics", load=load_declarations))
