"""A non-finite gradient: the optimizer step is skipped and counted, the run goes on, a resume across
the skipped step is exact, and more than optim.max_consecutive_skips of them in a row stop the run
with one line naming the key.

The fault is real, not injected: a recorded batch (train.py --replay, no server) whose sampler gave
one token a log-prob of -200, a finite log-prob the replay accepts. The importance weight pi_k/alpha
= exp(logp_k + 200) overflows float32, and so does the gradient of eq. 6 under the exact ratio
anchor. One process, the tiny model, four replayed batches.
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

from grpo.progress import Progress
from grpo.recording import batch_path
from test_replay_validation import record_stream
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


def overflowing(run_dir: Path, model_dir: Path, bad: tuple[int, ...]) -> Path:
    """Four recorded batches (they share their token ids: only rewards and seeds differ), the
    iterations in `bad` with one token's recorded log-prob at -200."""
    record_stream(run_dir, model_dir, M=4)
    for k in bad:
        path = batch_path(run_dir, 0, k)
        table = pq.read_table(path)
        logps = table.column("logp_alpha").to_pylist()
        logps[0][0] = -200.0
        column = pa.array(logps, table.column("logp_alpha").type)
        pq.write_table(table.set_column(table.column_names.index("logp_alpha"), "logp_alpha", column), path)
    return run_dir


def replay(model_dir: Path, recorded: Path, out: Path, name: str, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
           f"model.path={model_dir}", f"log.out_dir={out}", f"log.run_name={name}", "--replay", str(recorded),
           "grpo.S=1", "grpo.M=4", "grpo.i=1", "checkpoint.every=1", "checkpoint.keep_last=4", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_the_streak_counts_skips_in_a_row_and_survives_a_checkpoint():
    progress = Progress()
    for finite in (True, False, False, True, False):
        progress = progress.after_step(finite)
    assert (progress.step, progress.nan_skips, progress.nan_streak) == (5, 3, 1)
    assert Progress.from_json(json.loads(json.dumps(progress.to_json()))) == progress
    assert Progress.from_json({"step": 4, "nan_skips": 2}).nan_streak == 0  # a checkpoint from before the streak


def test_a_skipped_step_is_counted_the_run_goes_on_and_a_resume_across_it_is_exact(model_dir, tmp_path):
    recorded = overflowing(tmp_path / "recorded", model_dir, bad=(1,))
    full = replay(model_dir, recorded, tmp_path, "full")
    assert full.returncode == 0, full.stderr[-4000:]
    a = steps(tmp_path / "full")
    assert sorted(a) == [1, 2, 3, 4]
    assert [a[s]["nan_skips"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert not (a[2]["grad_norm"] < float("inf")) and all(a[s]["grad_norm"] < float("inf") for s in (1, 3, 4))
    # the batches share their tokens, so KL(pi || pi_ref) on them reads the policy: step 3 sees the
    # one step 2 saw (the skipped step left it as it was), step 4 one that moved again
    assert a[3]["kl"] == a[2]["kl"] != a[4]["kl"]
    assert a[2]["lr"] == a[3]["lr"]  # (a constant schedule here; it advances over the skip either way)
    assert (tmp_path / "full" / "final" / "model.safetensors").is_file()

    # killed after step 1's checkpoint: the resumed run takes the skipped step again and repeats the rest
    shutil.copytree(tmp_path / "full", tmp_path / "crash", symlinks=True)
    for name in ("step_2", "step_3", "step_4"):
        shutil.rmtree(tmp_path / "crash" / "checkpoints" / name)
    shutil.rmtree(tmp_path / "crash" / "final")
    resumed = replay(model_dir, recorded, tmp_path, "crash", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    b = steps(tmp_path / "crash")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (2, 3, 4):
        for key in ("loss", "kl", "grad_norm", "entropy", "nan_skips", "lr", "clip_frac"):
            assert json.dumps(b[step][key]) == json.dumps(a[step][key]), (step, key)  # bit for bit, nan included


def test_more_skips_in_a_row_than_the_bound_stop_the_run_with_one_line(model_dir, tmp_path):
    recorded = overflowing(tmp_path / "recorded", model_dir, bad=(1, 2))
    proc = replay(model_dir, recorded, tmp_path, "stuck", "optim.max_consecutive_skips=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "wandb" not in line]
    assert errors == ["[train] error: 2 optimizer steps in a row (steps 2-3) had a non-finite gradient, more than "
                      "optim.max_consecutive_skips=1; stopped (--resume continues from the last checkpoint)"], errors
    rows = steps(tmp_path / "stuck")
    assert sorted(rows) == [1, 2, 3] and rows[3]["nan_skips"] == 2
    assert not (tmp_path / "stuck" / "final").exists()
