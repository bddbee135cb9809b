"""train.main on several command lines in one process, which imports train.py once: for the tests
of inputs train.py refuses (a process per case imported torch, transformers and the trainer each time).

    python tests/train_main_cases.py CASES_JSON RESULTS_JSON

CASES_JSON maps a case's name to train.py's arguments; RESULTS_JSON gets, per case, train.main's
return code (None if an exception escaped it) and what it wrote to stderr (the traceback included).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cases(argv_by_name: dict[str, list[str]], work: Path, env: dict) -> dict[str, tuple]:
    """name -> (return code, stderr) of train.main(argv), every case in one child process."""
    cases, results = work / "train_cases.json", work / "train_results.json"
    cases.write_text(json.dumps(argv_by_name))
    proc = subprocess.run([sys.executable, __file__, str(cases), str(results)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: (r["code"], r["stderr"]) for name, r in json.loads(results.read_text()).items()}


def main(cases_file: str, results_file: str) -> None:
    sys.path.insert(0, str(ROOT))
    import train

    results = {}
    for name, argv in json.loads(Path(cases_file).read_text()).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = train.main(argv)
            except BaseException:  # a traceback in train.py (a SystemExit too: no case here may exit)
                traceback.print_exc()
                code = None
        results[name] = {"code": code, "stderr": err.getvalue()}
    Path(results_file).write_text(json.dumps(results))
    os._exit(0)  # a case may have left a process group or threads behind: nothing to tear down


if __name__ == "__main__":
    main(*sys.argv[1:])
