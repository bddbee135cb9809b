"""Seeded sweeps: grid points x seeds, each one normal `torchrun train.py` run in its own directory.

    python scripts/sweep.py --config configs/cpu_demo.yaml \\
        --grid grpo.v=1,10 objective.mask_zero_variance=true,false --seeds 0,1,2
    python scripts/sweep.py --config configs/cpu_demo.yaml --name fig2 --seeds 0,1,2 \\
        --point v1-i1 --point v1-i1-mask objective.mask_zero_variance=true --point v10-i1 grpo.v=10
    python scripts/sweep.py ... --print          # one command line per run, for a cluster launcher
    python scripts/sweep.py ... --only v10-s2    # one run, resumable: what a cluster node runs
    python scripts/plot.py --sweep runs/sweeps/fig2 --out fig2.png

Grid points are the named `--point`s (or one unnamed point) times the product of the `--grid`
axes; `--set` overrides apply to every run. Run `<point>-s<seed>` goes to
`<out-dir>/<name>/<point>-s<seed>/` with `seed=<seed>`, W&B group `<name>/<point>` (so the
dashboard aggregates the seeds of a point) and tags `sweep=<name>`, `point=<point>`,
`seed=<seed>`; train.py stamps the group and tags on every metrics.jsonl row too.

Runs go one after another. The sweep is resumable: a run whose `final/` export exists is done and
skipped; a run with a complete checkpoint continues with `--resume`; a run that died before its
first checkpoint is moved aside to `<run>.attempt-<n>/` (kept, not deleted) and starts again.
With `--archive DIR`, each finished run's records (all but its weights and checkpoints) are copied
to `DIR/<name>/<run>/` and the runs found there are restored instead of run: commit DIR, and a sweep
spread over machines that keep no disk continues from the repository (scripts/run_archive.py).
Killing the sweep kills the run in flight (it gets SIGTERM, checkpoints and exits); the next
`sweep.py` with the same arguments continues where it stopped. `sweep.json` in the sweep
directory records the points, seeds and runs (what scripts/plot.py reads); `logs/<run>.log` holds
each run's output and `logs/<run>.json` its attempts' wall time (record_start, record_attempt).
Every run's config is checked before anything starts: a bad key or value is one line naming it,
exit 2.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import run_archive  # noqa: E402  (scripts/run_archive.py: a finished run's records, kept in the repository)

SWEEP_FILE = "sweep.json"


class SweepError(Exception):
    """Arguments the sweep cannot run; the message names the argument."""


@dataclass(frozen=True)
class Point:
    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class RunSpec:
    name: str  # <point>-s<seed>: the run directory and W&B name
    point: str
    seed: int
    overrides: tuple[str, ...]  # everything train.py gets after --config


def parse_axis(text: str) -> tuple[str, list[str]]:
    """'grpo.v=1,10' -> ('grpo.v', ['1', '10'])."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values or any(not v for v in values.split(",")):
        raise SweepError(f"--grid {text!r}: expected key=value1,value2,...")
    return key, values.split(",")


def grid_points(named: list[list[str]] | None, axes: list[str] | None) -> list[Point]:
    """Named points (each NAME key=value ...) times the product of the grid axes."""
    base = [Point(p[0], tuple(p[1:])) for p in named or []]
    for p in base:
        if not p.name or "/" in p.name or "=" in p.name or any("=" not in o for o in p.overrides):
            raise SweepError(f"--point {' '.join([p.name, *p.overrides])!r}: expected NAME key=value ...")
    parsed = [parse_axis(a) for a in axes or []]
    base = base or [Point("", ())]  # no named points: the grid alone (or the config as it is)
    points = []
    for p in base:
        for values in itertools.product(*(vals for _, vals in parsed)):
            suffix = "-".join(f"{key.rsplit('.', 1)[-1]}={v}" for (key, _), v in zip(parsed, values))
            name = "-".join(part for part in (p.name, suffix) if part) or "base"
            points.append(Point(name, p.overrides + tuple(f"{key}={v}" for (key, _), v in zip(parsed, values))))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f"grid points with the same name: {sorted(n for n in names if names.count(n) > 1)}")
    return points


def plan(args) -> tuple[Path, list[Point], list[RunSpec]]:
    """The sweep directory, its points and its runs (each seed's runs of every point, seed by seed)."""
    if not args.seeds:
        raise SweepError("--seeds: give at least one seed, e.g. --seeds 0,1,2")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SweepError(f"--seeds {args.seeds!r}: expected integers separated by commas") from None
    name = args.name or Path(args.config).stem
    if "/" in name:
        raise SweepError(f"--name {name!r}: must not contain '/'")
    sweep_dir = Path(args.out_dir) / name
    points = grid_points(args.point, args.grid)
    runs = []
    # Seed-major: a sweep stopped part-way has every grid point at the seeds it finished.
    for seed in seeds:
        for point in points:
            run = f"{point.name}-s{seed}"
            tags = [f"sweep={name}", f"point={point.name}", f"seed={seed}"]
            runs.append(RunSpec(run, point.name, seed, (
                *args.set, *point.overrides, f"seed={seed}", f"log.out_dir={sweep_dir}", f"log.run_name={run}",
                f"log.group={name}/{point.name}", f"log.tags={json.dumps(tags)}")))
    return sweep_dir, points, runs


def check_configs(config: str, runs: list[RunSpec]) -> dict:
    """Every run's config resolves (unknown keys, wrong types, bad values stop here, before any run);
    returns each run's `checkpoint:` section (where its checkpoints are, for `state`)."""
    from grpo.config import ConfigError, load_config
    from grpo.train_config import TrainConfig

    checkpoints = {}
    for run in runs:
        try:
            checkpoints[run.name] = load_config(TrainConfig, config, list(run.overrides)).checkpoint
        except ConfigError as e:
            raise SweepError(f"run {run.name}: {e}") from None
    return checkpoints


def command(args, run: RunSpec, resume: bool, portable: bool = False) -> list[str]:
    """The run's torchrun line; `portable` (for --print): `torchrun train.py` as a user on another
    machine types it in the repository root, rather than this machine's paths."""
    torchrun = "torchrun" if portable else str(Path(sys.executable).with_name("torchrun"))
    train = "train.py" if portable else str(ROOT / "train.py")
    return [torchrun, "--standalone", f"--nproc_per_node={args.nproc_per_node}", train,
            "--config", args.config, *run.overrides, *(["--resume"] if resume else [])]


def state(run_dir: Path, checkpoint) -> str:
    """done (exported, here or where its archived record comes from), resume (a complete checkpoint
    where the run's `checkpoint:` section puts them), stale (started, nothing to resume), new."""
    if run_archive.finished(run_dir):
        return "done"
    from grpo.checkpoint import Checkpointer

    if Checkpointer(checkpoint, run_dir).latest() is not None:
        return "resume"
    return "stale" if run_dir.exists() else "new"


def move_aside(run_dir: Path) -> Path:
    for n in itertools.count(1):
        dest = run_dir.with_name(f"{run_dir.name}.attempt-{n}")
        if not dest.exists():
            run_dir.rename(dest)
            return dest


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the sweep dies (even by SIGKILL), so no run is
    orphaned and the next sweep never races one still running."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def prune_checkpoints(run_dir: Path, checkpoint) -> None:
    """Delete a finished run's checkpoints (its final/ export, metrics and logs stay): a long sweep of
    fp32 runs on a small disk (~2 GB a checkpoint of SmolLM2 with AdamW and pi_ref). Only a
    directory inside the run's own (a checkpoint.dir elsewhere may hold other runs' too)."""
    from grpo.checkpoint import Checkpointer

    directory = Checkpointer(checkpoint, run_dir).dir
    inside = directory.resolve().is_relative_to(run_dir.resolve())
    if inside and (run_dir / "final").is_dir() and directory.is_dir():
        shutil.rmtree(directory)


def execute(args, run: RunSpec, checkpoint, sweep_dir: Path, index: int, total: int) -> bool:
    run_dir = sweep_dir / run.name
    status = state(run_dir, checkpoint)
    archive_dir = Path(args.archive) / sweep_dir.name if args.archive else None
    if status != "done" and archive_dir and run_archive.archived(archive_dir, run.name):
        if run_dir.exists():  # a start this machine did not finish: kept, as a stale run is
            move_aside(run_dir)
        run_archive.restore(archive_dir, run.name, sweep_dir)
        print(f"[sweep] {index}/{total} {run.name}: finished elsewhere, restored from {archive_dir}", flush=True)
        return True
    if status == "done":
        print(f"[sweep] {index}/{total} {run.name}: done, skipped", flush=True)
        keep(args, run, checkpoint, sweep_dir, archive_dir)
        return True
    if status == "stale":
        print(f"[sweep] {index}/{total} {run.name}: no complete checkpoint, kept as {move_aside(run_dir).name}",
              flush=True)
    cmd = command(args, run, resume=status == "resume")
    log_path = sweep_dir / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[sweep] {index}/{total} {run.name}: {'resuming' if status == 'resume' else 'starting'} "
          f"(log: {log_path})", flush=True)
    record_start(sweep_dir, run, log_path)
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        code = subprocess.call(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=_die_with_parent)
    seconds = time.monotonic() - t0
    ok = code == 0 and state(run_dir, checkpoint) == "done"
    record_attempt(sweep_dir, run, seconds, code)
    if ok:
        keep(args, run, checkpoint, sweep_dir, archive_dir)
    print(f"[sweep] {index}/{total} {run.name}: {'finished' if ok else f'FAILED (exit {code})'} "
          f"in {seconds:.0f} s", flush=True)
    return ok


def keep(args, run: RunSpec, checkpoint, sweep_dir: Path, archive_dir: Path | None) -> None:
    """A finished run: its records into the archive (--archive; once, unless they are missing there),
    then its checkpoints deleted (--prune-checkpoints)."""
    from grpo.checkpoint import Checkpointer

    run_dir = sweep_dir / run.name
    if archive_dir and (run_dir / run_archive.FINAL).is_dir() and not run_archive.archived(archive_dir, run.name):
        dest = run_archive.archive(sweep_dir, run.name, archive_dir, Checkpointer(checkpoint, run_dir).dir)
        print(f"[sweep] {run.name}: records archived in {dest} (commit them)", flush=True)
    if args.prune_checkpoints:
        prune_checkpoints(run_dir, checkpoint)


def record_start(sweep_dir: Path, run: RunSpec, log_path: Path) -> None:
    """Marks an attempt as running in logs/<run>.json (`running_since`). One still marked there when
    the run starts again was cut off with its sweep (a sitting's end, a killed node) and never saw
    record_attempt: it is counted now (`cut_off`), as having run until the last line it wrote to the
    run's log (each attempt appends to it), so the wall time holds every attempt that ran."""
    record = run_archive.attempts(sweep_dir, run.name)
    since = record.pop("running_since", None)
    if since is not None and log_path.is_file():
        record["wall_s"] += max(0.0, log_path.stat().st_mtime - since)
        record["attempts"] += 1
        record["cut_off"] = record.get("cut_off", 0) + 1
    record["running_since"] = time.time()
    run_archive.attempts_path(sweep_dir, run.name).write_text(json.dumps(record) + "\n")


def record_attempt(sweep_dir: Path, run: RunSpec, seconds: float, code: int) -> None:
    """logs/<run>.json: wall seconds summed over the run's attempts (scripts/plot.py's table), how many,
    how many of them were cut off (record_start), the last one's exit code."""
    record = run_archive.attempts(sweep_dir, run.name)
    record.pop("running_since", None)
    record = {**record, "wall_s": record["wall_s"] + seconds, "attempts": record["attempts"] + 1, "exit": code}
    run_archive.attempts_path(sweep_dir, run.name).write_text(json.dumps(record) + "\n")


def write_manifest(sweep_dir: Path, args, points: list[Point], runs: list[RunSpec]) -> None:
    manifest = {"name": sweep_dir.name, "config": args.config, "seeds": sorted({r.seed for r in runs}),
                "points": [asdict(p) for p in points], "runs": [asdict(r) for r in runs]}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / SWEEP_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        if sorted(map(json.dumps, old["runs"])) != sorted(map(json.dumps, manifest["runs"])):
            raise SweepError(f"{path} describes another sweep (other points, seeds or overrides): "
                             "give this one another --name or --out-dir")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the base run config (configs/*.yaml)")
    ap.add_argument("--grid", nargs="+", metavar="KEY=V1,V2", help="axes whose product makes the grid")
    ap.add_argument("--point", nargs="+", action="append", metavar="NAME [KEY=VALUE ...]",
                    help="a named grid point and its overrides (repeat for more)")
    ap.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every run")
    ap.add_argument("--name", help="sweep name (default: the config's file name)")
    ap.add_argument("--out-dir", default="runs/sweeps", help="sweeps go to OUT_DIR/NAME/ (default runs/sweeps)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="torchrun processes per run (default 1)")
    ap.add_argument("--prune-checkpoints", action="store_true",
                    help="delete a run's checkpoints once it has finished (its final/ export and metrics stay)")
    ap.add_argument("--archive", metavar="DIR", help="keep each finished run's records (not its weights or "
                    "checkpoints) in DIR/NAME/, and restore from there the runs this machine does not have: a "
                    "sweep spread over machines that do not keep their disks (scripts/run_archive.py)")
    ap.add_argument("--print", action="store_true", help="print one command per run instead of running them")
    ap.add_argument("--only", nargs="+", metavar="RUN", help="run only these runs (e.g. v10-i1-s2): one node of a "
                    "cluster job, with the same skip/resume logic")
    args = ap.parse_args(argv)
    try:
        if not Path(args.config).is_file():
            raise SweepError(f"--config {args.config}: no such file")
        if any("=" not in o for o in args.set):
            raise SweepError(f"--set {args.set}: expected key=value ...")
        sweep_dir, points, runs = plan(args)
        checkpoints = check_configs(args.config, runs)
        unknown = sorted(set(args.only or []) - {r.name for r in runs})
        if unknown:
            raise SweepError(f"--only {unknown}: not runs of this sweep ({', '.join(r.name for r in runs)})")
        if args.print:
            for run in runs:
                print(shlex.join(command(args, run, resume=False, portable=True)))
            return 0
        write_manifest(sweep_dir, args, points, runs)
    except SweepError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    chosen = [(i, run) for i, run in enumerate(runs, 1) if not args.only or run.name in args.only]
    failed = [run.name for i, run in chosen
              if not execute(args, run, checkpoints[run.name], sweep_dir, i, len(runs))]
    if failed:
        print(f"[sweep] {len(failed)} of {len(chosen)} runs failed: {', '.join(failed)} (see {sweep_dir}/logs/); "
              "run the same command again to retry them", file=sys.stderr)
        return 1
    what = f"all {len(runs)} runs" if len(chosen) == len(runs) else f"{len(chosen)} of {len(runs)} runs (--only)"
    print(f"[sweep] {what} done: python scripts/plot.py --sweep {sweep_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
