"""The named datasets: one table row per set, read from the Hugging Face Hub or a fetched copy.

A row says where a set lives on the Hub (dataset id, config, split), which fields hold the question
and the gold answer, and how the answer is written. `data.dataset: gsm8k_train` is the same as
`data.dataset: openai/gsm8k` with `config: main`, `split: train`, `question_key: question`,
`answer_key: answer`, `answer_format: gsm8k`. Each row was read off its dataset card (docs/data.md
cites them); `rows` is the size as published (the full-size checks in tests/test_data.py hold it).

How a gold answer is written (`answer_format`):
  plain   the field is the answer itself ("18", "\\frac{1}{2}", or a number such as AMC's 27.0)
  gsm8k   a worked solution whose last line is "#### N": N, thousands commas removed
  boxed   a worked solution (MATH's `solution`): the contents of its last \\boxed{...}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.rewards import boxed_contents

ANSWER_FORMATS = ("plain", "gsm8k", "boxed")


@dataclass(frozen=True)
class NamedSet:
    name: str  # what data.dataset says
    hub_id: str  # the Hugging Face Hub dataset repository
    config: Optional[str]  # its config (subset); None: the repository's only one
    split: str
    question_key: str  # the field holding the question text
    answer_key: str  # the field holding the gold answer
    answer_format: str  # one of ANSWER_FORMATS
    rows: int  # rows in the split as published
    file: str  # what `python -m grpo.data fetch --out DIR` writes and `data.data_dir: DIR` reads


NAMED_SETS = {s.name: s for s in [
    NamedSet("gsm8k_train", "openai/gsm8k", "main", "train", "question", "answer", "gsm8k", 7473, "gsm8k_train.jsonl"),
    NamedSet("gsm8k_test", "openai/gsm8k", "main", "test", "question", "answer", "gsm8k", 1319, "gsm8k_test.jsonl"),
    NamedSet("math500", "HuggingFaceH4/MATH-500", None, "test", "problem", "answer", "plain", 500,
             "math500_test.jsonl"),
    NamedSet("aime24", "HuggingFaceH4/aime_2024", None, "train", "problem", "answer", "plain", 30, "aime24_test.jsonl"),
    NamedSet("amc23", "math-ai/amc23", None, "test", "question", "answer", "plain", 40, "amc23_test.jsonl"),
    NamedSet("deepscaler", "agentica-org/DeepScaleR-Preview-Dataset", None, "train", "problem", "answer", "plain",
             40315, "deepscaler_train.jsonl"),
]}


def gold_answer(value, answer_format: str) -> str:
    """A row's gold answer as a string math-verify can parse; raises ValueError saying why it cannot."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):  # AMC 2023 stores 27.0: write integers as integers
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if answer_format == "gsm8k":
        if "####" not in text:
            raise ValueError("GSM8K answer has no '#### N' line")
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    elif answer_format == "boxed":
        boxes = boxed_contents(text)
        if not boxes:
            raise ValueError("answer has no \\boxed{...} (answer_format: boxed)")
        text = boxes[-1].strip()
    if not text:
        raise ValueError("answer is empty")
    return text
