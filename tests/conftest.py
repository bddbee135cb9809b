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


def pytest_collection_modifyitems(config, items):
    """Tests marked `last_in_module` (they stop a module-scoped server) run after the rest of their
    module, wherever they are written: a test added below one of them once found the server gone."""
    def key(index_item):
        index, item = index_item
        module_first = next(i for i, other in enumerate(items) if other.module is item.module)
        return (module_first, item.get_closest_marker("last_in_module") is not None, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
