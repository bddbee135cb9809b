"""Off-policy instruments (issue #29): which weights sampled each batch, alpha's lag, and the
rollout recording (grpo/recording.py, docs/offpolicy.md)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from grpo import recording
from grpo.metrics import LogConfig, group_key
from grpo.progress import Progress, alpha_lag
from grpo.recording import SCHEMA, batch_path, read_rollouts, record_batch
from grpo.rollout import Rollout
from test_missing_stats import config, rollout_of, row_of

# ---------------------------------------------------------------------------------------------
# the weights version of each sequence, and alpha's lag


def lags(S: int, M: int, v: int, i: int) -> list[tuple[int, int, int, int]]:
    """(stage, k, lag in pushes, lag in steps) of every optimizer step of a run, the progress moving
    as train.py's loop moves it (a push every v iterations, after step 0; i steps per batch)."""
    progress, out = Progress(), []
    for stage in range(S):
        for k in range(M):
            if k % v == 0 and progress.step > 0:
                progress = progress.after_push(progress.weights_version + 1, f"w/v{progress.weights_version + 1}")
            sampled = progress.weights_version  # what the server serves when the batch is sampled
            for it in range(i):
                progress = progress.after_step(finite=it != 1)  # a skipped step counts as a step
                pushes, steps = alpha_lag(progress, sampled, progress.step - it - 1)
                out.append((stage, k, pushes, steps))
    return out


@pytest.mark.parametrize("S,M,v,i", [(1, 6, 1, 1), (1, 6, 1, 3), (2, 5, 2, 2), (2, 6, 3, 1), (1, 4, 10, 2)])
def test_the_lag_in_steps_is_the_v_window_and_no_push_separates_a_batch_from_its_sampler(S, M, v, i):
    for stage, k, pushes, steps in lags(S, M, v, i):
        assert pushes == 0
        assert steps == (k % v) * i, (stage, k)  # a push starts every stage and every v-window
    if v == 1:
        assert {steps for *_, steps in lags(S, M, v, i)} == {0}  # on policy


def test_a_batch_sampled_before_a_push_lags_by_a_push_and_its_steps_are_unknown():
    progress = Progress(step=8).after_push(3, "w/v3")
    assert alpha_lag(progress, 3, 8) == (0, 0) and alpha_lag(progress, 3, 10) == (0, 2)
    assert alpha_lag(progress, 2, 10) == (1, None)  # only the newest push's step is kept


def test_progress_from_an_old_checkpoint_has_no_push_step_until_the_next_push():
    old = {"step": 6, "stage": 0, "iteration": 3, "weights_version": 1, "weights_dir": "w/v1", "nan_skips": 0}
    progress = Progress.from_json(old)
    assert progress.pushed_at_step is None and alpha_lag(progress, 1, 6) == (0, None)
    pushed = progress.after_push(2, "w/v2")
    assert pushed.pushed_at_step == 6 and alpha_lag(pushed, 2, 6) == (0, 0)
    assert Progress.from_json(json.loads(json.dumps(pushed.to_json()))) == pushed


def test_every_sequence_carries_the_version_that_sampled_it():
    cfg = config()
    rollout = rollout_of(cfg, version=3)
    assert {s.weights_version for s in rollout.samples} == {3} and rollout.weights_version == 3
    again = Rollout.from_json(json.loads(json.dumps(rollout.to_json())))
    assert again.weights_version == 3
    # a batch of the asynchronous sampler holds several versions: the batch's is its oldest
    again.samples[0].weights_version = 2
    assert again.versions == [2, 3] and again.weights_version == 2
    # a sequence that a push split (in-flight updates) carries its spans, through JSON too
    again.samples[1].version_spans = [[3, 0, 2], [4, 2, len(again.samples[1].completion_ids)]]
    back = Rollout.from_json(json.loads(json.dumps(again.to_json())))
    assert back.versions == [2, 3, 4] and back.samples[1].token_versions()[:3] == [3, 3, 4]
    assert "version_spans" not in back.samples[0].to_json()


def test_rows_carry_the_lag_under_bound():
    cfg = config()
    rollout = rollout_of(cfg, reward=lambda j: float(j % 2), version=2)
    pushed = Progress(step=4, weights_version=2, pushed_at_step=4)
    # the batch of iteration k = 2 of a v = 4, i = 2 window: 4 steps after the push; its second step
    row = row_of(cfg, rollout, progress=Progress(**{**pushed.to_json(), "step": 10}), sgd_iteration=1)
    assert row["alpha_lag_pushes"] == 0 and row["alpha_lag_steps"] == 4
    assert group_key("alpha_lag_steps") == "bound/alpha_lag_steps"
    assert group_key("alpha_lag_pushes") == "bound/alpha_lag_pushes"
    # unknown (a checkpoint from before the push step was saved): missing, not a made-up number
    row = row_of(cfg, rollout, progress=Progress(step=10, weights_version=2, pushed_at_step=None))
    assert row["alpha_lag_pushes"] == 0 and "alpha_lag_steps" not in row


# ---------------------------------------------------------------------------------------------
# rollout recording


# what the batches below were made with: a model and tokenizer of the recording's metadata
MADE_WITH = {"model": json.dumps({"model_type": "qwen2", "vocab_size": 64}), "tokenizer": "0" * 64}


def batch(seed: int = 5, version: int = 0):
    """A batch with signal (rewards alternate), a truncated sequence per group, log-probs that are
    not float32 numbers."""
    return rollout_of(config(B=3, G=4), reward=lambda j: float(j % 2), seed=seed, version=version)


def test_save_rollouts_is_off_by_default_and_a_bool():
    assert LogConfig().save_rollouts is False and LogConfig(save_rollouts=True).save_rollouts
    with pytest.raises(ValueError, match="save_rollouts"):
        LogConfig(save_rollouts="yes")


def test_a_recorded_batch_reads_back_as_exactly_its_samples(tmp_path):
    rollout = batch(seed=77, version=4)
    path = record_batch(tmp_path, 1, 12, 77, rollout, MADE_WITH)
    assert path == tmp_path / "rollouts" / "batch-s0001-k000012.parquet" == batch_path(tmp_path, 1, 12)
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA)
    # what the numbers mean travels with them: the format, the model and the tokenizer they were made with
    assert table.schema.metadata == {b"format": b"grpo-rollouts/4", **{k.encode(): v.encode() for k, v in MADE_WITH.items()}}
    rows = table.to_pylist()
    assert len(rows) == len(rollout.samples) == 12
    for row, s in zip(rows, rollout.samples):
        assert (row["stage"], row["iteration"], row["seed"], row["weights_version"]) == (1, 12, 77, 4)
        assert row["group"] == s.group and row["prompt_ids"] == s.prompt_ids and row["completion_ids"] == s.completion_ids
        # alpha's log-probs as the trainer computes with them (grpo.batching collates float32)
        assert np.array_equal(np.asarray(row["logp_alpha"], np.float32), np.asarray(s.logp_alpha, np.float32))
        assert (row["reward"], row["correct"], row["adv"], row["seq_weight"], row["truncated"]) == \
               (s.reward, s.correct, s.adv, s.seq_weight, s.truncated)
    assert table.column("logp_alpha").type.value_type == "float"  # float32
    assert any(s.truncated for s in rollout.samples) and any(not s.truncated for s in rollout.samples)
    [again] = read_rollouts(tmp_path)
    assert again.equals(table)


def test_a_killed_writer_leaves_a_temp_file_that_no_reader_sees_and_the_next_write_replaces(tmp_path, monkeypatch):
    record_batch(tmp_path, 0, 0, 1, batch(1), MADE_WITH)

    def killed(path):  # the process dies after writing the temporary file, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(recording, "fsync_file", killed)
    with pytest.raises(KeyboardInterrupt):
        record_batch(tmp_path, 0, 1, 2, batch(2), MADE_WITH)
    monkeypatch.undo()
    directory = tmp_path / "rollouts"
    tmp = directory / ".batch-s0000-k000001.parquet.tmp"
    assert tmp.is_file() and not batch_path(tmp_path, 0, 1).exists()
    tmp.write_bytes(tmp.read_bytes()[:100])  # and torn: not even a Parquet file
    assert [t.column("iteration")[0].as_py() for t in read_rollouts(tmp_path)] == [0]
    assert ds.dataset(directory, format="parquet").to_table().num_rows == 12  # a dataframe reader of the directory
    record_batch(tmp_path, 0, 1, 2, batch(2), MADE_WITH)
    assert not tmp.exists() and sorted(p.name for p in directory.iterdir()) == [
        "batch-s0000-k000000.parquet", "batch-s0000-k000001.parquet"]
    assert [t.column("seed")[0].as_py() for t in read_rollouts(tmp_path)] == [1, 2]


def test_a_resumed_run_rewrites_the_batches_after_its_checkpoint_without_duplicate_or_gap(tmp_path):
    seeds = {(s, k): 100 * s + k for s in range(2) for k in range(3)}
    for (s, k), seed in seeds.items():  # the first attempt reached stage 1, iteration 2, then died
        record_batch(tmp_path, s, k, seed, batch(seed), MADE_WITH)
    (tmp_path / "rollouts" / ".batch-s0001-k000002.parquet.tmp").write_bytes(b"torn")
    # resumed from a checkpoint before stage 0, iteration 2: that batch is sampled again (here from
    # other weights, as when the pushed weights were gone) and overwrites its file; what the first
    # attempt recorded past it is dropped, to be recorded again as the run reaches it
    record_batch(tmp_path, 0, 2, 999, batch(999, version=7), MADE_WITH)
    got = [(t.column("stage")[0].as_py(), t.column("iteration")[0].as_py(), t.column("seed")[0].as_py())
           for t in read_rollouts(tmp_path)]
    assert got == [(0, 0, 0), (0, 1, 1), (0, 2, 999)]
    assert not list((tmp_path / "rollouts").glob(".*"))
    for s, k in [(1, 0), (1, 1), (1, 2)]:
        record_batch(tmp_path, s, k, seeds[s, k], batch(seeds[s, k]), MADE_WITH)
    batches = read_rollouts(tmp_path)
    keys = [(t.column("stage")[0].as_py(), t.column("iteration")[0].as_py()) for t in batches]
    assert keys == sorted(seeds) and len(set(keys)) == len(keys)
    assert batches[2].column("weights_version").to_pylist() == [7] * 12
    assert read_rollouts(tmp_path / "no-such-run") == []


def test_a_sequence_split_by_a_push_is_recorded_with_its_spans_and_replayed_per_token(tmp_path):
    """In-flight updates (rollout.inflight_updates): a sequence that a push split carries its version
    spans; format 4 records them (before, record_batch refused such a batch: "cannot be recorded in
    grpo-rollouts/3"), and the replay's rollout (train.py --replay, scripts/compare_objectives.py)
    gives each token its own version again. The other sequences record no spans."""
    rollout = batch(seed=9, version=4)
    split = rollout.samples[5]
    n = len(split.completion_ids)
    split.version_spans = [[4, 0, 2], [5, 2, n]]
    record_batch(tmp_path, 0, 3, 9, rollout, MADE_WITH)
    spans = pq.read_table(batch_path(tmp_path, 0, 3)).column("version_spans").to_pylist()
    assert spans[5] == [[4, 0, 2], [5, 2, n]] and all(s == [] for j, s in enumerate(spans) if j != 5)
    stream = recording.RecordedStream(tmp_path)
    stream.check_batches([(0, 3)], config(B=3, G=4), MADE_WITH, None)
    again = stream.rollout(0, 3, config(B=3, G=4))
    assert again.samples[5].token_versions() == [4, 4] + [5] * (n - 2) and again.versions == [4, 5]
    assert all(s.version_spans is None for j, s in enumerate(again.samples) if j != 5)


def test_a_recording_of_format_3_reads_as_sequences_of_one_version(tmp_path):
    """Files written before format 4 have no version_spans column: they pass the checks and replay as
    before, every token of a sequence its weights_version's."""
    record_batch(tmp_path, 0, 0, 5, batch(seed=5, version=2), MADE_WITH)
    path = batch_path(tmp_path, 0, 0)
    table = pq.read_table(path).drop_columns(["version_spans"])
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"format": b"grpo-rollouts/3"}), path)
    stream = recording.RecordedStream(tmp_path)
    stream.check_batches([(0, 0)], config(B=3, G=4), MADE_WITH, None)
    again = stream.rollout(0, 0, config(B=3, G=4))
    assert again.versions == [2] and all(s.version_spans is None for s in again.samples)
