"""What a run was made with: the code's commit and tree (and whether the checkout had changes), the machine
(CPU model, flags, cores; GPUs) and the command line, one JSON line per start of the run.

train.py appends a line to <run_dir>/provenance.jsonl at every start, next to the resolved
config.yaml, so a run resumed under other code or on another machine shows it (a line per
attempt). scripts/fig2_report.py reads it to refuse runs of other commits than the replica's.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

FILE = "provenance.jsonl"
ROOT = Path(__file__).resolve().parent.parent  # the checkout train.py runs from


def usable_cores() -> list[int]:
    """The cores this process may run on (all of the machine's where the OS cannot say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_state(root: Path = ROOT) -> dict:
    """{"commit": the checkout's HEAD (None outside a git checkout), "tree": HEAD's tree, the hash of
    its files' contents, "dirty": whether tracked files differ from it or files git does not ignore
    were added (None when unknown), "changed": those paths (at most 20)}. Ignored paths (runs/,
    .cache/, .venv/) are not changes of the code. The tree outlives the commit: a branch squashed or
    rebased onto main loses the commit a run recorded, and `git log --format='%H %T'` still finds
    the commits with the same files."""
    revs = _git(root, "rev-parse", "HEAD", "HEAD^{tree}")
    if revs is None:
        return {"commit": None, "tree": None, "dirty": None, "changed": []}
    head, tree = revs.split()
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": head, "tree": tree, "dirty": None if status is None else bool(changed), "changed": changed[:20]}


def cpu_kind(flags: list[str]) -> str:
    """The class of x86 CPU that decides the fast path here (docs/cpu.md): AMX, AVX512-BF16, AVX2 only."""
    if any(f.startswith("amx") for f in flags):
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def machine(cpuinfo: Optional[str] = None) -> dict:
    """{"cpu": model name, "cpu_kind", "flags": /proc/cpuinfo's flags of the first processor,
    "cores": processors the OS has, "usable_cores": those this process may run on, "gpus": CUDA
    device names, "platform"}. cpuinfo: /proc/cpuinfo's text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    lines = cpuinfo.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), [])
    gpus = []
    if "torch" in sys.modules:  # a trainer has it; a report need not import it
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": model, "cpu_kind": cpu_kind(flags), "flags": flags, "cores": os.cpu_count(),
            "usable_cores": len(usable_cores()), "gpus": gpus, "platform": platform.platform()}


def machine_text(m: dict) -> str:
    """'2 x AMD EPYC 7B13 (AVX2 only)', with the GPUs if any."""
    text = f"{m.get('usable_cores') or m.get('cores')} x {m.get('cpu')} ({m.get('cpu_kind')})"
    return text + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else "")


def record(run_dir: Path, argv: Optional[list[str]] = None, root: Path = ROOT) -> dict:
    """Append this start's line to <run_dir>/provenance.jsonl and return it."""
    line = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "started_unix": time.time(), **code_state(root),
            "machine": machine(), "argv": list(sys.argv if argv is None else argv), "python": platform.python_version()}
    if "torch" in sys.modules:
        line["torch"] = sys.modules["torch"].__version__
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def read(run_dir: Path) -> list[dict]:
    """The run's starts, oldest first ([] when it has no provenance.jsonl: a run from before it). A
    line cut short (the process killed while writing it) is a start whose commit is unknown."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    starts = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                starts.append(json.loads(line))
            except json.JSONDecodeError:
                starts.append({"commit": None, "dirty": None, "unreadable": line[:80]})
    return starts
