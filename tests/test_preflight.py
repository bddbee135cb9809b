"""The dry run (`train.py --check`, `eval.py --check`, grpo/preflight.py): one line per start-up
decision, exit 0 or 2, no server, no process group.

In-process (the quick tier) except one real `python train.py --check` process with the Hub off.
Data rows are written here in GSM8K's and MATH-500's schemas; the model is the tests' tiny one.
"""
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from test_data import GSM8K_ROWS, MATH_ROWS, _write
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
PAPER = str(ROOT / "configs/gsm8k_qwen0.5b_v10-i1.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Files as `python -m grpo.data fetch gsm8k_train gsm8k_test math500 --out DIR` writes them."""
    root = tmp_path_factory.mktemp("fetched")
    _write(root / "gsm8k_train.jsonl", GSM8K_ROWS)
    _write(root / "gsm8k_test.jsonl", GSM8K_ROWS[:2])
    _write(root / "math500_test.jsonl", MATH_ROWS)
    return root


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """No Hub and empty caches, as on a cluster node: datasets and huggingface_hub offline."""
    import datasets
    import huggingface_hub.constants as hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def run_check(script: str, argv: list[str], capsys) -> tuple[int, list[str]]:
    module = __import__(script)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    return exit_.value.code, [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_train_check_passes_with_local_data_and_model_and_plans_8_gpus(model_dir, data_dir, capsys):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    code, lines = run_check("train", ["--check", "--gpus", "8", "--config", PAPER, f"model.path={model_dir}",
                                      f"data.data_dir={data_dir}", f"eval_data.data_dir={data_dir}"], capsys)
    assert code == 0, "\n".join(lines)
    assert [line.split(":")[0] for line in lines] == [
        "ok    config", "ok    layout", "ok    batch", "ok    data", "ok    eval_data", "ok    model", "ok    tokenizer",
        "ok    prompts", "check"]
    assert lines[1] == ("ok    layout: 8 GPUs (--gpus 8): vLLM server on GPU 0 (tensor_parallel_size 1, "
                        "gpu_memory_utilization 0.85); trainer ranks 0..6 on GPUs 1..7: torchrun --nproc_per_node=7 "
                        "train.py")
    assert lines[2] == ("ok    batch: 28 prompts over 7 trainer ranks: 4 prompts x 16 completions = 64 sequences "
                        "per rank per iteration")
    assert lines[3] == f"ok    data: gsm8k_train: 3 problems from {data_dir / 'gsm8k_train.jsonl'}"
    assert "fits server.max_model_len=2048" in lines[7]
    assert lines[-1] == "check: all 8 checks passed; nothing was started (no server, no process group)"
    assert not torch.distributed.is_initialized()
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children  # no server, no rank


def test_train_check_without_the_hub_names_the_data_in_one_line(no_hub, capsys):
    code, lines = run_check("train", ["--check", "--gpus", "8", "--config", PAPER], capsys)
    assert code == 2
    data = [line for line in lines if line.startswith("FAIL  data:")]
    assert len(data) == 1 and data[0].startswith("FAIL  data: dataset 'gsm8k_train' cannot be had: ")
    for needle in ("openai/gsm8k (config main, split train)", "HF_HUB_OFFLINE", "data_dir is not set",
                   "python -m grpo.data fetch gsm8k_train --out DIR"):
        assert needle in data[0]
    assert any(line.startswith("FAIL  model: model.path: Qwen/Qwen2.5-0.5B-Instruct") for line in lines)
    assert "ok    layout: 8 GPUs (--gpus 8)" in "\n".join(lines)
    assert lines[-1] == "check: 3 of 8 checks failed (2 skipped); nothing was started"


@pytest.mark.parametrize("args,expected", [
    (["--nproc-per-node", "6", "server.tensor_parallel_size=2"],
     "FAIL  batch: grpo.batch_prompts: 28 prompts do not split over 6 ranks (rank counts that divide it: "
     "[1, 2, 4, 7, 14, 28]); change the ranks or grpo.batch_prompts"),
    (["--nproc-per-node", "6", "server.tensor_parallel_size=2", "grpo.batch_prompts=24"],
     "ok    layout: 8 GPUs (--gpus 8): vLLM server on GPUs 0,1 (tensor_parallel_size 2, gpu_memory_utilization "
     "0.85); trainer ranks 0..5 on GPUs 2..7: torchrun --nproc_per_node=6 train.py"),
    (["--nproc-per-node", "8"], "FAIL  layout: torchrun --nproc_per_node=8 trainers plus the inference server need "
                                "9 GPUs"),
    (["--nnodes", "2", "--nproc-per-node", "7"], "ok    batch: 28 prompts over 14 trainer ranks"),
    # a fleet (server.replicas): each engine's GPUs, then the trainers on the rest
    (["--nproc-per-node", "4", "server.replicas=4"],
     "ok    layout: 8 GPUs (--gpus 8): 4 vLLM servers (a fleet) on GPU 0 | GPU 1 | GPU 2 | GPU 3 (tensor_parallel_size "
     "1, gpu_memory_utilization 0.85 each); trainer ranks 0..3 on GPUs 4..7: torchrun --nproc_per_node=4 train.py"),
    (["server.replicas=2", "server.tensor_parallel_size=2"],
     "ok    layout: 8 GPUs (--gpus 8): 2 vLLM servers (a fleet) on GPUs 0,1 | GPUs 2,3 (tensor_parallel_size 2, "
     "gpu_memory_utilization 0.85 each); trainer ranks 0..3 on GPUs 4..7: torchrun --nproc_per_node=4 train.py"),
    (["--nproc-per-node", "5", "server.replicas=4"],
     "FAIL  layout: torchrun --nproc_per_node=5 trainers plus 4 inference servers need 9 GPUs, 8 are visible"),
    (['server.urls=["http://a:1","http://b:2"]', "server.push_mode=bytes"],
     "ok    layout: 8 GPUs (--gpus 8): 2 servers attached at http://a:1, http://b:2 (a fleet); trainer ranks 0..7 on "
     "GPUs 0..7: torchrun --nproc_per_node=8 train.py"),
    (['server.urls=["http://a:1"]', "server.replicas=2", "server.push_mode=bytes"],
     "FAIL  config: "),
])
def test_train_check_plans_the_layout_it_is_given(args, expected, no_hub, capsys):
    code, lines = run_check("train", ["--check", "--gpus", "8", "--config", PAPER, *args], capsys)
    assert code == 2  # the data and the model cannot be had here
    assert any(line.startswith(expected) for line in lines), "\n".join(lines)


def test_train_check_honours_cuda_visible_devices(no_hub, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    _, lines = run_check("train", ["--check", "--gpus", "8", "--config", PAPER, "grpo.batch_prompts=27"], capsys)
    assert ("ok    layout: 4 of 8 GPUs (--gpus, CUDA_VISIBLE_DEVICES=4,5,6,7): vLLM server on GPU 4 "
            "(tensor_parallel_size 1, gpu_memory_utilization 0.85); trainer ranks 0..2 on GPUs 5..7") in "\n".join(lines)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7,8")
    _, lines = run_check("train", ["--check", "--gpus", "8", "--config", PAPER], capsys)
    assert "FAIL  layout: CUDA_VISIBLE_DEVICES=6,7,8 names 8, not among the GPUs 0..7 of --gpus 8" in lines


def test_eval_check(model_dir, data_dir, capsys):
    config = str(ROOT / "configs/eval_math500.yaml")
    code, lines = run_check("eval", ["--check", "--gpus", "2", "--config", config, f"model={model_dir}",
                                     f"data.data_dir={data_dir}"], capsys)
    assert code == 0, "\n".join(lines)
    assert f"ok    data: math500: 2 problems from {data_dir / 'math500_test.jsonl'}" in lines
    assert any(line.startswith("ok    prompts: the longest of 2 prompts (") for line in lines)
    assert ("ok    layout: 2 GPUs (--gpus 2): vLLM server on GPU 0 (tensor_parallel_size 1, "
            "gpu_memory_utilization 0.85)") in lines
    code, lines = run_check("eval", ["--check", "--config", config, "model=/nowhere/model",
                                     f"data.data_dir={data_dir}", "eval.max_tokens=40000"], capsys)
    assert code == 2
    assert any(line.startswith("FAIL  model: model: /nowhere/model does not exist") for line in lines), lines
    assert "skip  prompts: needs a check above that failed" in lines


@pytest.mark.torchrun
def test_train_check_cli_without_the_hub(tmp_path):
    """The real command on a machine without the Hub: the one-line data error, exit 2, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--check", "--config", PAPER], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    data = [line for line in proc.stdout.splitlines() if line.startswith("FAIL  data:")]
    assert len(data) == 1 and "dataset 'gsm8k_train' cannot be had" in data[0] and \
        f"HF datasets cache ({tmp_path / 'hf' / 'datasets'})" in data[0], proc.stdout
