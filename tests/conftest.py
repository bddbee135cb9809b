"""Shared test set-up.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, or Triton finds
"0 active drivers" on a CPU machine; conftest is imported before every test module.
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
