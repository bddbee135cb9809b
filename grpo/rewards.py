"""Rewards r(x, y) as a weighted sum of registered terms, each a pure function of one completion.

    reward:
      terms: {correct: 1.0, format: 0.1}         # r = sum_t weight_t * term_t(completion)

A term sees one completion: its text, token count, whether it was truncated, the budget it was
sampled under, the gold answer and the problem (`Completion`). It is registered by name with the
range of its values, its knobs (fields of the `reward:` section) and whether it must run in the
worker pool (grpo/reward_pool.py: a time-bounded process, for math-verify) or may run in-process:

    @register_term("concise", range=(0.0, 1.0), equation="1 - num_tokens / max_tokens")
    def concise(c: Completion, cfg) -> float:
        return 1.0 - c.num_tokens / c.max_tokens

The range may be a function of the config, `range=lambda cfg, max_tokens: (lo, hi)` (the `reward:`
section and the completion budget, grpo.max_new_tokens in training), so that it says what can
actually fire: a penalty that cannot fire under the config has the range (0, 0).

Shipped: `correct` (math-verify equivalence of the last \\boxed{} answer with the gold one, in
the pool), `format` (exactly one balanced \\boxed{}) and `overlong` (DAPO's soft overlong
penalty). The reward's range, the weighted sum of the terms' ranges (`reward_range`; a term with
weight 0 adds nothing), is what the objective scales rewards by for the bound's M
(grpo/advantages.py); a term whose range leaves [0, 1] (a penalty) is allowed. Each configured
term's batch mean is logged (reward_term_<name>), and correctness is always checked, whatever its
weight: it is the task's measure (pass_rate, eval).

A term that raises, or returns NaN or inf, on one completion is handled alike in this process and
in the worker pool (grpo.reward_pool.run_term): the completion scores the term's minimum and the
failure is counted (reward_failed_<name> per batch); more than `reward.max_failed_frac` of one
batch's completions failed by one term stops the run with one line naming it (`RewardError`). A
finite value outside the term's declared range is a `RewardError` at once, naming the term and the
value: the bound's M would be wrong.
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

from grpo import metrics, registry
from grpo.registry import Knob
from grpo.reward_pool import FAILED, WorkerPool, run_term

_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
CORRECT = "correct"  # the term that decides pass_rate and the evaluation's pass@k


@dataclass(frozen=True)
class Completion:
    """What a reward term sees of one sampled completion."""

    text: str
    gold: str  # the problem's gold answer
    num_tokens: Optional[int] = None  # completion tokens
    truncated: bool = False  # cut at the budget without an end-of-sequence token
    max_tokens: Optional[int] = None  # the budget it was sampled under (grpo.max_new_tokens, eval.max_tokens)
    problem: Any = None  # the grpo.data.Problem it answers (id, prompt, answer, source)


@dataclass(frozen=True)
class Scored:
    """A term's value with what it saw: status "ok", "no_answer" or "error: ..."; answer: what it
    extracted (the correctness term: the last \\boxed{} content), for evaluation's majority vote."""

    value: float
    status: str = "ok"
    answer: Optional[str] = None


class RewardError(ValueError):
    """A reward term the run cannot trust: a value outside its declared range, or failures on more
    than reward.max_failed_frac of a batch. One line naming the term (a ValueError: while a config
    is read, a range function's bad answer is a config error)."""


Range = Union[tuple[float, float], Callable[[Any, Optional[int]], tuple[float, float]]]


@dataclass(frozen=True)
class Term:
    name: str
    fn: Callable[[Completion, Any], Any]  # (completion, reward cfg) -> float | Scored
    range: Range  # [lo, hi] of its values, or (reward cfg, budget) -> [lo, hi]; a failed completion scores lo
    pool: bool  # runs in the worker pool with a deadline (grpo/reward_pool.py), else in-process
    equation: str
    paper: str
    knobs: tuple = ()
    setup: Optional[Callable[[], None]] = None  # run once in each worker before it says ready (slow imports, first-call set-up)

    @property
    def source(self) -> tuple[str, str, str]:
        """(module, file, function name): where the worker pool finds the term."""
        return _source(self.fn)

    def range_at(self, cfg, max_tokens: Optional[int]) -> tuple[float, float]:
        """[lo, hi] of its values under the `reward:` section cfg, for completions sampled under a
        budget of max_tokens tokens (None: not known). RewardError when a range function gives none."""
        if not callable(self.range):
            return self.range
        with registry.blame("reward term", self.name, self.fn.__module__):
            lo, hi = self.range(cfg, max_tokens)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise RewardError(f"reward term {self.name}: its range at max_tokens={max_tokens} is {(lo, hi)}: it must "
                              f"be finite with lo <= hi ({registry.origin(self.fn.__module__)})")
        return float(lo), float(hi)


def _source(fn) -> tuple[str, str, str]:
    return fn.__module__, inspect.getfile(fn), fn.__name__


TERMS: dict[str, Term] = {}


def register_term(name: str, *, range: Range, equation: str, paper: str = "-", pool: bool = False,
                  knobs: tuple = (), setup: Optional[Callable[[], None]] = None):
    """Decorator: register fn(c: Completion, cfg) -> float (or Scored) as the reward term `name`;
    cfg is the `reward:` section (its knobs). range: (lo, hi), or a function (cfg, max_tokens) ->
    (lo, hi) of the `reward:` section and the completion budget, for a range that follows the
    config. Its batch mean is logged as reward_term_<name>, its failures as reward_failed_<name>."""
    if not callable(range):
        lo, hi = range
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"term {name}: range must be finite with lo < hi, got {range}")
        range = (float(lo), float(hi))
    shown = f"range [{range[0]:g}, {range[1]:g}]" if not callable(range) else "range: a function of the config"

    def register(fn):
        registry.register(TERMS, name, Term(name, fn, range, pool, equation, paper, tuple(knobs), setup), "reward term")
        metrics.declare(f"reward_term_{name}", "rollout", f"batch mean of the reward term `{name}` before its weight "
                        f"({shown}): {equation}", module=fn.__module__)
        return fn
    return register


metrics.declare("reward_failed_*", "rollout", "reward_failed_<term>: completions of the batch on which that reward term "
                "raised or returned NaN/inf, each scored the term's minimum (past `reward.max_failed_frac` of a batch "
                "the run stops)")


def knobs() -> list[Knob]:
    return registry.unique_knobs(term.knobs for term in TERMS.values())


def owners() -> list[registry.Owner]:
    """The terms as owners of their knobs: a term's knobs have an effect while it is in reward.terms
    (correctness always: it is checked whatever its weight)."""
    return [registry.Owner("reward term", term.name, term.knobs, term.fn.__module__,
                           lambda cfg, name=term.name: name == CORRECT or name in cfg.terms,
                           f"reward.terms: {{{term.name}: <weight>}}")
            for term in TERMS.values()]


# ---------------------------------------------------------------------------------------------
# The `reward:` section


@dataclass
@registry.with_knobs(owners)  # + every registered term's knobs: require_boxed, overlong_buffer, ...
class RewardConfig:
    terms: dict[str, float] = field(default_factory=lambda: {CORRECT: 1.0})
    """the reward, term name -> weight: r = sum_t weight_t * term_t (registered terms: docs/objectives.md)."""
    timeout_s: float = 5.0  # deadline per completion for a pool term; past it the completion scores the term's minimum
    workers: int = 2  # worker processes of the pool; 0 = run pool terms in this process (main thread only)
    start_timeout_s: float = 120.0  # a worker not ready after this long is an error (e.g. import failure)
    max_failed_frac: float = 0.25  # a term that raised or returned NaN/inf on more than this fraction of one batch's completions stops the run (each failure scores the term's minimum and is counted: reward_failed_<term>)

    def __post_init__(self):
        if not isinstance(self.terms, dict) or not self.terms:
            raise ValueError(f"terms: a mapping of term name to weight, e.g. {{correct: 1.0}}, got {self.terms!r}")
        for name, weight in self.terms.items():
            if name not in TERMS:
                raise ValueError(f"terms: unknown term {name!r} (registered: {sorted(TERMS)})")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"terms: {name}: the weight must be a finite number, got {weight!r}")
        if not any(self.terms.values()):
            raise ValueError("terms: the weighted reward has no range ([0, 0]): give a term a nonzero weight")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.workers < 0:
            raise ValueError(f"workers: must be >= 0, got {self.workers}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if not 0.0 <= self.max_failed_frac <= 1.0:
            raise ValueError(f"max_failed_frac: must be in [0, 1] (1: never stop), got {self.max_failed_frac}")
        registry.check_section(self)


def reward_range(cfg: RewardConfig, max_tokens: Optional[int] = None) -> tuple[float, float]:
    """[lo, hi] of the weighted sum for completions sampled under a budget of max_tokens tokens: each
    term's range under the config times its weight, added (what the bound's M scales rewards by;
    [0, 1] for the default `{correct: 1.0}`). Only what can fire widens it: a term with weight 0
    adds nothing, and a range that follows the config is (0, 0) where the term cannot fire."""
    lo = hi = 0.0
    for name, weight in cfg.terms.items():
        if weight == 0:
            continue
        a, b = (weight * v for v in TERMS[name].range_at(cfg, max_tokens))
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


# ---------------------------------------------------------------------------------------------
# The scorer


class RewardScorer:
    """Scores completions: pool terms in the worker pool (each with a deadline), the others here.

    with RewardScorer(RewardConfig(workers=2)) as scorer:
        rewards, info = scorer.score([Completion(text, gold, num_tokens, truncated, max_tokens, problem), ...])

    info: n, correct (list of 0/1: the correctness term, always checked), terms (name -> list of
    values of each configured term), term_means (reward_term_<name> -> batch mean), failed
    (reward_failed_<name> -> completions the term raised on or returned NaN/inf for, or whose
    worker died), extracted (the last \\boxed{} contents or None), accuracy, timeouts, errors (a
    term reported an error of its own: math-verify could not parse), no_answer (no balanced
    \\boxed{} while require_boxed), unique_pairs (pool tasks run), seconds. A failed or timed-out
    completion scores the term's minimum. RewardError (one line naming the term): a value outside
    the term's declared range, or failures past reward.max_failed_frac of the batch.
    """

    def __init__(self, cfg: Optional[RewardConfig] = None):
        self.cfg = cfg or RewardConfig()
        self.pooled = [name for name in dict.fromkeys([CORRECT, *self.cfg.terms]) if TERMS[name].pool]
        setups = [_source(TERMS[name].setup) for name in self.pooled if TERMS[name].setup is not None]
        self.pool = WorkerPool(self.cfg.workers, self.cfg.timeout_s, self.cfg.start_timeout_s,
                               {name: TERMS[name].source for name in self.pooled}, setups, asdict(self.cfg))

    @property
    def total_timeouts(self) -> int:
        return self.pool.total_timeouts

    def score(self, completions: list[Completion]) -> tuple[list[float], dict]:
        import time

        t0 = time.monotonic()
        results, unique = self._run_pool(completions)
        for name in dict.fromkeys([CORRECT, *self.cfg.terms]):
            if name not in results:  # in-process terms: the pool's own handling of one task (run_term)
                results[name] = [run_term(TERMS[name].fn, c, self.cfg) for c in completions]
        values = {name: self._values(name, completions, got) for name, got in results.items()}
        statuses = {name: [status for _, status, _ in got] for name, got in results.items()}
        failed = {name: sum(s.startswith(FAILED) for s in statuses[name]) for name in self.cfg.terms}
        self._check_failures(failed, statuses, len(completions))
        rewards = [0.0] * len(completions)
        for name, weight in self.cfg.terms.items():
            rewards = [r + weight * v for r, v in zip(rewards, values[name])]
        correct, status = values[CORRECT], statuses[CORRECT]
        all_statuses = [s for name in results for s in statuses[name]]
        info = {
            "n": len(completions),
            "correct": correct,
            "terms": {name: values[name] for name in self.cfg.terms},
            "term_means": {f"reward_term_{name}": sum(values[name]) / max(len(completions), 1)
                           for name in self.cfg.terms},
            "failed": {f"reward_failed_{name}": count for name, count in failed.items()},
            "extracted": [answer for _, _, answer in results[CORRECT]],
            "accuracy": sum(correct) / max(len(correct), 1),
            "timeouts": sum(s == "timeout" for name in self.pooled for s in statuses[name]),
            "errors": sum(s.startswith("error") for s in all_statuses),
            "no_answer": status.count("no_answer"),
            "unique_pairs": unique,
            "seconds": time.monotonic() - t0,
        }
        return rewards, info

    def _values(self, name: str, completions: list[Completion], results: list) -> list[float]:
        """The term's value per completion: its minimum where it failed or timed out; a finite value
        outside its declared range is a RewardError (the bound's M would be wrong)."""
        term, out = TERMS[name], []
        for c, (value, _, _) in zip(completions, results):
            lo, hi = term.range_at(self.cfg, c.max_tokens)
            if value is not None and not lo <= value <= hi:
                raise RewardError(f"reward term {name} returned {value!r} for a completion, outside its declared "
                                  f"range [{lo:g}, {hi:g}] (max_tokens={c.max_tokens}; "
                                  f"{registry.origin(term.fn.__module__)}): fix the term or its range")
            out.append(lo if value is None else value)
        return out

    def _check_failures(self, failed: dict, statuses: dict, n: int) -> None:
        """Past reward.max_failed_frac of the batch, a term's failures stop the run: one line naming it."""
        for name, count in failed.items():
            if n and count / n > self.cfg.max_failed_frac:
                first = next(s for s in statuses[name] if s.startswith(FAILED))
                raise RewardError(f"reward term {name} failed on {count} of {n} completions of a batch, more than "
                                  f"reward.max_failed_frac={self.cfg.max_failed_frac:g} (first: {first}; "
                                  f"{registry.origin(TERMS[name].fn.__module__)})")

    def _run_pool(self, completions):
        """Every pool term on every completion, identical tasks once (GRPO groups often repeat short
        answers): name -> a (value or None, status, answer) per completion; and the tasks run."""
        tasks: dict[tuple, int] = {}
        keys = {name: [tasks.setdefault((name, _task_key(c)), len(tasks)) for c in completions]
                for name in self.pooled}
        by_task = {index: (name, c) for name in self.pooled for index, c in zip(keys[name], completions)}
        results = self.pool.run([by_task[i] for i in range(len(tasks))])
        return {name: [results[i] for i in keys[name]] for name in self.pooled}, len(tasks)

    def wait_ready(self) -> None:
        """Block until every pool worker has started (score() does not need this; benchmarks do)."""
        self.pool.wait_ready()

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _task_key(c: Completion) -> tuple:
    problem_id = getattr(c.problem, "id", None)
    return c.text, c.gold, c.num_tokens, c.truncated, c.max_tokens, problem_id


# ---------------------------------------------------------------------------------------------
# Shipped terms

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


_gold_cache: dict = {}  # parsed gold answers: a worker (or this process) parses each gold once


# Answers of the common shapes (integer, fraction, decimal, expression) against their gold forms.
_WARM_UP = ((r"\boxed{1}", "1"), (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{2.5}", "5/2"), (r"\boxed{x^2+1}", "1+x^2"))


def _warm_up_math_verify() -> None:
    """Before a worker says ready: score a few answers with the term itself. The first answer of a
    shape compiles math-verify's regexes and builds the LaTeX parser's prediction tables (~40x the
    work of later ones, 0.05 s on a free core); inside a task's deadline, on a loaded machine, that
    most likely timed out a replaced worker's first, correct, answer (scored 0)."""
    for answer, gold in _WARM_UP:
        correct(Completion(answer, gold), RewardConfig())  # its defaults: the answers are boxed


@register_term(CORRECT, range=(0.0, 1.0), pool=True, setup=_warm_up_math_verify,
               paper="math-verify (Hugging Face): sympy equivalence of the answer with the gold one",
               knobs=(Knob("require_boxed", True, bool, "correct: no \\boxed{} -> 0. False: math-verify takes the "
                           "answer from the text (\"the answer is\", else the last number), for models that rarely "
                           "box (SmolLM2-135M: 56 of 64 samples unboxed)"),),
               equation="1 if math-verify finds the last \\boxed{} answer (require_boxed: false: the text's) equal "
                        "to the gold answer, else 0")
def correct(c: Completion, cfg) -> Scored:
    """Math-verify with its own timeouts off: the worker pool bounds the time (grpo/reward_pool.py)."""
    from math_verify import parse, verify

    boxes = boxed_contents(c.text)
    extracted = boxes[-1].strip()[:1000] if boxes else None
    if boxes:
        answer_text = f"\\boxed{{{boxes[-1]}}}"
    elif cfg.require_boxed:
        return Scored(0.0, "no_answer", None)
    else:
        answer_text = c.text
    try:
        gold_parsed = _gold_cache.get(c.gold)
        if gold_parsed is None:
            gold_parsed = parse(gold_to_latex(c.gold), parsing_timeout=None)
            if len(_gold_cache) > 4096:
                _gold_cache.clear()
            _gold_cache[c.gold] = gold_parsed
        answer_parsed = parse(answer_text, parsing_timeout=None)
        equal = verify(gold_parsed, answer_parsed, timeout_seconds=None)
    except Exception as e:  # math-verify raises rarely; a broken answer is a wrong answer, but count it
        return Scored(0.0, f"error: {type(e).__name__}: {e}"[:200], extracted)
    return Scored(1.0 if equal else 0.0, "ok", extracted)


@register_term("format", range=(0.0, 1.0), equation="1 if the completion holds exactly one balanced \\boxed{}, else 0")
def format_ok(c: Completion, cfg) -> float:
    return 1.0 if len(boxed_contents(c.text)) == 1 else 0.0


def _check_buffer(value) -> Optional[str]:
    return None if value is None or value >= 1 else "must be >= 1 or null"


@register_term("overlong", range=(-1.0, 0.0), paper="2503.14476 (DAPO, soft overlong punishment)",
               knobs=(Knob("overlong_buffer", None, Optional[int], "overlong: L_cache, the tokens before the budget "
                           "where the penalty ramps from 0 to -1; null: a fifth of the budget (DAPO's 4096 of 20480)",
                           _check_buffer),),
               equation="0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max; -1 past it "
                        "(L_max: the completion's budget)")
def overlong(c: Completion, cfg) -> float:
    if c.num_tokens is None or c.max_tokens is None:
        raise ValueError("overlong: the completion's num_tokens and max_tokens are needed")
    cache = cfg.overlong_buffer if cfg.overlong_buffer is not None else max(c.max_tokens // 5, 1)
    start = c.max_tokens - cache
    if c.num_tokens <= start:
        return 0.0
    if c.num_tokens <= c.max_tokens:
        return (start - c.num_tokens) / cache
    return -1.0
