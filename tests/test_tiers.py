"""The quick tier (`make test-quick`) stays in-process: a test that starts a Python child process
(torchrun ranks, a script under `sys.executable`) pays an interpreter and torch import per child and
belongs in the torchrun tier, as tests/conftest.py defines it. Checked from the test files' source,
so a new test is placed right before anyone times the tiers."""
import ast
import json
import os
from pathlib import Path

import pytest
from timeline import summary as timeline_summary

TESTS = Path(__file__).resolve().parent


def _markers(node: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}


def _module_markers(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return {part.split(".")[-1] for part in ast.unparse(node.value).replace("[", " ").replace("]", " ")
                    .replace(",", " ").split()}
    return set()


def _starts_python(call: ast.Call) -> bool:
    """torchrun(...), or a command list that begins with sys.executable (subprocess.run, Popen)."""
    if isinstance(call.func, ast.Name) and call.func.id == "torchrun":
        return True
    return any(isinstance(a, ast.List) and a.elts and ast.unparse(a.elts[0]) == "sys.executable" for a in call.args)


def quick_tests_starting_python(files) -> list[str]:
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        module = _module_markers(tree)
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            if (_markers(node) | module) & {"torchrun", "vllm"}:
                continue
            if any(_starts_python(call) for call in ast.walk(node) if isinstance(call, ast.Call)):
                found.append(f"{path.name}::{node.name}")
    return found


def test_no_quick_test_starts_a_python_child_process():
    assert quick_tests_starting_python(sorted(TESTS.glob("test_*.py"))) == []


def test_the_check_finds_an_unmarked_child_process(tmp_path):
    f = tmp_path / "test_example.py"
    f.write_text("import sys, subprocess, pytest\n"
                 "def test_unmarked():\n    subprocess.run([sys.executable, '-c', 'pass'])\n"
                 "@pytest.mark.torchrun\ndef test_marked():\n    subprocess.run([sys.executable, '-c', 'pass'])\n"
                 "def test_in_process():\n    assert sys.version\n")
    assert quick_tests_starting_python([f]) == ["test_example.py::test_unmarked"]


def test_the_budget_names_the_slow_tests_that_do_not_say_why():
    """tests/conftest.py's budget: a test over 60 s (set-up and call) says why in its docstring or a
    fixture's ("Over 60 s"); the run's summary names each that does not."""
    from types import SimpleNamespace

    import conftest

    def item(doc, fixture_docs=()):
        defs = {f"f{i}": [SimpleNamespace(func=SimpleNamespace(__doc__=d))] for i, d in enumerate(fixture_docs)}
        return SimpleNamespace(obj=SimpleNamespace(__doc__=doc), _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))

    assert conftest.says_why_slow(item("Over 60 s: two trainings."))
    assert conftest.says_why_slow(item(None, ["A shared run, over 60 s: it trains."]))
    assert not conftest.says_why_slow(item("Two trainings.", ["A shared run."]))
    durations = {"a": 61.0, "b": 200.0, "c": 59.0, "d": 90.0}
    says = {"a": False, "b": False, "c": False, "d": True}
    assert conftest.unexplained(durations, says) == [(200.0, "b"), (61.0, "a")]


@pytest.mark.torchrun
def test_the_tests_sharing_a_heavy_files_module_fixture_run_on_one_worker(tmp_path):
    """`make test`'s distribution, run for real (pytest -n 2 --dist loadgroup on a scratch suite
    that uses this conftest): the tests of a file holding a torchrun test that use its module-scoped
    fixture run on one worker (it is built once); that file's other tests, and an all-quick file's,
    go to whichever worker is free. Before, the grouping rode on xdist renaming each test
    "<id>@<group>", which pytest 9.2 ignores, and every test spread over both workers (pytest-xdist
    issue 1386); then a whole file went to one worker, its tests that share nothing included."""
    import subprocess
    import sys

    suite = tmp_path / "tests"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('grpo_tests_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n"
        "globals().update({k: v for k, v in vars(mod).items() if k.startswith('pytest_')})\n")
    record = tmp_path / "ran"

    def body(name: str, sleep_s: float) -> str:
        return (f"    time.sleep({sleep_s})\n    open({str(record)!r}, 'a').write({name!r} + ' ' + str(i) + ' '"
                " + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")

    (suite / "test_heavy.py").write_text(
        "import os, time, pytest\n"
        "@pytest.fixture(scope='module')\ndef shared():\n    return 1\n"
        "@pytest.mark.torchrun\ndef test_child(shared, i=0):\n" + body("shared", 0.3) +
        "@pytest.mark.parametrize('i', range(1, 6))\ndef test_quick(shared, i):\n" + body("shared", 0.3) +
        "@pytest.mark.parametrize('i', range(6))\ndef test_free(i):\n" + body("free", 0.1))
    (suite / "test_light.py").write_text(
        "import os, time, pytest\n@pytest.mark.parametrize('i', range(8))\ndef test_quick(i):\n" + body("light", 0.2))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    quick: q\n    torchrun: t\n    vllm: v\n"
                                         "    last_in_module: l\n")
    timeline = tmp_path / "timeline.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                           "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "GRPO_TEST_TIMELINE": str(timeline)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set] = {"shared": set(), "free": set(), "light": set()}
    ran_on = {}
    for line in record.read_text().splitlines():
        name, i, worker = line.split()
        workers[name].add(worker)
        ran_on[(name, int(i))] = worker
    assert len(workers["shared"]) == 1, workers
    assert workers["free"] - workers["shared"], workers  # not held to the shared fixture's worker
    assert workers["light"] == {"gw0", "gw1"}, workers
    # the controller's timeline (GRPO_TEST_TIMELINE): every phase of every test, on the worker that ran it
    phases = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert len(phases) == 3 * 20 and {p["when"] for p in phases} == {"setup", "call", "teardown"}
    calls = {p["test"]: p for p in phases if p["when"] == "call"}
    assert calls["tests/test_light.py::test_quick[3]"]["worker"] == ran_on[("light", 3)]
    assert calls["tests/test_heavy.py::test_free[2]"]["worker"] == ran_on[("free", 2)]
    assert calls["tests/test_heavy.py::test_child"]["stop"] - calls["tests/test_heavy.py::test_child"]["start"] >= 0.3
    result = timeline_summary(phases)
    assert set(result["workers"]) == {"gw0", "gw1"} and result["span_s"] > 0


def test_the_timeline_summary_says_each_workers_busy_share_and_idle_tail():
    """tests/timeline.py on a hand-made timeline: gw0 ran a (0-10 s) and c (10-30 s), gw1 ran b
    (2-12 s), then sat idle 18 s while c ran; span 30 s, so gw0 was busy 30/30 and gw1 10/30. The
    tail (the last tenth: stops after 27 s) holds c alone, 20 s, started at 10 s."""
    def phase(worker, test, start, stop, when="call"):
        return {"worker": worker, "test": test, "when": when, "start": 100 + start, "stop": 100 + stop}

    result = timeline_summary([phase("gw0", "a", 0, 1, "setup"), phase("gw0", "a", 1, 10), phase("gw1", "b", 2, 12),
                               phase("gw0", "c", 10, 30)])
    assert result["span_s"] == 30.0
    assert result["workers"] == {"gw0": {"busy_s": 30.0, "busy_share": 1.0, "idle_at_end_s": 0.0},
                                 "gw1": {"busy_s": 10.0, "busy_share": 0.333, "idle_at_end_s": 18.0}}
    assert result["tail"] == [{"test": "c", "worker": "gw0", "seconds": 20.0, "started_s": 10.0}]


def test_each_worker_computes_on_its_share_of_the_cores(request):
    """conftest gives each pytest-xdist worker's in-process torch its share of the cores (at least one
    thread): at full width each, the workers' threads waited on each other in OpenMP's barriers."""
    import torch

    from conftest import worker_threads
    from grpo.provenance import usable_cores

    assert [worker_threads(2, n) for n in (1, 2, 3)] == [2, 1, 1] and worker_threads(16, 3) == 5
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is not None:  # make test and make test-quick run workers
        assert torch.get_num_threads() == worker_threads(len(usable_cores()), workerinput["workercount"])
