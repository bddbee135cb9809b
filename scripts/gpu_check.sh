#!/usr/bin/env bash
# The trainer-side GPU checks (see scripts/gpu_check.py): one JSON report.
#   bash scripts/gpu_check.sh --dry-run    list the steps
#   bash scripts/gpu_check.sh              run them on cuda:0 (under 20 minutes on one H100/H200)
# Uses .venv/bin/python when there is one, else the machine's python3 (the GPU image has torch,
# Triton, transformers, safetensors and pyyaml, and no package registry).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" scripts/gpu_check.py "$@"
