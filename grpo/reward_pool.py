"""The worker pool that runs reward terms with a deadline each: infrastructure, no reward maths.

Why. math-verify (sympy underneath) can run for ever on adversarial text (`10^{10^{10^{10}}}`
never finishes comparing; 1000 nested braces take ~16 s to parse), and its own signal.alarm
timeouts only work on a process's main thread. So a term registered with pool=True
(grpo/rewards.py: math-verify correctness) runs in a worker process, with a deadline measured here:
a worker past its deadline is killed and replaced (~1 s to start a new one), its task ends with
status "timeout" (the caller scores it as the term's minimum). The pool is created once and runs
tasks in parallel, PIPELINE_DEPTH queued per worker.

workers=0 runs the tasks in this process instead, each bounded by a SIGALRM timer (main thread
only): for tests and benchmarks.

A task is (term name, completion); a result is (value or None, status, answer): status "ok",
"no_answer", "error: ..." (the term's own report), "timeout", or "failed: ..." (the term raised,
returned NaN or inf, or its worker died: the same in a worker and in the trainer's process,
`run_term`); answer is what the term extracted (the correctness term: the last \\boxed{} content),
or None. A result without a value scores the term's minimum (grpo/rewards.py counts failures).
"""
from __future__ import annotations

import collections
import importlib
import logging
import math
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

PIPELINE_DEPTH = 2  # tasks queued per worker, so it starts the next one without a round trip
PIPELINE_MAX_CHARS = 16_000  # larger tasks go only to idle workers (socket buffer ~200 KB)

Result = tuple[Optional[float], str, Optional[str]]
FAILED = "failed"  # the status of a task the term did not score: it raised, returned NaN/inf, or its worker died


def load_terms(sources: dict[str, tuple[str, str, str]]) -> dict:
    """name -> function for each term of `sources`: name -> (module, file, function name); a plugin
    module (grpo.registry.import_plugin) is imported by its file, any other by its name."""
    from grpo import registry

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the pool bounds it
    out = {}
    for name, (module, file, attr) in sources.items():
        loaded = registry.import_plugin(file) if module.startswith(registry.PLUGIN_PREFIX) \
            else importlib.import_module(module)
        out[name] = getattr(loaded, attr)
    return out


def run_term(fn, completion, cfg) -> Result:
    """One task, as a worker and the trainer's process run it: the term's value, status, answer (a
    term returns a number, or an object with value, status and answer: grpo.rewards.Scored). A term
    that raises, returns NaN or inf, or returns no number failed on this completion: no value,
    status "failed: why" (scored as its minimum and counted by the caller)."""
    try:
        out = fn(completion, cfg)
        value, status, answer = (out.value, out.status, out.answer) if hasattr(out, "status") else (out, "ok", None)
        value = float(value)
    except Exception as e:  # a broken term on one completion: counted, scored as its minimum
        return None, f"{FAILED}: {type(e).__name__}: {e}"[:200], None
    if not math.isfinite(value):
        return None, f"{FAILED}: returned {value}", answer
    return value, status, answer


def _worker_main(fd: int, sources: dict[str, tuple[str, str, str]], setups: list[tuple[str, str, str]],
                 cfg: dict) -> None:
    """Worker loop on a socket: receive (key, term, completion), send (key, value, status, answer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; close() ends us
    terms = load_terms(sources)
    for setup in load_terms(dict(enumerate(setups))).values():  # slow imports and first calls, before
        setup()                                                # saying ready, so that deadlines exclude them
    settings = SimpleNamespace(**cfg)
    conn = multiprocessing.connection.Connection(fd)
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer went away
            return
        if message is None:
            return
        key, name, completion = message
        conn.send((key, *run_term(terms[name], completion, settings)))


class _Worker:
    """One process: a fresh interpreter (not multiprocessing's spawn/forkserver, which would
    re-import the trainer's __main__, torch and vLLM included, in every worker), talking over a
    socket pair with multiprocessing's message framing. -I: neither the working directory nor
    PYTHON* variables can shadow modules; it gets the trainer's sys.path explicitly."""

    def __init__(self, sources: dict, setups: list, cfg: dict):
        parent_sock, child_sock = socket.socketpair()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        child_fd = child_sock.detach()
        code = (f"import sys; sys.path[:] = {sys.path!r}; from grpo.reward_pool import _worker_main; "
                f"_worker_main({child_fd}, {sources!r}, {setups!r}, {cfg!r})")
        try:
            self.process = subprocess.Popen([sys.executable, "-I", "-c", code], pass_fds=[child_fd],
                                            stdin=subprocess.DEVNULL)
        finally:
            os.close(child_fd)
        self.started_at = time.monotonic()
        self.ready = False
        self.queue: collections.deque[int] = collections.deque()  # keys sent, head being run
        self.deadline = math.inf  # for the head of the queue

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class _Deadline(Exception):
    pass


class WorkerPool:
    """Runs (term, completion) tasks with a deadline each, in `workers` processes (0: in this one).

    sources: term name -> (module, file, function name) of every term a task may name (their modules
    are imported in each worker); setups: functions, named the same way, each worker runs before
    it says ready (slow imports, first-call set-up: outside every deadline); cfg: the reward section
    as a plain dict (a term reads its knobs)."""

    def __init__(self, workers: int, timeout_s: float, start_timeout_s: float, sources: dict, setups: list,
                 cfg: dict):
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.sources, self.setups, self.cfg = sources, setups, cfg
        self.total_timeouts = 0  # over the pool's life, for logging
        self._workers: list[_Worker] = [_Worker(sources, setups, cfg) for _ in range(workers)]
        self._inline = workers == 0
        # One caller at a time: a message on a worker's pipe carries a key into its caller's task
        # list, so two callers at once (the asynchronous sampler's thread per server) would read each
        # other's results, and one would wait forever for a result the other took.
        self._one_caller = threading.Lock()

    def run(self, tasks: list[tuple[str, Any]]) -> list[Result]:
        with self._one_caller:
            results = self._run_inline(tasks) if self._inline else self._run_pool(tasks)
            self.total_timeouts += sum(status == "timeout" for _, status, _ in results)
        return results

    def wait_ready(self) -> None:
        """Block until every worker has started (run() does not need this; benchmarks do)."""
        for worker in self._workers:
            while not worker.ready:
                left = worker.started_at + self.start_timeout_s - time.monotonic()
                if left <= 0 or not worker.conn.poll(left):
                    raise RuntimeError(f"reward worker not ready after {self.start_timeout_s} s")
                try:
                    worker.ready = worker.conn.recv() == "ready"
                except (EOFError, OSError):
                    raise RuntimeError(f"reward worker exited during start-up "
                                       f"(exit code {worker.process.wait()})") from None

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            worker.kill()
        self._workers = []

    # -- in this process ----------------------------------------------------------------------

    def _run_inline(self, tasks) -> list[Result]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("reward.workers=0 bounds each term with SIGALRM: call it from the main thread "
                               "or use workers >= 1")
        terms = load_terms(self.sources)
        settings = SimpleNamespace(**self.cfg)

        def expire(*_):
            raise _Deadline

        results = []
        previous = signal.signal(signal.SIGALRM, expire)
        try:
            for name, completion in tasks:
                try:
                    signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
                    results.append(run_term(terms[name], completion, settings))
                except _Deadline:
                    results.append((None, "timeout", None))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)
        return results

    # -- in the workers -------------------------------------------------------------------------

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self.sources, self.setups, self.cfg)

    def _run_pool(self, tasks) -> list[Result]:
        """Hand tasks to workers, at most PIPELINE_DEPTH queued each so none idles between tasks;
        the head of a worker's queue has the deadline. A worker past it is replaced: its head ends
        with status "timeout", the tasks queued behind it go back to the pending queue."""
        results: list = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        n_done = 0

        def retire(i: int, head_status: str) -> None:
            nonlocal n_done
            worker = self._workers[i]
            if worker.queue:
                results[worker.queue.popleft()] = (None, head_status, None)
                n_done += 1
                pending.extendleft(reversed(worker.queue))
            self._replace(i)

        while n_done < len(tasks):
            now = time.monotonic()
            for i, worker in enumerate(list(self._workers)):  # top up ready workers' queues
                while worker.ready and pending and len(worker.queue) < PIPELINE_DEPTH:
                    key = pending[0]
                    name, completion = tasks[key]
                    # A busy worker reads its socket only between tasks: never queue a message
                    # that might not fit in the socket buffer behind a task that may hang.
                    if worker.queue and _size(completion) > PIPELINE_MAX_CHARS:
                        break
                    try:
                        worker.conn.send((key, name, completion))
                    except OSError:  # it died: replace it; the task stays pending
                        retire(i, f"{FAILED}: worker died (exit code {worker.process.poll()})")
                        break
                    pending.popleft()
                    if not worker.queue:
                        worker.deadline = now + self.timeout_s
                    worker.queue.append(key)
            waits = [w.deadline if w.ready else w.started_at + self.start_timeout_s for w in self._workers]
            wait_s = max(0.0, min(waits) - now)
            ready_conns = multiprocessing.connection.wait([w.conn for w in self._workers], timeout=wait_s)
            for i, worker in enumerate(list(self._workers)):
                if worker.conn not in ready_conns:
                    continue
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):  # the worker died (crash, OOM kill)
                    if not worker.ready:
                        worker.kill()
                        raise RuntimeError(f"reward worker exited during start-up "
                                           f"(exit code {worker.process.returncode})") from None
                    retire(i, f"{FAILED}: worker died (exit code {worker.process.poll()})")
                    continue
                if message == "ready":
                    worker.ready = True
                    continue
                key, *result = message
                results[key] = tuple(result)
                n_done += 1
                worker.queue.popleft()  # results come back in the order tasks were sent
                # The worker moved on to the next queued task as it sent this result.
                worker.deadline = time.monotonic() + self.timeout_s if worker.queue else math.inf
            now = time.monotonic()
            for i, worker in enumerate(list(self._workers)):
                if worker.ready and worker.queue and now >= worker.deadline:
                    retire(i, "timeout")
                elif not worker.ready and now >= worker.started_at + self.start_timeout_s:
                    raise RuntimeError(f"reward worker not ready after {self.start_timeout_s} s")
        return results


def _size(completion) -> int:
    """Characters a task carries (what fills the socket buffer)."""
    return len(getattr(completion, "text", "")) + len(getattr(completion, "gold", "") or "")
