"""Rollout recording: every batch as it was trained on, one Parquet file per batch.

    log.save_rollouts: true   ->   runs/<name>/rollouts/batch-s0000-k000012.parquet   (stage 0, iteration 12)
    batches = read_rollouts("runs/<name>")        # pyarrow Tables in (stage, iteration) order

A row per sampled sequence: the prompt and completion token ids, alpha's per-token log-probs (the
float32 the trainer computes with), reward, correctness, advantage, eq. 8 / RED weight, and the
batch's stage, iteration, seed and weights version (the columns are SCHEMA; docs/offpolicy.md).
Any dataframe library reads the files one by one or the directory as one dataset.

Crash safety: a batch is written under a temporary name starting with '.' (which pyarrow's and
polars' directory readers skip, and which `read_rollouts` never matches), fsynced and renamed into
place, so a file under its final name is always whole; the temporary name is fixed per batch, so
what a killed writer left is overwritten by the next write of that batch. Resume: a resumed run
samples again the batches after its checkpoint (they are a function of weights version, prompts
and seed) and rewrites their files; writing batch (s, k) removes the files an earlier attempt
wrote past it, so the directory never holds a batch twice nor one the run did not reach.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from grpo.fsutil import fsync_dir, fsync_file

ROLLOUTS_DIR = "rollouts"
FORMAT = "grpo-rollouts/1"  # in each file's schema metadata; bumped when a column changes meaning
_BATCH_FILE = re.compile(r"^batch-s(\d+)-k(\d+)\.parquet$")


def _list(item: pa.DataType) -> pa.DataType:
    # Parquet names a list's item "element": the schema read back is then the one written
    return pa.list_(pa.field("element", item))


SCHEMA = pa.schema([
    ("stage", pa.int32()),  # s of Algorithm 1
    ("iteration", pa.int32()),  # k within the stage
    ("seed", pa.int64()),  # the batch's seed (train.batch_seed): the server's sampling and RED-Drop's choices
    ("weights_version", pa.int32()),  # the version of alpha that sampled the sequence
    ("group", pa.int32()),  # the prompt's index in the batch (its G sequences share it)
    ("prompt_ids", _list(pa.int32())),
    ("completion_ids", _list(pa.int32())),
    ("logp_alpha", _list(pa.float32())),  # log alpha(o_t | q, o_<t) per completion token, as trained on
    ("reward", pa.float64()),
    ("correct", pa.float64()),  # the correctness part of the reward
    ("adv", pa.float64()),  # eq. 2 advantage (after RED)
    ("seq_weight", pa.float64()),  # eq. 8 mask / RED weight: 0 for a sequence that contributes nothing
    ("truncated", pa.bool_()),  # cut at grpo.max_new_tokens
], metadata={"format": FORMAT})


def batch_path(run_dir: str | os.PathLike, stage: int, iteration: int) -> Path:
    """Where batch (stage, iteration) is recorded; the names sort in training order."""
    return Path(run_dir) / ROLLOUTS_DIR / f"batch-s{stage:04d}-k{iteration:06d}.parquet"


def batch_table(stage: int, iteration: int, seed: int, rollout) -> pa.Table:
    """A grpo.rollout.Rollout as a table of SCHEMA, a row per sequence in the batch's order."""
    samples = rollout.samples
    n = len(samples)
    columns = {
        "stage": [stage] * n, "iteration": [iteration] * n, "seed": [seed] * n,
        "weights_version": [s.weights_version for s in samples], "group": [s.group for s in samples],
        "prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
        "logp_alpha": [s.logp_alpha for s in samples], "reward": [s.reward for s in samples],
        "correct": [s.correct for s in samples], "adv": [s.adv for s in samples],
        "seq_weight": [s.seq_weight for s in samples], "truncated": [s.truncated for s in samples],
    }
    return pa.Table.from_pydict(columns, schema=SCHEMA)


def record_batch(run_dir: str | os.PathLike, stage: int, iteration: int, seed: int, rollout) -> Path:
    """Write batch (stage, iteration) atomically and durably (rank 0, before training on it); drop
    what an earlier attempt of the run recorded past it. Returns the file."""
    path = batch_path(run_dir, stage, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(batch_table(stage, iteration, seed, rollout), tmp)
    fsync_file(tmp)
    os.replace(tmp, path)
    for later in sorted(path.parent.iterdir()):
        found = _batch_key(later.name.removeprefix(".").removesuffix(".tmp"))
        if found is not None and found > (stage, iteration):
            later.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def _batch_key(name: str):
    """(stage, iteration) of a batch file's name, or None for any other name."""
    match = _BATCH_FILE.match(name)
    return (int(match[1]), int(match[2])) if match else None


def read_rollouts(run_dir: str | os.PathLike) -> list[pa.Table]:
    """The recorded batches of a run, one table each, in training order (stage, iteration);
    temporary files of an unfinished write are ignored. `.to_pylist()` gives a row per sequence."""
    directory = Path(run_dir) / ROLLOUTS_DIR
    if not directory.is_dir():
        return []
    files = sorted((key, p) for p in directory.iterdir() if (key := _batch_key(p.name)) is not None)
    return [pq.read_table(p) for _, p in files]


# ---------------------------------------------------------------------------------------------
# Replay: a recorded stream as the sampler (train.py --replay RUN_DIR)


class ReplayError(ValueError):
    """A recorded stream that cannot stand in for the sampler; the message names the file or key."""


class RecordedStream:
    """The batches a run recorded (log.save_rollouts), served in place of the inference server:
    alpha is the recorded sampler, fixed and known (the paper's v -> infinity limit), and every
    objective, correction, learning rate or i applies to it as it would live."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        directory = self.run_dir / ROLLOUTS_DIR
        if not directory.is_dir():
            raise ReplayError(f"--replay {run_dir}: no {ROLLOUTS_DIR}/ (record a run with log.save_rollouts=true)")
        self.files = {key: p for p in directory.iterdir() if (key := _batch_key(p.name)) is not None}
        if not self.files:
            raise ReplayError(f"--replay {run_dir}: {directory} holds no recorded batch")

    def check_covers(self, stages: int, iterations: int) -> None:
        """Every (stage, iteration) of the schedule has a recorded batch, or one line naming the first missing."""
        for s in range(stages):
            for k in range(iterations):
                if (s, k) not in self.files:
                    raise ReplayError(f"--replay {self.run_dir}: no batch for stage {s}, iteration {k} "
                                      f"({batch_path(self.run_dir, s, k).name}); grpo.S / grpo.M ask for more than "
                                      f"was recorded")

    def rollout(self, stage: int, iteration: int, cfg):
        """Batch (stage, iteration) as grpo.rollout.sample_rollout would return it under `cfg`: the
        recorded sequences, log-probs of alpha and rewards; advantages and weights (eq. 2, eq. 8,
        RED with the batch's own seed) from cfg.objective through the function sampling calls
        (grpo.advantages.batch_advantages), so another objective sees its own."""
        from grpo.advantages import batch_advantages
        from grpo.rollout import Rollout, Sample, batch_stats

        table = pq.read_table(self.files[(stage, iteration)])
        rows = table.to_pylist()
        G = cfg.grpo.G
        if len(rows) % G or len(rows) // G != cfg.grpo.batch_prompts:
            raise ReplayError(f"{self.files[(stage, iteration)]}: {len(rows)} sequences, the config's batch is "
                              f"grpo.batch_prompts={cfg.grpo.batch_prompts} x grpo.G={G}")
        adv, seq_weight, adv_stats = batch_advantages([r["reward"] for r in rows], cfg, rows[0]["seed"])
        samples = [Sample(group=r["group"], prompt_ids=r["prompt_ids"], completion_ids=r["completion_ids"],
                          logp_alpha=r["logp_alpha"], truncated=r["truncated"], reward=r["reward"],
                          correct=r["correct"], adv=adv[j], seq_weight=seq_weight[j],
                          weights_version=r["weights_version"]) for j, r in enumerate(rows)]
        stats = {**adv_stats, **batch_stats(samples), "reward_timeouts": 0.0, "time_generate": 0.0,
                 "time_reward": 0.0, "engine": {}}
        return Rollout(samples, stats)
