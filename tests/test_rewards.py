"""grpo/rewards.py with real math-verify in real worker processes.

One pool (2 workers) serves the module: start-up ~1 s, the 1319 x 2 GSM8K verifications ~5 s
(the full test split, from $GRPO_TEST_DATA_DIR; skipped without it), the adversarial case about one
deadline (3 s) plus a worker restart.
"""
import os
import random
import re
import time
from typing import Optional

import pytest

from grpo.data import DataConfig, read_rows
from grpo.rewards import Completion, RewardConfig, RewardScorer, boxed_contents, gold_to_latex

# The scorer's math-verify runs in worker processes: the torchrun tier (child processes).
pytestmark = pytest.mark.torchrun
TIMEOUT_S = 3.0


def extract_answer(text: str) -> Optional[str]:
    """The final answer as written: contents of the last outermost \\boxed{...}, None if there is none.

    The reference the tests compare RewardScorer's info["extracted"] with (the trainer takes that
    one, computed in time-bounded workers).
    """
    boxes = boxed_contents(text)
    return boxes[-1].strip() if boxes else None


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(workers=2, timeout_s=TIMEOUT_S)) as s:
        yield s


def score(scorer, texts, golds):
    """The scorer on completions that are text and gold answer only (what correctness reads)."""
    return scorer.score([Completion(text, gold) for text, gold in zip(texts, golds, strict=True)])


def _as_boxed(solution: str) -> str:
    """A GSM8K reference solution with its final "#### N" line rewritten as \\boxed{N} (N as written, commas too)."""
    return re.sub(r"####\s*(.+)\s*$", lambda m: f"\\boxed{{{m.group(1).strip()}}}", solution)


def _gsm8k_rows():
    """The GSM8K test split's reference solutions, boxed, and their gold answers (the full set)."""
    data_dir = os.environ.get("GRPO_TEST_DATA_DIR")
    if not data_dir or not os.path.isfile(os.path.join(data_dir, "gsm8k_test.jsonl")):
        pytest.skip("full-size check: set GRPO_TEST_DATA_DIR to a folder holding gsm8k_test.jsonl (`python -m "
                    "grpo.data fetch gsm8k_test --out DIR`) to run it")
    rows = [row for _, row in read_rows(DataConfig(dataset="gsm8k_test", data_dir=data_dir)).rows]
    gold = [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows]
    return [_as_boxed(r["answer"]) for r in rows], gold


def _worked_sums(n: int):
    """n GSM8K-style solutions written here (a sum, "#### N" boxed) and their gold answers."""
    pairs = [(3 + i, 11 * i + 4) for i in range(n)]
    return ([_as_boxed(f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b:,}") for a, b in pairs],
            [str(a + b) for a, b in pairs])


# --------------------------------------------------------------------------------------------
# Pure helpers


def test_boxed_contents():
    assert boxed_contents(r"so \boxed{x^{2}} then \boxed{\frac{1}{2}}.") == ["x^{2}", r"\frac{1}{2}"]
    assert boxed_contents(r"\boxed{a \boxed{b}} and \fbox{c}") == [r"a \boxed{b}", "c"]  # outermost only
    assert boxed_contents(r"\boxed{5} \boxed{unclosed") == ["5"]
    assert boxed_contents(r"\boxed {7}") == ["7"]
    assert boxed_contents("no box {here}") == []
    assert boxed_contents(r"}} \boxed{\{1, 2\}}") == [r"\{1, 2\}"]
    assert extract_answer(r"\boxed{1} so \boxed{ 2 }") == "2" and extract_answer("none") is None


def test_gold_to_latex():
    assert gold_to_latex("18") == r"\boxed{18}"
    assert gold_to_latex("steps\n#### 1,234") == r"\boxed{1234}"
    assert gold_to_latex(r"$\frac{1}{2}$") == r"\boxed{\frac{1}{2}}"
    assert gold_to_latex(r"\boxed{3}") == r"\boxed{3}"


def test_config_validation():
    with pytest.raises(ValueError, match="terms: unknown term 'fromat'"):
        RewardConfig(terms={"correct": 0.9, "fromat": 0.1})
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0)


# --------------------------------------------------------------------------------------------
# GSM8K: every reference solution is right, every mismatched one wrong


def test_gsm8k_reference_solutions_score_one(scorer):
    solutions, gold = _gsm8k_rows()
    assert len(solutions) == 1319 and all(s.rstrip().endswith("}") for s in solutions)
    rewards, info = score(scorer, solutions, gold)
    assert info["timeouts"] == 0 and info["errors"] == 0 and info["no_answer"] == 0
    wrong = [(i, solutions[i][-40:], gold[i]) for i, r in enumerate(rewards) if r != 1.0]
    assert wrong == []


def test_gsm8k_deranged_pairs_score_zero_unless_values_match(scorer):
    solutions, gold = _gsm8k_rows()
    n = len(gold)
    rng = random.Random(0)
    while True:  # a derangement: nobody keeps their own gold
        perm = list(range(n))
        rng.shuffle(perm)
        if all(i != j for i, j in enumerate(perm)):
            break
    other_gold = [gold[j] for j in perm]
    rewards, info = score(scorer, solutions, other_gold)
    expected = [1.0 if float(gold[i]) == float(other_gold[i]) else 0.0 for i in range(n)]
    assert 0 < sum(expected) < 0.05 * n  # a few random pairs share a value (~1%)
    assert rewards == expected
    assert info["timeouts"] == 0


# --------------------------------------------------------------------------------------------
# Format reward and modes


def test_terms_weigh_correctness_and_format():
    completions = [r"\boxed{4}", r"\boxed{5}", r"first \boxed{3} then \boxed{4}", "4", r"\boxed{2+2}"]
    golds = ["4"] * 5
    with RewardScorer(RewardConfig(workers=1, terms={"correct": 0.8, "format": 0.2})) as s:
        rewards, info = score(s, completions, golds)
    # correct, format:  (1,1)   (0,1)  (1,0) last box counts   (0,0) no box   (1,1)
    assert rewards == pytest.approx([1.0, 0.2, 0.8, 0.0, 1.0])
    assert info["correct"] == [1.0, 0.0, 1.0, 0.0, 1.0] and info["terms"]["format"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert info["no_answer"] == 1 and info["accuracy"] == pytest.approx(0.6)
    assert info["extracted"] == ["4", "5", "4", None, "2+2"]


def test_inline_mode_and_unboxed_answers():
    completions = [r"\boxed{0.5}", r"The answer is $\frac{1}{2}$.", r"\boxed{\frac{2}{4}}", r"\boxed{1/3}"]
    golds = [r"\frac{1}{2}"] * 4
    with RewardScorer(RewardConfig(workers=0)) as s:
        assert score(s, completions, golds)[0] == [1.0, 0.0, 1.0, 0.0]
    with RewardScorer(RewardConfig(workers=0, require_boxed=False)) as s:
        assert score(s, completions, golds)[0] == [1.0, 1.0, 1.0, 0.0]
        # Unboxed, the last number counts: listing candidates does not earn the reward.
        assert score(s, ["19 20 21 22", "2 + 17 = 19", "2 + 17 = 19, no wait 20"], ["19"] * 3)[0] == [0.0, 1.0, 0.0]


def test_duplicates_are_scored_once(scorer):
    rewards, info = score(scorer, [r"\boxed{7}"] * 6 + [r"\boxed{8}"] * 2, ["7"] * 8)
    assert rewards == [1.0] * 6 + [0.0] * 2 and info["unique_pairs"] == 2 and info["n"] == 8


# --------------------------------------------------------------------------------------------
# Adversarial text and dead workers


def test_adversarial_completions_time_out_and_pool_recovers(scorer):
    tower = r"Surely \boxed{10^{10^{10^{10}}}}"  # sympy never finishes comparing this with 5
    braces = r"\boxed{" + "{" * 500_000 + "1" + "}" * 500_000 + "}"  # a megabyte of nested braces
    old_pids = {w.process.pid for w in scorer.pool._workers}
    start = time.monotonic()
    rewards, info = score(scorer, [tower, braces, r"\boxed{5}"], ["5", "5", "5"])
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 0.0, 1.0]
    assert info["timeouts"] == 2
    # Both run in parallel and are cut at the deadline; the third waits for a fresh worker (~1 s idle).
    assert elapsed < TIMEOUT_S + 12, elapsed  # slack for a worker restart on a contended machine
    assert not old_pids & {w.process.pid for w in scorer.pool._workers}  # the stuck workers were replaced
    solutions, gold = _worked_sums(40)
    rewards, info = score(scorer, solutions, gold)
    assert rewards == [1.0] * 40 and info["timeouts"] == 0
    assert scorer.total_timeouts >= 2


def test_tasks_queued_behind_a_stuck_one_are_rescored():
    # One worker: the two easy completions are queued behind the tower (pipelining), so when the
    # worker is killed they must go back to the queue and be scored by its replacement. The deadline
    # is the tower's; the replacement's first answer must fit in it on a loaded machine (CI once scored
    # it 0, most likely a timeout while a fresh worker's first answer still built math-verify's tables).
    with RewardScorer(RewardConfig(workers=1, timeout_s=TIMEOUT_S)) as s:
        s.wait_ready()
        rewards, info = score(s, [r"\boxed{10^{10^{10^{10}}}}", r"\boxed{1}", r"\boxed{2}"], ["5", "1", "3"])
    assert (rewards, info["timeouts"], info["errors"]) == ([0.0, 1.0, 0.0], 1, 0), info  # info: which path scored it


_FIRST_ANSWER_WORK = """
import sys
from dataclasses import asdict
from types import SimpleNamespace

from grpo.rewards import CORRECT, TERMS, Completion, RewardConfig

term, cfg = TERMS[CORRECT], SimpleNamespace(**asdict(RewardConfig()))
term.setup()


def calls(completion):
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event == "call"

    sys.setprofile(count)
    try:
        assert term.fn(completion, cfg).status == "ok"
    finally:
        sys.setprofile(None)
    return n


print(*(calls(Completion(text, gold)) for text, gold in [(r"so \\boxed{7}", "7"), (r"so \\boxed{8}", "9")]))
"""


def test_a_fresh_workers_first_answer_costs_what_later_ones_do():
    """The correctness term's setup runs before a worker says ready, outside every deadline. It used
    to import math-verify only, and the first answer then compiled its regexes and built the LaTeX
    parser's tables inside its deadline: 265847 Python calls against 6441 for the next one, enough
    on a loaded machine to time out a replaced worker's first, correct, answer. Counted in calls,
    not seconds, in a fresh interpreter as a worker is one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:] = {sys.path!r}\n" + _FIRST_ANSWER_WORK],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, later = map(int, out.stdout.split())
    assert first < 2 * later, (first, later)


def test_killed_worker_is_replaced(scorer):
    """A worker that dies while it serves (crash, OOM kill) is replaced and its tasks rescored. One
    that dies before it is ready ends the scoring instead (the pool cannot tell a broken set-up from
    a kill), so the victim must be ready first: alone, or first in its file, this test used to kill
    a worker still importing math-verify."""
    scorer.wait_ready()
    victim = scorer.pool._workers[0].process
    victim.kill()
    victim.wait()
    rewards, info = score(scorer, [r"\boxed{1}", r"\boxed{2}", r"\boxed{3}"], ["1", "2", "4"])
    assert rewards == [1.0, 1.0, 0.0] and info["errors"] == 0
    assert victim.pid not in {w.process.pid for w in scorer.pool._workers}


def test_two_threads_scoring_at_once_each_get_their_own_results():
    """The asynchronous sampler scores from one thread per server through the run's one scorer.
    Before, two callers shared the workers' pipes unguarded: one read the other's results (another
    batch's rewards, or a key past its own list) and the other waited forever for a result already
    taken (an async run on two servers hung in its close, its last sampler blocked in recv)."""
    import threading

    n = 24
    cases = {"right": [str(i) for i in range(n)], "wrong": [str(i + 1) for i in range(n)]}
    texts = [f"so \\boxed{{{i}}}" for i in range(n)]
    got: dict[str, list] = {name: [] for name in cases}

    def score_repeatedly(name):
        try:
            for _ in range(6):
                got[name].append(score(shared, texts, cases[name])[1]["correct"])
        except BaseException as e:  # noqa: BLE001 - reported below
            got[name].append(e)

    with RewardScorer(RewardConfig(workers=1, timeout_s=TIMEOUT_S)) as shared:
        shared.wait_ready()
        threads = [threading.Thread(target=score_repeatedly, args=(name,), daemon=True) for name in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller is still waiting for its results"
    assert got["right"] == [[1.0] * n] * 6, got["right"]
    assert got["wrong"] == [[0.0] * n] * 6, got["wrong"]


def test_close_ends_workers():
    s = RewardScorer(RewardConfig(workers=2))
    s.wait_ready()
    assert all(w.ready for w in s.pool._workers)
    assert score(s, [r"\boxed{3}"], ["3"])[0] == [1.0]
    processes = [w.process for w in s.pool._workers]
    s.close()
    assert all(p.poll() is not None for p in processes)
