"""grpo/data: the named sets (Hub layout, fetched files, the full real sets), malformed rows, the
arithmetic task, prompts, the sampler.

Every row here is written by the test in its source's schema. The Hub path runs without a network:
a folder laid out like the Hub's dataset repository, at the named set's Hub id relative to the
working directory, is what `datasets.load_dataset(id, config, split=...)` reads (HF_HUB_OFFLINE on).
The checks that need the full real sets read them from $GRPO_TEST_DATA_DIR (a folder of
`python -m grpo.data fetch ... --out DIR` files) and skip without it.
"""
import json
import os
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.config import ConfigError, load_config
from grpo.data import (NAMED_SETS, ArithmeticConfig, ArithmeticTask, DataConfig, DataError, DataUnavailable, Problem,
                       PromptSampler, build_prompt, encode_prompt, load_problem_set, load_problems, make_sampler)
from grpo.data.__main__ import main as data_cli

# --------------------------------------------------------------------------------------------
# Rows in each source's schema (made up here, in the published field layout)

GSM8K_ROWS = [
    {"question": "Mia has 3 boxes of 24 pencils and gives away 10. How many pencils are left?",
     "answer": "She has 3 * 24 = <<3*24=72>>72 pencils.\nShe keeps 72 - 10 = <<72-10=62>>62.\n#### 62"},
    {"question": "A farm sells 1,200 eggs a day for 30 days. How many eggs is that?",
     "answer": "1200 * 30 = <<1200*30=36000>>36,000 eggs.\n#### 36,000"},
    {"question": "Tom reads 15 pages a day. How many days does a 90-page book take him?",
     "answer": "90 / 15 = <<90/15=6>>6 days.\n#### 6"},
]
MATH_ROWS = [  # HuggingFaceH4/MATH-500: problem, solution, answer, subject, level, unique_id
    {"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$.",
     "answer": "\\frac{3}{4}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Convert $(0,2)$ to polar coordinates.", "solution": "It is $\\boxed{\\left( 2, \\frac{\\pi}{2} \\right)}$.",
     "answer": "\\left( 2, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/2.json"},
]
AIME_ROWS = [  # HuggingFaceH4/aime_2024: id, problem, solution, answer (a string), url, year
    {"id": 60, "problem": "Find the remainder when $2^{10}$ is divided by $1000$.", "solution": "$1024$.",
     "answer": "24", "url": "https://example.org/aime/1", "year": "2024"},
    {"id": 61, "problem": "Find $7 \\cdot 11 \\cdot 13$.", "solution": "$1001$.", "answer": "1001",
     "url": "https://example.org/aime/2", "year": "2024"},
]
AMC_ROWS = [  # math-ai/amc23: id, question, answer (a float), url
    {"id": 0, "question": "Two trains 45 miles apart meet moving at 18 and 12 mph. How far does the first go?",
     "answer": 27.0, "url": "https://example.org/amc/1"},
    {"id": 1, "question": "What is $1/4 + 1/4$?", "answer": 0.5, "url": "https://example.org/amc/2"},
]
DEEPSCALER_ROWS = [  # agentica-org/DeepScaleR-Preview-Dataset: problem, answer, solution
    {"problem": "Compute $1+2$.", "answer": "3", "solution": "It is $3$."},
    {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}", "solution": "..."},
    {"problem": "What is $2^{10}$?", "answer": "1024", "solution": "..."},
]

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# GSM8K
"""


def _write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hub_repositories(root: Path) -> dict[str, list]:
    """Under root, every named set's Hub repository laid out as on the Hub (README configs, config
    folders, Parquet shards or the single JSON/JSONL file the repository holds); name -> its rows."""
    gsm8k = root / "openai/gsm8k"
    (gsm8k / "README.md").parent.mkdir(parents=True, exist_ok=True)
    (gsm8k / "README.md").write_text(GSM8K_README)
    _write(gsm8k / "main/train-00000-of-00001.parquet", GSM8K_ROWS)
    _write(gsm8k / "main/test-00000-of-00001.parquet", GSM8K_ROWS[:2])
    _write(gsm8k / "socratic/train-00000-of-00001.parquet", GSM8K_ROWS[2:])
    _write(root / "HuggingFaceH4/MATH-500/test.jsonl", MATH_ROWS)
    _write(root / "HuggingFaceH4/aime_2024/data/train-00000-of-00001.parquet", AIME_ROWS)
    _write(root / "math-ai/amc23/test-00000-of-00001.parquet", AMC_ROWS)
    _write(root / "agentica-org/DeepScaleR-Preview-Dataset/deepscaler.json", DEEPSCALER_ROWS)
    return {"gsm8k_train": GSM8K_ROWS, "gsm8k_test": GSM8K_ROWS[:2], "math500": MATH_ROWS, "aime24": AIME_ROWS,
            "amc23": AMC_ROWS, "deepscaler": DEEPSCALER_ROWS}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A working directory holding every named set's repository, the HF datasets cache in tmp_path,
    and the Hub off: what `datasets` reads for a Hub id is the folder of that name."""
    import datasets

    root = tmp_path / "hub"
    rows = hub_repositories(root)
    monkeypatch.chdir(root)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return rows


# --------------------------------------------------------------------------------------------
# Named sets: the Hub path and fetched files give the same problems


EXPECTED_GOLD = {"gsm8k_train": ["62", "36000", "6"], "gsm8k_test": ["62", "36000"],
                 "math500": ["\\frac{3}{4}", "\\left( 2, \\frac{\\pi}{2} \\right)"], "aime24": ["24", "1001"],
                 "amc23": ["27", "0.5"], "deepscaler": ["3", "\\frac{1}{2}", "1024"]}


@pytest.mark.parametrize("name", list(NAMED_SETS))
def test_named_set_from_hub_layout_equals_the_jsonl_loader(name, hub, tmp_path):
    from_hub = load_problems(DataConfig(dataset=name))
    assert [p.answer for p in from_hub] == EXPECTED_GOLD[name]
    question_key = NAMED_SETS[name].question_key
    assert [p.prompt for p in from_hub] == [r[question_key] for r in hub[name]]
    # the same rows as the file `fetch` writes: the same problems, ids included
    fetched = tmp_path / "fetched"
    _write(fetched / NAMED_SETS[name].file, hub[name])
    assert load_problems(DataConfig(dataset=name, data_dir=str(fetched))) == from_hub
    assert from_hub[0].source == name and from_hub[0].id == f"{name}/{hub[name][0].get('id', 1)}"


def test_hub_id_config_split_fields_and_format_as_jsonl(hub, tmp_path):
    cfg = DataConfig(dataset="openai/gsm8k", config="main", split="train", question_key="question",
                     answer_format="gsm8k")
    loaded = load_problem_set(cfg)
    assert loaded.origin == "openai/gsm8k (config main, split train)"
    jsonl = load_problems(DataConfig(dataset=str(_write(tmp_path / "rows.jsonl", GSM8K_ROWS)), answer_format="gsm8k"))
    assert [(p.prompt, p.answer) for p in loaded.problems] == [(p.prompt, p.answer) for p in jsonl]
    assert [p.id for p in loaded.problems] == [f"openai/gsm8k:main:train/{i}" for i in (1, 2, 3)]
    other = load_problems(DataConfig(dataset="openai/gsm8k", config="socratic", split="train", answer_format="gsm8k"))
    assert [p.answer for p in other] == ["6"]
    # MATH's worked solution: the last \\boxed{} is the answer field
    boxed = load_problems(DataConfig(dataset="HuggingFaceH4/MATH-500", answer_key="solution", answer_format="boxed"))
    assert [p.answer for p in boxed] == EXPECTED_GOLD["math500"]


def test_hub_config_and_split_mistakes_name_the_key(hub):
    with pytest.raises(DataError, match=r"^config: openai/gsm8k \(config mian, split train\): .*'main', 'socratic'"):
        load_problems(DataConfig(dataset="openai/gsm8k", config="mian", split="train"))
    with pytest.raises(DataError, match=r"^split: openai/gsm8k \(config main\) has splits train, test; choose one"):
        load_problems(DataConfig(dataset="openai/gsm8k", config="main"))
    with pytest.raises(DataError, match=r"^split: .*tset"):
        load_problems(DataConfig(dataset="gsm8k_train", split="tset"))


def test_a_set_that_cannot_be_had_is_one_line(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)  # no repository folders here, an empty cache, the Hub off
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataUnavailable) as e:
        load_problems(DataConfig(dataset="gsm8k_train"))
    message = str(e.value)
    assert "\n" not in message
    for needle in ("'gsm8k_train'", "openai/gsm8k (config main, split train)", str(tmp_path / "datasets-cache"),
                   "HF_HUB_OFFLINE", "data_dir is not set", "python -m grpo.data fetch gsm8k_train --out DIR"):
        assert needle in message, (needle, message)
    with pytest.raises(DataUnavailable, match=r"'math500': .*nowhere/math500_test\.jsonl not found .*"
                                              r"python -m grpo\.data fetch math500 --out .*nowhere"):
        load_problems(DataConfig(dataset="math500", data_dir=str(tmp_path / "nowhere")))
    with pytest.raises(DataUnavailable, match=r"'acme/none' cannot be had: .*HF_HUB_OFFLINE"):
        load_problems(DataConfig(dataset="acme/none", split="train"))


def test_fetch_writes_what_data_dir_reads(hub, tmp_path, capsys):
    out = tmp_path / "offline"
    assert data_cli(["fetch", "gsm8k_test", "amc23", "--out", str(out)]) == 0
    assert "gsm8k_test: 2 rows of openai/gsm8k (config main, split test)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["amc23_test.jsonl", "gsm8k_test.jsonl"]  # no temporary left
    assert [json.loads(line) for line in (out / "amc23_test.jsonl").read_text().splitlines()] == AMC_ROWS  # as published
    for name in ("gsm8k_test", "amc23"):
        assert load_problems(DataConfig(dataset=name, data_dir=str(out))) == load_problems(DataConfig(dataset=name))
    assert data_cli(["fetch", "gsm9k", "--out", str(out)]) == 2
    assert "unknown named set 'gsm9k'" in capsys.readouterr().err


def test_data_config_refuses_what_cannot_be_meant(tmp_path):
    with pytest.raises(ValueError, match="dataset: must be one of gsm8k_train, .*a Hub dataset id"):
        DataConfig(dataset="gsm9k")
    with pytest.raises(ValueError, match="config: only a Hub id"):
        DataConfig(dataset="rows.jsonl", config="main")
    with pytest.raises(ValueError, match="split: only a Hub id"):
        DataConfig(dataset="arithmetic", split="train")
    with pytest.raises(ValueError, match="data_dir: only named sets"):
        DataConfig(dataset="openai/gsm8k", data_dir=str(tmp_path))


def test_missing_file_and_config_loader():
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_problems(DataConfig(dataset="/nowhere.jsonl"))
    cfg = load_config(DataConfig, overrides=["dataset=gsm8k_test", "arithmetic.ops=+-", "on_bad_row=skip"])
    assert cfg.arithmetic.ops == "+-" and cfg.on_bad_row == "skip"
    with pytest.raises(ConfigError, match="arithmetic.ops"):
        load_config(DataConfig, overrides=["arithmetic.ops=/"])


def test_docs_data_md_documents_every_key_and_named_set():
    """docs/data.md holds a row for each data key (arithmetic's included) and each named set as the table has it."""
    import dataclasses

    doc = (Path(__file__).resolve().parent.parent / "docs" / "data.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    keys = [f.name for f in dataclasses.fields(DataConfig) if f.name != "arithmetic"]
    keys += [f"arithmetic.{f.name}" for f in dataclasses.fields(ArithmeticConfig)]
    undocumented = [k for k in keys if not any(f"`{k}`" in row.split("|")[1] for row in rows)]
    assert undocumented == [], undocumented
    for s in NAMED_SETS.values():
        row = next((r for r in rows if r.startswith(f"| `{s.name}` |")), None)
        assert row is not None, f"docs/data.md has no row for {s.name}"
        cells = [c.strip().strip("`") for c in row.split("|")[1:-1]]
        assert cells == [s.name, s.hub_id, s.config or "(default)", s.split, str(s.rows), s.question_key,
                         s.answer_key, s.answer_format, s.file], cells


# --------------------------------------------------------------------------------------------
# The full real sets: from $GRPO_TEST_DATA_DIR (CI: our local copy), else skipped

FULL_DATA = os.environ.get("GRPO_TEST_DATA_DIR")


def full_set(name: str) -> list[Problem]:
    if not FULL_DATA:
        pytest.skip("full-size check: set GRPO_TEST_DATA_DIR to a folder written by `python -m grpo.data fetch "
                    f"{name} --out DIR` to run it")
    if not (Path(FULL_DATA) / NAMED_SETS[name].file).is_file():
        pytest.skip(f"full-size check: {NAMED_SETS[name].file} is not in GRPO_TEST_DATA_DIR={FULL_DATA}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the real files have no malformed row
        return load_problems(DataConfig(dataset=name, data_dir=FULL_DATA))


@pytest.mark.parametrize("name", list(NAMED_SETS))
def test_full_named_set_has_its_published_rows(name):
    problems = full_set(name)
    assert len(problems) == NAMED_SETS[name].rows
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.prompt and p.answer and p.source == name for p in problems)
    if name.startswith("gsm8k"):
        for p in problems:
            float(p.answer)  # numeric, thousands commas removed
            assert "," not in p.answer


def test_full_gsm8k_first_rows():
    test, train = full_set("gsm8k_test"), full_set("gsm8k_train")
    assert test[0].answer == "18" and test[0].prompt.startswith("Janet") and test[0].id == "gsm8k_test/1"
    assert "1450000" in {p.answer for p in test}  # "#### 1,450,000" in the file
    assert train[0].answer == "72" and train[0].prompt.startswith("Natalia")


def test_full_math500_every_answer_parses():
    from math_verify import parse

    from grpo.rewards import gold_to_latex

    problems = full_set("math500")
    unparsed = [(p.id, p.answer) for p in problems if not parse(gold_to_latex(p.answer))]
    assert unparsed == []


# --------------------------------------------------------------------------------------------
# Malformed rows


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_json_line_names_file_and_line(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", [
        json.dumps({"problem": "1+1?", "answer": "2"}),
        "",  # blank lines are not rows (line numbers still count them)
        '{"problem": "2+2?", "answer": ',
    ])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        load_problems(DataConfig(dataset=str(path)))


def test_missing_field_names_file_and_line(tmp_path):
    path = _write_lines(tmp_path / "missing.jsonl", [
        json.dumps({"problem": "1+1?", "answer": "2"}),
        json.dumps({"problem": "2+2?", "solution": "4"}),
    ])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: missing field 'answer'"):
        load_problems(DataConfig(dataset=str(path)))


def test_gsm8k_answer_without_hashes(tmp_path):
    _write_lines(tmp_path / "gsm8k_test.jsonl", [
        json.dumps({"question": "q1", "answer": "work\n#### 1,234"}),
        json.dumps({"question": "q2", "answer": "work but no final line"}),
    ])
    cfg = DataConfig(dataset="gsm8k_test", data_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"gsm8k_test\.jsonl:2: GSM8K answer has no '#### N' line"):
        load_problems(cfg)


def test_skip_mode_counts_every_bad_row(tmp_path):
    path = _write_lines(tmp_path / "gsm8k_test.jsonl", [
        json.dumps({"question": "q1", "answer": "#### 5"}),
        "not json",
        json.dumps({"question": "q3"}),
        json.dumps({"question": "q4", "answer": "no hashes"}),
        json.dumps(["a", "list"]),
        json.dumps({"question": "q6", "answer": "x\n#### -3"}),
    ])
    cfg = DataConfig(dataset="gsm8k_test", data_dir=str(tmp_path), on_bad_row="skip")
    with pytest.warns(UserWarning, match="skipped 4 malformed rows"):
        result = load_problem_set(cfg)
    assert result.skipped == 4
    assert [r.split(": ", 1)[0] for r in result.skip_reasons] == [f"{path}:{i}" for i in (2, 3, 4, 5)]
    assert [(p.prompt, p.answer) for p in result.problems] == [("q1", "5"), ("q6", "-3")]


def test_json_and_parquet_bad_rows_name_the_row(tmp_path):
    json_path = tmp_path / "rows.json"
    json_path.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b"}]))
    with pytest.raises(DataError, match=r"rows\.json: row 2: missing field 'answer'"):
        load_problems(DataConfig(dataset=str(json_path)))
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"problem": "a", "answer": "1"},\n{"problem": \n')
    with pytest.raises(DataError, match=r"broken\.json:4: not valid JSON"):
        load_problems(DataConfig(dataset=str(broken)))
    pq_path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"problem": ["a", "b", None], "answer": ["1", "2", "3"]}), pq_path)
    with pytest.raises(DataError, match=r"rows\.parquet: row 3: missing field 'problem'"):
        load_problems(DataConfig(dataset=str(pq_path)))


# --------------------------------------------------------------------------------------------
# DeepScaleR-style rows (problem / answer / solution) in three formats

def test_deepscaler_rows_in_jsonl_json_parquet(tmp_path):
    _write_lines(tmp_path / "ds.jsonl", [json.dumps(r) for r in DEEPSCALER_ROWS])
    (tmp_path / "ds.json").write_text(json.dumps(DEEPSCALER_ROWS))
    pq.write_table(pa.Table.from_pylist(DEEPSCALER_ROWS), tmp_path / "ds.parquet")
    expected = [("Compute $1+2$.", "3"), ("Simplify $\\frac{2}{4}$.", "\\frac{1}{2}"), ("What is $2^{10}$?", "1024")]
    for name in ("ds.jsonl", "ds.json", "ds.parquet"):
        problems = load_problems(DataConfig(dataset=str(tmp_path / name)))
        assert [(p.prompt, p.answer) for p in problems] == expected, name
        assert [p.id for p in problems] == [f"{tmp_path / name}/{i}" for i in (1, 2, 3)]


def test_custom_field_names(tmp_path):
    path = _write_lines(tmp_path / "custom.jsonl", [json.dumps({"q": "Q?", "final": 7.5, "id": "x9"})])
    problems = load_problems(DataConfig(dataset=str(path), question_key="q", answer_key="final"))
    assert problems == [Problem(id=f"{path}/x9", prompt="Q?", answer="7.5", source=str(path))]


# --------------------------------------------------------------------------------------------
# Procedural arithmetic


def test_arithmetic_values_and_knobs():
    cfg = ArithmeticConfig(n_terms_min=2, n_terms_max=4, min_operand=3, max_operand=12, ops="+-*", eval_size=50)
    task = ArithmeticTask(cfg)
    problems = [task.train_problem(seed=1, index=i) for i in range(300)]
    problems = [p for p in problems if p is not None]
    seen_terms, seen_ops = set(), set()
    for p in problems:
        expression = p.prompt.removeprefix("What is ").removesuffix("?")
        tokens = expression.split(" ")
        operands, ops = [int(t) for t in tokens[0::2]], tokens[1::2]
        assert all(3 <= x <= 12 for x in operands)
        seen_terms.add(len(operands)), seen_ops.update(ops)
        assert int(p.answer) == eval(expression)  # Python's precedence matches the usual one
    assert seen_terms == {2, 3, 4} and seen_ops == {"+", "-", "*"}
    sums = ArithmeticTask(ArithmeticConfig(ops="+", max_operand=9, min_operand=0, eval_size=0))
    p = sums.train_problem(0, 0)
    assert p.prompt.count("+") == 1 and "-" not in p.prompt and "*" not in p.prompt


def test_arithmetic_is_deterministic_and_eval_is_disjoint():
    cfg = ArithmeticConfig(max_operand=20, eval_size=100)
    a, b = ArithmeticTask(cfg), ArithmeticTask(cfg)
    assert a.eval_problems() == b.eval_problems()
    held_out = {p.prompt for p in a.eval_problems()}
    assert len(held_out) == 100
    train = [a.train_problem(seed=0, index=i) for i in range(3000)]
    skipped = sum(p is None for p in train)
    assert 0 < skipped < 3000  # 100 of 400 sums are held out, so some draws collide and are skipped
    assert not held_out & {p.prompt for p in train if p is not None}
    assert [p.prompt for p in train[:50] if p] == [p.prompt for p in
                                                   (b.train_problem(0, i) for i in range(50)) if p]
    other_seed = [a.train_problem(seed=1, index=i) for i in range(50)]
    assert [p and p.prompt for p in other_seed] != [p and p.prompt for p in train[:50]]
    assert load_problems(DataConfig(dataset="arithmetic", arithmetic=cfg)) == a.eval_problems()
    assert load_problems(DataConfig(dataset="arithmetic", arithmetic=cfg, limit=7)) == a.eval_problems()[:7]


def test_arithmetic_too_small_space_is_an_error():
    cfg = ArithmeticConfig(min_operand=1, max_operand=2, eval_size=4)  # only 4 distinct sums exist
    sampler = PromptSampler(ArithmeticTask(cfg), batch_size=1)
    with pytest.raises(RuntimeError, match="held out"):
        sampler.next_batch()
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(ArithmeticConfig(min_operand=1, max_operand=2, eval_size=5)).eval_problems()


def test_arithmetic_config_validation():
    with pytest.raises(ValueError, match="ops:"):
        ArithmeticConfig(ops="+/")
    with pytest.raises(ValueError, match="n_terms_max:"):
        ArithmeticConfig(n_terms_min=3, n_terms_max=2)


# --------------------------------------------------------------------------------------------
# Prompts


def _tiny_tokenizer(with_template=True):
    """Character-level tokenizer built in memory (no hub): BOS added by the post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if with_template:  # ChatML, as SmolLM2 and Qwen use
        tokenizer.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def test_build_prompt_uses_chat_template():
    tokenizer = _tiny_tokenizer()
    cfg = DataConfig(system_prompt="Be brief.", instruction="Put the answer in \\boxed{}.")
    problem = Problem(id="t/1", prompt="What is 2 + 3?", answer="5", source="t")
    text = build_prompt(tokenizer, problem, cfg)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 3?\nPut the answer in \\boxed{}.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = encode_prompt(tokenizer, text)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS added on top
    assert tokenizer.bos_token_id not in ids
    assert tokenizer.decode(ids) == text
    no_system = build_prompt(tokenizer, problem, DataConfig(system_prompt=""))
    assert no_system.startswith("<|im_start|>user\nWhat is 2 + 3?\n") and "\\boxed{}" in no_system


def test_build_prompt_with_project_tiny_tokenizer():
    from tiny_models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    problem = ArithmeticTask(ArithmeticConfig(eval_size=0)).train_problem(seed=0, index=0)
    text = build_prompt(tokenizer, problem, DataConfig(system_prompt="S."))
    assert text.startswith("<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nWhat is ")
    assert text.endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(encode_prompt(tokenizer, text)) == text


def test_build_prompt_without_template_warns_and_uses_plain_format():
    tokenizer = _tiny_tokenizer(with_template=False)
    cfg = DataConfig(system_prompt="S.", instruction="I.")
    problem = Problem(id="t/1", prompt="Q?", answer="1", source="t")
    import grpo.data.prompts as prompts_module
    prompts_module._warned_no_template = False
    with pytest.warns(UserWarning, match="no chat template"):
        text = build_prompt(tokenizer, problem, cfg)
    assert text == "S.\nQ?\nI.\nassistant:"


# --------------------------------------------------------------------------------------------
# Sampler


def _problems(n):
    return [Problem(id=f"p/{i}", prompt=f"q{i}", answer=str(i), source="p") for i in range(n)]


def _ids(batch):
    return [p.id for p in batch]


def test_sampler_is_deterministic_from_seed_and_covers_each_epoch():
    problems = _problems(12)
    sampler_a, sampler_b, sampler_c = (PromptSampler(problems, 4, seed=s) for s in (3, 3, 4))
    batches_a = [_ids(sampler_a.next_batch()) for _ in range(6)]
    batches_b = [_ids(sampler_b.next_batch()) for _ in range(6)]
    batches_c = [_ids(sampler_c.next_batch()) for _ in range(6)]
    assert batches_a == batches_b
    assert batches_a != batches_c
    epoch0 = sum(batches_a[:3], [])
    epoch1 = sum(batches_a[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == sorted(p.id for p in problems)  # each epoch: all, once
    assert epoch0 != epoch1  # reshuffled
    assert sampler_a.epoch == 1
    assert _ids(PromptSampler(problems, 12, shuffle=False).next_batch()) == [p.id for p in problems]


def test_batch_crossing_epoch_boundary():
    sampler = PromptSampler(_problems(5), 3, seed=0)
    first, second = sampler.next_batch(), sampler.next_batch()  # second = 2 of epoch 0 + 1 of epoch 1
    assert len(set(_ids(first) + _ids(second)[:2])) == 5
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 1


@pytest.mark.parametrize("source", ["list", "arithmetic"])
def test_cursor_save_restore_continues_identically(source):
    def make():
        if source == "list":
            return PromptSampler(_problems(7), 3, seed=11)
        return PromptSampler(ArithmeticTask(ArithmeticConfig(max_operand=9, min_operand=0, eval_size=20)), 3, seed=11)

    sampler = make()
    for _ in range(4):
        sampler.next_batch()
    state = sampler.state_dict()
    assert all(type(v) is int for v in state.values())
    expected = [_ids(sampler.next_batch()) for _ in range(5)]
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a plain-JSON round trip
    assert [_ids(resumed.next_batch()) for _ in range(5)] == expected
    other = PromptSampler(_problems(8), 3, seed=11)
    with pytest.raises(ValueError, match="n_problems"):
        other.load_state_dict(state)


def test_make_sampler_for_files_and_arithmetic(tmp_path):
    path = _write(tmp_path / "ds.jsonl", DEEPSCALER_ROWS)
    sampler = make_sampler(DataConfig(dataset=str(path)), batch_size=2, seed=0)
    assert len(sampler.next_batch()) == 2 and sampler.n_problems == 3
    arith = make_sampler(DataConfig(dataset="arithmetic"), batch_size=4)
    batch = arith.next_batch()
    assert all(p.source == "arithmetic" and p.id.startswith("arithmetic-train/") for p in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean file gives no skip warning
        load_problem_set(DataConfig(dataset=str(path)))


def test_a_dotted_field_name_reaches_into_nested_rows_from_every_source(hub, tmp_path):
    """`answer_key: answer.final` names a field inside an object: JSONL and JSON objects, a Parquet
    struct column and a Hub-layout folder's nested feature all read it the same way."""
    rows = [{"q": {"text": "What is 2 + 3?"}, "answer": {"final": "5", "steps": "2 + 3"}},
            {"q": {"text": "What is 7 * 6?"}, "answer": {"final": "42", "steps": "7 * 6"}}]
    want = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
    folder = Path("acme/nested")  # the hub fixture's working directory: a Hub id is its folder
    _write(folder / "data/train-00000-of-00001.parquet", rows)
    sources = [str(_write(tmp_path / f"nested.{suffix}", rows)) for suffix in ("jsonl", "json", "parquet")]
    for dataset in [*sources, "acme/nested"]:
        cfg = DataConfig(dataset=dataset, question_key="q.text", answer_key="answer.final")
        assert [(p.prompt, p.answer) for p in load_problems(cfg)] == want, dataset
    with pytest.raises(DataError, match=r"nested\.jsonl:1: missing field 'answer\.total'"):
        load_problems(DataConfig(dataset=sources[0], question_key="q.text", answer_key="answer.total"))
