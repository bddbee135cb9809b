"""Loading problems: named sets, Hugging Face Hub ids and local folders (through `datasets`), and
local JSON / JSONL / Parquet files (read here, so a bad row is named by its file and line).

Where `data.dataset` is looked up:
  a named set (grpo.data.sets)   data.data_dir set: <data_dir>/<its file> only (what `python -m
                                 grpo.data fetch --out` wrote); else its Hub id, config and split,
                                 from the HF cache or the Hub (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE
                                 honoured)
  arithmetic                     the procedural task (grpo.data.arithmetic)
  *.json, *.jsonl, *.parquet     that file
  anything else                  `datasets.load_dataset(dataset, config, split=split)`: a local
                                 dataset folder (e.g. laid out like a Hub repository) or a Hub id

A set that cannot be had stops with one `DataUnavailable` line naming the set, what was tried and
the fetch command; a file that does not read (an empty, truncated or corrupt Parquet file, text that
is not UTF-8, no permission), also inside a dataset folder, with one `DataError` line naming it (and
its line). Loaders never drop a row silently: a malformed row raises an error naming its
file and line (or dataset and row), or, with `on_bad_row: skip`, is skipped and counted
(`load_problem_set(...).skipped`, and a warning).
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

from grpo.data.arithmetic import ArithmeticConfig, ArithmeticTask
from grpo.data.problem import Problem
from grpo.data.sets import NAMED_SETS, NamedSet, gold_answer

PATH_SUFFIXES = (".json", ".jsonl", ".parquet")


def dataset_kind(dataset: str) -> Literal["named", "arithmetic", "file", "datasets"]:
    """How `data.dataset` is read (module docstring); "datasets" = a Hub id or a local folder."""
    if dataset in NAMED_SETS:
        return "named"
    if dataset == "arithmetic":
        return "arithmetic"
    if dataset.lower().endswith(PATH_SUFFIXES):
        return "file"
    return "datasets"


@dataclass
class DataConfig:
    # a named set (gsm8k_train, gsm8k_test, math500, aime24, amc23, deepscaler: docs/data.md), arithmetic,
    # a Hub dataset id (owner/name), a local dataset folder, or a .json/.jsonl/.parquet file
    dataset: str = "arithmetic"
    config: Optional[str] = None  # Hub ids and folders: the config (subset), e.g. main; null: the named set's, else the only one
    split: Optional[str] = None  # Hub ids and folders: the split; null: the named set's, else the only one
    data_dir: Optional[str] = None  # named sets only: read <data_dir>/<file> (`python -m grpo.data fetch --out`), never the Hub
    system_prompt: str = "You are a helpful assistant that solves math problems."  # "" = no system message
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."  # after the question
    on_bad_row: Literal["error", "skip"] = "error"  # malformed row: raise (naming file and line), or skip and count
    limit: Optional[int] = None  # keep only the first `limit` problems (file order), None = all
    question_key: Optional[str] = None  # question field; null: the named set's, else "problem" where a row has it, else "question"
    answer_key: Optional[str] = None  # gold answer field; null: the named set's, else "answer"
    answer_format: Literal["auto", "plain", "gsm8k", "boxed"] = "auto"  # auto: the named set's, else plain (grpo.data.sets)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)  # used when dataset == "arithmetic"

    def __post_init__(self):
        kind = dataset_kind(self.dataset)
        if kind == "datasets" and "/" not in self.dataset and not Path(self.dataset).is_dir():
            known = ", ".join([*NAMED_SETS, "arithmetic"])
            raise ValueError(f"dataset: must be one of {known}, a Hub dataset id (owner/name), a local dataset folder, "
                             f"or a path ending {'/'.join(PATH_SUFFIXES)}, got {self.dataset!r}")
        for key in ("config", "split"):
            if getattr(self, key) is not None and kind in ("file", "arithmetic"):
                raise ValueError(f"{key}: only a Hub id, a dataset folder or a named set has one, not "
                                 f"dataset {self.dataset!r}; leave it null")
        if self.data_dir is not None and kind != "named":
            raise ValueError(f"data_dir: only named sets ({', '.join(NAMED_SETS)}) are read from it, not dataset "
                             f"{self.dataset!r} (give a file or folder as data.dataset itself)")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit: must be >= 1 or null, got {self.limit}")


class DataError(ValueError):
    """A malformed data row or source; the message names the file and line (JSONL), row (JSON,
    Parquet, a Hub split) or the key."""


class DataUnavailable(DataError, FileNotFoundError):
    """The dataset cannot be had (no such file, not on the Hub nor in its cache): one line naming
    the set, what was tried and how to fetch it."""


@dataclass
class ProblemSet:
    problems: list[Problem]
    skipped: int  # malformed rows skipped (on_bad_row: skip); 0 in error mode
    skip_reasons: list[str]  # one "file:line: why" per skipped row
    origin: str = ""  # where the rows came from, in words (a file, or a Hub id with config and split)


@dataclass(frozen=True)
class Rows:
    """The rows of one source, each with its location for messages ('file:line', 'file: row k',
    'openai/gsm8k (main, train): row k'), and how to read a question and an answer from them."""

    name: str  # the source's name in problem ids: a named set, a file path, a Hub id with config and split
    origin: str  # where they came from, in words
    rows: list[tuple[str, object]]  # (location, row-or-DataError)
    question_key: Optional[str]  # None: "problem" where a row has it, else "question"
    answer_key: str
    answer_format: str


# ---------------------------------------------------------------------------------------------
# Sources


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:  # permission, a directory under a file's name, an I/O error
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> tuple[int, str]:
    """(line, reason) of the first byte of `raw` that is not UTF-8 (Python's own error names neither
    the file nor the line)."""
    line = raw.count(b"\n", 0, e.start) + 1
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    return line, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); save the file as UTF-8"


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(location, row-or-error) for each line of a JSONL file; a line that is not UTF-8 or not
    JSON is a row error naming its line."""
    for line_no, raw in enumerate(_read_bytes(path).split(b"\n"), 1):
        if not raw.strip():
            continue  # a blank line holds no row
        try:
            yield f"{path}:{line_no}", json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            yield f"{path}:{line_no}", DataError(_not_utf8(raw, e)[1])
        except json.JSONDecodeError as e:
            yield f"{path}:{line_no}", DataError(f"not valid JSON ({e.msg} at column {e.colno})")


def _json_document(path: Path):
    """A .json file's value; DataError naming the file and line when it is not UTF-8 JSON."""
    raw = _read_bytes(path)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line, reason = _not_utf8(raw, e)
        raise DataError(f"{path}:{line}: {reason}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path) -> list[dict]:
    """A Parquet file's rows; DataError naming the file when it is empty, truncated or corrupt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise DataError(f"{path}: not a readable Parquet file (it is empty)")
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid (no footer, truncated), OSError (corrupt pages)
        reason = re.sub(r"^Could not open Parquet input source '[^']*': ", "", " ".join(str(e).split()))
        raise DataError(f"{path}: not a readable Parquet file ({reason})") from None


def _file_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(location, row-or-error) for each row of a JSON / JSONL / Parquet file. What makes the whole
    file unreadable (not UTF-8, not JSON, a truncated or corrupt Parquet file, no permission) raises
    DataError naming it (and the line)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif suffix == ".json":
        rows = _json_document(path)
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of objects, got {type(rows).__name__}")
        for i, row in enumerate(rows, 1):
            yield f"{path}: row {i}", row
    elif suffix == ".parquet":
        for i, row in enumerate(_parquet_rows(path), 1):
            yield f"{path}: row {i}", row
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use {', '.join(PATH_SUFFIXES)})")


def _unreadable_file(folder: Path) -> Optional[str]:
    """The first data file (.json, .jsonl, .parquet) under a dataset folder that cannot be read, as
    one line naming it (and the line); None when each reads. `datasets` reports such a file without
    its name (a corrupt page) or only in a log line; this names it."""
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in PATH_SUFFIXES or any(p.startswith(".") for p in path.relative_to(folder).parts) \
                or not path.is_file():
            continue
        try:
            if path.suffix.lower() == ".parquet":
                _parquet_rows(path)
            elif path.suffix.lower() == ".jsonl":
                bad = next((f"{where}: {row}" for where, row in _jsonl_rows(path) if isinstance(row, DataError)), None)
                if bad:
                    return bad
            else:  # a JSON document, or JSON lines (`datasets` reads either from a .json file)
                try:
                    _json_document(path)
                except DataError as whole:
                    if any(isinstance(row, DataError) for _, row in _jsonl_rows(path)):
                        return str(whole)
        except DataError as e:
            return str(e)
    return None


@contextlib.contextmanager
def _quiet_hub():
    """No progress bars, per-retry warnings or error logs from `datasets` / `huggingface_hub` while
    a split loads: the outcome is one line either way (a file it could not read is named there)."""
    import datasets

    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    bars = datasets.utils.logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: `datasets` uses its cache and nothing else."""
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def describe_hub(dataset: str, config: Optional[str], split: Optional[str]) -> str:
    """'openai/gsm8k (config main, split train)'."""
    parts = [f"config {config}" if config else "", f"split {split}" if split else ""]
    parts = [p for p in parts if p]
    return f"{dataset} ({', '.join(parts)})" if parts else dataset


def _datasets_rows(dataset: str, config: Optional[str], split: Optional[str]) -> tuple[str, list]:
    """(split, rows) of one split through `datasets.load_dataset` (a Hub id: the HF cache first,
    then the Hub; a local folder: read in place). Raises DataUnavailable when the dataset cannot be
    had, DataError naming `config` / `split` when it has no such config or split, or naming the file
    of a local folder that does not read."""
    where = describe_hub(dataset, config, split)
    with _quiet_hub() as datasets:
        try:
            loaded = datasets.load_dataset(dataset, config, split=split)
        except Exception as e:
            raise _load_error(e, dataset, where) from None
    if split is None:  # the dataset's splits: exactly one can be meant
        if len(loaded) != 1:
            raise DataError(f"split: {where} has splits {', '.join(loaded)}; choose one")
        split, loaded = next(iter(loaded.items()))
    try:
        return split, loaded.to_list()
    except Exception as e:  # text that is not UTF-8: Arrow's JSON reader lets it through, its rows do not
        raise _load_error(e, dataset, where) from None


def _load_error(e: Exception, dataset: str, where: str) -> DataError:
    """What `datasets` raised, as the one line to stop with."""
    import pyarrow as pa

    reason = (str(e).splitlines() or [""])[0][:300] or type(e).__name__
    if isinstance(e, ValueError) and not isinstance(e, (pa.ArrowException, UnicodeError)):
        # a config or split that does not exist; the message lists the ones that do
        first = " ".join(str(e).split())
        return DataError(f"{'split' if 'split' in first.lower() else 'config'}: {where}: {first}")
    if Path(dataset).is_dir():  # a local folder: a file in it does not read (ArrowInvalid, OSError, not UTF-8)
        return DataError(_unreadable_file(Path(dataset)) or f"{where}: {type(e).__name__}: {reason}")
    # unreachable and not cached (ConnectionError), no such dataset, no data files
    return DataUnavailable(f"{where}: {type(e).__name__}: {reason}")


def fetch_hint(names: list[str], out: str = "DIR") -> str:
    return f"python -m grpo.data fetch {' '.join(names)} --out {out}"


def named_set_rows(named: NamedSet, cfg: DataConfig) -> tuple[str, str, list[tuple[str, object]]]:
    """(name, origin, rows) of a named set: from cfg.data_dir if given, else the HF cache or the Hub."""
    config = cfg.config if cfg.config is not None else named.config
    split = cfg.split if cfg.split is not None else named.split
    if cfg.data_dir is not None:
        path = Path(cfg.data_dir).expanduser() / named.file
        if not path.is_file():
            raise DataUnavailable(f"dataset {named.name!r}: {path} not found (data_dir: {cfg.data_dir}); write it "
                                  f"where the Hub is reachable with: {fetch_hint([named.name], cfg.data_dir)}")
        return named.name, str(path), list(_file_rows(path))
    try:
        split, rows = _datasets_rows(named.hub_id, config, split)
    except DataUnavailable as e:
        import datasets

        hub = "the Hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if hub_offline() else "the Hub did not give it"
        raise DataUnavailable(
            f"dataset {named.name!r} cannot be had: tried the Hugging Face Hub and the HF datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}) for {e}; {hub}; no local copy (data_dir is not set). Fetch it "
            f"where the Hub is reachable: {fetch_hint([named.name])}, then set data_dir: DIR") from None
    where = describe_hub(named.hub_id, config, split)
    return named.name, where, [(f"{where}: row {i}", row) for i, row in enumerate(rows, 1)]


def read_rows(cfg: DataConfig) -> Rows:
    """The raw rows behind cfg.dataset (any kind but arithmetic), with the fields and the answer
    format to read them by."""
    kind = dataset_kind(cfg.dataset)
    named = NAMED_SETS.get(cfg.dataset)
    if kind == "named":
        name, origin, rows = named_set_rows(named, cfg)
    elif kind == "file":
        path = Path(cfg.dataset).expanduser()
        if not path.is_file():
            raise DataUnavailable(f"dataset {cfg.dataset!r}: file not found: {path}")
        name = origin = str(path)
        rows = list(_file_rows(path))
    elif kind == "datasets":
        try:
            split, loaded = _datasets_rows(cfg.dataset, cfg.config, cfg.split)
        except DataUnavailable as e:
            hub = "the Hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if hub_offline() else "not on the Hub"
            raise DataUnavailable(f"dataset {cfg.dataset!r} cannot be had: not a local folder, not in the HF datasets "
                                  f"cache, {hub} ({e}); give a local .jsonl/.parquet file or folder instead") from None
        origin = describe_hub(cfg.dataset, cfg.config, split)
        name = ":".join(part for part in (cfg.dataset, cfg.config, split) if part)  # openai/gsm8k:main:train
        rows = [(f"{origin}: row {i}", row) for i, row in enumerate(loaded, 1)]
    else:
        raise DataError(f"dataset {cfg.dataset!r} has no rows (it is generated: grpo.data.arithmetic)")
    fmt = cfg.answer_format if cfg.answer_format != "auto" else (named.answer_format if named else "plain")
    question_key = cfg.question_key if cfg.question_key is not None else (named.question_key if named else None)
    answer_key = cfg.answer_key if cfg.answer_key is not None else (named.answer_key if named else "answer")
    return Rows(name, origin, rows, question_key, answer_key, fmt)


# ---------------------------------------------------------------------------------------------
# Problems


def load_problem_set(cfg: DataConfig) -> ProblemSet:
    """The problems of cfg.dataset; for "arithmetic", the held-out evaluation set."""
    if cfg.dataset == "arithmetic":
        return ProblemSet(ArithmeticTask(cfg.arithmetic).eval_problems()[:cfg.limit], 0, [], "arithmetic")
    source = read_rows(cfg)
    problems, reasons = [], []
    for where, row in source.rows:
        try:
            problems.append(_row_to_problem(row, where, source))
        except (DataError, ValueError) as e:
            message = f"{where}: {e}"
            if cfg.on_bad_row == "error":
                raise DataError(message) from None
            reasons.append(message)
        if cfg.limit is not None and len(problems) >= cfg.limit:
            break
    if reasons:
        warnings.warn(f"{source.origin}: skipped {len(reasons)} malformed rows (first: {reasons[0]})", stacklevel=2)
    if not problems:
        raise DataError(f"{source.origin}: no usable rows")
    return ProblemSet(problems, len(reasons), reasons, source.origin)


def load_problems(cfg: DataConfig) -> list[Problem]:
    """The problems of cfg.dataset (see load_problem_set for the skip count)."""
    return load_problem_set(cfg).problems


def _row_to_problem(row, where: str, source: Rows) -> Problem:
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object, got {type(row).__name__}")
    # unnamed sources: DeepScaleR, MATH, AIME write "problem"; GSM8K and AMC "question"
    question_key = source.question_key or ("problem" if "problem" in row else "question")
    fields = {}
    for key in (question_key, source.answer_key):
        # a dotted name (answer.final) reaches into nested objects, whatever the source: JSON objects,
        # Parquet structs and Hub features are dicts here; a field of that very name comes first
        value = row.get(key) if key in row else row
        for part in [] if key in row else key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            raise DataError(f"missing field {key!r} (fields present: {', '.join(sorted(row))})")
        fields[key] = value
    question = fields[question_key]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"field {question_key!r} must be non-empty text")
    row_id = row.get("id", where.rsplit(":", 1)[-1].replace(" row ", "").strip())
    return Problem(id=f"{source.name}/{row_id}", prompt=question.strip(),
                   answer=gold_answer(fields[source.answer_key], source.answer_format), source=source.name)
