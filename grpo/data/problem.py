"""A math problem as every loader gives it: raw question text and a gold answer math-verify parses."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Problem:
    id: str  # unique within its source, e.g. "gsm8k_test/17" or "arithmetic-train/42"
    prompt: str  # raw question text (no chat template, no instruction)
    answer: str  # gold answer, a string math-verify can parse (e.g. "18", "\\frac{1}{2}")
    source: str  # dataset name or file path it came from
