"""A run's private weights root (grpo/serving/inference.py, in /dev/shm when it has room) is removed
when its server stops; a SIGKILLed run cannot remove it, and before, each such crash left one
behind: gigabytes of RAM per crash with a real model. A root's name now holds its owner (pid and
start time), and making the next root reclaims those whose owner is gone."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.fsutil import _host_tag
from grpo.serving.inference import _private_root

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.torchrun
def test_a_root_whose_owner_is_gone_is_reclaimed_when_the_next_is_made(tmp_path):
    parent = tmp_path / "shm"
    # a run's root, made by a process that then died without cleaning up (as a SIGKILLed trainer leaves it)
    made = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from grpo.serving.inference "
                           "import _private_root; print(_private_root(Path(sys.argv[1]), 'crash'))", str(parent)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    dead = Path(made.stdout.strip())
    (dead / "weights-v00000001").mkdir()
    (dead / "weights-v00000001" / "model.safetensors").write_bytes(b"\0" * 4096)
    alive = _private_root(parent, "running")  # this process's: its owner runs
    reused = parent / f"grpo-weights-old-p{os.getpid()}s1-abcdefgh"  # a pid that now names another process
    reused.mkdir()
    gone = re.search(r"p(\d+)s\d+-", dead.name)[1]  # the dead owner's pid: only what they are keeps these
    other_host = "0" * 8 if _host_tag() != "0" * 8 else "1" * 8  # a pid there says nothing here
    kept = {"another name": parent / "grpo-weights-crash-abcd1234", "a file": parent / f"grpo-weights-x-p{gone}s1-abcdefgh",
            "another machine's": parent / f"grpo-weights-z-h{other_host}p{gone}s1-abcdefgh"}
    kept["another name"].mkdir()
    kept["another machine's"].mkdir()
    kept["a file"].write_text("not a root")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (parent / f"grpo-weights-y-p{gone}s1-abcdefgh").symlink_to(target)  # a link: never followed

    new = _private_root(parent, "next")
    assert not dead.exists() and not reused.exists()
    assert alive.is_dir() and new.is_dir() and target.is_dir() and all(p.exists() for p in kept.values())
    assert new.name.startswith(f"grpo-weights-next-h{_host_tag()}p{os.getpid()}s")


@pytest.mark.torchrun  # the dead owner is a child process
def test_a_directory_another_starting_process_reclaims_meanwhile_is_passed_over(tmp_path, monkeypatch):
    """Every rank now makes a directory of its own at start (its TMPDIR), so two processes reclaim
    the same dead owner's directory at once: the one that finds it gone between looking at it and
    reading its owner goes on (before: FileNotFoundError, and the rank's start failed)."""
    from grpo.fsutil import owned_dir, reclaim_owned

    made = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from grpo.fsutil import "
                           "owned_dir; print(owned_dir(Path(sys.argv[1]), 'tmp'))", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    dead = Path(made.stdout.strip())
    real_lstat = Path.lstat
    looks = []

    def removed_by_the_other(self):
        if self == dead:
            looks.append(self)
            if len(looks) == 2:  # after it was seen to be a directory, before its owner is read:
                import shutil
                shutil.rmtree(dead)  # the other process reclaimed it just now
        return real_lstat(self)

    monkeypatch.setattr(Path, "lstat", removed_by_the_other)
    assert reclaim_owned(tmp_path, "tmp") == []
    assert len(looks) == 2  # the window was hit
    monkeypatch.undo()
    assert not dead.exists() and owned_dir(tmp_path, "tmp").is_dir()


def test_a_launched_fleet_sizes_dev_shm_for_a_root_per_server(tmp_path):
    """A push writes one copy into each launched server's root (server.replicas R: R roots), so /dev/shm
    must hold keep_last + 2 pushes in every one of them. Bug: each replica sized it for itself alone,
    so the documented 1.5B fleet of 6 in a 16 GB shm container chose /dev/shm and stopped with no
    space at its first push. A model (a sparse file: its size only) whose pushes fit /dev/shm twice
    over for one server goes there for one, and to the run directory for four."""
    from grpo.serving.fleet import ServerFleet
    from grpo.serving.inference import ServerConfig

    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm here")
    cfg = ServerConfig(keep_last=2)
    model_bytes = (shutil.disk_usage(shm).free - (1 << 30)) // (2 * (cfg.keep_last + 2))
    if model_bytes < 1 << 20:
        pytest.skip("/dev/shm is nearly full here")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    with open(model_dir / "model.safetensors", "wb") as f:
        f.truncate(model_bytes)
    run_dir = tmp_path / "run"
    one = ServerFleet.replica_configs(cfg, model_dir, run_dir, 1)
    four = ServerFleet.replica_configs(cfg, model_dir, run_dir, 4)
    assert [c.weights_root for c in one] == [str(shm)]
    assert [c.weights_root for c in four] == [str(run_dir.resolve())] * 4
    # a root the config names is every server's parent, whatever its room
    assert {c.weights_root for c in ServerFleet.replica_configs(
        ServerConfig(weights_root=str(tmp_path / "w")), model_dir, run_dir, 4)} == {str(tmp_path / "w")}
