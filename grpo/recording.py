"""Rollout recording: every batch as it was trained on, one Parquet file per batch.

    log.save_rollouts: true   ->   runs/<name>/rollouts/batch-s0000-k000012.parquet   (stage 0, iteration 12)
    batches = read_rollouts("runs/<name>")        # pyarrow Tables in (stage, iteration) order

A row per sampled sequence: the prompt and completion token ids, alpha's per-token log-probs (the
float32 the trainer computes with), reward, correctness, advantage, eq. 8 / RED weight, and the
batch's stage, iteration, seed and weights version (the columns are SCHEMA; docs/offpolicy.md).
Any dataframe library reads the files one by one or the directory as one dataset. Each file's
schema metadata says what its numbers mean: the format, the model they were made with (its
config.json) and the tokenizer's vocabulary (a sha256 of its token -> id map): `model_and_tokenizer`.

Crash safety: a batch is written under a temporary name starting with '.' (which pyarrow's and
polars' directory readers skip, and which `read_rollouts` never matches), fsynced and renamed into
place, so a file under its final name is always whole; the temporary name is fixed per batch, so
what a killed writer left is overwritten by the next write of that batch. Resume: a resumed run
samples again the batches after its checkpoint (they are a function of weights version, prompts
and seed) and rewrites their files; writing batch (s, k) removes the files an earlier attempt
wrote past it, so the directory never holds a batch twice nor one the run did not reach.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo.fsutil import fsync_dir, fsync_file, no_space, preallocate

ROLLOUTS_DIR = "rollouts"
# In each file's schema metadata; bumped when a column changes meaning or the metadata what it
# holds (2: the model and tokenizer the batch was made with).
FORMAT = "grpo-rollouts/2"
# config.json keys that do not change what the model computes for a token id
_NOT_THE_MODEL = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")
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


def model_and_tokenizer(model_dir: str | os.PathLike, tokenizer) -> dict[str, str]:
    """What a recorded batch's token ids and log-probs mean, as its schema metadata: the model
    (its config.json, less names, versions and dtype) and the tokenizer (sha256 of its token -> id
    map, added tokens included). A replay refuses a recording whose model or tokenizer differ."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = {k: v for k, v in sorted(config.items()) if k not in _NOT_THE_MODEL}
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return {"model": json.dumps(model, separators=(",", ":")), "tokenizer": hashlib.sha256(vocab.encode()).hexdigest()}


def batch_path(run_dir: str | os.PathLike, stage: int, iteration: int) -> Path:
    """Where batch (stage, iteration) is recorded; the names sort in training order."""
    return Path(run_dir) / ROLLOUTS_DIR / f"batch-s{stage:04d}-k{iteration:06d}.parquet"


def batch_table(stage: int, iteration: int, seed: int, rollout, made_with: dict[str, str]) -> pa.Table:
    """A grpo.rollout.Rollout as a table of SCHEMA, a row per sequence in the batch's order, its
    metadata saying what it was made with (`model_and_tokenizer`)."""
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
    schema = SCHEMA.with_metadata({**SCHEMA.metadata, **{k.encode(): v.encode() for k, v in made_with.items()}})
    return pa.Table.from_pydict(columns, schema=schema)


def record_batch(run_dir: str | os.PathLike, stage: int, iteration: int, seed: int, rollout,
                 made_with: dict[str, str]) -> Path:
    """Write batch (stage, iteration) atomically and durably (rank 0, before training on it); drop
    what an earlier attempt of the run recorded past it. `made_with`: the model and tokenizer it was
    made with (`model_and_tokenizer`). Returns the file. A full disk raises grpo.fsutil.NoSpaceError
    and leaves the directory as it was."""
    path = batch_path(run_dir, stage, iteration)
    tmp = path.with_name(f".{path.name}.tmp")
    sink = pa.BufferOutputStream()  # in memory first: the write's size is known before it starts
    pq.write_table(batch_table(stage, iteration, seed, rollout, made_with), sink)
    data = sink.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            preallocate(f.fileno(), data.size)
            f.write(data)
    except OSError as e:  # a full disk: one line naming the file and its size; the batches before stay
        tmp.unlink(missing_ok=True)
        full = no_space(e, path, data.size)
        if full is not None:
            raise full from None
        raise
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

    def check(self, cfg, made_with: dict[str, str]) -> None:
        """Refuse, before the first step, a stream that cannot stand in for the sampler under `cfg`
        (a TrainConfig): a batch of the schedule missing, or one whose file is not a readable
        recording of this format, was made with another model or tokenizer (`made_with`: this
        run's, from `model_and_tokenizer`), has a column missing, of another type or with nulls,
        log-probs that are not one finite number per completion token, a token id outside the
        model's vocabulary, non-finite rewards, or another batch shape than grpo.batch_prompts x
        grpo.G. Raises ReplayError naming the file (and row)."""
        self.check_covers(cfg.grpo.S, cfg.grpo.M)
        self.check_batches([(s, k) for s in range(cfg.grpo.S) for k in range(cfg.grpo.M)], cfg, made_with)

    def check_batches(self, keys, cfg, made_with: dict[str, str]) -> None:
        """`check` of the recorded batches `keys` ((stage, iteration) pairs) alone."""
        config = json.loads(made_with["model"])
        vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 2**31
        for key in keys:
            path = self.files[key]
            try:
                check_batch(path, key, cfg.grpo.batch_prompts, cfg.grpo.G, made_with, vocab_size)
            except ReplayError as e:
                raise ReplayError(f"--replay {self.run_dir}: {path.name}: {e}") from None

    def check_covers(self, stages: int, iterations: int) -> None:
        """Every (stage, iteration) of the schedule has a recorded batch, or one line naming the first missing."""
        for s in range(stages):
            for k in range(iterations):
                if (s, k) not in self.files:
                    raise ReplayError(f"--replay {self.run_dir}: no batch for stage {s}, iteration {k} "
                                      f"({batch_path(self.run_dir, s, k).name}); grpo.S / grpo.M ask for more than "
                                      f"was recorded")

    def rollout(self, stage: int, iteration: int, cfg):
        """Batch (stage, iteration) as grpo.rollout.sample_rollout would return it under `cfg` (a
        stream `check` passed): the recorded sequences, log-probs of alpha and rewards; advantages
        and weights (eq. 2, eq. 8, RED with the batch's own seed) from cfg.objective through the
        function sampling calls (grpo.advantages.batch_advantages), so another objective sees its own."""
        from grpo.advantages import batch_advantages
        from grpo.rollout import Rollout, Sample, batch_stats

        rows = pq.read_table(self.files[(stage, iteration)]).to_pylist()  # checked by `check`
        adv, seq_weight, adv_stats = batch_advantages([r["reward"] for r in rows], cfg, rows[0]["seed"])
        samples = [Sample(group=r["group"], prompt_ids=r["prompt_ids"], completion_ids=r["completion_ids"],
                          logp_alpha=r["logp_alpha"], truncated=r["truncated"], reward=r["reward"],
                          correct=r["correct"], adv=adv[j], seq_weight=seq_weight[j],
                          weights_version=r["weights_version"]) for j, r in enumerate(rows)]
        stats = {**adv_stats, **batch_stats(samples), "reward_timeouts": 0.0, "time_generate": 0.0,
                 "time_reward": 0.0, "engine": {}}
        return Rollout(samples, stats)


def check_batch(path: Path, key: tuple[int, int], batch_prompts: int, G: int, made_with: dict[str, str],
                vocab_size: int) -> None:
    """One recorded file against the format, the model and tokenizer of `made_with`, SCHEMA, the
    batch shape, the vocabulary and finiteness (RecordedStream.check). Raises ReplayError saying
    what (and which row), without the file's name."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ReplayError(f"not a readable Parquet file ({' '.join(str(e).split())})") from None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    found = meta.get("format")
    if found != FORMAT:
        why = ("no format in its metadata (not written by log.save_rollouts)" if found is None else
               f"format {found}, which does not record the model and tokenizer it was made with"
               if found == "grpo-rollouts/1" else f"unknown format {found}")
        raise ReplayError(f"{why}; this version replays {FORMAT}")
    if meta.get("model") != made_with["model"]:
        differs = _differs(meta.get("model", "{}"), made_with["model"])
        raise ReplayError(f"made with another model than model.path: {differs}")
    if meta.get("tokenizer") != made_with["tokenizer"]:
        raise ReplayError(f"made with another tokenizer than model.path's (vocabulary sha256 "
                          f"{meta.get('tokenizer', 'absent')[:12]} there, {made_with['tokenizer'][:12]} here)")
    col = {}
    for field in SCHEMA:
        if field.name not in table.column_names:
            raise ReplayError(f"no column {field.name}")
        if not table.column(field.name).type.equals(field.type):
            raise ReplayError(f"column {field.name} is {table.column(field.name).type}, expected {field.type}")
        col[field.name] = column = table.column(field.name).combine_chunks()
        if column.null_count:
            raise ReplayError(f"row {_first(column.is_null())}: {field.name} is null")
        if pa.types.is_list(field.type) and pc.list_flatten(column).null_count:
            raise ReplayError(f"row {_row_of(column, _first(pc.list_flatten(column).is_null()))}: {field.name} "
                              f"holds a null")
    wrong = pc.or_(pc.not_equal(col["stage"], key[0]), pc.not_equal(col["iteration"], key[1]))
    if (row := _first(wrong)) >= 0:
        raise ReplayError(f"row {row} is of stage {col['stage'][row]}, iteration {col['iteration'][row]}; the "
                          f"file's name says stage {key[0]}, iteration {key[1]}")
    # group_advantages takes a batch as B groups of G consecutive rows: row j is of group j // G
    in_order = pa.array(range(table.num_rows), pa.int32())
    in_order = pc.divide(in_order, G) if table.num_rows == batch_prompts * G else None
    if in_order is None or not pc.all(pc.equal(col["group"], in_order)).as_py():
        sizes = {c["values"].as_py(): c["counts"].as_py() for c in pc.value_counts(col["group"])}
        if in_order is not None and sorted(sizes) == list(range(batch_prompts)) and set(sizes.values()) == {G}:
            raise ReplayError(f"row {_first(pc.not_equal(col['group'], in_order))}: a group's {G} sequences are not "
                              f"consecutive rows")
        raise ReplayError(f"{table.num_rows} sequences in {len(sizes)} groups of "
                          f"{', '.join(map(str, sorted(set(sizes.values())))) or 0}; the config's batch is "
                          f"grpo.batch_prompts={batch_prompts} x grpo.G={G}")
    if len(pc.unique(col["seed"])) != 1:
        raise ReplayError("its rows hold more than one seed (a batch has one)")
    for name in ("prompt_ids", "completion_ids"):
        if (row := _first(pc.equal(pc.list_value_length(col[name]), 0))) >= 0:
            raise ReplayError(f"row {row}: {name} is empty")
        ids = pc.list_flatten(col[name])
        if (at := _first(pc.or_(pc.less(ids, 0), pc.greater_equal(ids, vocab_size)))) >= 0:
            raise ReplayError(f"row {_row_of(col[name], at)}: {name} holds token id {ids[at]}, outside the "
                              f"model's vocabulary [0, {vocab_size})")
    lengths = pc.list_value_length(col["logp_alpha"]), pc.list_value_length(col["completion_ids"])
    if (row := _first(pc.not_equal(*lengths))) >= 0:
        raise ReplayError(f"row {row}: logp_alpha has {lengths[0][row]} values for {lengths[1][row]} completion tokens")
    logps = pc.list_flatten(col["logp_alpha"])
    if (at := _first(pc.invert(pc.is_finite(logps)))) >= 0:
        raise ReplayError(f"row {_row_of(col['logp_alpha'], at)}: logp_alpha holds {logps[at]}, not a finite log-prob")
    if (row := _first(pc.invert(pc.is_finite(col["reward"])))) >= 0:
        raise ReplayError(f"row {row}: reward is {col['reward'][row]}, not a finite number")


def _first(mask: pa.Array) -> int:
    """The index of the first True in a boolean array (-1: none)."""
    return pc.index(mask, True).as_py()


def _row_of(lists: pa.Array, at: int) -> int:
    """The row that holds item `at` of a list column's flattened items."""
    return pc.list_parent_indices(lists)[at].as_py()


def _differs(recorded: str, ours: str) -> str:
    """The first config.json key on which the recording's model and ours differ, as words."""
    a, b = json.loads(recorded), json.loads(ours)
    key = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
    if key is None:
        return "its config is not recorded"
    return f"{key} is {a.get(key, 'absent')!r} there, {b.get(key, 'absent')!r} here"
