"""`train.py --replay` checks a recording before the first step (grpo/recording.py, RecordedStream.check):
a file that is not a readable recording of this format, made with another model or tokenizer,
sampled by other weights than model.path's (a same-config model of another seed), with a column
missing or mistyped, log-probs that are not one finite number per completion token, a token id
outside the vocabulary or another G is refused with one line naming the file, exit 2;
replay_other_weights=true replays a recording of other weights on purpose.

Before, each was read inside the training loop: a traceback after training the batches before it,
or (another model, other weights, a NaN log-prob, an unknown format) a run that trained silently
and exited 0.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.models import load_tokenizer
from grpo.recording import (RecordedStream, ReplayError, batch_path, model_and_tokenizer, record_batch, sampled_by,
                            weights_differ, weights_fingerprint)
from test_missing_stats import config, rollout_of
from tiny_models import make_tiny_model_dir, make_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
BAD = (0, 1)  # the batch each case spoils: the one after a batch a run would train on first


def record_stream(run_dir: Path, model_dir: Path, made_with=None, M: int = 2, G: int = 8, B: int = 2) -> Path:
    """M batches of B prompts x G completions recorded as a run of `model_dir` records them (sampled by
    version 0, its weights), with rewards that give every group a learning signal (the tiny model's
    vocabulary holds every id)."""
    made_with = made_with or {**model_and_tokenizer(model_dir, load_tokenizer(model_dir)),
                              **sampled_by(0, weights_fingerprint(model_dir))}
    cfg = config(B=B, G=G)
    for k in range(M):
        record_batch(run_dir, 0, k, 10 + k, rollout_of(cfg, reward=lambda j: float((j + k) % 3 == 0), seed=10 + k),
                     made_with)
    return run_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory):
    """The same architecture and config as model_dir, other weights (another seed)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-seed1") / "qwen2", arch="qwen2", seed=1)


def _check(run: Path, cfg, model_dir: Path, other_weights: bool = False) -> None:
    """RecordedStream.check as train.py's start-up calls it with model.path = model_dir."""
    RecordedStream(run).check(cfg, model_and_tokenizer(model_dir, load_tokenizer(model_dir)),
                              None if other_weights else weights_fingerprint(model_dir))


@pytest.fixture(scope="module")
def good(model_dir, tmp_path_factory):
    return record_stream(tmp_path_factory.mktemp("recorded") / "run", model_dir)


def _rewrite(path: Path, change) -> None:
    pq.write_table(change(pq.read_table(path)), path)


def _with_metadata(**meta):
    def change(table):
        kept = {k: v for k, v in (table.schema.metadata or {}).items() if k.decode() not in meta}
        return table.replace_schema_metadata({**kept, **{k.encode(): v.encode() for k, v in meta.items() if v}})
    return change


def _set_row(column: str, row: int, value):
    def change(table):
        values = table.column(column).to_pylist()
        values[row] = value(values[row])
        return table.set_column(table.column_names.index(column), column, pa.array(values, table.column(column).type))
    return change


def _spoil(case: str, path: Path, model_dir: Path, vocab: int) -> None:
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "garbage":
        path.write_bytes(os.urandom(3000))
    elif case == "no logp_alpha":
        _rewrite(path, lambda t: t.drop_columns(["logp_alpha"]))
    elif case == "logp_alpha as float64":
        _rewrite(path, lambda t: t.set_column(t.column_names.index("logp_alpha"), "logp_alpha",
                                              t.column("logp_alpha").cast(pa.list_(pa.float64()))))
    elif case == "logp_alpha one short":
        _rewrite(path, _set_row("logp_alpha", 3, lambda lp: lp[:-1]))
    elif case == "nan logp_alpha":
        _rewrite(path, _set_row("logp_alpha", 2, lambda lp: [float("nan")] + lp[1:]))
    elif case == "null reward":
        _rewrite(path, _set_row("reward", 5, lambda r: None))
    elif case == "token outside the vocabulary":
        _rewrite(path, _set_row("completion_ids", 4, lambda ids: ids[:-1] + [vocab]))
    elif case == "groups interleaved":  # rows 1 and 8 swapped: each group's 8 rows are no longer consecutive
        _rewrite(path, lambda t: t.take([0, 8, *range(2, 8), 1, *range(9, t.num_rows)]))
    elif case == "spans not tiling":  # a sequence split by a push whose spans leave a token out
        _rewrite(path, _set_row("version_spans", 6, lambda _: [[0, 0, 1], [1, 2, 8]]))
    elif case == "spans from another version":
        _rewrite(path, _set_row("version_spans", 6, lambda _: [[3, 0, 1], [4, 1, 8]]))
    elif case == "spans going back":
        _rewrite(path, _set_row("version_spans", 6, lambda _: [[0, 0, 1], [0, 1, 8]]))
    elif case == "unknown format":
        _rewrite(path, _with_metadata(format="grpo-rollouts/9"))
    elif case == "format 1":
        _rewrite(path, _with_metadata(format="grpo-rollouts/1", model=None, tokenizer=None))
    elif case == "format 2":
        _rewrite(path, _with_metadata(format="grpo-rollouts/2", weights=None))
    elif case == "no weights":
        _rewrite(path, _with_metadata(weights=None))
    elif case == "other weights":  # the same config and tokenizer, another seed's values
        other = make_tiny_model_dir(path.parent.parent / "seed_7", arch="qwen2", seed=7)
        _rewrite(path, _with_metadata(**sampled_by(0, weights_fingerprint(other))))
    elif case == "another model":
        other = make_tiny_model_dir(path.parent.parent / "other_model", hidden_size=64, num_heads=2, num_kv_heads=1)
        _rewrite(path, _with_metadata(**model_and_tokenizer(other, load_tokenizer(other))))
    elif case == "another tokenizer":
        mine = model_and_tokenizer(model_dir, make_tiny_tokenizer(vocab_size=400))
        _rewrite(path, _with_metadata(tokenizer=mine["tokenizer"]))
    else:
        raise AssertionError(case)


# what the one line names, after the file
CASES = {
    "truncated": "not a readable Parquet file",
    "empty": "not a readable Parquet file",
    "garbage": "not a readable Parquet file",
    "no logp_alpha": "no column logp_alpha",
    "logp_alpha as float64": "column logp_alpha is list<element: double>, expected list<element: float>",
    "logp_alpha one short": "row 3: logp_alpha has 4 values for 5 completion tokens",
    "nan logp_alpha": "row 2: logp_alpha holds nan, not a finite log-prob",
    "null reward": "row 5: reward is null",
    "token outside the vocabulary": "row 4: completion_ids holds token id 454, outside the model's vocabulary [0, 454)",
    "groups interleaved": "row 1: a group's 8 sequences are not consecutive rows",
    "spans not tiling": "row 6: version_spans [[0, 0, 1], [1, 2, 8]]: the spans do not tile the 8 completion "
                        "tokens in order",
    "spans from another version": "row 6: version_spans [[3, 0, 1], [4, 1, 8]]: the first span's version is not "
                                  "weights_version 0",
    "spans going back": "row 6: version_spans [[0, 0, 1], [0, 1, 8]]: each span's version must be newer than the one "
                        "before",
    "unknown format": "unknown format grpo-rollouts/9; this version replays grpo-rollouts/4 (and grpo-rollouts/3)",
    "format 1": "format grpo-rollouts/1, which does not record the model and tokenizer",
    "format 2": "format grpo-rollouts/2, which does not record the weights that sampled it, so they cannot be "
                "checked against model.path's; replay_other_weights=true replays it without that check",
    "no weights": "its metadata holds no fingerprint of the weights (version 0) that sampled it; "
                  "replay_other_weights=true",
    "other weights": "sampled by other weights than model.path's, which the replay starts from (lm_head.weight, "
                     "model.embed_tokens.weight, model.layers.0.mlp.down_proj.weight, 13 more differ)",
    "another model": "made with another model than model.path: hidden_size is 64 there, 128 here",
    "another tokenizer": "made with another tokenizer than model.path's",
}


def _spoiled(case: str, good: Path, model_dir: Path, tmp_path: Path) -> Path:
    run = tmp_path / "recorded"
    shutil.copytree(good, run)
    _spoil(case, batch_path(run, *BAD), model_dir, len(load_tokenizer(model_dir)))
    return run


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_spoiled_recording_is_refused_naming_file_and_row(case, good, model_dir, tmp_path):
    run = _spoiled(case, good, model_dir, tmp_path)
    cfg = config(B=2, G=8)
    cfg.grpo.S, cfg.grpo.M = 1, 2
    with pytest.raises(ReplayError) as e:
        _check(run, cfg, model_dir)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--replay {run}: {batch_path(run, *BAD).name}: "), line
    assert CASES[case] in line, line


def test_the_recording_as_written_passes_and_another_batch_shape_is_refused(good, model_dir):
    made_with = model_and_tokenizer(model_dir, load_tokenizer(model_dir))
    weights = weights_fingerprint(model_dir)
    cfg = config(B=2, G=8)
    cfg.grpo.S, cfg.grpo.M = 1, 2
    RecordedStream(good).check(cfg, made_with, weights)  # the writer's own output passes every check
    for B, G, expected in ((2, 4, "16 sequences in 2 groups of 8; the config's batch is grpo.batch_prompts=2 x grpo.G=4"),
                           (4, 4, "16 sequences in 2 groups of 8; the config's batch is grpo.batch_prompts=4 x grpo.G=4"),
                           (1, 8, "16 sequences in 2 groups of 8; the config's batch is grpo.batch_prompts=1 x grpo.G=8")):
        other = config(B=B, G=G)
        other.grpo.S, other.grpo.M = 1, 2
        with pytest.raises(ReplayError, match="batch-s0000-k000000.parquet: " + expected.replace("[", r"\[")):
            RecordedStream(good).check(other, made_with, weights)


def test_a_recording_of_other_weights_is_refused_unless_told(good, model_dir, other_seed):
    """A recording carries the fingerprint of the weights that sampled each batch. Replayed with
    model.path = a model of the same config and tokenizer but another seed, its version-0 batches were
    sampled by other weights than the replay starts from: refused, naming the tensors that differ
    (before, it trained silently with alpha another model's, kl_pik_alpha 0.78 instead of 0).
    replay_other_weights (starts_from None) replays it; the recording's own weights pass."""
    cfg = config(B=2, G=8)
    cfg.grpo.S, cfg.grpo.M = 1, 2
    with pytest.raises(ReplayError, match=r"batch-s0000-k000000.parquet: sampled by other weights than model.path's, "
                                          r"which the replay starts from \(lm_head.weight, .* more differ\)"):
        _check(good, cfg, other_seed)
    _check(good, cfg, other_seed, other_weights=True)
    _check(good, cfg, model_dir)


def test_the_weights_fingerprint_is_of_the_values_not_of_the_files(model_dir, tmp_path):
    """The same weights in another file layout (two shards, another order) and a wider dtype give the
    same fingerprint; one value of one tensor moved by 1e-3 moves it, named (the tolerance is the
    summation order's, grpo.serving.fingerprint.moment_tolerances: 2e-4 on this tensor's sum)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    save_file({n: tensors[n].double() for n in names[::2]}, copy / "model-00002-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, copy / "model-00001-of-00002.safetensors")
    ours = weights_fingerprint(model_dir)
    assert weights_differ(weights_fingerprint(copy), ours) == []
    nudged = dict(tensors)
    nudged[names[3]] = tensors[names[3]].clone()
    nudged[names[3]].view(-1)[7] += 1e-3
    save_file(nudged, copy / "model-00001-of-00002.safetensors")
    (copy / "model-00002-of-00002.safetensors").unlink()
    assert weights_differ(weights_fingerprint(copy), ours) == [names[3]]


@pytest.mark.torchrun
def test_train_replays_other_weights_only_when_told(good, other_seed, tmp_path):
    """Through train.py (a process each, side by side): --replay of a recording sampled by model_dir's
    weights, with model.path a same-config model of another seed, is one line naming the file, exit 2,
    no step taken; with replay_other_weights=true it trains on every batch. Before: it trained silently."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
           f"model.path={other_seed}", f"log.out_dir={tmp_path / 'runs'}", "grpo.S=1", "grpo.M=2", "checkpoint.every=0",
           "--replay", str(good)]
    procs = {told: subprocess.Popen([*cmd, f"log.run_name=told_{str(told).lower()}", f"replay_other_weights={str(told).lower()}"],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for told in (False, True)}
    errs = {told: proc.communicate(timeout=900)[1] for told, proc in procs.items()}
    outcomes = {told: (procs[told].returncode, err) for told, err in errs.items()}
    code, err = outcomes[False]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, f"exit {code}\n{err[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith(f"config error: --replay {good}: batch-s0000-k000000.parquet: "
                                                   f"sampled by other weights than model.path's"), lines
    assert "replay_other_weights=true" in lines[0]
    assert not (tmp_path / "runs" / "told_false" / "metrics.jsonl").exists()
    code, err = outcomes[True]
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "told_true" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["iteration"]) for r in rows if "loss" in r] == [(0, 0), (0, 0), (0, 1), (0, 1)]  # i = 2


@pytest.mark.torchrun
def test_train_refuses_a_spoiled_recording_before_the_first_step(good, model_dir, tmp_path):
    """Through train.py itself (a process each, side by side): one line naming the file, exit 2, no
    step logged. Before: another model's recording trained and exited 0, and a truncated file ended
    in a traceback after training the first batch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    procs = {}
    for case in ("another model", "truncated"):
        run = _spoiled(case, good, model_dir, tmp_path / case.replace(" ", "_"))
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
               f"model.path={model_dir}", f"log.out_dir={tmp_path / 'runs'}", f"log.run_name=r{len(procs)}",
               "grpo.S=1", "grpo.M=2", "--replay", str(run)]
        procs[case] = (run, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True))
    for case, (run, proc) in procs.items():
        _, err = proc.communicate(timeout=600)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in err, f"{case}: exit {proc.returncode}\n{err[-3000:]}"
        assert len(lines) == 1 and lines[0].startswith(f"config error: --replay {run}: batch-s0000-k000001.parquet: ")
        assert CASES[case] in lines[0], lines[0]
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl"))  # refused before any step


def test_train_check_runs_the_same_checks(good, model_dir, tmp_path, capsys):
    """`train.py --check --replay` (the dry run, grpo/preflight.py) refuses what the replay would."""
    import train

    run = _spoiled("nan logp_alpha", good, model_dir, tmp_path)
    argv = ["--check", "--config", str(ROOT / "configs/tiny_test.yaml"), f"model.path={model_dir}", "grpo.S=1",
            "grpo.M=2"]
    for replayed, code, line in ((good, 0, f"ok    replay: {good} holds every batch"),
                                 (run, 2, f"FAIL  replay: --replay {run}: batch-s0000-k000001.parquet: "
                                          f"{CASES['nan logp_alpha']}")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            train.main([*argv, "--replay", str(replayed)])
        out = capsys.readouterr().out
        assert exit_.value.code == code and any(row.startswith(line) for row in out.splitlines()), out
