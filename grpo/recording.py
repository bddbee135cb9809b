"""Rollout recording: every batch as it was trained on, one Parquet file per batch.

    log.save_rollouts: true   ->   runs/<name>/rollouts/batch-s0000-k000012.parquet   (stage 0, iteration 12)
    batches = read_rollouts("runs/<name>")        # pyarrow Tables in (stage, iteration) order

A row per sampled sequence: the prompt and completion token ids, alpha's per-token log-probs (the
float32 the trainer computes with), reward, correctness, advantage, eq. 8 / RED weight, the
batch's stage, iteration, seed and weights version, and the version spans of a sequence that a
push split (in-flight updates: which version sampled which of its tokens; empty for the others)
(the columns are SCHEMA; docs/offpolicy.md). Files of format 3, which has no spans, read as
sequences of one version each.
Any dataframe library reads the files one by one or the directory as one dataset. Each file's
schema metadata says what its numbers mean: the format, the model they were made with (its
config.json) and the tokenizer's vocabulary (a sha256 of its token -> id map): `model_and_tokenizer`;
and the fingerprint of the weights that sampled it (`sampled_by`: per tensor, grpo/serving/
fingerprint.py's moments of the weights version as served), which a replay checks against the
weights it starts from (version 0: the model directory; `RecordedStream.check`).

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
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo.fsutil import fsync_dir, fsync_file, no_space, preallocate

ROLLOUTS_DIR = "rollouts"
# In each file's schema metadata; bumped when a column changes meaning or the metadata what it
# holds (2: the model and tokenizer the batch was made with; 3: the weights that sampled it; 4: the
# version spans of sequences sampled by several versions).
FORMAT = "grpo-rollouts/4"
SPANLESS = "grpo-rollouts/3"  # no version_spans column: every sequence sampled by its weights_version alone
UNWEIGHED = "grpo-rollouts/2"  # replayed only where the weights are not checked (replay_other_weights)
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
    # [[version, start, end], ...] over the completion tokens where a push swapped the weights while the
    # sequence was sampled (in-flight updates), each range sampled by that version; [] where weights_version
    # sampled every token (the first span's version is weights_version)
    ("version_spans", _list(_list(pa.int32()))),
], metadata={"format": FORMAT})
ADDED_IN_FORMAT_4 = ("version_spans",)  # absent from format 3 (and 2) files, which read as having none


def model_and_tokenizer(model_dir: str | os.PathLike, tokenizer) -> dict[str, str]:
    """What a recorded batch's token ids and log-probs mean, as its schema metadata: the model
    (its config.json, less names, versions and dtype) and the tokenizer (sha256 of its token -> id
    map, added tokens included). A replay refuses a recording whose model or tokenizer differ."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = {k: v for k, v in sorted(config.items()) if k not in _NOT_THE_MODEL}
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return {"model": json.dumps(model, separators=(",", ":")), "tokenizer": hashlib.sha256(vocab.encode()).hexdigest()}


def weights_fingerprint(weights_dir: str | os.PathLike) -> dict[str, list]:
    """{tensor name: [numel, sum, sum of squares]} of the weights in a directory (its *.safetensors,
    else *.bin): a model directory, or a push's weights directory. The moments are those the server's
    push check uses (grpo.serving.fingerprint.tensor_moments), of the values as stored, so the same
    weights in another file layout or a wider dtype give the same numbers; the lm_head its
    config.json ties to the embedding is left out, as a push leaves it out."""
    import torch
    from safetensors import safe_open

    from grpo.models import LM_HEAD_KEY, ties_word_embeddings
    from grpo.serving.fingerprint import tensor_moments

    config_path = Path(weights_dir) / "config.json"
    tied = ties_word_embeddings(json.loads(config_path.read_text()) if config_path.is_file() else {})
    moments: dict[str, list] = {}
    index = Path(weights_dir) / "model.safetensors.index.json"  # a sharded model: its shards, not stray files
    files = sorted({Path(weights_dir) / f for f in json.loads(index.read_text())["weight_map"].values()}
                   if index.is_file() else Path(weights_dir).glob("*.safetensors"))
    for file in files:  # a tensor at a time: a large model is never in memory whole
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if not (tied and name == LM_HEAD_KEY):
                    moments[name] = list(tensor_moments(f.get_tensor(name)))
    for file in [] if files else sorted(Path(weights_dir).glob("*.bin")):
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True, mmap=True).items():
            if not (tied and name == LM_HEAD_KEY):
                moments[name] = list(tensor_moments(tensor))
    if not moments:
        raise ReplayError(f"{weights_dir}: no weights (*.safetensors or *.bin) to fingerprint")
    return dict(sorted(moments.items()))


def sampled_by(version: int, fingerprint: dict[str, list]) -> dict[str, str]:
    """A batch's metadata entry for the weights version that sampled it (merged into `made_with`)."""
    return {"weights": json.dumps({"version": version, "moments": fingerprint}, separators=(",", ":"))}


def recorded_weights(path: str | os.PathLike) -> dict[str, str]:
    """The `sampled_by` entry of a recorded batch ({} when it has none: format grpo-rollouts/2)."""
    meta = pq.read_schema(path).metadata or {}
    return {"weights": meta[b"weights"].decode()} if b"weights" in meta else {}


def weights_differ(recorded: dict[str, list], ours: dict[str, list], limit: int = 3) -> list[str]:
    """The tensors whose moments differ between two weights_fingerprint results by more than a
    summation order explains (grpo.serving.fingerprint.moment_tolerances), or that one lacks."""
    from grpo.serving.fingerprint import moment_tolerances

    bad = sorted(set(recorded) ^ set(ours))
    for name in sorted(set(recorded) & set(ours)):
        (n_r, s_r, q_r), (n_o, s_o, q_o) = recorded[name], ours[name]
        tol_s, tol_q = moment_tolerances(int(n_o), s_o, q_o)
        if n_r != n_o or abs(s_r - s_o) > tol_s or abs(q_r - q_o) > tol_q:
            bad.append(name)
    return bad[:limit] + ([f"{len(bad) - limit} more"] if len(bad) > limit else [])


def batch_path(run_dir: str | os.PathLike, stage: int, iteration: int) -> Path:
    """Where batch (stage, iteration) is recorded; the names sort in training order."""
    return Path(run_dir) / ROLLOUTS_DIR / f"batch-s{stage:04d}-k{iteration:06d}.parquet"


def batch_table(stage: int, iteration: int, seed: int, rollout, made_with: dict[str, str]) -> pa.Table:
    """A grpo.rollout.Rollout as a table of SCHEMA, a row per sequence in the batch's order, its
    metadata saying what it was made with (`model_and_tokenizer`, and `sampled_by` its weights)."""
    samples = rollout.samples
    n = len(samples)
    columns = {
        "stage": [stage] * n, "iteration": [iteration] * n, "seed": [seed] * n,
        "weights_version": [s.weights_version for s in samples], "group": [s.group for s in samples],
        "prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
        "logp_alpha": [s.logp_alpha for s in samples], "reward": [s.reward for s in samples],
        "correct": [s.correct for s in samples], "adv": [s.adv for s in samples],
        "seq_weight": [s.seq_weight for s in samples], "truncated": [s.truncated for s in samples],
        "version_spans": [s.version_spans or [] for s in samples],
    }
    schema = SCHEMA.with_metadata({**SCHEMA.metadata, **{k.encode(): v.encode() for k, v in made_with.items()}})
    return pa.Table.from_pydict(columns, schema=schema)


def record_batch(run_dir: str | os.PathLike, stage: int, iteration: int, seed: int, rollout,
                 made_with: dict[str, str]) -> Path:
    """Write batch (stage, iteration) atomically and durably (rank 0, before training on it); drop
    what an earlier attempt of the run recorded past it. `made_with`: the model and tokenizer it was
    made with (`model_and_tokenizer`) and the weights that sampled it (`sampled_by`). Returns the file. A full disk raises grpo.fsutil.NoSpaceError
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

    def check(self, cfg, made_with: dict[str, str], starts_from: Optional[dict[str, list]]) -> None:
        """Refuse, before the first step, a stream that cannot stand in for the sampler under `cfg`
        (a TrainConfig): a batch of the schedule missing, or one whose file is not a readable
        recording of this format, was made with another model or tokenizer (`made_with`: this
        run's, from `model_and_tokenizer`), was sampled from the model directory (version 0) by
        other weights than `starts_from` (weights_fingerprint of model.path, the replay's pi_theta_0;
        None: not checked, replay_other_weights), has a column missing, of another type or with
        nulls, log-probs that are not one finite number per completion token, a token id outside
        the model's vocabulary, non-finite rewards, or another batch shape than grpo.batch_prompts x
        grpo.G. Raises ReplayError naming the file (and row)."""
        self.check_covers(cfg.grpo.S, cfg.grpo.M)
        self.check_batches([(s, k) for s in range(cfg.grpo.S) for k in range(cfg.grpo.M)], cfg, made_with,
                           starts_from)

    def check_batches(self, keys, cfg, made_with: dict[str, str], starts_from: Optional[dict[str, list]]) -> None:
        """`check` of the recorded batches `keys` ((stage, iteration) pairs) alone."""
        config = json.loads(made_with["model"])
        vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 2**31
        for key in keys:
            path = self.files[key]
            try:
                check_batch(path, key, cfg.grpo.batch_prompts, cfg.grpo.G, made_with, vocab_size, starts_from)
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
                          weights_version=r["weights_version"], version_spans=r.get("version_spans") or None)
                   for j, r in enumerate(rows)]
        stats = {**adv_stats, **batch_stats(samples), "reward_timeouts": 0.0, "time_generate": 0.0,
                 "time_reward": 0.0, "engine": {}}
        return Rollout(samples, stats)


def check_batch(path: Path, key: tuple[int, int], batch_prompts: int, G: int, made_with: dict[str, str],
                vocab_size: int, starts_from: Optional[dict[str, list]]) -> None:
    """One recorded file against the format, the model and tokenizer of `made_with`, the weights
    `starts_from` (when sampled by version 0), SCHEMA, the batch shape, the vocabulary and
    finiteness (RecordedStream.check). Raises ReplayError saying what (and which row), without the
    file's name."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ReplayError(f"not a readable Parquet file ({' '.join(str(e).split())})") from None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    found = meta.get("format")
    if found == UNWEIGHED and starts_from is not None:
        raise ReplayError(f"format {found}, which does not record the weights that sampled it, so they cannot be "
                          f"checked against model.path's; replay_other_weights=true replays it without that check")
    if found not in (FORMAT, SPANLESS, UNWEIGHED):
        why = ("no format in its metadata (not written by log.save_rollouts)" if found is None else
               f"format {found}, which does not record the model and tokenizer it was made with"
               if found == "grpo-rollouts/1" else f"unknown format {found}")
        raise ReplayError(f"{why}; this version replays {FORMAT} (and {SPANLESS})")
    if meta.get("model") != made_with["model"]:
        differs = _differs(meta.get("model", "{}"), made_with["model"])
        raise ReplayError(f"made with another model than model.path: {differs}")
    if meta.get("tokenizer") != made_with["tokenizer"]:
        raise ReplayError(f"made with another tokenizer than model.path's (vocabulary sha256 "
                          f"{meta.get('tokenizer', 'absent')[:12]} there, {made_with['tokenizer'][:12]} here)")
    col = {}
    for field in SCHEMA:
        if field.name in ADDED_IN_FORMAT_4 and found != FORMAT:
            continue  # an older format: none recorded (every sequence of one version)
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
    spans = col.get("version_spans")
    if spans is not None:
        _check_spans(spans, col["weights_version"], lengths[1])
    if starts_from is not None and pc.max(col["weights_version"]).as_py() == 0:
        _check_starting_weights(meta.get("weights"), starts_from)


def _check_spans(spans: pa.Array, versions: pa.Array, lengths: pa.Array) -> None:
    """Each row's version spans, where it has any: [version, start, end] triples that tile its
    completion tokens in order, from weights_version on, each version newer than the one before."""
    for row in pc.indices_nonzero(pc.greater(pc.list_value_length(spans), 0)).to_pylist():
        triples, n = spans[row].as_py(), lengths[row].as_py()
        where = f"row {row}: version_spans {triples}"
        if any(len(t) != 3 for t in triples):
            raise ReplayError(f"{where}: each span is [version, start, end]")
        if triples[0][0] != versions[row].as_py():
            raise ReplayError(f"{where}: the first span's version is not weights_version {versions[row].as_py()}")
        ends = [0] + [end for _, _, end in triples]
        if [start for _, start, _ in triples] != ends[:-1] or ends[-1] != n or any(
                start >= end for _, start, end in triples):
            raise ReplayError(f"{where}: the spans do not tile the {n} completion tokens in order")
        if any(b[0] <= a[0] for a, b in zip(triples, triples[1:])):
            raise ReplayError(f"{where}: each span's version must be newer than the one before")


def _check_starting_weights(recorded: Optional[str], starts_from: dict[str, list]) -> None:
    """A batch sampled from the recording run's model directory (version 0) was sampled by the
    weights the replay starts from: else its log-probs of alpha are another model's, and every
    ratio pi_theta / alpha with them (nothing else would show it but kl_pik_alpha far from 0)."""
    weights = json.loads(recorded) if recorded else None
    if not isinstance(weights, dict) or weights.get("version") != 0 or not isinstance(weights.get("moments"), dict):
        raise ReplayError("its metadata holds no fingerprint of the weights (version 0) that sampled it; "
                          "replay_other_weights=true replays it without that check")
    differ = weights_differ(weights["moments"], starts_from)
    if differ:
        raise ReplayError(f"sampled by other weights than model.path's, which the replay starts from ({', '.join(differ)} "
                          f"differ): a model of the same config but other values (another seed, a fine-tune); "
                          f"replay_other_weights=true replays it on these weights anyway")


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
