"""grpo/data.py: loaders on the real data files, malformed rows, arithmetic task, prompts, sampler."""
import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.config import ConfigError, load_config
from grpo.data import (ArithmeticConfig, ArithmeticTask, DataConfig, DataError, Problem, PromptSampler,
                       build_prompt, encode_prompt, load_problem_set, load_problems, make_sampler)

# --------------------------------------------------------------------------------------------
# Named datasets in ../shared/data


def test_gsm8k_test_has_1319_numeric_golds():
    problems = load_problems(DataConfig(dataset="gsm8k_test"))
    assert len(problems) == 1319
    for p in problems:
        float(p.answer)  # numeric, commas stripped
        assert "," not in p.answer and p.prompt and p.source == "gsm8k_test"
    assert problems[0].answer == "18" and problems[0].prompt.startswith("Janet")
    assert problems[0].id == "gsm8k_test/1"
    assert len({p.id for p in problems}) == 1319
    # "#### 1,450,000" in the file becomes a plain integer
    assert "1450000" in {p.answer for p in problems}


def test_gsm8k_train_has_7473():
    problems = load_problems(DataConfig(dataset="gsm8k_train"))
    assert len(problems) == 7473
    assert problems[0].answer == "72" and problems[0].prompt.startswith("Natalia")


@pytest.mark.parametrize("name,count,first_answer", [
    ("math500", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("aime24", 30, "204"),
    ("amc23", 40, "27"),  # stored as the float 27.0
])
def test_competition_sets(name, count, first_answer):
    problems = load_problems(DataConfig(dataset=name))
    assert len(problems) == count
    assert problems[0].answer == first_answer
    assert all(p.prompt and p.answer for p in problems)


def test_data_dir_is_relative_to_repo_root_not_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(load_problems(DataConfig(dataset="amc23"))) == 40


def test_limit_keeps_first_rows():
    problems = load_problems(DataConfig(dataset="gsm8k_test", limit=3))
    assert [p.answer for p in problems] == ["18", "3", "70000"]


def test_missing_file_and_unknown_name():
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_problems(DataConfig(dataset="/nowhere.jsonl"))
    with pytest.raises(ValueError, match="dataset: must be one of"):
        DataConfig(dataset="gsm9k")


def test_config_loader_builds_data_config():
    cfg = load_config(DataConfig, overrides=["dataset=gsm8k_test", "arithmetic.ops=+-", "on_bad_row=skip"])
    assert cfg.arithmetic.ops == "+-" and cfg.on_bad_row == "skip"
    with pytest.raises(ConfigError, match="arithmetic.ops"):
        load_config(DataConfig, overrides=["arithmetic.ops=/"])


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

DEEPSCALER_ROWS = [
    {"problem": "Compute $1+2$.", "answer": "3", "solution": "It is $3$."},
    {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}", "solution": "..."},
    {"problem": "What is $2^{10}$?", "answer": "1024", "solution": "..."},
]


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
    import grpo.data as data_module
    data_module._warned_no_template = False
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


def test_make_sampler_for_files_and_arithmetic():
    sampler = make_sampler(DataConfig(dataset="amc23"), batch_size=4, seed=0)
    assert len(sampler.next_batch()) == 4 and sampler.n_problems == 40
    arith = make_sampler(DataConfig(dataset="arithmetic"), batch_size=4)
    batch = arith.next_batch()
    assert all(p.source == "arithmetic" and p.id.startswith("arithmetic-train/") for p in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean file gives no skip warning
        load_problem_set(DataConfig(dataset="aime24"))
