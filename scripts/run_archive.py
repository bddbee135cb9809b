"""A sweep's finished runs kept as records in a directory of the repository, for a sweep spread over
machines that do not keep their disks (a sitting a day on whatever machine it gets, preemptible nodes).

    python scripts/sweep.py ... --archive results/sweeps      # archives each run as it finishes
    git add results/sweeps && git commit                       # the records travel with the repository

ARCHIVE/<sweep>/ mirrors the sweep directory without what is large or belongs to one machine: each
finished run's files but its exported weights (final/), its checkpoints, its W&B files and its
server's directory (log and access token), with
`final.json` in their place (each file the export held: its size and sha256), `logs/<run>.json` (its
wall time) and the sweep's `sweep.json`. On a machine that does not have a run, `restore` copies its
records back into the run directory, and the run counts as finished (`finished`): scripts/sweep.py
skips it and scripts/fig2_report.py counts it, its weights being on the machine that made them. The
archive is read as a sweep directory too (`fig2_report.py --sweep ARCHIVE/<sweep>`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

FINAL = "final"  # the run's export (train.py): weights and tokenizer
FINAL_RECORD = "final.json"  # the archive's record of it
LEFT_OUT = (FINAL, "checkpoints", "wandb", "server")  # large, or one machine's (the server's log and token)


def attempts_path(sweep_dir: Path, run: str) -> Path:
    """logs/<run>.json: scripts/sweep.py's record of the run's attempts (wall seconds summed, how many,
    how many were cut off with the sweep, the last one's exit code; record_start, record_attempt)."""
    return sweep_dir / "logs" / f"{run}.json"


def attempts(sweep_dir: Path, run: str) -> dict:
    """The run's attempts record; zero attempts where sweep.py has recorded none."""
    path = attempts_path(sweep_dir, run)
    return json.loads(path.read_text()) if path.is_file() else {"wall_s": 0.0, "attempts": 0}


def finished(run_dir: Path) -> bool:
    """The run has exported its final weights: here (final/) or on the machine its record comes from."""
    return (run_dir / FINAL).is_dir() or (run_dir / FINAL_RECORD).is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def final_record(final_dir: Path) -> dict:
    """What the export holds: {relative path: {bytes, sha256}}, to check a copy of it against."""
    return {"files": {str(p.relative_to(final_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                      for p in sorted(final_dir.rglob("*")) if p.is_file()}}


def _records(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """The run directory's files that the archive keeps (relative paths)."""
    kept = []
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if not path.is_file() or rel.parts[0] in LEFT_OUT or path.resolve().is_relative_to(checkpoint_dir.resolve()):
            continue
        kept.append(rel)
    return kept


def archive(sweep_dir: Path, run: str, archive_dir: Path, checkpoint_dir: Path) -> Path:
    """Copies finished run `run` of `sweep_dir` into `archive_dir` (ARCHIVE/<sweep>); returns its record
    directory. Written beside it first and renamed, so a record is whole or absent."""
    run_dir = sweep_dir / run
    if not (run_dir / FINAL).is_dir():
        raise ValueError(f"{run_dir}: not finished here (no {FINAL}/), nothing to archive")
    dest = archive_dir / run
    tmp = archive_dir / f".{run}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for rel in _records(run_dir, checkpoint_dir):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run_dir / rel, tmp / rel)
    (tmp / FINAL_RECORD).write_text(json.dumps(final_record(run_dir / FINAL), indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    wall_time = attempts_path(sweep_dir, run)
    if wall_time.is_file():
        attempts_path(archive_dir, run).parent.mkdir(exist_ok=True)
        shutil.copy2(wall_time, attempts_path(archive_dir, run))
    manifest = sweep_dir / "sweep.json"
    if manifest.is_file():
        shutil.copy2(manifest, archive_dir / "sweep.json")
    return dest


def archived(archive_dir: Path, run: str) -> bool:
    return (archive_dir / run / FINAL_RECORD).is_file()


def restore(archive_dir: Path, run: str, sweep_dir: Path) -> Path:
    """Copies run `run`'s records from the archive into the sweep directory; returns the run directory,
    which must not exist (sweep.py moves a start this machine did not finish aside first)."""
    source = archive_dir / run
    if not archived(archive_dir, run):
        raise ValueError(f"{source}: no archived run ({FINAL_RECORD} missing)")
    run_dir = sweep_dir / run
    if run_dir.exists():
        raise ValueError(f"{run_dir}: already here, not overwritten by its archived record")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    tmp = sweep_dir / f".{run}.restoring"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    os.replace(tmp, run_dir)
    record = attempts_path(archive_dir, run)
    if record.is_file():
        attempts_path(sweep_dir, run).parent.mkdir(exist_ok=True)
        shutil.copy2(record, attempts_path(sweep_dir, run))
    return run_dir
