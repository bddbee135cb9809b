"""A full disk, made real: a small tmpfs mounted for the test (where this machine lets the test
mount one; else the tests are skipped, saying so). ENOSPC while writing a push, a recorded batch or
a checkpoint stops the write with one line naming the path and the space it needed, and leaves
what was written before as it was; after space is freed, `--resume` continues exactly.

Before: a push into a full tmpfs killed the trainer with SIGBUS (its memory-mapped copy), a
recorded batch or a checkpoint ended in a traceback (DCP's says only "unexpected pos").
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.checkpoint import verify_checkpoint
from grpo.fsutil import NoSpaceError
from grpo.recording import ROLLOUTS_DIR, read_rollouts, record_batch
from test_missing_stats import config, rollout_of
from test_recording import MADE_WITH
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent


class SmallDisk:
    """A tmpfs of `size` mounted at `path` for one test; remount() gives it another size."""

    def __init__(self, path: Path):
        self.path = path
        self.mounted = False

    def mount(self, size: int) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"this machine does not let the test mount a small tmpfs ({proc.stderr.strip()})")
        self.mounted = True
        return self.path

    def remount(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "--lazy", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disk = SmallDisk(tmp_path / "small")
    yield disk
    disk.unmount()


@pytest.mark.torchrun
def test_a_push_into_a_full_root_is_one_error_and_leaves_the_root_as_it_was(small_disk, tmp_path):
    """The writer memory-maps the weights file and copies into it: on a full tmpfs that copy was
    a SIGBUS that killed the trainer. Its space is now reserved first. A child process writes, so
    a SIGBUS before the fix fails this test instead of killing pytest."""
    model = make_tiny_model_dir(tmp_path / "tiny", arch="qwen2")
    root = small_disk.mount(3 << 20) / "root"  # one push of the tiny model (1.6 MiB in fp32) fits, two do not
    script = f"""
import torch
from safetensors.torch import load_file
from grpo.fsutil import NoSpaceError
from grpo.serving.weights_writer import write_weights
state = load_file({str(model / "model.safetensors")!r})
write_weights(state, {str(model)!r}, {str(root)!r}, version=1, step=1, dtype=torch.float32)
try:
    write_weights({{k: v + 1 for k, v in state.items()}}, {str(model)!r}, {str(root)!r}, version=2, step=2,
                  dtype=torch.float32)
except NoSpaceError as e:
    print("ERROR", e)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit {proc.returncode} (-7: SIGBUS)\n{proc.stderr[-3000:]}"
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert line.startswith(f"ERROR {root}/weights-v00000002: no space left on device: the write needs 1.6 MiB, ")
    assert line.endswith(" is free there")
    assert sorted(p.name for p in root.iterdir()) == ["weights-v00000001"]  # no temporary directory left
    from grpo.serving.weights_check import check_weights_dir

    assert check_weights_dir(root / "weights-v00000001", root)["version"] == 1  # the version before stays whole


def test_a_batch_recorded_on_a_full_disk_is_one_error_and_the_batches_before_stay(small_disk):
    run = small_disk.mount(64 << 10)  # 64 KiB: a few batches of 12 sequences
    cfg = config(B=3, G=4)
    written = 0
    with pytest.raises(NoSpaceError) as e:
        for k in range(100):
            record_batch(run, 0, k, k, rollout_of(cfg, reward=lambda j: float(j % 2), seed=k), MADE_WITH)
            written += 1
    assert 0 < written < 100
    path = run / ROLLOUTS_DIR / f"batch-s0000-k{written:06d}.parquet"
    assert str(e.value).startswith(f"{path}: no space left on device: the write needs ")
    assert [t.column("iteration")[0].as_py() for t in read_rollouts(run)] == list(range(written))
    assert not list((run / ROLLOUTS_DIR).glob(".*"))  # no temporary file left behind
    (run / ROLLOUTS_DIR / "batch-s0000-k000000.parquet").unlink()  # space freed: the same batch now records
    record_batch(run, 0, written, written, rollout_of(cfg, reward=lambda j: float(j % 2), seed=written), MADE_WITH)


@pytest.mark.torchrun
def test_a_checkpoint_on_a_full_disk_stops_the_run_and_resume_continues_exactly(small_disk, tmp_path):
    """A replayed run (no server) whose checkpoint.dir holds one checkpoint and a half: the start-up
    check warns that keep_last + 1 = 2 do not fit; step 1's checkpoint is written, step 2's finds the
    disk full: one line naming it and its size, exit 1, step 1's checkpoint valid and no partial one
    left. The disk grown, --resume repeats step 2 bit for bit and finishes the run."""
    from test_replay_validation import record_stream

    model = make_tiny_model_dir(tmp_path / "tiny", arch="qwen2")
    recorded = record_stream(tmp_path / "recorded", model, M=3)
    # one checkpoint: pi_theta and AdamW's moments (3 x 1.6 MB) and pi_ref (1.6 MB), 6.6 MB = 6.3 MiB
    ckpt_dir = small_disk.mount(10 << 20)
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
           f"model.path={model}", f"log.out_dir={tmp_path}", "log.run_name=full", "--replay", str(recorded),
           "grpo.S=1", "grpo.M=3", "grpo.i=1", "checkpoint.every=1", "checkpoint.keep_last=1",
           f"checkpoint.dir={ckpt_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr[-4000:]
    warning = [line for line in first.stderr.splitlines() if line.startswith("[train] warning: checkpoint.dir")]
    assert len(warning) == 1 and "fewer than checkpoint.keep_last + 1 = 2 checkpoints of this run (6.3 MiB each)" \
        in warning[0], first.stderr[-3000:]
    errors = [line for line in first.stderr.splitlines() if "error" in line and "wandb" not in line]
    assert errors == [f"[train] error: {ckpt_dir}/step_2: no space left on device: the write needs 6.3 MiB, "
                      f"{errors[0].split(', ')[1].split(' is free')[0]} is free there; free space there, then --resume"]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_1"] and verify_checkpoint(ckpt_dir / "step_1") is None
    attempt = {r["step"]: r for r in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
               if "loss" in r}
    assert sorted(attempt) == [1, 2]  # step 2 was taken; its checkpoint was not written

    small_disk.remount(30 << 20)  # space freed
    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    assert sorted(rows) == [1, 2, 3]
    for key in ("loss", "kl", "grad_norm", "entropy", "lr", "reward_mean"):
        assert json.dumps(rows[2][key]) == json.dumps(attempt[2][key]), key  # the same step 2, bit for bit
    assert rows[3]["kl"] != rows[2]["kl"]  # and the run went on from there
    assert [p.name for p in ckpt_dir.iterdir()] == ["step_3"]  # keep_last = 1
    assert (tmp_path / "full" / "final" / "model.safetensors").is_file()
