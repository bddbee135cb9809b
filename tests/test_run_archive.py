"""scripts/run_archive.py and sweep.py --archive: a sweep continued on a machine that has none of its
run directories, from the finished runs' records kept in the repository."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

from grpo.checkpoint import CheckpointConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import plot  # noqa: E402
import run_archive  # noqa: E402
import sweep  # noqa: E402

CONFIG = str(ROOT / "configs/tiny_test.yaml")
ARGS = ["--config", CONFIG, "--grid", "grpo.v=1,2", "--seeds", "0", "--name", "s"]


def finished_run(sweep_dir: Path, name: str, weights: bytes = b"w" * 1000) -> Path:
    """A run directory as train.py leaves it once exported: records, final/, checkpoints, W&B, server."""
    run = sweep_dir / name
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(weights)
    (run / "final" / "config.json").write_text("{}")
    (run / "checkpoints" / "step_5").mkdir(parents=True)
    (run / "checkpoints" / "step_5" / "model.pt").write_bytes(b"c" * 100)
    (run / "wandb").mkdir()
    (run / "wandb" / "debug.log").write_text("w&b")
    (run / "server").mkdir()
    (run / "server" / "token").write_text("secret")
    (run / "rollouts").mkdir()
    (run / "rollouts" / "batch_0.pt").write_bytes(b"r" * 10)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/pass@1": 0.5}) + "\n")
    (run / "provenance.jsonl").write_text(json.dumps({"commit": "abc", "dirty": False}) + "\n")
    (run / "config.yaml").write_text("seed: 0\n")
    (sweep_dir / "logs").mkdir(exist_ok=True)
    (sweep_dir / "logs" / f"{name}.json").write_text(json.dumps({"wall_s": 12.0, "attempts": 1, "exit": 0}) + "\n")
    return run


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_finished_run_is_archived_without_its_weights_and_restored_as_finished(tmp_path):
    sweep_dir, archive_dir = tmp_path / "runs" / "s", tmp_path / "repo" / "s"
    run = finished_run(sweep_dir, "v=1-s0")
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "s", "points": [{"name": "v=1", "overrides": []}],
                                                      "runs": [{"name": "v=1-s0", "point": "v=1", "seed": 0}]}))
    dest = run_archive.archive(sweep_dir, "v=1-s0", archive_dir, run / "checkpoints")
    assert files(dest) == {"metrics.jsonl", "provenance.jsonl", "config.yaml", "rollouts/batch_0.pt", "final.json"}
    record = json.loads((dest / "final.json").read_text())["files"]
    assert record["model.safetensors"] == {"bytes": 1000, "sha256": hashlib.sha256(b"w" * 1000).hexdigest()}
    assert set(record) == {"model.safetensors", "config.json"}
    assert files(archive_dir) >= {"sweep.json", "logs/v=1-s0.json"}
    assert not list(archive_dir.glob(".*"))  # no temporary left beside the record

    # another machine: none of the run directories, the repository's archive
    elsewhere = tmp_path / "other" / "s"
    assert sweep.state(elsewhere / "v=1-s0", CheckpointConfig()) == "new"
    restored = run_archive.restore(archive_dir, "v=1-s0", elsewhere)
    assert files(restored) == files(dest) and run_archive.finished(restored)
    assert sweep.state(restored, CheckpointConfig()) == "done"
    assert json.loads((elsewhere / "logs" / "v=1-s0.json").read_text())["wall_s"] == 12.0
    # plot.py (and fig2_report.py) read a restored run, or the archive itself, as finished
    (elsewhere / "sweep.json").write_text((archive_dir / "sweep.json").read_text())
    for directory in elsewhere, archive_dir:
        _, points = plot.load_sweep(directory)
        assert points["v=1"][0][0]["eval/pass@1"] == 0.5


def test_a_run_not_finished_is_not_archived(tmp_path):
    run = tmp_path / "s" / "a-s0"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="not finished"):
        run_archive.archive(tmp_path / "s", "a-s0", tmp_path / "archive", run / "checkpoints")


def test_a_sweep_restores_archived_runs_and_archives_those_it_finished(tmp_path, capsys):
    """On a machine with v=1-s0 finished and nothing of v=2-s0, whose record is in the archive: the
    sweep runs neither (no torchrun starts), archives v=1-s0 and restores v=2-s0; a start of v=2-s0
    that this machine left unfinished is kept aside, not overwritten."""
    out, archive_dir = tmp_path / "runs", tmp_path / "repo"
    other = tmp_path / "other"
    finished_run(other / "s", "v=2-s0", weights=b"x")
    run_archive.archive(other / "s", "v=2-s0", archive_dir / "s", other / "s" / "v=2-s0" / "checkpoints")
    finished_run(out / "s", "v=1-s0")
    (out / "s" / "v=2-s0").mkdir(parents=True)  # started here, died before a checkpoint
    code = sweep.main([*ARGS, "--out-dir", str(out), "--archive", str(archive_dir), "--prune-checkpoints"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, lines
    assert lines[0] == "[sweep] 1/2 v=1-s0: done, skipped"
    assert lines[1] == f"[sweep] v=1-s0: records archived in {archive_dir / 's' / 'v=1-s0'} (commit them)"
    assert lines[2] == f"[sweep] 2/2 v=2-s0: finished elsewhere, restored from {archive_dir / 's'}"
    assert run_archive.archived(archive_dir / "s", "v=1-s0") and not (out / "s" / "v=1-s0" / "checkpoints").exists()
    assert (out / "s" / "v=2-s0" / "final.json").is_file() and (out / "s" / "v=2-s0.attempt-1").is_dir()
    # once archived, a run is not archived again
    assert sweep.main([*ARGS, "--out-dir", str(out), "--archive", str(archive_dir)]) == 0
    assert "records archived" not in capsys.readouterr().out
