"""Math problems for GRPO: loaders, the procedural arithmetic task, chat prompts, a seeded sampler.

A problem is raw question text plus a gold answer string that math-verify can parse
(rewards.py wraps it in \\boxed{} before parsing). Loaders never drop a row silently: a malformed
row raises an error naming the file and line, or, with `on_bad_row: skip`, is skipped and counted
(`load_problem_set(...).skipped`, and a warning).

The sampler gives the global batch order (a permutation of the problems seeded by `seed` and the
epoch); rank 0 samples and scores the whole batch, and the trainer shards the rollout. Its cursor
is two plain ints (epoch, position) so a checkpoint can resume the exact stream.
"""
from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

REPO_ROOT = Path(__file__).resolve().parents[1]

# Named datasets in data_dir: file name and how its gold answer is written.
NAMED_DATASETS = {
    "gsm8k_train": ("gsm8k_train.jsonl", "gsm8k"),
    "gsm8k_test": ("gsm8k_test.jsonl", "gsm8k"),
    "math500": ("math500_test.jsonl", "plain"),
    "aime24": ("aime24_test.jsonl", "plain"),
    "amc23": ("amc23_test.jsonl", "plain"),
}
PATH_SUFFIXES = (".json", ".jsonl", ".parquet")
ARITHMETIC_OPS = "+-*"


@dataclass
class Problem:
    id: str  # unique within its source, e.g. "gsm8k_test/17" or "arithmetic-train/42"
    prompt: str  # raw question text (no chat template, no instruction)
    answer: str  # gold answer, a string math-verify can parse (e.g. "18", "\\frac{1}{2}")
    source: str  # dataset name or file path it came from


@dataclass
class ArithmeticConfig:
    """Procedural easy arithmetic, e.g. "What is 12 + 7?": unlimited, seeded, for the CPU demo."""

    n_terms_min: int = 2  # fewest operands in an expression
    n_terms_max: int = 2  # most operands in an expression
    min_operand: int = 1  # smallest operand value
    max_operand: int = 20  # largest operand value (1..20 sums: SmolLM2-135M-Instruct ~22% right, lenient reward)
    ops: str = "+"  # operators to draw from, any of "+-*" (usual precedence: * before + and -)
    seed: int = 0  # generator seed; the held-out set and the training stream derive from it
    eval_size: int = 100  # held-out problems (distinct); the training stream never yields these

    def __post_init__(self):
        if self.n_terms_min < 2:
            raise ValueError(f"n_terms_min: must be >= 2, got {self.n_terms_min}")
        if self.n_terms_max < self.n_terms_min:
            raise ValueError(f"n_terms_max: must be >= n_terms_min ({self.n_terms_min}), got {self.n_terms_max}")
        if self.min_operand < 0:
            raise ValueError(f"min_operand: must be >= 0, got {self.min_operand}")
        if self.max_operand < self.min_operand:
            raise ValueError(f"max_operand: must be >= min_operand ({self.min_operand}), got {self.max_operand}")
        if not self.ops or any(op not in ARITHMETIC_OPS for op in self.ops):
            raise ValueError(f"ops: must be a non-empty string of characters from {ARITHMETIC_OPS!r}, got {self.ops!r}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size: must be >= 0, got {self.eval_size}")


@dataclass
class DataConfig:
    # gsm8k_train | gsm8k_test | math500 | aime24 | amc23 | arithmetic | a path ending .json/.jsonl/.parquet
    dataset: str = "arithmetic"
    data_dir: str = "../shared/data"  # where named datasets live; relative paths are from the repo root
    system_prompt: str = "You are a helpful assistant that solves math problems."  # "" = no system message
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."  # after the question
    on_bad_row: Literal["error", "skip"] = "error"  # malformed row: raise (naming file and line), or skip and count
    limit: Optional[int] = None  # keep only the first `limit` problems (file order), None = all
    question_key: Optional[str] = None  # path datasets: question field; None = "problem", else "question"
    answer_key: str = "answer"  # path datasets: gold answer field
    answer_format: Literal["auto", "plain", "gsm8k"] = "auto"  # gsm8k = take the value after "####"; auto = by name
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)  # used when dataset == "arithmetic"

    def __post_init__(self):
        if self.dataset not in NAMED_DATASETS and self.dataset != "arithmetic" \
                and not self.dataset.endswith(PATH_SUFFIXES):
            known = ", ".join([*NAMED_DATASETS, "arithmetic"])
            raise ValueError(f"dataset: must be one of {known} or a path ending {'/'.join(PATH_SUFFIXES)}, "
                             f"got {self.dataset!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit: must be >= 1 or null, got {self.limit}")


# ---------------------------------------------------------------------------------------------
# Loading files


class DataError(ValueError):
    """A malformed data row; the message names the file and the line (JSONL) or row (JSON, Parquet)."""


class DataFileNotFound(DataError, FileNotFoundError):
    """The dataset file does not exist (a DataError, so callers report it like a bad row)."""


@dataclass
class ProblemSet:
    problems: list[Problem]
    skipped: int  # malformed rows skipped (on_bad_row: skip); 0 in error mode
    skip_reasons: list[str]  # one "file:line: why" per skipped row


def resolve_data_path(cfg: DataConfig) -> Path:
    """The file behind cfg.dataset: data_dir/<file> for named datasets, else the path itself."""
    if cfg.dataset in NAMED_DATASETS:
        data_dir = Path(cfg.data_dir)
        if not data_dir.is_absolute():
            data_dir = REPO_ROOT / data_dir
        return data_dir / NAMED_DATASETS[cfg.dataset][0]
    return Path(cfg.dataset)


def _gold_text(value, gsm8k: bool) -> str:
    """Gold answer as a string math-verify can parse; raises ValueError saying why it cannot."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):  # AMC23 stores 27.0: write integers as integers
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if gsm8k:
        if "####" not in text:
            raise ValueError("GSM8K answer has no '#### N' line")
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not text:
        raise ValueError("answer is empty")
    return text


def _iter_rows(path: Path):
    """Yield (location, row-or-error) for each row; location is 'file:line' or 'file: row k'."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue  # a blank line holds no row
                try:
                    yield f"{path}:{line_no}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{path}:{line_no}", DataError(f"not valid JSON ({e.msg} at column {e.colno})")
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of objects, got {type(rows).__name__}")
        for i, row in enumerate(rows, 1):
            yield f"{path}: row {i}", row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path}: row {i}", row
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use {', '.join(PATH_SUFFIXES)})")


def load_problem_set(cfg: DataConfig) -> ProblemSet:
    """Load a file dataset (named or a path); for "arithmetic", the held-out evaluation set."""
    if cfg.dataset == "arithmetic":
        return ProblemSet(ArithmeticTask(cfg.arithmetic).eval_problems()[:cfg.limit], 0, [])
    path = resolve_data_path(cfg)
    if not path.is_file():
        raise DataFileNotFound(f"dataset {cfg.dataset!r}: file not found: {path}")
    name = cfg.dataset if cfg.dataset in NAMED_DATASETS else str(path)
    fmt = cfg.answer_format
    if fmt == "auto":
        fmt = NAMED_DATASETS[cfg.dataset][1] if cfg.dataset in NAMED_DATASETS else "plain"
    problems, reasons = [], []
    for where, row in _iter_rows(path):
        try:
            problems.append(_row_to_problem(row, where, name, fmt, cfg))
        except (DataError, ValueError) as e:
            message = f"{where}: {e}"
            if cfg.on_bad_row == "error":
                raise DataError(message) from None
            reasons.append(message)
        if cfg.limit is not None and len(problems) >= cfg.limit:
            break
    if reasons:
        warnings.warn(f"{path}: skipped {len(reasons)} malformed rows (first: {reasons[0]})", stacklevel=2)
    if not problems:
        raise DataError(f"{path}: no usable rows")
    return ProblemSet(problems, len(reasons), reasons)


def load_problems(cfg: DataConfig) -> list[Problem]:
    """The problems of cfg.dataset (see load_problem_set for the skip count)."""
    return load_problem_set(cfg).problems


def _row_to_problem(row, where: str, name: str, fmt: str, cfg: DataConfig) -> Problem:
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object, got {type(row).__name__}")
    if cfg.question_key is not None:
        question_key = cfg.question_key
    else:  # DeepScaleR, MATH, AIME: "problem"; GSM8K: "question"
        question_key = "problem" if "problem" in row else "question"
    for key in (question_key, cfg.answer_key):
        if key not in row or row[key] is None:
            raise DataError(f"missing field {key!r} (fields present: {', '.join(sorted(row))})")
    question = row[question_key]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"field {question_key!r} must be non-empty text")
    row_id = row.get("id", where.rsplit(":", 1)[-1].replace(" row ", "").strip())
    return Problem(id=f"{name}/{row_id}", prompt=question.strip(),
                   answer=_gold_text(row[cfg.answer_key], gsm8k=fmt == "gsm8k"), source=name)


# ---------------------------------------------------------------------------------------------
# Procedural arithmetic


class ArithmeticTask:
    """Seeded arithmetic problems addressed by index: train_problem(seed, i), eval_problems().

    Each problem is drawn from its own Random seeded by a string (sha512 inside `random`, so the
    same on every machine and Python run). The held-out set comes from a separate stream; the
    training stream skips any expression that is in it, so train and eval are disjoint.
    """

    def __init__(self, cfg: ArithmeticConfig):
        self.cfg = cfg
        self._eval: Optional[list[Problem]] = None
        self._eval_questions: set[str] = set()

    def _draw(self, stream_key: str) -> tuple[str, int]:
        rng = random.Random(stream_key)
        cfg = self.cfg
        n_terms = rng.randint(cfg.n_terms_min, cfg.n_terms_max)
        operands = [rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(n_terms)]
        ops = [rng.choice(cfg.ops) for _ in range(n_terms - 1)]
        # Value with the usual precedence: a sum of signed products.
        total, product, sign = 0, operands[0], 1
        for op, x in zip(ops, operands[1:]):
            if op == "*":
                product *= x
            else:
                total += sign * product
                product, sign = x, (1 if op == "+" else -1)
        total += sign * product
        expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
        return expression, total

    def _problem(self, id: str, expression: str, value: int) -> Problem:
        return Problem(id=id, prompt=f"What is {expression}?", answer=str(value), source="arithmetic")

    def eval_problems(self) -> list[Problem]:
        """cfg.eval_size distinct held-out problems (the same list on every call and machine)."""
        if self._eval is None:
            problems, seen, index = [], set(), 0
            while len(problems) < self.cfg.eval_size:
                if index > 100 * self.cfg.eval_size + 1000:
                    raise ValueError(f"arithmetic: cannot find {self.cfg.eval_size} distinct problems; "
                                     f"widen the operand range or lower eval_size")
                expression, value = self._draw(f"arith:{self.cfg.seed}:eval:{index}")
                index += 1
                if expression not in seen:
                    seen.add(expression)
                    problems.append(self._problem(f"arithmetic-eval/{len(problems)}", expression, value))
            self._eval, self._eval_questions = problems, seen
        return self._eval

    def train_problem(self, seed: int, index: int) -> Optional[Problem]:
        """Problem `index` of the training stream for sampler seed `seed`; None if it is held out."""
        self.eval_problems()
        expression, value = self._draw(f"arith:{self.cfg.seed}:train:{seed}:{index}")
        if expression in self._eval_questions:
            return None
        return self._problem(f"arithmetic-train/{seed}/{index}", expression, value)


# ---------------------------------------------------------------------------------------------
# Prompts


def chat_messages(problem: Problem, cfg: DataConfig) -> list[dict]:
    user = f"{problem.prompt}\n{cfg.instruction}" if cfg.instruction else problem.prompt
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return messages + [{"role": "user", "content": user}]


_warned_no_template = False


def build_prompt(tokenizer, problem: Problem, cfg: DataConfig) -> str:
    """Prompt text through the tokenizer's chat template, ending where the assistant speaks.

    Tokenize it with add_special_tokens=False (see encode_prompt): the template already holds the
    special tokens the model expects.
    """
    messages = chat_messages(problem, cfg)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    global _warned_no_template
    if not _warned_no_template:
        warnings.warn("tokenizer has no chat template: using a plain 'system\\nuser\\nassistant:' prompt",
                      stacklevel=2)
        _warned_no_template = True
    return "\n".join(m["content"] for m in messages) + "\nassistant:"


def encode_prompt(tokenizer, prompt_text: str) -> list[int]:
    """Token ids of a prompt built by build_prompt (no extra BOS: the template wrote its own)."""
    return list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Global batches in a seeded order; resumable from two ints.

    Over a list: each epoch is a fresh permutation seeded by (seed, epoch); a batch that reaches
    the end of an epoch continues into the next. Over an ArithmeticTask: the unlimited training
    stream (epoch stays 0, position counts drawn indices, held-out ones included).
    """

    def __init__(self, source: Union[list[Problem], ArithmeticTask], batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if isinstance(source, list) and not source:
            raise ValueError("source: no problems to sample from")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: Optional[list[int]] = None  # permutation of the current epoch

    @property
    def n_problems(self) -> int:
        """Number of problems per epoch; -1 for the unlimited arithmetic stream."""
        return len(self.source) if isinstance(self.source, list) else -1

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.source)))
            if self.shuffle:
                random.Random(f"sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order = order
        return self._order

    def _next_problem(self) -> Problem:
        if isinstance(self.source, ArithmeticTask):
            for _ in range(10_000):  # a non-degenerate space never needs this many
                problem = self.source.train_problem(self.seed, self.position)
                self.position += 1
                if problem is not None:
                    return problem
            raise RuntimeError("arithmetic: every training problem is held out; widen the operand range "
                               "or lower eval_size")
        if self.position >= len(self.source):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        problem = self.source[self._epoch_order()[self.position]]
        self.position += 1
        return problem

    def next_batch(self) -> list[Problem]:
        """The next global batch (batch_size problems)."""
        return [self._next_problem() for _ in range(self.batch_size)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_problems": self.n_problems, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "n_problems", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state: {key} is {state[key]} in the checkpoint but "
                                 f"{getattr(self, key)} here; resuming would give a different stream")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def make_sampler(cfg: DataConfig, batch_size: int, seed: int = 0) -> PromptSampler:
    """Training sampler for cfg.dataset (the unlimited stream for "arithmetic")."""
    source = ArithmeticTask(cfg.arithmetic) if cfg.dataset == "arithmetic" else load_problems(cfg)
    return PromptSampler(source, batch_size, seed=seed)
