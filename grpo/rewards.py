"""Rewards r(x, y) in [0, 1]: math-verify correctness of the last \\boxed{} answer, plus an optional format term.

    r = (1 - format_weight) * correct + format_weight * format_ok

where correct = 1 when math-verify finds the completion's final answer equal to the gold answer,
and format_ok = 1 when the completion holds exactly one balanced \\boxed{...}.

Time bound. math-verify (sympy underneath) can run for ever on adversarial text (`10^{10^{10^{10}}}`
never finishes comparing; 1000 nested braces take ~16 s to parse), and its own signal.alarm
timeouts only work on a process's main thread. So every completion is scored in a worker process
(everything, brace matching included) with a deadline measured in the trainer: a worker past its
deadline is killed and replaced (~1 s to start a new one), its completion scores 0 and is counted
in info["timeouts"]. The pool is created once and scores completions in parallel.
"""
from __future__ import annotations

import collections
import logging
import math
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

_THIS_FILE = os.path.abspath(__file__)  # workers run this file (see _Worker)
PIPELINE_DEPTH = 2  # tasks queued per worker, so it starts the next one without a round trip
PIPELINE_MAX_CHARS = 16_000  # larger tasks go only to idle workers (socket buffer ~200 KB)
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


@dataclass
class RewardConfig:
    format_weight: float = 0.0  # weight of the format term (exactly one \boxed{}); correctness gets 1 - this
    timeout_s: float = 5.0  # deadline per completion in a worker; past it the completion scores 0
    workers: int = 2  # worker processes; 0 = score in this process (main thread only, math-verify's alarm)
    # No \boxed{} -> correct = 0. False: math-verify takes the answer from the text ("the answer is",
    # else the last number), for models that rarely box (SmolLM2-135M: 56 of 64 samples unboxed).
    require_boxed: bool = True
    start_timeout_s: float = 120.0  # a worker not ready after this long is an error (e.g. import failure)

    def __post_init__(self):
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"format_weight: must be in [0, 1], got {self.format_weight}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.workers < 0:
            raise ValueError(f"workers: must be >= 0, got {self.workers}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")


# ---------------------------------------------------------------------------------------------
# Pure functions (run inside the workers)


def boxed_contents(text: str) -> list[str]:
    """Contents of the outermost balanced \\boxed{...} (or \\fbox{...}) in order of appearance.

    One linear pass over the braces with a stack, so a megabyte of braces costs well under a
    second; an unclosed \\boxed{ is not an answer.
    """
    boxed_braces = {m.end() - 1 for m in _BOXED_OPEN.finditer(text)}
    if not boxed_braces:
        return []
    stack, spans = [], []
    for m in _BRACE.finditer(text):
        i = m.start()
        if text[i] == "{":
            stack.append(i)
        elif stack:
            j = stack.pop()
            if j in boxed_braces:
                spans.append((j, i))
    spans.sort()
    outermost, end = [], -1
    for j, i in spans:
        if j > end:  # not nested inside the previous outermost box
            outermost.append(text[j + 1:i])
            end = i
    return outermost


def gold_to_latex(gold: str) -> str:
    """Gold answer as text math-verify extracts reliably: \\boxed{gold} (a raw '#### N' gives N)."""
    gold = gold.strip()
    if "\\boxed" in gold:
        return gold
    if "####" in gold:  # a GSM8K solution passed as gold
        gold = gold.rsplit("####", 1)[1].strip().replace(",", "")
    if len(gold) >= 2 and gold[0] == gold[-1] == "$":
        gold = gold.strip("$")
    return f"\\boxed{{{gold}}}"


def score_one(completion: str, gold: str, require_boxed: bool, timeout: Optional[int] = None,
              gold_cache: Optional[dict] = None) -> tuple[float, float, str, Optional[str]]:
    """(correct, format_ok, status, extracted) for one completion.

    status is "ok", "no_answer" or "error: ..."; extracted is the last \\boxed{} content (first
    1000 characters), None if there is none.

    `timeout` is math-verify's own signal.alarm bound (main thread only); workers pass None.
    """
    from math_verify import parse, verify

    boxes = boxed_contents(completion)
    format_ok = 1.0 if len(boxes) == 1 else 0.0
    extracted = boxes[-1].strip()[:1000] if boxes else None
    if boxes:
        answer_text = f"\\boxed{{{boxes[-1]}}}"
    elif require_boxed:
        return 0.0, format_ok, "no_answer", None
    else:
        answer_text = completion
    try:
        if gold_cache is not None and gold in gold_cache:
            gold_parsed = gold_cache[gold]
        else:
            gold_parsed = parse(gold_to_latex(gold), parsing_timeout=timeout)
            if gold_cache is not None:
                if len(gold_cache) > 4096:
                    gold_cache.clear()
                gold_cache[gold] = gold_parsed
        answer_parsed = parse(answer_text, parsing_timeout=timeout)
        correct = verify(gold_parsed, answer_parsed, timeout_seconds=timeout)
    except Exception as e:  # math-verify raises rarely; a broken answer is a wrong answer, but count it
        return 0.0, format_ok, f"error: {type(e).__name__}: {e}"[:200], extracted
    return (1.0 if correct else 0.0), format_ok, "ok", extracted


def _worker_main(fd: int, require_boxed: bool) -> None:
    """Worker loop on a socket: receive (key, completion, gold), send (key, *score_one(...))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; close() ends us
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": we bound it
    import math_verify  # noqa: F401  (import before saying ready, so deadlines exclude it)

    conn = multiprocessing.connection.Connection(fd)
    gold_cache: dict = {}
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer went away
            return
        if message is None:
            return
        key, completion, gold = message
        conn.send((key, *score_one(completion, gold, require_boxed, None, gold_cache)))


# ---------------------------------------------------------------------------------------------
# The pool


class _Worker:
    """One scoring process: a fresh interpreter (not multiprocessing's spawn/forkserver, which
    would re-import the trainer's __main__, torch and vLLM included, in every worker), talking
    over a socket pair with multiprocessing's message framing."""

    def __init__(self, require_boxed: bool):
        parent_sock, child_sock = socket.socketpair()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        child_fd = child_sock.detach()
        # Run this file, not the package: whatever grpo/__init__ comes to import stays out of the
        # workers. -I: neither the working directory nor PYTHON* variables can shadow modules.
        code = (f"import runpy; runpy.run_path({_THIS_FILE!r}, run_name='grpo_reward_worker')"
                f"['_worker_main']({child_fd}, {require_boxed!r})")
        try:
            self.process = subprocess.Popen([sys.executable, "-I", "-c", code], pass_fds=[child_fd],
                                            stdin=subprocess.DEVNULL)
        finally:
            os.close(child_fd)
        self.started_at = time.monotonic()
        self.ready = False
        self.queue: collections.deque[int] = collections.deque()  # keys sent, head being scored
        self.deadline = math.inf  # for the head of the queue

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class RewardScorer:
    """Scores completions against gold answers in worker processes with a per-completion deadline.

    with RewardScorer(RewardConfig(workers=2)) as scorer:
        rewards, info = scorer.score(completions, golds)

    info: n, correct (list of 0/1), format_ok (list), extracted (list of last \\boxed{} contents or
    None), accuracy, timeouts, errors (math-verify raised or a worker died), no_answer (no balanced
    \\boxed{} while require_boxed), unique_pairs, seconds.
    """

    def __init__(self, cfg: Optional[RewardConfig] = None):
        self.cfg = cfg or RewardConfig()
        self._workers: list[_Worker] = []
        self.total_timeouts = 0  # over the scorer's life, for logging
        self._inline_gold_cache: dict = {}  # workers=0: parsed gold answers, as each worker keeps
        if self.cfg.workers > 0:
            self._workers = [_Worker(self.cfg.require_boxed) for _ in range(self.cfg.workers)]

    # -- public ---------------------------------------------------------------------------------

    def score(self, completions: list[str], golds: list[str]) -> tuple[list[float], dict]:
        if len(completions) != len(golds):
            raise ValueError(f"score: {len(completions)} completions but {len(golds)} gold answers")
        t0 = time.monotonic()
        # Identical (completion, gold) pairs are scored once: GRPO groups often repeat short answers.
        unique: dict[tuple[str, str], int] = {}
        keys = [unique.setdefault((c, g), len(unique)) for c, g in zip(completions, golds)]
        pairs = list(unique)
        if self.cfg.workers == 0:
            results = self._score_inline(pairs)
        else:
            results = self._score_pool(pairs)
        correct = [results[k][0] for k in keys]
        format_ok = [results[k][1] for k in keys]
        w = self.cfg.format_weight
        rewards = [(1.0 - w) * c + w * f for c, f in zip(correct, format_ok)]
        statuses = [results[k][2] for k in keys]
        timeouts = statuses.count("timeout")
        self.total_timeouts += timeouts
        info = {
            "n": len(completions),
            "correct": correct,
            "format_ok": format_ok,
            "extracted": [results[k][3] for k in keys],
            "accuracy": sum(correct) / max(len(correct), 1),
            "timeouts": timeouts,
            "errors": sum(s.startswith(("error", "worker died")) for s in statuses),
            "no_answer": statuses.count("no_answer"),
            "unique_pairs": len(pairs),
            "seconds": time.monotonic() - t0,
        }
        return rewards, info

    def wait_ready(self) -> None:
        """Block until every worker has started (score() does not need this; benchmarks do)."""
        for worker in self._workers:
            while not worker.ready:
                left = worker.started_at + self.cfg.start_timeout_s - time.monotonic()
                if left <= 0 or not worker.conn.poll(left):
                    raise RuntimeError(f"reward worker not ready after {self.cfg.start_timeout_s} s")
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

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- inside ---------------------------------------------------------------------------------

    def _score_inline(self, pairs):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("RewardScorer(workers=0) relies on signal.alarm: call it from the main thread "
                               "or use workers >= 1")
        timeout = max(1, math.ceil(self.cfg.timeout_s))  # math-verify's alarm has whole seconds
        return [score_one(c, g, self.cfg.require_boxed, timeout, self._inline_gold_cache) for c, g in pairs]

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self.cfg.require_boxed)

    def _score_pool(self, pairs):
        """Hand pairs to workers, at most PIPELINE_DEPTH queued each so none idles between
        tasks; the head of a worker's queue has the deadline. A worker past it is replaced: its
        head scores 0 ("timeout"), the tasks queued behind it go back to the pending queue."""
        results: list = [None] * len(pairs)
        pending = collections.deque(range(len(pairs)))
        n_done = 0

        def retire(i: int, head_status: str) -> None:
            nonlocal n_done
            worker = self._workers[i]
            if worker.queue:
                results[worker.queue.popleft()] = (0.0, 0.0, head_status, None)
                n_done += 1
                pending.extendleft(reversed(worker.queue))
            self._replace(i)

        while n_done < len(pairs):
            now = time.monotonic()
            for i, worker in enumerate(list(self._workers)):  # top up ready workers' queues
                while worker.ready and pending and len(worker.queue) < PIPELINE_DEPTH:
                    key = pending[0]
                    completion, gold = pairs[key]
                    # A busy worker reads its socket only between tasks: never queue a message
                    # that might not fit in the socket buffer behind a task that may hang.
                    if worker.queue and len(completion) + len(gold) > PIPELINE_MAX_CHARS:
                        break
                    try:
                        worker.conn.send((key, completion, gold))
                    except OSError:  # it died: replace it; the task stays pending
                        retire(i, f"worker died (exit code {worker.process.poll()})")
                        break
                    pending.popleft()
                    if not worker.queue:
                        worker.deadline = now + self.cfg.timeout_s
                    worker.queue.append(key)
            waits = [w.deadline if w.ready else w.started_at + self.cfg.start_timeout_s for w in self._workers]
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
                    retire(i, f"worker died (exit code {worker.process.poll()})")
                    continue
                if message == "ready":
                    worker.ready = True
                    continue
                key, *result = message
                results[key] = tuple(result)
                n_done += 1
                worker.queue.popleft()  # results come back in the order tasks were sent
                # The worker moved on to the next queued task as it sent this result.
                worker.deadline = time.monotonic() + self.cfg.timeout_s if worker.queue else math.inf
            now = time.monotonic()
            for i, worker in enumerate(list(self._workers)):
                if worker.ready and worker.queue and now >= worker.deadline:
                    retire(i, "timeout")
                elif not worker.ready and now >= worker.started_at + self.cfg.start_timeout_s:
                    raise RuntimeError(f"reward worker not ready after {self.cfg.start_timeout_s} s")
        return results
