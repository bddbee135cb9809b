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
    assert len(gpu_check.STEPS) == 9
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
                          "push", "shared_prompts"}
    assert steps["lm_head"]["result"]["ok"] and steps["lm_head"]["result"]["logits_dtype"] == "torch.float32"
    assert steps["parity"]["result"]["worst_relative_error"] < 2e-2
    assert steps["collectives"]["result"]["ok"] and steps["collectives"]["result"]["backend"] == "gloo"
    fsdp = steps["fsdp"]["result"]
    assert fsdp["activation_checkpointing_True"]["tokens"] == fsdp["activation_checkpointing_False"]["tokens"] > 0
    assert steps["push"]["result"]["toy"]["bytes"] > 0
    shared = steps["shared_prompts"]["result"]  # a group as one row: fewer tokens, the same numbers
    assert shared["tokens_shared"] < shared["tokens_plain"] and shared["logp_max_abs_diff"] < 1e-4
