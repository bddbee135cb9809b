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


# The tests of a file with a vLLM or child-process test that use its module-scoped fixtures (servers,
# reference runs) run on one pytest-xdist worker, so that those start once; its other tests go to
# whichever worker is free (pytest_collection_modifyitems, below).
#
# The grouping is done here, not by xdist's own loadgroup: xdist 3.8 tells its scheduler a test's
# group by appending "@group" to item._nodeid, and pytest 9.2 derives nodeid from a structured id
# instead, so every mark was silently ignored (pytest-xdist issue 1386) and a module's tests, with
# their module-scoped servers, ran on both workers. Each worker writes every test's group to the
# file GROUPS_ENV names (the controller sets it before the workers start); the controller's
# scheduler reads it once every worker has collected.
GROUPS_ENV = "GRPO_TEST_GROUPS_FILE"


def _group_of(item):
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


_is_worker = False  # a pytest-xdist worker (its reports reach the controller, which records them)


def worker_threads(usable_cores: int, workers: int) -> int:
    """Intra-op threads for the in-process tests of one of `workers` pytest-xdist workers: its share
    of the cores, at least one."""
    return max(1, usable_cores // workers)


def pytest_configure(config):
    global _is_worker
    # Not PYTEST_XDIST_WORKER: a pytest started by a test inherits its worker's environment.
    _is_worker = hasattr(config, "workerinput")
    if _is_worker:
        # Workers share the cores: at full width each (two threads per worker on two cores) their
        # threads waited on each other in OpenMP's barriers; on its share the quick tier took 31-34 s
        # against 38-39 s (docs/tests.md, "Threads"). Only this process: the trainers, servers and
        # ranks a test starts pick their own threads.
        import torch

        from grpo.provenance import usable_cores

        torch.set_num_threads(worker_threads(len(usable_cores()), config.workerinput["workercount"]))
    if not _is_worker and config.getoption("dist", "no") == "loadgroup":
        import tempfile

        fd, path = tempfile.mkstemp(prefix="grpo-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_ENV] = config._grpo_groups_file = path


def pytest_unconfigure(config):
    path = getattr(config, "_grpo_groups_file", None)
    if path:
        os.environ.pop(GROUPS_ENV, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup: xdist's scope scheduling, each test's scope its group (see above)."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups = None

        def _split_scope(self, nodeid):
            if ByGroup.groups is None:  # first asked once every worker has collected (and written)
                import json

                ByGroup.groups = json.loads(open(config._grpo_groups_file).read() or "{}")
            return ByGroup.groups.get(nodeid) or nodeid

    return ByGroup(config, log)


def shares_module_fixture(item) -> bool:
    """Whether the test uses, directly or through another fixture, one built once per module (or
    class, or package): the tests that must run on one worker for it to be built once."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope in ("class", "module", "package")
                                    for defs in info.name2fixturedefs.values())


@__import__("pytest").hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier marker (make test-quick / test-torchrun / test-vllm select
    them; `make test` runs all three). Tests marked `last_in_module` (they stop a module-scoped
    server) run after the rest of their module, wherever they are written: a test added below one
    of them once found the server gone.

    Order and grouping for `make test` (pytest -n N --dist loadgroup --no-loadscope-reorder): the
    files with a vLLM test first, then those with child processes, then the quick ones, so the
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
    # The tests of a file with a vLLM or child-process test that share its module fixtures (a server,
    # a reference run) run together on one worker, so those start once; the file's other tests, and
    # every test of an all-quick file (its module fixtures are cheap: a worker may build one too), go
    # one by one to whichever worker is free, which keeps a long file from being one long pole.
    quick = TIERS[::-1].index("quick")
    for item, module in zip(items, modules):
        if (item.get_closest_marker("xdist_group") is None and heaviest[module] != quick
                and shares_module_fixture(item)):
            item.add_marker(pytest.mark.xdist_group(module.__name__))
    groups_file = os.environ.get(GROUPS_ENV)
    if groups_file and _is_worker:  # for the controller's scheduler (see above)
        import json

        groups = {item.nodeid: "@" + group for item in items if (group := _group_of(item)) is not None}
        partial = f"{groups_file}.{os.getpid()}"
        with open(partial, "w") as f:
            json.dump(groups, f)
        os.replace(partial, groups_file)  # the workers collect the same tests: either file will do

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


# GRPO_TEST_TIMELINE=FILE: each test phase's worker, start and stop (epoch seconds), one JSON line
# each, appended by the controller; `python tests/timeline.py FILE` says where the run's wall time
# went (each worker's busy share, and how long each sat idle at the end).
TIMELINE_ENV = "GRPO_TEST_TIMELINE"


def pytest_runtest_logreport(report):
    """On the controller (or the only process): each test's set-up + call seconds."""
    if report.when in ("setup", "call"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    timeline = os.environ.get(TIMELINE_ENV)
    if timeline and not _is_worker:
        import json

        node = getattr(report, "node", None)  # xdist's WorkerController on the controller
        worker = node.gateway.id if node is not None else "main"
        with open(timeline, "a") as f:
            f.write(json.dumps({"worker": worker, "test": report.nodeid, "when": report.when,
                                "start": report.start, "stop": report.stop}) + "\n")
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
