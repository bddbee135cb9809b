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


TIERS = ("quick", "torchrun", "vllm")


def tier(item) -> str:
    """A test's tier: vllm (it starts a real vLLM engine), torchrun (it starts child processes:
    torchrun ranks, the CLIs, the AOT compiler, pip's resolver), else quick (in-process, seconds)."""
    for name in ("vllm", "torchrun"):
        if item.get_closest_marker(name) is not None:
            return name
    return "quick"


def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier marker (make test-quick / test-torchrun / test-vllm select
    them; `make test` runs all three). Tests marked `last_in_module` (they stop a module-scoped
    server) run after the rest of their module, wherever they are written: a test added below one
    of them once found the server gone."""
    for item in items:
        item.add_marker(getattr(__import__("pytest").mark, tier(item)))
    def key(index_item):
        index, item = index_item
        module_first = next(i for i, other in enumerate(items) if other.module is item.module)
        return (module_first, item.get_closest_marker("last_in_module") is not None, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
