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
    """A test's tier: vllm (it starts a real vLLM engine, or imports vLLM), torchrun (it starts child processes:
    torchrun ranks, the CLIs, the AOT compiler, pip's resolver), else quick (in-process, seconds)."""
    for name in ("vllm", "torchrun"):
        if item.get_closest_marker(name) is not None:
            return name
    return "quick"


# A file with a vLLM or child-process test is marked as one xdist_group, meant to run whole on one
# worker so that its module-scoped servers and reference runs start once. pytest-xdist 3.8 ignores
# the marks under pytest 9.2 (it renames item._nodeid, which pytest 9.2 no longer reads: issue
# 1386), so today the tests spread over the workers one by one.


@__import__("pytest").hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier marker (make test-quick / test-torchrun / test-vllm select
    them; `make test` runs all three). Tests marked `last_in_module` (they stop a module-scoped
    server) run after the rest of their module, wherever they are written: a test added below one
    of them once found the server gone.

    Order and grouping for `make test` (pytest -n 2 --dist loadgroup --no-loadscope-reorder): the
    files with a vLLM test first, then those with child processes, then the quick ones, so the two
    workers start on the longest work and the seconds-long files fill in at the end (by test count,
    xdist's default order, the 15-minute test_faults.py came last and one worker finished alone)."""
    import pytest

    # item.module walks up the node tree on every read: read it once per item (a lookup per pair of
    # items, as this sort once did, cost ~5 s per pytest process at 1072 tests)
    modules = [item.module for item in items]
    heaviest, module_first = {}, {}
    for index, (item, module) in enumerate(zip(items, modules)):
        item.add_marker(getattr(pytest.mark, tier(item)))
        heaviest[module] = min(heaviest.get(module, 2), TIERS[::-1].index(tier(item)))
        module_first.setdefault(module, index)
    # A file with a vLLM or child-process test runs whole on one worker (its servers and reference
    # runs start once); the tests of an all-quick file go one by one to whichever worker is free (their
    # module fixtures are cheap: a worker may build one too), which evens the two workers' ends.
    quick = TIERS[::-1].index("quick")
    for item, module in zip(items, modules):
        if item.get_closest_marker("xdist_group") is None and heaviest[module] != quick:
            item.add_marker(pytest.mark.xdist_group(module.__name__))

    def key(index):
        module = modules[index]
        return (heaviest[module], module_first[module], items[index].get_closest_marker("last_in_module") is not None,
                index)

    items[:] = [items[index] for index in sorted(range(len(items)), key=key)]


# The suite's budget (README, "Tests"): a test whose set-up and call take over SLOW_S seconds says
# why in its docstring, or in the docstring of a fixture it uses, with the words "over 60 s" (any case).
# The run ends by naming each test over it that does not (a list, not a failure: a loaded machine
# is slower, and the budget is a reading of CI's run, not a bound every machine must meet).
SLOW_S = 60.0
_durations: dict[str, float] = {}
_says_why: dict[str, bool] = {}


def says_why_slow(item) -> bool:
    docs = [getattr(item, "obj", None).__doc__ or ""]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        docs += [d.func.__doc__ or "" for d in defs]
    return any("over 60 s" in doc.lower() for doc in docs)


@__import__("pytest").hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        outcome.get_result().user_properties.append(("says_why_slow", says_why_slow(item)))


def pytest_runtest_logreport(report):
    """On the controller (or the only process): each test's set-up + call seconds."""
    if report.when in ("setup", "call"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "says_why_slow":
            _says_why[report.nodeid] = value


def unexplained(durations: dict[str, float], says_why: dict[str, bool], limit: float = SLOW_S
                ) -> list[tuple[float, str]]:
    """(seconds, test) of each test over `limit` whose docstrings do not say why, slowest first."""
    return sorted(((s, n) for n, s in durations.items() if s > limit and says_why.get(n) is False), reverse=True)


def pytest_terminal_summary(terminalreporter):
    over = unexplained(_durations, _says_why)
    if over:
        terminalreporter.section(f"over {SLOW_S:.0f} s without saying why (tests/conftest.py, SLOW_S)")
        for seconds, nodeid in over:
            terminalreporter.line(f"{seconds:6.1f} s  {nodeid}")
