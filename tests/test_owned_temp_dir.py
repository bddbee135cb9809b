"""A process's temporary files, and those of the processes it starts, go into one directory it owns
(grpo.fsutil.own_temp_dir: train.py's ranks, eval.py, a standalone server). A SIGKILLed run left
what its libraries made in TMPDIR for a normal exit to remove: the long chaos soak counted 42
W&B media and 42 W&B artifact directories, 22 more tmp* directories and W&B's sockets, one set per
kill. Now they sit in the killed process's directory, which the next start reclaims."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from grpo.fsutil import own_temp_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def short_tmp():
    """A TMPDIR with a short path (a Unix socket's path has at most 107 bytes), gone afterwards."""
    import shutil

    temp = Path(tempfile.mkdtemp(prefix="go", dir="/tmp"))
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def tmpdir_env(monkeypatch):
    """Point TMPDIR (the environment and tempfile's cache of it) somewhere for one test, with
    inductor's cache where it is by default (in TMPDIR)."""
    def point(path: Path) -> None:
        monkeypatch.setenv("TMPDIR", str(path))
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return point


# the killed process: a TMPDIR of its own, W&B started in it, and a child process (as a trainer starts
# its server) making a temporary file of its own
_KILLED = """
import subprocess, sys, tempfile, time
from pathlib import Path
from grpo.fsutil import own_temp_dir
from grpo.metrics import LogConfig, MetricsLogger
with own_temp_dir() as own:
    MetricsLogger(LogConfig(wandb_mode='offline'), Path(sys.argv[1]), {}, rank=0)
    child = subprocess.Popen([sys.executable, '-c', 'import tempfile, time; '
                              'print(tempfile.mkstemp(prefix="child")[1], tempfile.gettempdir(), flush=True); '
                              'time.sleep(120)'], stdout=subprocess.PIPE, text=True)
    print(own, child.stdout.readline().strip(), flush=True)
    time.sleep(120)
"""


@pytest.mark.torchrun  # child processes, SIGKILLed
def test_what_a_killed_run_leaves_in_tmpdir_is_in_its_own_directory_which_the_next_start_reclaims(
        tmp_path, short_tmp, tmpdir_env):
    tmpdir_env(short_tmp)
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path / "killed")], env=env, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "child.err", "wb"), text=True, start_new_session=True)
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 3, (tmp_path / "child.err").read_text()[-3000:]
        own, child_file, child_tmp = map(Path, line)
        deadline = time.time() + 300  # W&B's service starts in the background, slowly on a loaded machine
        while time.time() < deadline and not list(own.glob("wandb_symon-*.sock")):
            time.sleep(0.2)
        made = sorted(p.name for p in own.iterdir())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert own.parent == short_tmp and re.match(rf"grpo-tmp-h[0-9a-f]{{8}}p{proc.pid}s", own.name)
    assert child_tmp == own and child_file.parent == own and child_file.is_file()  # the child used its parent's
    # what the W&B SDK makes at import and its service's sockets: all made in the killed process's directory
    assert any(n.startswith("wandb_symon-") for n in made), made
    # W&B's service outlives the kill and removes its own sockets as it goes, 2-6 s later here (the
    # check that ran 1 s after the kill failed on a loaded machine): wait for that, so that the listings
    # below hold what stays
    deadline = time.time() + 60
    while time.time() < deadline and list(own.glob("wandb_symon-*.sock")):
        time.sleep(0.2)
    left = sorted(p.name for p in own.iterdir())
    assert any(n.endswith("wandb-media") for n in left) and any(n.endswith("wandb-artifacts") for n in left), left
    # nothing else in TMPDIR itself but inductor's cache, kept there to be shared by runs
    assert all(p.name.startswith("torchinductor_") for p in short_tmp.iterdir() if p != own)

    with own_temp_dir() as mine:
        assert not own.exists()  # the killed process's directory, reclaimed at this start
        assert mine.parent == short_tmp and tempfile.gettempdir() == os.environ["TMPDIR"] == str(mine)
    assert not mine.exists() and not list(short_tmp.glob("grpo-tmp-*"))
    assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(short_tmp)  # given back at the end


@pytest.mark.torchrun  # a child process
def test_a_process_started_by_an_owner_uses_its_directory_and_inductors_cache_stays_shared(short_tmp, tmpdir_env):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tmpdir_env(short_tmp)
    shared_cache = default_cache_dir()
    with own_temp_dir() as own:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == shared_cache  # not per run: kernels compile once
        out = subprocess.run([sys.executable, "-c", "import tempfile; from grpo.fsutil import own_temp_dir\n"
                              "with own_temp_dir() as d: print(d, tempfile.gettempdir())"],
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [str(own), str(own)]  # no nested directory
        assert own.is_dir()  # and the child's end did not remove its parent's
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


@pytest.mark.quick
def test_a_tmpdir_too_long_for_the_engines_sockets_is_kept_as_it_is(short_tmp, tmpdir_env):
    """vLLM's ZMQ sockets are <TMPDIR>/<uuid4>, and a socket's path has at most 107 bytes: an owned
    directory under a long TMPDIR would stop the engine from starting, so files go where they went."""
    long = short_tmp / ("x" * (70 - len(str(short_tmp)) - 1))  # 70 bytes: with the owned name, over 107 - 37
    long.mkdir()
    tmpdir_env(long)
    with own_temp_dir() as own:
        assert own == long and os.environ["TMPDIR"] == str(long)
    assert long.is_dir() and list(long.iterdir()) == []
