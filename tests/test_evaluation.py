"""Fast tests of the evaluation maths: pass@k, maj@k and summaries, against values worked by hand."""
import math

import pytest

from grpo.evaluation import EvalConfig, maj_at_k, majority_answer, pass_at_k, summarize


# pass@k = 1 - C(n-c, k) / C(n, k), each expected value below worked out by hand.
@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 2 / 5),  # pass@1 is the plain success frequency c/n
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (5, 2, 3, 1 - 1 / 10),  # C(3,3)=1, C(5,3)=10
        (5, 2, 4, 1.0),  # n-c=3 < k: every 4-subset holds a correct sample
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (4, 1, 4, 1.0),  # k = n with one correct sample: the only subset is all of them
        (4, 0, 4, 0.0),  # k = n, c = 0
        (10, 0, 3, 0.0),  # c = 0
        (10, 0, 1, 0.0),  # c = 0, k = 1
        (3, 3, 1, 1.0),  # c = n
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (50, 1, 1, 1 / 50),  # the paper's K = 50 with a single success
        (50, 1, 50, 1.0),  # k = n = 50
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_stable_for_large_n():
    # C(2000, 10) is ~2.8e26: the product form must agree with exact big-integer arithmetic.
    n, c, k = 2000, 5, 10
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    # n = 10000, c = 1, k = 1: 1/10000 exactly.
    assert pass_at_k(10000, 1, 1) == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# Hand-made answers: the gold is "5".
ANSWERS = ["3", "5", "5", None, "3", "3"]
CORRECT = [False, True, True, False, False, False]


@pytest.mark.parametrize(
    "k, expected",
    [
        (1, 0.0),  # {"3"}: wrong
        (2, 0.0),  # "3" and "5" tie at one vote each: the first seen, "3", wins
        (3, 1.0),  # "5" has two votes against one
        (4, 1.0),  # None does not vote: still "5" 2-1
        (5, 0.0),  # "3" and "5" tie at 2: "3" came first
        (6, 0.0),  # "3" has three votes
    ],
)
def test_maj_at_k_hand_made_answers(k, expected):
    assert maj_at_k(ANSWERS, CORRECT, k) == expected


def test_majority_answer_ignores_missing_answers():
    assert majority_answer([None, None, "7"]) == "7"
    assert majority_answer([None, ""]) is None
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def _record(correct, extracted, n_tokens, finish_reasons, rewards=None):
    return {
        "correct": correct,
        "extracted": extracted,
        "n_tokens": n_tokens,
        "finish_reasons": finish_reasons,
        "rewards": rewards if rewards is not None else [float(x) for x in correct],
    }


def test_summary_of_hand_made_records():
    records = [
        _record([True, False, False, True], ["4", "5", "5", "4"], [10, 20, 30, 40], ["stop", "length", "stop", "stop"]),
        _record([False] * 4, ["1", None, "2", "1"], [5, 5, 5, 5], ["length"] * 4),
    ]
    s = summarize(records, pass_k=[1, 2, 4, 8])
    assert s["n_problems"] == 2 and s["samples_per_problem"] == 4 and s["n_samples"] == 8
    assert s["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert s["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # problem 1: 1 - C(2,2)/C(4,2)
    assert s["pass@4"] == pytest.approx((1 + 0) / 2)
    assert "pass@8" not in s  # k > K is left out
    # maj@4: problem 1 ties "4" vs "5" at 2, "4" came first and is correct; problem 2 votes "1", wrong.
    assert s["maj@4"] == pytest.approx(0.5)
    assert s["maj@1"] == pytest.approx(0.5)
    assert s["maj@2"] == pytest.approx(0.5)  # "4" vs "5" tie -> "4"
    assert s["mean_completion_tokens"] == pytest.approx((100 + 20) / 8)
    assert s["truncation_rate"] == pytest.approx(5 / 8)
    assert s["extraction_rate"] == pytest.approx(7 / 8)
    assert s["reward_mean"] == pytest.approx(2 / 8)


def test_summary_rejects_empty_records():
    with pytest.raises(ValueError, match="no records"):
        summarize([], pass_k=[1])


@pytest.mark.parametrize(
    "overrides, field",
    [({"k": 0}, "k"), ({"temperature": -1.0}, "temperature"), ({"pass_k": [0]}, "pass_k"),
     ({"subset": "last"}, "subset"), ({"n_problems": 0}, "n_problems"), ({"top_p": 0.0}, "top_p")],
)
def test_eval_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EvalConfig(**overrides)


def _run_plot(args):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "plot.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.torchrun
def test_plot_script_draws_reward_and_eval_panels(tmp_path):
    import json

    for name in ("v1-i1", "v10-i1"):
        run = tmp_path / name
        run.mkdir()
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, 11):
                row = {"step": step, "reward_mean": 0.1 * step}
                if step % 5 == 0:  # eval only every 5 steps, as in training
                    row["eval/pass@1"] = 0.05 * step
                    row["eval/n_problems"] = 100  # a count: not a default panel
                f.write(json.dumps(row) + "\n")
    out = tmp_path / "fig.png"
    result = _run_plot([str(tmp_path / "v1-i1"), str(tmp_path / "v10-i1"), "--out", str(out), "--smooth", "0.5"])
    assert result.returncode == 0, result.stderr
    assert "reward_mean, eval/pass@1 for 2 run(s)" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.torchrun
def test_plot_script_bad_input_is_one_readable_line(tmp_path):
    result = _run_plot([str(tmp_path / "missing-run")])
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "missing-run: no metrics.jsonl" in result.stderr
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "reward_mean": 0.5}\nnot json\n')
    result = _run_plot([str(bad)])
    assert result.returncode != 0 and "metrics.jsonl:2: not valid JSON" in result.stderr


def _completion(text, n_tokens, finish_reason="stop"):
    from grpo.serving.client import Completion

    return Completion(token_ids=list(range(n_tokens)), logprobs=[-0.5] * n_tokens, finish_reason=finish_reason,
                      text=text)


@pytest.mark.torchrun  # the real scorer's math-verify worker processes
def test_score_completions_with_the_real_scorer_and_twice_identical():
    from grpo.data import Problem
    from grpo.evaluation import score_completions
    from grpo.rewards import RewardConfig, RewardScorer

    problems = [Problem("p/0", "What is 12 + 7?", "19", "hand"), Problem("p/1", "What is 1/2 + 0?", "\\frac{1}{2}", "hand")]
    prompts = ["prompt 0", "prompt 1"]
    completions = [
        [_completion("12 + 7 = \\boxed{19}", 8), _completion("\\boxed{18}", 3), _completion("so 19", 16, "length")],
        [_completion("\\boxed{0.5}", 4), _completion("\\boxed{1/2}", 4), _completion("\\boxed{2}", 4)],
    ]
    with RewardScorer(RewardConfig(workers=1)) as scorer:
        first = score_completions(problems, prompts, completions, scorer)
        second = score_completions(problems, prompts, completions, scorer)
    assert first == second
    assert summarize(first, [1, 2, 3]) == summarize(second, [1, 2, 3])
    r0, r1 = first
    assert r0["correct"] == [True, False, False]  # no \boxed{} in the truncated one: not an answer
    assert r0["extracted"] == ["19", "18", None]
    assert r0["n_tokens"] == [8, 3, 16] and r0["finish_reasons"] == ["stop", "stop", "length"]
    assert r1["correct"] == [True, True, False]  # math-verify: 0.5 == 1/2 == \frac{1}{2}
    assert r1["n_correct"] == 2 and r1["gold"] == "\\frac{1}{2}" and r1["prompt"] == "prompt 1"
    s = summarize(first, [1, 2, 3])
    assert s["pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert s["pass@3"] == pytest.approx(1.0)
    # maj@3: problem 0 votes 19/18 tie -> "19" (first) correct; problem 1: "0.5", "1/2", "2" are three
    # different strings, tie -> "0.5" (first) correct.
    assert s["maj@3"] == pytest.approx(1.0)
    assert s["truncation_rate"] == pytest.approx(1 / 6)
    assert s["mean_completion_tokens"] == pytest.approx((8 + 3 + 16 + 12) / 6)


def test_select_problems_first_and_seeded_random():
    from grpo.evaluation import select_problems

    items = list(range(10))
    assert select_problems(items, EvalConfig(n_problems=3)) == [0, 1, 2]
    a = select_problems(items, EvalConfig(n_problems=4, subset="random", seed=1))
    assert a == select_problems(items, EvalConfig(n_problems=4, subset="random", seed=1))
    assert len(set(a)) == 4 and a == sorted(a)
    assert select_problems(items, EvalConfig(n_problems=50)) == items


def _run_eval(args):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "eval.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=root)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "gsm9k"], "data.dataset: must be one of"),
        (["--model", "{tmp}/hf", "--dataset", "{tmp}/missing.jsonl"], "file not found"),
        (["--model", "{tmp}/no-weights"], "has config.json but no weights"),
        (["--model", "{tmp}"], "holds no model weights"),
        (["--config", "{tmp}/missing.yaml"], "config file not found"),
        (["eval.k=0"], "eval.k: samples per problem must be >= 1"),
    ],
)
def test_eval_bad_input_gives_one_line_errors(tmp_path, capsys, args, message):
    import eval as eval_script

    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    if "{tmp}/hf" in args:
        _fake_hf_dir(tmp_path / "hf")  # a model that passes the checks, so the dataset's error shows
    assert eval_script.main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eval.py: error:") and message in err and "\n" not in err, err


def _fake_hf_dir(path):
    """Files an HF model directory has (eval.py checks them before the dataset); never loaded."""
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.torchrun
def test_eval_bad_input_exit_code_of_the_real_process(tmp_path):
    # An explicit model: a fresh clone has no .cache/models/smollm2 (eval.py's default) yet.
    result = _run_eval(["--model", _fake_hf_dir(tmp_path / "hf"), "--dataset", tmp_path / "missing.jsonl"])
    assert result.returncode == 2
    assert result.stderr.strip() == f"eval.py: error: dataset '{tmp_path / 'missing.jsonl'}': file not found: " \
                                    f"{tmp_path / 'missing.jsonl'}"


def test_resolve_model_dir_finds_a_run_export(tmp_path):
    import os
    import time

    from eval import EvalError, resolve_model_dir

    def hf_dir(path, tokenizer=True):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")
        if tokenizer:
            (path / "tokenizer.json").write_text("{}")
        return path

    run = (tmp_path / "run").resolve()
    older = hf_dir(run / "exports" / "step_10")
    newer = hf_dir(run / "exports" / "step_20")
    hf_dir(run / "weights" / "weights_v3", tokenizer=False)  # a server push: no tokenizer, not an export
    past = time.time() - 100
    os.utime(older / "model.safetensors", (past, past))
    assert resolve_model_dir(str(run)) == newer
    final = hf_dir(run / "final")
    os.utime(final / "model.safetensors", (past - 100, past - 100))
    assert resolve_model_dir(str(run)) == final  # final/ wins over newer exports
    assert resolve_model_dir(str(final)) == final
    with pytest.raises(EvalError, match="no tokenizer"):
        resolve_model_dir(str(run / "weights" / "weights_v3"))


def test_summary_without_majority_leaves_maj_at_k_out():
    records = [_record([True, False, False], [None, "3", ""], [4, 4, 4], ["stop", "stop", "stop"])]
    s = summarize(records, pass_k=[1, 2], majority=False)
    assert s["extraction_rate"] == pytest.approx(1 / 3)  # an empty \boxed{} is no answer
    assert s["pass@1"] == pytest.approx(1 / 3) and s["pass@2"] == pytest.approx(1 - 1 / 3)  # 1 - C(2,2)/C(3,2)
    assert s["pass@3"] == pytest.approx(1.0)
    assert not any(k.startswith("maj@") for k in s)
