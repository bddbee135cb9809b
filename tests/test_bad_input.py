"""Bad input to train.py: one line on stderr naming the key, file or row, exit code 2, and nothing
slow started first (each case here fails before the model is sharded or the server launched).
Data files that do not read (a corrupt, truncated or empty Parquet file, JSON that is not UTF-8, a
dataset folder without the split or with a file that does not read, a `fetch --out` that cannot be
written) are refused the same way by every entry point: train.py, eval.py, their --check and
`python -m grpo.data`.

The entry points run as real processes; train.py's many cases run through train.main in one.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import make_tiny_model_dir
from train_main_cases import run_cases

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _parquet(path: Path, rows: int = 40) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": [f"{i}+1?" for i in range(rows)], "answer": [str(i + 1) for i in range(rows)]}),
                   path)
    return path


def _corrupt(path: Path) -> str:
    """A Parquet file whose footer is whole and whose pages are not (pyarrow: OSError, not ArrowInvalid)."""
    data = bytearray(_parquet(path).read_bytes())
    for i in range(8, len(data) // 2):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return str(path)


def _truncated(path: Path) -> str:
    data = _parquet(path).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def _cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (overrides, what the one line must contain)."""
    good = {"question": "1+1?", "answer": "2"}
    return {
        "corrupt Parquet as data": ([f"data.dataset={_corrupt(tmp / 'corrupt.parquet')}"],
                                    ["data:", "corrupt.parquet", "not a readable Parquet file"]),
        "truncated Parquet as eval_data": ([f"eval_data.dataset={_truncated(tmp / 'truncated.parquet')}"],
                                           ["eval_data:", "truncated.parquet", "not a readable Parquet file"]),
        "hub id without a hub": (["model.path=Qwen/Qwen2.5-0.5B-Instruct"],
                                 ["model.path", "Qwen/Qwen2.5-0.5B-Instruct", "local"]),
        "path that is no directory": (["model.path=/nowhere/at/all/model"], ["model.path", "/nowhere/at/all/model"]),
        "model dir without weights": ([f"model.path={tmp / 'empty_model'}"], ["model.path", "no config.json"]),
        "missing dataset file": ([f"data.dataset={tmp / 'nowhere.jsonl'}"], ["data:", "nowhere.jsonl", "not found"]),
        "malformed JSONL row": ([f"data.dataset={_jsonl(tmp / 'bad.jsonl', [good, '{oops'])}"],
                                ["data:", "bad.jsonl:2", "not valid JSON"]),
        "row without an answer": ([f"data.dataset={_jsonl(tmp / 'noans.jsonl', [good, good, {'question': 'x'}])}"],
                                  ["data:", "noans.jsonl:3", "'answer'"]),
        "missing eval_data file": ([f"eval_data.dataset={tmp / 'no_eval.jsonl'}"], ["eval_data:", "no_eval.jsonl"]),
        "nan learning rate": (["optim.lr=nan"], ["optim.lr"]),
        "inf temperature": (["grpo.temperature=inf"], ["grpo.temperature"]),
        "nan grad clip": (["optim.grad_clip=nan"], ["optim.grad_clip"]),
        "nan beta": (["objective.beta=nan"], ["objective.beta"]),
        "context shorter than prompt + completion": (["server.max_model_len=40"],
                                                     ["server.max_model_len", "grpo.max_new_tokens"]),
        "a knob whose loss is not selected": (["objective.eps_low_is=0.5"],
                                              ["objective.eps_low_is", "loss cispo", "drop the key"]),
    }


@pytest.mark.torchrun
def test_each_bad_input_is_one_line_and_exit_2(model_dir, tmp_path):
    """Each bad input to train.py is one line naming it and exit 2, with no traceback. One case runs
    as train.py itself (its exit code); every case runs through train.main in one process. Over 60 s
    on a loaded machine: two processes that import train.py."""
    (tmp_path / "empty_model").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home")}
    cases = _cases(tmp_path)
    argv = {name: ["--config", str(ROOT / "configs/tiny_test.yaml"), f"model.path={model_dir}",
                   f"log.out_dir={tmp_path / 'runs'}", f"log.run_name=case{i}", *overrides]
            for i, (name, (overrides, _)) in enumerate(cases.items())}
    whole = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv["nan learning rate"]], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = run_cases(argv, tmp_path, env)
    err = whole.communicate(timeout=600)[1]
    results["nan learning rate, as train.py"] = whole.returncode, err
    cases["nan learning rate, as train.py"] = cases["nan learning rate"]
    for name, (_, expected) in cases.items():
        code, err = results[name]
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, f"{name}: exit {code}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{name}:\n{err[-3000:]}"
        assert lines[-1].startswith("config error: "), f"{name}: {lines[-1]}"
        for needle in expected:
            assert needle in lines[-1], f"{name}: {needle!r} not in {lines[-1]!r}"
    # nothing slow started: no server was launched, no weights were written
    assert not list((tmp_path / "runs").glob("*/weights*"))


def _data_cases(tmp: Path, model_dir: Path) -> dict[str, tuple[list[str], str, list[str]]]:
    """name -> (command, where its one line is, what the line must contain): one cause each, through
    eval.py, train.py --check, eval.py --check and `python -m grpo.data fetch`."""
    (tmp / "empty.parquet").write_bytes(b"")
    (tmp / "latin1.jsonl").write_bytes('{"question": "1+1?", "answer": "2"}\n\n{"question": "caf\u00e9 1+1?", '
                                       '"answer": "2"}\n'.encode("latin-1"))
    (tmp / "latin1.json").write_bytes('[{"question": "1+1?", "answer": "2"},\n {"question": "\u00e9t\u00e9?", '
                                      '"answer": "2"}]'.encode("latin-1"))
    (tmp / "a_file").write_text("")
    for name, spoil in (("no_test_split", _parquet), ("truncated_inside", _truncated)):
        (tmp / name / "data").mkdir(parents=True)
        spoil(tmp / name / "data" / "train-00000-of-00001.parquet")
    train = [sys.executable, str(ROOT / "train.py"), "--check", "--config", str(ROOT / "configs/tiny_test.yaml"),
             f"model.path={model_dir}"]
    evaluate = [sys.executable, str(ROOT / "eval.py"), "--model", str(model_dir), "--out", str(tmp / "eval_out")]
    fetch = [sys.executable, "-m", "grpo.data", "fetch", "gsm8k_test", "--out"]
    return {
        "empty Parquet, eval.py": ([*evaluate, "--dataset", str(tmp / "empty.parquet")], "stderr",
                                   ["eval.py: error: ", "empty.parquet: not a readable Parquet file (it is empty)"]),
        "Latin-1 JSONL, train.py --check": ([*train, f"data.dataset={tmp / 'latin1.jsonl'}"], "FAIL",
                                            ["FAIL  data: ", "latin1.jsonl:3: not UTF-8 text (byte 0xe9 at column 18)"]),
        "Latin-1 JSON, eval.py --check": ([*evaluate, "--check", "--dataset", str(tmp / "latin1.json")], "FAIL",
                                          ["FAIL  data: ", "latin1.json:2: not UTF-8 text (byte 0xe9 at column 16)"]),
        "fetch --out under a file": ([*fetch, str(tmp / "a_file" / "sets")], "stderr",
                                     ["python -m grpo.data: error: --out ", "a_file/sets: cannot make the folder"]),
        "fetch --out under /proc": ([*fetch, "/proc/grpo-sets"], "stderr",
                                    ["python -m grpo.data: error: --out /proc/grpo-sets: cannot make the folder"]),
        "folder without the split, train.py --check": (
            [*train, f"data.dataset={tmp / 'no_test_split'}", "data.split=test"], "FAIL",
            ["FAIL  data: split: ", "no_test_split (split test): ", "'train'"]),
        "folder with a truncated file, eval.py --check": (
            [*evaluate, "--check", "--dataset", str(tmp / "truncated_inside")], "FAIL",
            ["FAIL  data: ", "truncated_inside/data/train-00000-of-00001.parquet: not a readable Parquet file"]),
    }


@pytest.mark.torchrun
def test_each_unreadable_data_source_is_one_line_naming_the_file(model_dir, tmp_path):
    """Each entry point refuses a data source that does not read with one line naming the file (and
    the line), exit 2, nothing started: no traceback, no log line of `datasets` beside it, no output
    folder. Before, pyarrow's ArrowInvalid / OSError and Python's UnicodeDecodeError were tracebacks
    (exit 1) or lines naming no file, and `fetch --out` under a file or /proc a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    cases = _data_cases(tmp_path, model_dir)
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (cmd, _, _) in cases.items()}
    for name, (_, where, expected) in cases.items():
        out, err = procs[name].communicate(timeout=600)
        assert procs[name].returncode == 2, f"{name}: exit {procs[name].returncode}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{name}:\n{err[-3000:]}"
        errors = [line for line in err.splitlines() if line.strip()]
        if where == "FAIL":  # the dry run: one FAIL line among its decisions, nothing on stderr
            assert not errors, f"{name}: {errors}"
            errors = [line for line in out.splitlines() if line.startswith("FAIL")]
        assert len(errors) == 1, f"{name}: {errors}"
        assert errors[0].startswith(expected[0]), f"{name}: {errors[0]}"
        for needle in expected[1:]:
            assert needle in errors[0], f"{name}: {needle!r} not in {errors[0]!r}"
    assert not (tmp_path / "eval_out").exists()  # eval.py stopped before its output folder


def test_resume_flag_is_accepted_anywhere(model_dir):
    import train

    for argv in (["--resume", "--config", "configs/tiny_test.yaml", f"model.path={model_dir}", "grpo.v=3"],
                 ["--config", "configs/tiny_test.yaml", f"model.path={model_dir}", "grpo.v=3", "--resume"],
                 ["--config", "configs/tiny_test.yaml", f"model.path={model_dir}", "--resume", "grpo.v=3"]):
        cfg, resume = train.parse_args([a.replace("configs/", str(ROOT / "configs") + "/") for a in argv])
        assert resume and cfg.grpo.v == 3 and cfg.model.path == str(model_dir), argv


def test_hub_id_in_the_hf_cache_resolves_to_its_snapshot(model_dir, tmp_path, monkeypatch):
    """A hub id already in the HF cache is used offline, as the local snapshot directory."""
    from grpo.models import resolve_model_path

    repo = tmp_path / "hub" / "models--acme--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert Path(resolve_model_path("acme/tiny")) == snap


@pytest.mark.parametrize("text, overrides, expected", [
    ("grpo:\n  v: 2\n  i: [1, 2\nlog:\n  run_name: x\n", [], "bad.yaml: not valid YAML at line 4, column 4: "
                                                             "expected ',' or ']', but got ':'"),
    ("grpo:\n\tv: 2\n", [], "bad.yaml: not valid YAML at line 2, column 1: found character '\\t'"),
    ("grpo:\n  v: 2\n", ["grpo.i=[1,"], "command line: grpo.i=[1,: not valid YAML at column 4"),
], ids=["unclosed list", "tab", "override"])
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, capsys, text, overrides, expected):
    """PyYAML's own report is 7 lines whose marks name `<unicode string>`: one line instead, naming
    the file (or the override), the line and the column; exit 2 before anything is loaded."""
    import train

    (tmp_path / "bad.yaml").write_text(text)
    assert train.main(["--config", str(tmp_path / "bad.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert expected in lines[0], lines[0]
