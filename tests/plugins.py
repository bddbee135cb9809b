"""A user's module (examples/*.py) imported for one test through the config's `plugins:`, and
everything it registered taken back afterwards, so the registries (and the docs generated from
them) are the library's own for the tests that follow."""
import contextlib
import sys
from pathlib import Path

from grpo import advantages, instruments, losses, metrics, registry, rewards, rollout

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@contextlib.contextmanager
def registered(name):
    """Yields the path of examples/<name> (or `name` itself, a path); what loading it registers is
    removed on exit."""
    tables = (losses.LOSSES, losses.CORRECTIONS, advantages.ADVANTAGES, advantages.STEPS, rewards.TERMS,
              instruments.INSTRUMENTS, metrics.DECLARED)
    before = [set(t) for t in tables]
    batch_metrics = list(rollout.BATCH_METRICS)
    modules = set(sys.modules)
    try:
        yield name if isinstance(name, Path) else EXAMPLES / name
    finally:
        for table, keys in zip(tables, before):
            for key in set(table) - keys:
                del table[key]
        rollout.BATCH_METRICS[:] = batch_metrics
        registry.prune_knobs()
        for module in set(sys.modules) - modules:
            if module.startswith(registry.PLUGIN_PREFIX):
                del sys.modules[module]


def doc_holds(name: str) -> bool:
    """docs/extending.md shows examples/<name> as it is."""
    return (EXAMPLES / name).read_text().strip() in (ROOT / "docs" / "extending.md").read_text()
