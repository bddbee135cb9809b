"""Math problems for GRPO: named sets and their table, loaders, the arithmetic task, chat prompts,
the seeded sampler. docs/data.md documents every `data:` key and every named set.

A problem is raw question text plus a gold answer string that math-verify can parse (rewards.py
wraps it in \\boxed{} before parsing).

  sets.py        the named sets (Hub id, config, split, fields, answer format) and answer formats
  load.py        DataConfig; named sets, Hub ids and folders through `datasets`; JSON/JSONL/Parquet
  arithmetic.py  the procedural arithmetic task of the CPU demo
  prompts.py     chat prompts through the tokenizer's template
  sampler.py     the global batch order, resumable from two ints
  __main__.py    `python -m grpo.data fetch NAME ... --out DIR`: named sets as local files
"""
from grpo.data.arithmetic import ARITHMETIC_OPS, ArithmeticConfig, ArithmeticTask
from grpo.data.load import (PATH_SUFFIXES, DataConfig, DataError, DataUnavailable, ProblemSet, load_problem_set,
                            load_problems, read_rows)
from grpo.data.problem import Problem
from grpo.data.prompts import build_prompt, chat_messages, encode_prompt
from grpo.data.sampler import PromptSampler, make_sampler
from grpo.data.sets import NAMED_SETS, NamedSet

__all__ = ["ARITHMETIC_OPS", "ArithmeticConfig", "ArithmeticTask", "PATH_SUFFIXES", "DataConfig", "DataError",
           "DataUnavailable", "ProblemSet", "load_problem_set", "load_problems", "read_rows", "Problem",
           "build_prompt", "chat_messages", "encode_prompt", "PromptSampler", "make_sampler", "NAMED_SETS", "NamedSet"]
