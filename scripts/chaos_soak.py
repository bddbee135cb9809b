"""Chaos soak: a 2-rank training run under random faults ends exactly as the uninterrupted run.

    .venv/bin/python scripts/chaos_soak.py --mode short              # CI (tests/test_chaos.py): 3 faults, 8 steps
    .venv/bin/python scripts/chaos_soak.py --mode short --steps 1 8  # the same faults over 16 steps (CI's until issue 48)
    .venv/bin/python scripts/chaos_soak.py --mode long --seed 1      # releases: >= 200 steps, >= 20 faults of every kind

The run: `torchrun --nproc_per_node=2 train.py` on the tiny test model (tests/tiny_models.py) and
configs/tiny_test.yaml, with v = 3, i = 2, sample-ahead on and every batch recorded
(log.save_rollouts). A seeded driver watches it from outside, as an operator or a scheduler sees a
run (its files, its processes, the server's weights root), and injects faults at the moments it
observes:

  kinds    rank0, rank1   SIGKILL of one trainer rank (rank 0 also owns the inference server)
           torchrun       SIGKILL of torchrun and of every process under it at once (a node's job killed)
           sigterm        SIGTERM to torchrun (a scheduler's preemption: the ranks checkpoint and exit)
           server         SIGKILL of the inference server process
           engine         SIGKILL of the server's vLLM engine-core process
  moments  checkpoint     while a checkpoint is being written (checkpoints/step_N.tmp exists)
           push           while a weight push is in flight (a weights directory written into the
                          server's root that the server does not serve yet)
           generation     while the engine computes (its CPU time grows), outside a push
           resume         right after a resumed attempt starts, before its first step
           any            a random moment of a step

After a fault that ends the run, the driver checks that every process of the attempt is gone and
resumes it (`--resume`). At the end: every step's metrics (timing keys aside), the sample tables,
every recorded batch and the final exported model equal the uninterrupted run's bit for bit, each
step is logged once, and no process, temporary file or directory, /dev/shm weights root or other
shared-memory file an attempt's processes used is left. It prints the faults by kind and moment,
what differed or was left, and a final JSON line; the exit code is 0 when everything held
(docs/faults.md).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("rank0", "rank1", "torchrun", "sigterm", "server", "engine")
ENDS_THE_RUN = ("rank0", "rank1", "torchrun", "sigterm")  # the others: the trainer restarts its server
MOMENTS = ("checkpoint", "push", "generation", "resume", "any")
# short mode: one fault of each way the run can lose something, at the moments most likely to lose it
SHORT_PLAN = (("rank1", "checkpoint"), ("server", "resume"), ("engine", "generation"))
# (grpo.S, grpo.M); i = 2 optimizer steps per iteration. short: 8 steps, the fewest in which every fault
# of SHORT_PLAN still lands at its moment (the first checkpoint is step 4's) and the resumed run still
# pushes (v = 3) and trains on after the push: each step of the uninterrupted run past that only
# repeated what the steps before it had compared (16 steps: 323 s in CI; 8: 252 s on a quiet 2-core machine)
STEPS = {"short": (1, 4), "long": (2, 50)}
POLL_S = 0.01  # how often the run's files and the engine's CPU time are looked at
# the moments that last a fraction of a second, and the most a fault waits inside one (s): a random part of
# the shortest such moment seen so far, at once the first time (see Soak.delay)
SHORT_MOMENTS = {"checkpoint": 0.3, "push": 0.01, "generation": 0.3}
TREE_EVERY_S = 0.5  # how often its process tree is walked (psutil scans every process)
GONE_WITHIN_S = 90.0  # a killed attempt's processes, or a killed server's, must all be gone by then
STOP_WITHIN_S = 120.0  # a rank's death must end the attempt by then (the run's lost-rank bound)
# rank 0's first line once every rank is in the process group: before it, a dead rank cannot be
# named by the others (they wait in the group's rendezvous, or have not started), only by torchrun
GROUP_FORMED = "[train] gradients reduce-scattered after"


def run_overrides(stages: int, iterations: int) -> list[str]:
    return [f"grpo.S={stages}", f"grpo.M={iterations}", "grpo.v=3", "grpo.i=2", "grpo.sample_ahead=true",
            "log.save_rollouts=true", "checkpoint.every=4", "checkpoint.keep_last=2", "eval_data=null",
            "server.enforce_eager=true"]


def timing_key(key: str) -> bool:
    """Wall-clock figures: they differ between any two runs."""
    return key.startswith("time_") or key == "tokens_per_s"


@dataclass
class Fault:
    kind: str
    moment: str
    attempt: int = -1  # which attempt it hit (-1: never fired)
    step: int = -1  # the last step the run had logged when it fired
    at_s: float = 0.0  # seconds into the attempt
    seen: str = ""  # what the driver observed when it fired (the moment's evidence)
    stop_s: Optional[float] = None  # a fault that ends the run: seconds until torchrun exited
    lost_rank_line: str = ""  # a rank's death: the line that named it
    group_formed: bool = True  # a rank's death: the process group had formed when it came (GROUP_FORMED)


# ------------------------------------------------------------------------------------------------
# One attempt of a run: its processes and what they write


class Attempt:
    """One `torchrun ... train.py` of a run, in its own session, with every process it ever had."""

    def __init__(self, index: int, cmd: list[str], env: dict, log_path: Path, run_dir: Path, resumed: bool):
        self.index, self.run_dir, self.resumed, self.log_path = index, run_dir, resumed, log_path
        self.started = time.monotonic()
        self.step_log = StepLog(run_dir)
        # where it continues from, and whether rows of an earlier attempt past that are still in the log
        self.resumed_from = latest_checkpoint_step(run_dir) if resumed else 0
        self.stale_rows = any(step > self.resumed_from for step in self.step_log.steps())
        self.first_step_s: Optional[float] = None  # seconds from the launch to its first new step
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.known: dict[tuple[int, float], psutil.Process] = {}  # every process seen under torchrun
        self.roles: dict[tuple[int, float], str] = {}
        self.shm_inodes: set[int] = set()  # of the /dev/shm files its processes mapped (see note_shm)
        self._walked = 0.0
        self.walk()

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def walk(self, force: bool = False) -> None:
        """Record every process now under torchrun (a process re-parented to init after its parent
        died is still known from an earlier walk)."""
        if not force and time.monotonic() - self._walked < TREE_EVERY_S:
            return
        self._walked = time.monotonic()
        try:
            top = psutil.Process(self.proc.pid)
            tree = [top, *top.children(recursive=True)]
        except psutil.Error:
            return
        for p in tree:
            try:
                key = (p.pid, p.create_time())
                # again at every walk: vLLM's engine starts as a copy of the server and renames itself
                role = role_of(p, top.pid)
            except psutil.Error:  # it exited while being looked at: known only with a role
                continue
            self.known.setdefault(key, p)
            self.roles[key] = role

    def note_shm(self) -> None:
        """Remember the /dev/shm files its live processes map, by inode (glibc makes a semaphore under
        a temporary name and links it to its own, so the maps name a deleted file): looked at before
        every fault, the moment something could be left."""
        for p in self.live():
            try:
                maps = Path(f"/proc/{p.pid}/maps").read_text()
            except OSError:
                continue
            self.shm_inodes.update(int(line.split()[4]) for line in maps.splitlines() if " /dev/shm/" in line)

    def live(self, role: Optional[str] = None) -> list[psutil.Process]:
        out = []
        for key, p in self.known.items():
            if role is not None and self.roles[key] != role:
                continue
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def one(self, role: str) -> Optional[psutil.Process]:
        live = self.live(role)
        return max(live, key=lambda p: p.create_time()) if live else None  # a restarted server: the newest

    def describe(self, p: psutil.Process) -> str:
        key = next((k for k, q in self.known.items() if q is p), None)
        try:
            cmd = " ".join(p.cmdline())[:160]
        except psutil.Error:
            cmd = "?"
        return f"{self.roles.get(key, '?')} pid {p.pid}: {cmd}"

    def new_steps(self) -> int:
        """Steps this attempt has logged (a resume first drops the rows after its checkpoint)."""
        steps = self.step_log.steps()
        if self.stale_rows and self.step_log.rewrites == 0:
            return 0
        return sum(1 for step in steps if step > self.resumed_from)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""


def torchrun_root_cause(log: str) -> Optional[int]:
    """The rank torchrun's failure report names as its root cause (the first rank that failed)."""
    _, found, after = log.partition("Root Cause (first observed failure):")
    match = re.search(r"^\s*rank\s*:\s*(\d+)", after, re.MULTILINE) if found else None
    return int(match.group(1)) if match else None


def role_of(p: psutil.Process, torchrun_pid: int) -> str:
    """torchrun, rank<N>, server, engine, or other (W&B's service, reward workers, ...)."""
    if p.pid == torchrun_pid:
        return "torchrun"
    name, cmd = p.name(), " ".join(p.cmdline())
    if name == "VLLM::EngineCore":
        return "engine"
    if "grpo.serving.server" in cmd:
        return "server"
    if "train.py" in cmd:
        rank = p.environ().get("RANK")
        if rank is not None:
            return f"rank{rank}"
    return "other"


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's training rows, in file order (a torn last line skipped)."""
    return StepLog(run_dir).steps()


class StepLog:
    """metrics.jsonl's training steps, read as the file grows. A resume rewrites the file (a new
    inode, the rows after its checkpoint dropped): it is read again and `rewrites` counts it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.rewrites = 0
        self._inode, self._offset, self._steps, self._partial = None, 0, [], b""
        self.steps()

    def steps(self) -> list[int]:
        try:
            st = self.path.stat()
        except OSError:
            return self._steps
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._offset):
            self.rewrites += 1
            self._offset, self._steps, self._partial = 0, [], b""
        self._inode = st.st_ino
        if st.st_size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = self._partial + f.read(st.st_size - self._offset)
            self._offset = st.st_size
            *lines, self._partial = data.split(b"\n")
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "loss" in row:
                    self._steps.append(row["step"])
        return self._steps


def latest_checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (what --resume continues from), 0 if none."""
    from grpo.checkpoint import verify_checkpoint

    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return max((s for s in steps if verify_checkpoint(run_dir / "checkpoints" / f"step_{s}") is None), default=0)


# ------------------------------------------------------------------------------------------------
# The moments, as seen from outside


class Moments:
    """The predicates of MOMENTS for the attempt running now, from its files and its processes."""

    def __init__(self, attempt: Attempt):
        self.attempt = attempt
        self.ckpt_dir = attempt.run_dir / "checkpoints"
        self._engine_cpu: dict[int, tuple[float, float]] = {}  # engine pid -> (its CPU seconds, when they last grew)
        self._log = attempt.run_dir / "server" / "server.log"
        self._log_offset = 0
        self._serving = False  # the server's log says it serves (since its last start)

    def checkpoint(self) -> str:
        try:
            writing = [n for n in os.listdir(self.ckpt_dir) if n.endswith(".tmp")]
        except OSError:
            return ""
        return f"writing {writing[0]}" if writing else ""

    def weights_root(self) -> Optional[Path]:
        server = self.attempt.one("server")
        try:
            cmd = server.cmdline() if server else []
        except psutil.Error:
            return None
        return Path(cmd[cmd.index("--weights-root") + 1]) if "--weights-root" in cmd else None

    def push(self) -> str:
        root = self.weights_root()
        try:
            names = os.listdir(root) if root else []
            serving = (root / "SERVING").read_text().strip() if root and (root / "SERVING").is_file() else ""
        except OSError:
            return ""
        if any(n.startswith(".tmp-weights-v") for n in names):
            return "a push being written"
        written = sorted(n for n in names if n.startswith("weights-v"))
        if written and written[-1] > serving:  # zero-padded versions sort as numbers
            return f"{written[-1]} written, {serving or 'the model directory'} served"
        return ""

    def server_ready(self) -> bool:
        """The server's log shows it serving since its latest start (an engine starting up computes too)."""
        try:
            size = self._log.stat().st_size
        except OSError:
            return False
        if size > self._log_offset:
            with open(self._log, "rb") as f:
                f.seek(self._log_offset)
                new = f.read(size - self._log_offset)
            self._log_offset = size
            started, serving = new.rfind(b"starting grpo.serving.server"), new.rfind(b"[grpo.server] serving ")
            if started > serving:
                self._serving = False
            elif serving >= 0:
                self._serving = True
        return self._serving

    def generation(self) -> str:
        engine = self.attempt.one("engine")
        if engine is None or not self.server_ready() or self.push():
            return ""
        try:
            cpu = sum(engine.cpu_times()[:2])
        except psutil.Error:
            return ""
        now = time.monotonic()
        last, grew = self._engine_cpu.get(engine.pid, (cpu, 0.0))
        if cpu > last:
            grew = now
        self._engine_cpu[engine.pid] = (cpu, grew)
        return f"engine {engine.pid} computing" if now - grew < 0.1 else ""

    def before_first_step(self) -> bool:
        return self.attempt.new_steps() == 0


# ------------------------------------------------------------------------------------------------
# The soak


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.out = Path(args.out).resolve()
        # each run's TMPDIR, checked at the end: under the system's temporary directory, not under --out,
        # whose path can be long (pytest's), and short: each rank owns a directory in it (grpo.fsutil.
        # own_temp_dir) where vLLM's ZMQ sockets live, and a Unix socket's path has at most 107 bytes
        self.tmp = Path(tempfile.mkdtemp(prefix="gs"))
        self.stages, self.iterations = STEPS[args.mode] if args.steps is None else args.steps
        self.faults: list[Fault] = []
        self.problems: list[str] = []  # what did not hold: differences, leftovers, bounds
        self.attempts: list[Attempt] = []
        self.first_step_s: list[float] = []  # launch -> first new step, per attempt (the "resume" window)
        self.step_s = 3.0  # a step's seconds, measured as the run goes
        self.moment_s: dict[str, float] = {}  # the shortest of each of SHORT_MOMENTS seen so far (s)

    # -- runs
    def env(self, name: str) -> dict:
        tmp = self.tmp_of(name)  # every temporary file the run makes goes here, to be checked at the end
        tmp.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "WANDB_MODE": "offline",
                "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}

    def tmp_of(self, name: str) -> Path:
        return self.tmp / name.rsplit("-", 1)[-1]  # "chaos", "reference"

    def cmd(self, name: str, resume: bool) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny_test.yaml"),
                f"model.path={self.model_dir}", f"log.out_dir={self.out / 'runs'}", f"log.run_name={name}",
                f"seed={self.args.seed}", *run_overrides(self.stages, self.iterations),
                *(["--resume"] if resume else [])]

    def run_name(self, what: str) -> str:
        """The name of its run `what` ("chaos", "reference"), this soak's own: its weights roots in
        /dev/shm carry it, and the leftovers counted are those of this soak's runs only (with the
        seed alone, another soak of that seed running beside it, say a second test suite's, left
        roots that this one reported as its own)."""
        return f"soak{self.args.seed}-{self.tmp.name}-{what}"

    def start_reference(self) -> subprocess.Popen:
        name = self.run_name("reference")
        log = open(self.out / f"{name}.log", "wb")
        return subprocess.Popen(self.cmd(name, resume=False), cwd=ROOT, env=self.env(name), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self) -> Attempt:
        name = self.run_name("chaos")
        run_dir = self.out / "runs" / name
        resume = bool(self.attempts)
        attempt = Attempt(len(self.attempts), self.cmd(name, resume), self.env(name),
                          self.out / f"{name}.attempt{len(self.attempts):03d}.log", run_dir, resume)
        self.attempts.append(attempt)
        return attempt

    # -- the plan
    def plan(self) -> list[Fault]:
        if self.args.mode == "short":
            return [Fault(kind, moment) for kind, moment in SHORT_PLAN]
        n = self.args.faults_per_kind
        faults = [Fault(kind, MOMENTS[(i + KINDS.index(kind)) % len(MOMENTS)]) for kind in KINDS for i in range(n)]
        self.rng.shuffle(faults)
        return faults

    def next_fault(self, pending: list[Fault], fresh_resume: bool) -> Optional[Fault]:
        """A "resume" fault needs an attempt that has just resumed; take one there (more often as they
        pile up), and any other fault elsewhere."""
        resume = [f for f in pending if f.moment == "resume"]
        others = [f for f in pending if f.moment != "resume"]
        ending = [f for f in others if f.kind in ENDS_THE_RUN]
        if fresh_resume and resume and (not others or self.rng.random() < max(0.5, len(resume) / (len(ending) + 1))):
            return resume[0]
        return others[0] if others else None

    # -- the loop
    def chaos(self) -> None:
        pending = self.plan()
        attempt = self.launch()
        while True:
            fresh = attempt.resumed and Moments(attempt).before_first_step()
            fault = self.next_fault(pending, fresh)
            if fault is None:
                break
            fired = self.fire_when_due(attempt, fault, more_to_come=len(pending) > 1)
            if not fired:  # the attempt ended before the fault's moment came
                if attempt.proc.returncode == 0:  # the run is done: what is still planned can no longer come
                    self.problems += [f"{f.kind} at {f.moment} never fired: the run ended before its moment"
                                      for f in pending]
                    break
                self.problems.append(f"attempt {attempt.index} ended (exit {attempt.proc.returncode}) with no fault: "
                                     f"{failure_cause(attempt.log_text())}")
                self.reap(attempt)
                if len(self.attempts) > len(self.faults) + 3:
                    raise SystemExit(f"[soak] the run fails on its own: see {attempt.log_path}")
                attempt = self.launch()
                continue
            pending.remove(fault)
            self.faults.append(fault)
            print(f"[soak] fault {len(self.faults)}: {fault.kind} at {fault.moment} (attempt {fault.attempt}, "
                  f"after step {fault.step}, {fault.at_s:.1f} s in: {fault.seen})", flush=True)
            if fault.kind in ENDS_THE_RUN:
                self.after_run_fault(attempt, fault)
                attempt = self.launch()
        self.finish(attempt)

    def fire_when_due(self, attempt: Attempt, fault: Fault, more_to_come: bool = False) -> bool:
        """Wait for the fault's moment in this attempt and inject it; False if the attempt ends first.
        Once the moment is seen, the fault waits a random part of it (and the moment must still hold).
        A fault that ends the run, with faults still to come, does not fire once the run has logged its
        last step: the resumed attempt could have nothing left to run (the last checkpoint completes
        when the killed rank had written its part), and the faults after it would never come."""
        moments = Moments(attempt)
        predicate: Callable[[], str] = {
            "checkpoint": moments.checkpoint, "push": moments.push, "generation": moments.generation,
            "resume": lambda: "before the first step of the resumed attempt" if moments.before_first_step() else "",
            "any": lambda: "a random moment",
        }[fault.moment]
        holds_back = fault.kind in ENDS_THE_RUN and more_to_come
        seen_since, delay = None, self.delay(fault.moment)
        while attempt.proc.poll() is None:
            attempt.walk()
            self.learn_timings(attempt)
            target = self.target(attempt, fault.kind)
            if holds_back and max(attempt.step_log.steps(), default=0) >= self.final_step:
                target = []
            evidence = predicate() if target else ""
            if target and fault.moment == "resume" and not evidence:  # its first step came already: now, then
                evidence, delay = "at the first step of the resumed attempt", 0.0
            if not evidence:
                if seen_since is not None and target and fault.moment in SHORT_MOMENTS:  # it ended before the delay
                    self.saw_moment(fault.moment, time.monotonic() - seen_since)
                seen_since = None
            else:
                seen_since = seen_since or time.monotonic()
                if time.monotonic() - seen_since >= delay:
                    if fault.moment in SHORT_MOMENTS:
                        evidence = predicate()  # still inside it?
                    if evidence:
                        self.inject(attempt, fault, target, evidence)
                        return True
                    self.saw_moment(fault.moment, time.monotonic() - seen_since)
                    seen_since, delay = None, self.delay(fault.moment)  # it passed: wait for the next one
            time.sleep(POLL_S)
        return False

    def delay(self, moment: str) -> float:
        """How long a fault waits once its moment is seen. Inside one of SHORT_MOMENTS: a random part of
        the shortest seen so far, and none the first time. A fixed 0.3 s draw outlasted the tiny model's
        first checkpoint (about 0.2 s written): the rank kill fell on the run's last checkpoint instead,
        and CI's soak ended with two of its three faults never fired."""
        if moment in SHORT_MOMENTS:
            seen = self.moment_s.get(moment)
            return self.rng.uniform(0, min(SHORT_MOMENTS[moment], seen)) if seen is not None else 0.0
        return self.rng.uniform(0, self.first_step_estimate() if moment == "resume" else 2 * self.step_s)

    def saw_moment(self, moment: str, seconds: float) -> None:
        self.moment_s[moment] = min(seconds, self.moment_s.get(moment, seconds))

    @property
    def final_step(self) -> int:
        return self.stages * self.iterations * 2  # i = 2 optimizer steps per iteration (run_overrides)

    def target(self, attempt: Attempt, kind: str) -> list[psutil.Process]:
        """The processes the fault signals, when they exist now."""
        if kind in ("torchrun", "sigterm"):
            return attempt.live("torchrun")
        if kind in ("rank0", "rank1", "server", "engine"):
            p = attempt.one(kind)
            return [p] if p else []
        raise ValueError(kind)

    def inject(self, attempt: Attempt, fault: Fault, target: list[psutil.Process], evidence: str) -> None:
        fault.attempt, fault.at_s, fault.seen = attempt.index, attempt.seconds(), evidence
        steps = attempt.step_log.steps()
        fault.step = steps[-1] if steps else 0
        fault.group_formed = GROUP_FORMED in attempt.log_text()
        victims = [*target, *self.children(target[0])]  # a server's engine dies with it: looked up before
        attempt.walk(force=True)
        attempt.note_shm()
        if fault.kind == "torchrun":  # the whole job at once: torchrun, the ranks, the server, its engine, the rest
            for p in attempt.live():
                signal_quietly(p, signal.SIGKILL)
        elif fault.kind == "sigterm":
            signal_quietly(target[0], signal.SIGTERM)
        else:
            signal_quietly(target[0], signal.SIGKILL)
        if fault.kind in ("server", "engine"):
            self.check_gone(attempt, victims, f"{fault.kind} fault {len(self.faults) + 1}")

    @staticmethod
    def children(p: psutil.Process) -> list[psutil.Process]:
        try:
            return p.children(recursive=True)
        except psutil.Error:
            return []

    def after_run_fault(self, attempt: Attempt, fault: Fault) -> None:
        """The attempt must stop within STOP_WITHIN_S (a rank's death is found by the others) and
        leave no process; a rank's death is named in one line."""
        t0 = time.monotonic()
        try:
            attempt.proc.wait(timeout=STOP_WITHIN_S)
            fault.stop_s = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.problems.append(f"{fault.kind} at {fault.moment} (attempt {attempt.index}): torchrun still running "
                                 f"{STOP_WITHIN_S:.0f} s after the fault")
        if fault.kind in ("rank0", "rank1"):
            log = attempt.log_text()
            lost = [line for line in log.splitlines() if f"lost rank {fault.kind[-1]}" in line]
            if lost:
                fault.lost_rank_line = lost[0][:300]
            elif not fault.group_formed and torchrun_root_cause(log) == int(fault.kind[-1]):
                fault.lost_rank_line = f"torchrun's Root Cause: rank {fault.kind[-1]} (before the process group formed)"
        self.reap(attempt)

    def reap(self, attempt: Attempt) -> None:
        """Every process the attempt ever had must be gone within GONE_WITHIN_S (then it is killed)."""
        if attempt.proc.poll() is None:
            attempt.walk(force=True)
            for p in attempt.live():
                signal_quietly(p, signal.SIGKILL)
            attempt.proc.wait()
        self.check_gone(attempt, list(attempt.known.values()), f"attempt {attempt.index}")

    def check_gone(self, attempt: Attempt, procs: list[psutil.Process], what: str) -> None:
        deadline = time.monotonic() + GONE_WITHIN_S
        alive = procs
        while time.monotonic() < deadline:
            alive = [p for p in procs if running(p)]
            if not alive:
                return
            time.sleep(0.2)
        for p in alive:
            self.problems.append(f"{what}: {attempt.describe(p)} still running {GONE_WITHIN_S:.0f} s later")
            signal_quietly(p, signal.SIGKILL)

    def learn_timings(self, attempt: Attempt) -> None:
        new = attempt.new_steps()
        if new >= 1 and attempt.first_step_s is None:
            attempt.first_step_s = attempt.seconds()
            self.first_step_s.append(attempt.first_step_s)
        if new >= 3:
            self.step_s = max(0.5, (attempt.seconds() - attempt.first_step_s) / (new - 1))

    def first_step_estimate(self) -> float:
        return sum(self.first_step_s) / len(self.first_step_s) if self.first_step_s else 60.0

    def finish(self, attempt: Attempt) -> None:
        """No faults left: the run goes on to its end, resumed as often as it takes."""
        while True:
            attempt.proc.wait()
            self.reap(attempt)
            if attempt.proc.returncode == 0:
                return
            self.problems.append(f"attempt {attempt.index} ended with exit {attempt.proc.returncode} with no "
                                 f"fault: {failure_cause(attempt.log_text())}")
            if len(self.attempts) > len(self.faults) + 3:
                raise SystemExit(f"[soak] the run fails on its own: see {attempt.log_path}")
            attempt = self.launch()

    # -- the checks
    def compare(self, reference: Path, chaos: Path) -> None:
        ref_steps, chaos_steps = logged_steps(reference), logged_steps(chaos)
        expected = list(range(1, self.final_step + 1))
        if ref_steps != expected:
            self.problems.append(f"the reference run logged steps {ref_steps[:5]}...{ref_steps[-5:]}, expected 1..{expected[-1]}")
        if chaos_steps != expected:
            twice = sorted(s for s, n in collections.Counter(chaos_steps).items() if n > 1)
            missing = sorted(set(expected) - set(chaos_steps))
            self.problems.append(f"steps logged twice: {twice[:20]}, missing: {missing[:20]}")
        rows = {}
        for name, run in (("reference", reference), ("chaos", chaos)):
            rows[name] = {}
            for line in (run / "metrics.jsonl").read_text().splitlines():
                row = json.loads(line)
                if "loss" in row:
                    rows[name].setdefault(row["step"], row)
        for step, ref in sorted(rows["reference"].items()):
            got = rows["chaos"].get(step)
            if got is None:
                continue
            keys = {k for k in ref.keys() | got.keys() if not timing_key(k)}
            differ = sorted(k for k in keys if ref.get(k, "absent") != got.get(k, "absent")
                            and not (ref.get(k) != ref.get(k) and got.get(k) != got.get(k)))  # NaN == NaN here
            if differ:
                k = differ[0]
                self.problems.append(f"step {step}: {len(differ)} metrics differ, e.g. {k}: {ref.get(k, 'absent')!r} "
                                     f"uninterrupted, {got.get(k, 'absent')!r} under faults ({differ[:8]})")
        if (reference / "samples.jsonl").read_bytes() != (chaos / "samples.jsonl").read_bytes():
            self.problems.append("samples.jsonl differs from the uninterrupted run's")
        from grpo.recording import ROLLOUTS_DIR, read_rollouts

        ref_names = sorted(p.name for p in (reference / ROLLOUTS_DIR).iterdir())
        chaos_names = sorted(p.name for p in (chaos / ROLLOUTS_DIR).iterdir())
        if ref_names != chaos_names:
            self.problems.append(f"recorded files differ: {sorted(set(ref_names) ^ set(chaos_names))[:10]}")
        for a, b, name in zip(read_rollouts(reference), read_rollouts(chaos), ref_names):
            if not a.equals(b, check_metadata=True):
                self.problems.append(f"recorded batch {name} differs from the uninterrupted run's")
        ref_final, chaos_final = reference / "final", chaos / "final"
        for f in sorted(ref_final.iterdir()):
            if not (chaos_final / f.name).is_file() or digest(f) != digest(chaos_final / f.name):
                self.problems.append(f"final/{f.name} differs from the uninterrupted run's")

    def leftovers(self) -> None:
        """No process of any attempt, no temporary file or directory, no weights root in /dev/shm."""
        # its own ancestors (a shell, `timeout`, pytest) may carry --out in their command lines too
        ancestors = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        mine = [p for p in psutil.process_iter(["cmdline"]) if str(self.out) in " ".join(p.info["cmdline"] or [])
                and p.pid not in ancestors]
        for p in mine:
            self.problems.append(f"a process of the soak is still running: pid {p.pid} {' '.join(p.cmdline())[:160]}")
        chaos = self.out / "runs" / self.run_name("chaos")
        for p in sorted(chaos.rglob("*")):
            if p.name.endswith((".tmp", ".old")) or p.name.startswith(".tmp"):
                self.problems.append(f"a temporary file or directory is left in the run: {p.relative_to(chaos)}")
        # what every run leaves in TMPDIR, faults or not (torchrun's log directory, made before the
        # ranks own a directory of their own): only other kinds count
        baseline = temp_kinds(self.tmp_of(self.run_name("reference")))
        for kind, names in sorted(temp_kinds(self.tmp_of(self.run_name("chaos"))).items()):
            if kind not in baseline:
                self.problems.append(f"left in the run's TMPDIR, unlike the uninterrupted run's: {names[:5]}")
        self.baseline_temp = sorted(baseline)
        for name in ("chaos", "reference"):
            for p in sorted(Path("/dev/shm").glob(f"grpo-weights-{self.run_name(name)}-*")):
                self.problems.append(f"a weights root is left in /dev/shm: {p}")
        mapped = set().union(*(a.shm_inodes for a in self.attempts))
        for p in shm_files():  # what the attempts' processes mapped, still there (named semaphores, weights)
            if p.stat().st_ino in mapped:
                self.problems.append(f"a shared-memory file an attempt used is left: {p}")

    # -- all of it
    def run(self) -> int:
        t0 = time.monotonic()
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        from tests.tiny_models import make_tiny_model_dir

        self.model_dir = make_tiny_model_dir(self.out / "model", arch="qwen2")
        reference = self.start_reference()  # alongside: it shares the cores, not the outcome
        try:
            self.chaos()
            reference_rc = reference.wait()
        finally:
            for attempt in self.attempts:
                if attempt.proc.poll() is None:
                    self.reap(attempt)
            if reference.poll() is None:
                kill_tree(reference)
        wall = time.monotonic() - t0
        if reference_rc != 0:
            self.problems.append(f"the uninterrupted run failed (exit {reference_rc}): see "
                                 f"{self.out / (self.run_name('reference') + '.log')}")
        else:
            self.compare(self.out / "runs" / self.run_name("reference"), self.out / "runs" / self.run_name("chaos"))
        self.leftovers()
        return self.report(wall)

    def report(self, wall: float) -> int:
        by = collections.defaultdict(collections.Counter)
        for f in self.faults:
            by[f.kind][f.moment] += 1
        print(f"\n[soak] {self.args.mode} mode, seed {self.args.seed}: {self.final_step} steps, "
              f"{len(self.faults)} faults over {len(self.attempts)} attempts, {wall:.0f} s")
        width = max(len(m) for m in MOMENTS)
        print("  kind      " + " ".join(m.rjust(width) for m in MOMENTS) + "  total")
        for kind in KINDS:
            print(f"  {kind:<9} " + " ".join(str(by[kind][m]).rjust(width) for m in MOMENTS) +
                  f"  {sum(by[kind].values()):5d}")
        stops = [f.stop_s for f in self.faults if f.stop_s is not None and f.kind in ("rank0", "rank1")]
        if stops:
            print(f"  a killed rank ended its attempt within {max(stops):.1f} s (median {sorted(stops)[len(stops) // 2]:.1f} s)")
        by_torchrun = [f for f in self.faults if f.lost_rank_line.startswith("torchrun")]
        if by_torchrun:
            print(f"  {len(by_torchrun)} rank kills came before the process group formed: named by torchrun's report")
        unnamed = [f for f in self.faults if f.kind in ("rank0", "rank1") and not f.lost_rank_line]
        for f in unnamed:
            self.problems.append(f"{f.kind} killed at {f.moment} (attempt {f.attempt}): no line named the lost rank")
        print("  identical to the uninterrupted run, nothing left behind" if not self.problems else
              f"  {len(self.problems)} problems:")
        for p in self.problems:
            print(f"    - {p}")
        if getattr(self, "baseline_temp", None):
            print(f"  left in TMPDIR by every run, faults or not (not counted): {', '.join(self.baseline_temp)}")
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the processes the soak waited for, and theirs
        summary = {"mode": self.args.mode, "seed": self.args.seed, "steps": self.final_step,
                   "attempts": len(self.attempts), "faults": {k: dict(by[k]) for k in KINDS},
                   "faults_total": len(self.faults), "wall_s": round(wall, 1),
                   "cpu_s": round(usage.ru_utime + usage.ru_stime), "ok": not self.problems,
                   "problems": self.problems, "fault_log": [asdict(f) for f in self.faults]}
        (self.out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
        shutil.rmtree(self.tmp, ignore_errors=True)  # looked at above
        print(json.dumps({k: v for k, v in summary.items() if k != "fault_log"}))
        return 0 if not self.problems else 1


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_quietly(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        top = psutil.Process(proc.pid)
        for p in [top, *top.children(recursive=True)]:
            signal_quietly(p, signal.SIGKILL)
    except psutil.Error:
        pass
    proc.wait()


def shm_files() -> list[Path]:
    out = []
    for p in Path("/dev/shm").rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                out.append(p)
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return out


def temp_kinds(tmp: Path) -> dict[str, list[str]]:
    """The entries of a TMPDIR by kind: their names with random parts (uuids, hex, mkdtemp's suffix) as *.
    A directory of a process that still runs (grpo.fsutil.owned_dir: a rank's own TMPDIR) is in use, not left."""
    from grpo.fsutil import owned_kind, owner_gone

    kinds = collections.defaultdict(list)
    for p in sorted(tmp.iterdir()) if tmp.is_dir() else []:
        owned = owned_kind(p.name)
        if owned:
            if owner_gone(p.name):
                kinds[f"grpo-{owned}-*p*s*-*"].append(p.name)
            continue
        kind = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "*", p.name)
        kind = re.sub(r"[0-9a-f]{16,}", "*", kind)
        kind = re.sub(r"(?<=_)[a-z0-9_]{8}$", "*", kind)
        kinds[kind].append(p.name)
    return kinds


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip()[:200] for line in text.splitlines()[-lines:])


# an exception's last line ("grpo.serving.client.InferenceServerError: POST ... HTTP 400: ...", with
# torchrun's "[rank0]:" prefix or without) or the loop's own one-line error
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Timeout)\b: .*|\[train\] error: .*)$")


def failure_cause(log: str) -> str:
    """Why an attempt failed, from its log: its ranks' last exception line and the rank torchrun
    names first, not torchrun's closing banner ("error_file: <N/A> | traceback : To enable ...")."""
    causes = [line.strip() for line in log.splitlines()
              if EXCEPTION_LINE.match(line.strip()) and "ChildFailedError" not in line]
    rank = torchrun_root_cause(log)
    first = f"rank {rank} failed first: " if rank is not None else ""
    return f"{first}{causes[-1][:600]}" if causes else tail(log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("short", "long"), default="short")
    ap.add_argument("--seed", type=int, default=0, help="the faults' kinds, order and moments, and the run's seed")
    ap.add_argument("--faults-per-kind", type=int, default=20, help="long mode")
    ap.add_argument("--steps", type=int, nargs=2, metavar=("S", "M"), help="grpo.S and grpo.M (2 steps an iteration)")
    ap.add_argument("--out", default=None, help="work directory (default runs/chaos-<mode>-<seed>); replaced")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "runs" / f"chaos-{args.mode}-{args.seed}")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
