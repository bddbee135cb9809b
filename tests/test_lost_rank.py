"""A lost rank stops a 2-rank run within a bounded, stated time with one line naming it, and the
run resumes exactly (grpo.parallel.RankWatchdog; docs/faults.md).

Runs train.py under torchrun with 2 gloo ranks, replaying batches this module records (--replay:
no inference server, so every run starts in seconds): rank 1 SIGKILLed inside a collective while
rank 0 is busy outside one, rank 1 SIGKILLed outside any collective while rank 0 waits in one
(tests/lost_rank_train.py picks the moment), and rank 1 stopped with SIGSTOP (hung). Before, a
dead rank left its peer to notice it at its next collective (a traceback), or to be killed by
torchrun 30 s later; a hung one kept the others waiting for parallel.timeout_s (4 hours).
"""
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from grpo.models import load_tokenizer
from grpo.parallel import RankWatchdog, _start_time, _this_process
from grpo.recording import model_and_tokenizer, record_batch, sampled_by, weights_fingerprint
from grpo.rollout import Rollout, Sample
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import chaos_soak  # noqa: E402

COMMON = ["grpo.S=1", "grpo.M=4", "grpo.i=2", "grpo.v=2", "checkpoint.every=2", "log.wandb_mode=disabled",
          "log.sample_table_every=0"]
STEPS = list(range(1, 9))


# ------------------------------------------------------------------------------------------------
# The watchdog itself, in this process, with a real TCPStore (seconds)


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    yield master
    del master


def watchdog(store, rank, world_size, timeout_s=1.0):
    """A started watchdog whose verdicts this test takes (claim): it never ends this process itself."""
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    w = RankWatchdog(rank, world_size, timeout_s, store=client)
    assert w.claim(0.0) is None
    w.start()
    return w


def test_a_rank_whose_heartbeat_stops_is_named_by_every_other_rank(store):
    """Three ranks beat; rank 1's beat stops (a stopped process beats no more): rank 0 names it after
    the 1 s time-out, and rank 2 learns the same verdict through the store."""
    ranks = [watchdog(store, r, 3) for r in range(3)]
    time.sleep(0.6)
    assert ranks[0].claim(0.0) is None
    ranks[1].stop()  # silent from now on, its process still alive (the same one as the others here)
    t0 = time.monotonic()
    verdict = ranks[0].claim(5.0)
    assert verdict.startswith("lost rank 1 (no heartbeat for 1 s") and "parallel.heartbeat_timeout_s=1" in verdict
    assert 1.0 - 2 * ranks[0].interval_s <= time.monotonic() - t0 < 3.0  # its last beat was up to a beat before
    assert ranks[2].claim(3.0) == verdict
    for w in ranks:
        w.stop()


@pytest.mark.torchrun
def test_a_dead_rank_on_this_host_is_named_within_a_beat(store):
    """A rank's process on this host that has exited is lost at the next beat, well before its
    heartbeat time-out: the pid with its start time names that process, never a later one."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        client.set("grpo/watchdog/who/1", json.dumps({**_this_process(), "pid": peer.pid,
                                                       "start": _start_time(peer.pid)}))
        w = watchdog(store, 0, 2, timeout_s=30.0)
        client.add("grpo/watchdog/beat/1", 1)
        time.sleep(1.0)
        assert w.claim(0.0) is None
        peer.kill()
        peer.wait()
        t0 = time.monotonic()
        assert w.claim(10.0) == f"lost rank 1 (its process {peer.pid} exited)"
        assert time.monotonic() - t0 < 2 * w.interval_s + 1.0
        w.stop()
    finally:
        peer.kill()


def test_a_lost_store_is_named_after_the_time_out():
    """The launcher's store gone (torchrun's agent killed): a rank left running alone stops after
    the time-out instead of training on as an orphan."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    w = watchdog(master, 0, 1)
    time.sleep(0.5)
    del master  # the store's server goes with its object
    verdict = w.claim(10.0)
    w.stop()
    assert verdict is not None and verdict.startswith("lost the launcher's store 127.0.0.1"), verdict


# ------------------------------------------------------------------------------------------------
# train.py under torchrun


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny model and a recording of every batch of COMMON's schedule (2 prompts x G = 8)."""
    base = tmp_path_factory.mktemp("lost")
    model_dir = make_tiny_model_dir(base / "model", arch="qwen2")
    tok = load_tokenizer(model_dir)
    rng = random.Random(0)
    # what a replay checks the recording against: the model, tokenizer and the weights (version 0) that sampled it
    made_with = {**model_and_tokenizer(model_dir, tok), **sampled_by(0, weights_fingerprint(model_dir))}
    for k in range(4):
        samples = []
        for group, prompt in enumerate([f"What is {k} + 1?", f"What is {k} + 2?"]):
            prompt_ids = tok(prompt)["input_ids"]
            for j in range(8):
                n = rng.randint(3, 8)
                samples.append(Sample(group=group, prompt_ids=prompt_ids,
                                      completion_ids=[rng.randrange(3, len(tok)) for _ in range(n)],
                                      logp_alpha=[rng.uniform(-6.0, -0.1) for _ in range(n)], truncated=False,
                                      reward=float(j % 3 == 0), correct=float(j % 3 == 0)))
        record_batch(base / "recorded", 0, k, 1000 + k, Rollout(samples, {}), made_with)
    return base, model_dir


def command(base, model_dir, name, *extra, wrapper=False):
    script = ROOT / "tests" / "lost_rank_train.py" if wrapper else ROOT / "train.py"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
            "--config", str(ROOT / "configs" / "tiny_test.yaml"), f"model.path={model_dir}", f"log.out_dir={base}",
            f"log.run_name={name}", "--replay", str(base / "recorded"), *COMMON, *extra]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", **extra}


def rows(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["step"] not in out, f"step {row['step']} logged twice"
        out[row["step"]] = row
    return out


@pytest.fixture(scope="module")
def uninterrupted(recorded):
    base, model_dir = recorded
    proc = subprocess.run(command(base, model_dir, "uninterrupted"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rows(base / "uninterrupted")


def start(base, model_dir, name, *extra, lost=None) -> subprocess.Popen:
    return subprocess.Popen(command(base, model_dir, name, *extra, wrapper=lost is not None), cwd=ROOT,
                            env=env(**({"GRPO_TEST_LOST": lost} if lost else {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def rank_process(proc: subprocess.Popen, rank: int, deadline_s: float = 300) -> psutil.Process:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for p in psutil.Process(proc.pid).children():
            try:
                if p.environ().get("RANK") == str(rank):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} under torchrun")


def stop_time(proc: subprocess.Popen, victim: psutil.Process, limit_s: float) -> tuple[float, str]:
    """Seconds from the victim's death (or stop) to torchrun's exit, and the run's output; fails past limit_s."""
    while victim.is_running() and victim.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
        time.sleep(0.02)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            p.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the run was still waiting {limit_s:.0f} s after rank 1 was lost:\n{out[-3000:]}")
    return time.monotonic() - t0, out


def own_line(out: str, start: str) -> bool:
    """A line of the output starts with `start`: the lost-rank line is not glued to rank 0's
    progress bar, which tqdm leaves in the middle of a line (splitlines splits at its \\r too)."""
    return any(line.startswith(start) for line in out.splitlines())


def resume_matches(base, model_dir, name, uninterrupted) -> None:
    proc = subprocess.run(command(base, model_dir, name, "--resume"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = rows(base / name)
    assert sorted(resumed) == STEPS
    for step, row in uninterrupted.items():
        for key, value in row.items():
            if not (key.startswith("time_") or key == "tokens_per_s"):
                assert resumed[step][key] == value, (step, key)


@pytest.mark.torchrun
def test_a_rank_killed_inside_a_collective_stops_its_busy_peer_within_seconds(recorded, uninterrupted):
    """Rank 1 dies waiting in step 3's first all-gather while rank 0 is busy outside collectives
    for a minute: rank 0's watchdog sees rank 1's process gone within a beat (same host), names it
    and ends the rank (stopping nothing else: no server here), not at the end of its minute or when
    torchrun kills it 30 s after the death (a resume after it: the next tests and scripts/chaos_soak.py)."""
    base, model_dir = recorded
    proc = start(base, model_dir, "inside", "parallel.heartbeat_timeout_s=10", lost="inside:3")  # a beat a second
    seconds, out = stop_time(proc, rank_process(proc, 1), limit_s=25)
    assert own_line(out, "[grpo] rank 0: lost rank 1 (its process"), out[-3000:]
    assert seconds < 20, (seconds, out[-3000:])
    assert "exitcode  : 75" in out  # rank 0 ended for a lost rank (grpo.parallel.EXIT_LOST_RANK)


@pytest.mark.torchrun
def test_a_rank_killed_in_start_up_is_named_by_the_rank_torchrun_stops(recorded):
    """Rank 1 dies in start-up, after the process group formed, while rank 0 is busy loading (as
    starting the server keeps it). torchrun sees the death first and SIGTERMs rank 0 at once: before,
    rank 0 ended there with no line (the run's SIGTERM handling starts after start-up), and only
    torchrun's own report named the rank. Now rank 0 names it and ends with EXIT_LOST_RANK."""
    base, model_dir = recorded
    proc = start(base, model_dir, "setup", "parallel.heartbeat_timeout_s=10", lost="setup:0")
    seconds, out = stop_time(proc, rank_process(proc, 1), limit_s=25)
    assert own_line(out, "[grpo] rank 0: lost rank 1 (its process"), out[-3000:]
    assert "exitcode  : 75" in out, out[-3000:]
    assert seconds < 10, (seconds, out[-3000:])
    # the soak reads torchrun's report for a rank lost before the group formed (scripts/chaos_soak.py)
    assert chaos_soak.torchrun_root_cause(out) == 1, out[-3000:]


@pytest.mark.torchrun
def test_a_rank_killed_outside_collectives_before_the_first_checkpoint(recorded, uninterrupted):
    """Rank 1 dies outside any collective in step 1 while rank 0 waits for it in one: rank 0's
    collective fails at once and it prints one line naming rank 1 instead of gloo's traceback. No
    checkpoint was written yet: --resume starts the run again from step 0 (before, it refused:
    "no complete checkpoint") and repeats the uninterrupted run exactly, each step once. Over 60 s
    on a loaded machine (55-77 s in the suite): two 2-rank replays, the killed one and its resume."""
    base, model_dir = recorded
    proc = start(base, model_dir, "outside", "parallel.heartbeat_timeout_s=10", lost="outside:1")
    seconds, out = stop_time(proc, rank_process(proc, 1), limit_s=25)
    assert own_line(out, "[grpo] rank 0: lost rank 1 (its process"), out[-3000:]
    assert "[rank0]: Traceback" not in out and "Connection closed by peer" not in out, out[-3000:]
    assert not (base / "outside" / "checkpoints").is_dir() or not any((base / "outside" / "checkpoints").iterdir())
    resume_matches(base, model_dir, "outside", uninterrupted)


@pytest.mark.torchrun
def test_a_stopped_rank_is_lost_after_its_heartbeat_time_out(recorded):
    """Rank 1 stopped (SIGSTOP: alive, silent, its sockets open, so no collective ever fails) right
    after step 2: rank 0 finds its heartbeat still for parallel.heartbeat_timeout_s (5 s here),
    prints the line naming it and ends within 2 more beats. Before, every rank waited for
    parallel.timeout_s (4 hours). torchrun SIGKILLs the stopped rank 30 s later (torch 2.13's agent
    waits that long for a failed group); not waited for here. A resume after it is any resume
    (test_a_rank_killed_outside_collectives_before_the_first_checkpoint, scripts/chaos_soak.py)."""
    base, model_dir = recorded
    proc = subprocess.Popen(command(base, model_dir, "stopped", "parallel.heartbeat_timeout_s=5"), cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    survivor, victim = rank_process(proc, 0), rank_process(proc, 1)
    metrics = base / "stopped" / "metrics.jsonl"
    try:
        while not (metrics.is_file() and '"step": 2,' in metrics.read_text()):
            assert proc.poll() is None
            time.sleep(0.02)
        victim.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            survivor.wait(timeout=60)
        except psutil.TimeoutExpired:
            pytest.fail("rank 0 still waiting for the stopped rank 60 s later")
        seconds = time.monotonic() - t0
    finally:
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            p.kill()
        out, _ = proc.communicate()
    assert own_line(out, "[grpo] rank 0: lost rank 1 (no heartbeat for 5 s"), out[-3000:]
    assert seconds < 5 + 2 * 0.5 + 10, seconds  # the time-out, 2 beats, a busy machine
