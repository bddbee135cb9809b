"""The CPU replica of Fig. 2 as a page: each claim decided by the pre-set design (docs/fig2_design.md).

    python scripts/fig2_report.py --design configs/designs/fig2_cpu.yaml --sweep runs/sweeps/fig2-cpu-2 \\
        --vsweep runs/sweeps/fig2-cpu-2-v --compare runs/sweeps/fig2-cpu-2/v10-i1-s10/compare --out docs/fig2_cpu.md

Reads the design file (its seeds, eval, checkpoints, margin and arms), the runs scripts/sweep.py
made of it (`make replicate`) and writes the page (--out) with its figures beside it: <out>.png
(held-out pass@1 per arm against optimizer steps and against pushes, mean over seeds and min-max
band), <out>_lag.png (the off-policy instruments by lag inside a v-window) and <out>_vsweep.png
(pass@1 and pushes against v). Nothing on the page is written by hand. It holds, in order:

  where it comes from: the commits that fixed the design (git's history of the design file and of
    the sweep's config up to the runs' commit; the first replica's bbea659 and 6cd80e9), the runs'
    one code commit, their machines and dates;
  the runs: every arm x seed of the design, counted or why not;
  the verdicts: every pre-set test of scripts/fig2_power.TESTS, its per-seed values, mean and t
    interval, its planned power and the eval's standard error, and each claim's verdict;
  descriptive parts, without verdicts: every checkpoint's paired difference, each arm's pushes at each
    checkpoint (the comparisons at equal pushes that have no test), the per-arm table,
    v10-i1's instruments by lag, the v-sweep, the objectives' replay.

A run is counted when it has finished (its final/ export, or the archive's record of it), every start of it recorded
(provenance.jsonl, train.py) the replica's code commit with a clean checkout, and its config.yaml
has the design's eval. The replica's commit is the one its earliest start recorded; a run of another
commit, of a changed checkout, without provenance or with another eval is not counted, and the page
says so. A test is decided only when every seed of its arms is counted: otherwise its verdict is
"missing runs", naming them (never a verdict over fewer seeds). So the page says what it has at
every point of a sweep, and `make replicate` alone regenerates it.

The test (docs/fig2_design.md): the seeds' paired differences, their mean and the two-sided `level`
Student t interval; holds when it lies above the threshold (0, or -margin for "matches"), does not
hold when it lies below, not resolved when it straddles. A claim holds when all its primary tests
hold, does not hold when one does not. drift-push evaluates right after a push (the first at or after
each checkpoint): its tests read the other arm at the same steps. A sweep of other seeds, arms or arm
overrides than the design's is refused (one line, exit 2).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fig2_power as design_lib  # noqa: E402  (scripts/fig2_power.py: the design, its tests and statistics)
import plot  # noqa: E402  (scripts/plot.py: the sweep's runs, curves and bands)
import run_archive  # noqa: E402  (scripts/run_archive.py: a run finished here or archived)
from fig2_power import t_quantile  # noqa: E402,F401  (the quantile the intervals use; tests read it here)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo import provenance  # noqa: E402

PASS = "eval/pass@1"
HOLDS, REFUTED, OPEN, MISSING, PENDING = "holds", "does not hold", "not resolved", "missing runs", "pending"
# The first replica (2026-11-25/26): its settings and its rule were fixed by these commits before its runs.
FIRST_REPLICA = (("bbea659", "configs/cpu_fig2.yaml: the settings, fixed before any run of seeds 0-2"),
                 ("6cd80e9", "scripts/fig2_report.py: the first rule (a verdict at step 50)"))


class ReportError(Exception):
    """A sweep the page cannot be made from; the message names the directory or the point."""


# ---------------------------------------------------------------------------------------------
# statistics

@dataclass
class Interval:
    """The mean of paired differences and its two-sided t interval (lo, hi: None with < 2 pairs)."""

    diffs: list[float]
    mean: float
    lo: Optional[float]
    hi: Optional[float]

    @classmethod
    def of(cls, diffs: list[float], level: float = 0.95) -> "Interval":
        n = len(diffs)
        if n == 0:
            return cls([], math.nan, None, None)
        mean = sum(diffs) / n
        if n < 2:
            return cls(diffs, mean, None, None)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        return cls(diffs, mean, mean - half, mean + half)

    def text(self) -> str:
        if not self.diffs:
            return "n/a"
        if self.lo is None:
            return f"{self.mean:+.3f} (one seed: no interval)"
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"


def verdict(iv: Interval, threshold: float = 0.0) -> str:
    """The claim "effect > threshold" against the interval."""
    if iv.lo is None:
        return OPEN
    if iv.lo > threshold:
        return HOLDS
    if iv.hi < threshold:
        return REFUTED
    return OPEN


def all_of(verdicts: list[str]) -> str:
    """The verdict of "A and B and ...": pending or missing parts first, then any part that does not
    hold, then all holding."""
    for waiting in (PENDING, MISSING):
        if any(v.startswith(waiting) for v in verdicts):
            return waiting
    if REFUTED in verdicts:
        return REFUTED
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else OPEN


# ---------------------------------------------------------------------------------------------
# what one run shows (docs/fig2_design.md, "The metrics, exactly")

def evals(rows: list[dict], axis: str = "step") -> dict[float, float]:
    """{step or pushes: held-out pass@1} of a run's eval rows (pushes: the version evaluated)."""
    key = "step" if axis == "step" else "eval/weights_version"
    return {row[key]: float(row[PASS]) for row in rows if plot.finite(row.get(PASS)) and plot.finite(row.get(key))}


def checkpoint_evals(rows: list[dict], at: list[float]) -> Optional[list[tuple[float, float]]]:
    """(step, pass@1) of the run's eval of each checkpoint in `at`: its first eval at or after the
    checkpoint and before the next one (the last: at or after it). That is the checkpoint itself for
    every arm but drift-push, which evaluates only right after a push, at the first push at or after
    each multiple of eval_every (train.eval_due); None when a checkpoint has no eval."""
    curve = evals(rows)
    out = []
    for i, start in enumerate(at):
        end = at[i + 1] if i + 1 < len(at) else math.inf
        steps = [s for s in curve if start <= s < end]
        if not steps:
            return None
        out.append((min(steps), curve[min(steps)]))
    return out


def read_at(rows: list[dict], steps: list[float]) -> Optional[list[float]]:
    """The run's pass@1 at each of `steps`: its eval there, or the straight line between its evals on
    either side (None outside its evals). How an arm evaluated at the checkpoints is read at drift-push's
    eval steps, so that a paired difference compares the same optimizer steps."""
    curve = evals(rows)
    xs = sorted(curve)
    out = []
    for s in steps:
        if s in curve:
            out.append(curve[s])
            continue
        below, above = [x for x in xs if x < s], [x for x in xs if x > s]
        if not below or not above:
            return None
        lo, hi = below[-1], above[0]
        out.append(curve[lo] + (curve[hi] - curve[lo]) * (s - lo) / (hi - lo))
    return out


def drawdown(rows: list[dict], at: list[float]) -> Optional[float]:
    """The largest fall of the pass@1 curve over the checkpoints `at` (their evals): max over
    checkpoints s < t of pass@1(s) - pass@1(t), 0 for a curve that never falls; None when the run
    lacks one of them."""
    found = checkpoint_evals(rows, at)
    if not found:
        return None
    peak, worst = found[0][1], 0.0
    for _, v in found:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst


def learning(rows: list[dict], at: list[float]) -> Optional[float]:
    """The mean pass@1 over the checkpoints `at` (their evals; None when the run lacks one)."""
    found = checkpoint_evals(rows, at)
    return sum(v for _, v in found) / len(found) if found else None


def learning_difference(rows_a: list[dict], rows_b: list[dict], at: list[float]) -> Optional[float]:
    """L(a) - L(b) at the same optimizer steps: a's checkpoint evals against b read at their steps
    (b's own checkpoints wherever a evaluates at them); None when b cannot be read there."""
    found = checkpoint_evals(rows_a, at)
    other = read_at(rows_b, [s for s, _ in found]) if found else None
    if other is None:
        return None
    return sum(v for _, v in found) / len(found) - sum(other) / len(other)


def end_point(rows: list[dict], pushes_at_end: int) -> Optional[float]:
    """pass@1 at the run's last eval, when that eval is of the weights after `pushes_at_end` pushes."""
    last = [r for r in rows if plot.finite(r.get(PASS))]
    if not last or last[-1].get("eval/weights_version") != pushes_at_end:
        return None
    return float(last[-1][PASS])


def eval_samples(rows: list[dict], default: int) -> int:
    """Completions per eval, as the run's last eval row counted them."""
    counted = [r["eval/n_samples"] for r in rows if plot.finite(r.get("eval/n_samples"))]
    return int(counted[-1]) if counted else default


def noise_floor(rows: list[dict], at: list[float], default_samples: int) -> Optional[float]:
    """The mean drawdown the eval's noise alone gives a flat curve at this run's level: the flat
    curve's factor (fig2_power.flat_drawdown) times the binomial standard error of one checkpoint."""
    level = learning(rows, at)
    if level is None:
        return None
    mean_factor, _ = design_lib.flat_drawdown(len(at))
    return mean_factor * math.sqrt(level * (1 - level) / eval_samples(rows, default_samples))


def pushes(rows: list[dict]) -> int:
    """Weight pushes the run made (the newest version trained on or evaluated)."""
    versions = [row.get("weights_version", row.get("eval/weights_version")) for row in rows]
    return int(max((v for v in versions if plot.finite(v)), default=0))


def value(test: design_lib.Test, rows: list[dict], design: design_lib.Design) -> Optional[float]:
    """One run's value of the test's metric (docs/fig2_design.md)."""
    at = list(design.checkpoints)
    if test.metric == "learning":
        return learning(rows, at)
    if test.metric == "drawdown":
        return drawdown(rows, at)
    if test.metric == "at":
        return end_point(rows, design.equal_samples)
    if test.metric == "gain":
        level, start = learning(rows, at), evals(rows).get(0)
        return None if level is None or start is None else level - start
    if test.metric == "unstable":
        fall, floor = drawdown(rows, at), noise_floor(rows, at, design.eval_samples)
        return None if fall is None or floor is None else fall - floor
    raise ValueError(f"test {test.id}: unknown metric {test.metric!r}")


def eval_se(test: design_lib.Test, runs: dict[str, list[list[dict]]], design: design_lib.Design) -> Optional[float]:
    """The eval's binomial standard error of one seed's value of the test, at the counted runs' mean
    levels (an upper bound: the problems are a fixed set, the arms share the eval's sampling seeds)."""
    at = list(design.checkpoints)

    def mean(values: list[Optional[float]]) -> Optional[float]:
        return sum(values) / len(values) if values and None not in values else None

    def levels(arm: str) -> Optional[list[float]]:
        """The arm's mean pass@1 at each checkpoint's eval, over its runs."""
        found = [checkpoint_evals(rows, at) for rows in runs.get(arm, [])]
        if not found or None in found:
            return None
        return [sum(f[i][1] for f in found) / len(found) for i in range(len(at))]

    samples = design.eval_samples
    arms = [a for a in (test.a, test.b) if a]
    pq = lambda p: p * (1 - p)  # noqa: E731
    if test.metric == "at":
        ps = [mean([end_point(rows, design.equal_samples) for rows in runs.get(a, [])]) for a in arms]
        return None if None in ps else math.sqrt(sum(pq(p) for p in ps) / samples)
    per_arm = [levels(a) for a in arms]
    if None in per_arm:
        return None
    if test.metric in ("learning", "gain"):
        var = sum(pq(p) for ps in per_arm for p in ps) / samples / len(at) ** 2
        if test.metric == "gain":
            start = mean([evals(rows).get(0) for rows in runs.get(test.a, [])])
            var += pq(start) / samples if start is not None else 0.0
        return math.sqrt(var)
    _, var_flat = design_lib.flat_drawdown(len(at))
    return math.sqrt(var_flat * sum(pq(sum(ps) / len(ps)) for ps in per_arm) / samples)


# ---------------------------------------------------------------------------------------------
# the runs: counted, or why not

Points = dict[str, dict[int, list[dict]]]  # arm -> {seed: metrics rows}


@dataclass
class RunState:
    name: str
    arm: str
    seed: int
    rows: list[dict]
    finished: bool
    starts: list[dict]
    why_not: str = ""  # "" when counted
    problem: str = ""  # what makes it untraceable to the replica's commit and the design's eval ("" if nothing)

    @property
    def counted(self) -> bool:
        return self.finished and not self.why_not


@dataclass
class Sweep:
    dir: Path
    manifest: dict
    runs: dict[tuple[str, int], RunState]

    def points(self, counted_only: bool = True) -> Points:
        """{arm: {seed: rows}} of the counted runs (or, for the descriptive v-sweep, of every traceable run
        that has logged, finished or not)."""
        out: Points = {p["name"]: {} for p in self.manifest["points"]}
        for (arm, seed), run in self.runs.items():
            if run.counted if counted_only else (run.rows and not run.problem):
                out[arm][seed] = run.rows
        return out


def load_sweep(sweep_dir: Path, arms: dict[str, tuple[str, ...]], seeds: tuple[int, ...], what: str) -> Sweep:
    """The sweep's manifest and every run's state; a sweep of other arms (names or overrides) or seeds
    than the design's is refused (it is another design's). arms: {name: overrides}, {} for any."""
    path = sweep_dir / "sweep.json"
    if not path.is_file():
        raise ReportError(f"{sweep_dir}: no sweep.json (run `make replicate`, or give the {what} directory)")
    manifest = json.loads(path.read_text())
    names = [p["name"] for p in manifest["points"]]
    if arms and names != list(arms):
        raise ReportError(f"{path}: points {names} are not the design's arms {list(arms)}")
    for point in manifest["points"] if arms else []:
        if tuple(point["overrides"]) != arms[point["name"]]:
            raise ReportError(f"{path}: point {point['name']} ran {' '.join(point['overrides']) or 'no overrides'}, "
                              f"not the design's {' '.join(arms[point['name']]) or 'no overrides'}")
    if sorted(manifest["seeds"]) != sorted(seeds):
        raise ReportError(f"{path}: seeds {manifest['seeds']} are not the design's {list(seeds)}")
    runs = {}
    for run in manifest["runs"]:
        run_dir = sweep_dir / run["name"]
        metrics = run_dir / "metrics.jsonl"
        rows = plot.read_metrics(metrics) if metrics.is_file() and metrics.stat().st_size else []
        runs[run["point"], run["seed"]] = RunState(run["name"], run["point"], run["seed"], rows,
                                                   run_archive.finished(run_dir), provenance.read(run_dir))
    return Sweep(sweep_dir, manifest, runs)


def progress_of(sweep: Sweep, run: RunState) -> str:
    """Why an unfinished run is not counted: not started, stopped at a step, failed."""
    if not (sweep.dir / run.name).is_dir():
        return "not started"
    steps = [r["step"] for r in run.rows if plot.finite(r.get("step"))]
    where = f"at step {max(steps):g}" if steps else "before its first step"
    code = run_archive.attempts(sweep.dir, run.name).get("exit")
    return f"failed (exit {code}) {where}" if code not in (None, 0) else f"stopped {where}"


def replica_commit(sweeps: list[Sweep]) -> Optional[str]:
    """The commit the replica's earliest recorded start ran: every run must have run it."""
    return _earliest_start(sweeps).get("commit")


def replica_tree(sweeps: list[Sweep]) -> Optional[str]:
    """The tree (the files' hash) of the replica's commit, as its earliest start recorded it (None
    for a start from before provenance recorded trees)."""
    return _earliest_start(sweeps).get("tree")


def _earliest_start(sweeps: list[Sweep]) -> dict:
    starts = [s for sw in sweeps for run in sw.runs.values() for s in run.starts if s.get("commit")]
    return min(starts, key=lambda s: s.get("started_unix", math.inf)) if starts else {}


def check_runs(sweeps: list[Sweep], design: design_lib.Design, commit: Optional[str]) -> None:
    """Sets each run's problem (no provenance, another commit, a changed checkout, another eval) and
    why_not (unfinished, or its problem)."""
    for sweep in sweeps:
        for run in sweep.runs.values():
            run.problem = trace_problem(sweep, run, design, commit)
            run.why_not = progress_of(sweep, run) if not run.finished else run.problem


def trace_problem(sweep: Sweep, run: RunState, design: design_lib.Design, commit: Optional[str]) -> str:
    if not run.starts:
        return "no provenance.jsonl (run before train.py recorded its commit)"
    ran = sorted({s.get("commit") or "unknown" for s in run.starts})
    if ran != [commit]:
        return f"ran {', '.join(c[:7] for c in ran)}, not the replica's {str(commit)[:7]}"
    changed = [s for s in run.starts if s.get("dirty") is not False]
    if changed:
        paths = changed[0].get("changed") or ["unknown"]
        return f"a changed checkout ({', '.join(paths[:3])})"
    config = sweep.dir / run.name / "config.yaml"
    if not config.is_file():
        return "no config.yaml"
    ev = (yaml.safe_load(config.read_text()) or {}).get("eval") or {}
    if (ev.get("n_problems"), ev.get("k")) != (design.n_problems, design.k):
        return f"eval {ev.get('n_problems')} x {ev.get('k')}, not the design's {design.n_problems} x {design.k}"
    return ""


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@dataclass
class DesignHistory:
    """The commits (hash, unix time, date, subject) that changed each design file, up to the runs' commit."""

    commits: dict[str, list[tuple[str, int, str, str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    same_files: Optional[str] = None  # the commit of history read in place of a runs' commit missing from it


def commit_with_tree(tree: str) -> Optional[str]:
    """The oldest commit of this repository's history whose files are `tree` (None if none is)."""
    log = _git("log", "--all", "--reverse", "--format=%H %T") or ""
    return next((h for h, t in (line.split() for line in log.splitlines()) if t == tree), None)


def design_history(files: list[Path], commit: Optional[str], first_start: Optional[float],
                   tree: Optional[str] = None) -> DesignHistory:
    """git's history of the design files at the runs' commit; a problem when a file is not committed
    there or was changed after the first run started (the design was not fixed before the runs). A
    runs' commit missing from the history (rewritten: squashed, rebased) is read at the commit that
    has the same files, found by the tree the runs recorded (grpo/provenance.py)."""
    out = DesignHistory()
    if commit is None:
        out.problems.append("no run recorded a commit: the design's commit cannot be checked")
        return out
    if _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        out.same_files = commit_with_tree(tree) if tree else None
        if out.same_files is None:
            out.problems.append(f"the runs' commit {commit[:7]} is not in this repository's history"
                                + (f", nor is a commit with their files (tree {tree[:7]})" if tree else ""))
            return out
        commit = out.same_files
    for path in files:
        try:
            rel = path.resolve().relative_to(ROOT)
        except ValueError:
            out.problems.append(f"{path} is not in this repository: its commit cannot be named")
            continue
        log = _git("log", "--format=%h%x09%ct%x09%cs%x09%s", commit, "--", str(rel)) or ""
        history = [(h, int(t), d, s) for h, t, d, s in (line.split("\t", 3) for line in log.splitlines())]
        if not history:
            out.problems.append(f"{rel} is not committed at the runs' commit {commit[:7]}")
            continue
        out.commits[str(rel)] = history
        last = history[0]
        if first_start is not None and last[1] > first_start:
            out.problems.append(f"{rel} changed at {last[0]} ({last[2]}) after the first run started "
                                f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime(first_start))} UTC): "
                                "the design was not fixed before its runs")
    return out


# ---------------------------------------------------------------------------------------------
# the verdicts

@dataclass
class Decided:
    test: design_lib.Test
    verdict: str
    iv: Interval
    threshold: float
    missing: list[str]
    eval_se: Optional[float]
    planned: Optional[design_lib.Planned]


def decide(test: design_lib.Test, sweep: Sweep, design: design_lib.Design,
           planned: dict[str, design_lib.Planned]) -> Decided:
    threshold = -design.margin if test.threshold == "margin" else 0.0
    reason = test.pending(design)
    if reason:
        return Decided(test, f"{PENDING}: {reason}", Interval.of([]), threshold, [], None, planned.get(test.id))
    arms = [a for a in (test.a, test.b) if a]
    diffs, missing = [], []
    for seed in design.seeds:
        values, rows = [], []
        for arm in arms:
            run = sweep.runs.get((arm, seed))
            if run is None or not run.counted:
                missing.append(f"{arm}-s{seed} ({run.why_not if run else 'not in the sweep'})")
                continue
            v = value(test, run.rows, design)
            if v is None:
                missing.append(f"{run.name} (lacks the design's evals)")
            values.append(v)
            rows.append(run.rows)
        if len(values) == len(arms) and None not in values:
            if len(values) == 1:
                diffs.append(values[0])
            elif test.metric == "learning":  # at the same steps: b read at a's evals (drift-push's are off the grid)
                d = learning_difference(rows[0], rows[1], list(design.checkpoints))
                if d is None:
                    missing.append(f"{arms[1]}-s{seed} (no evals on either side of {arms[0]}-s{seed}'s)")
                else:
                    diffs.append(d)
            else:
                diffs.append(values[0] - values[1])
    iv = Interval.of(diffs, design.level)
    counted = sweep.points()
    se = eval_se(test, {a: list(counted.get(a, {}).values()) for a in arms}, design)
    if missing:
        return Decided(test, MISSING, iv, threshold, missing, se, planned.get(test.id))
    return Decided(test, verdict(iv, threshold), iv, threshold, [], se, planned.get(test.id))


def claim_verdicts(decided: list[Decided]) -> dict[str, str]:
    """Each claim's verdict: all of its primary tests."""
    out = {}
    for claim in design_lib.CLAIMS:
        primary = [d.verdict for d in decided if d.test.claim == claim and d.test.role == "primary"]
        out[claim] = all_of(primary)
    return out


def effect_text(t: design_lib.Test) -> str:
    names = {"learning": "L", "drawdown": "D", "at": "P", "gain": "G", "unstable": "U"}
    m = names[t.metric]
    return f"{m}({t.a}) - {m}({t.b})" if t.b else f"{m}({t.a})"


def verdict_table(decided: list[Decided], claims: dict[str, str], design: design_lib.Design) -> str:
    lines = ["| claim | test | each seed's value | seeds | mean [95% t interval] | threshold | verdict | planned power | "
             "eval SE (one seed) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for claim, text in design_lib.CLAIMS.items():
        lines.append(f"| **{text}** | | | | | | **{claims[claim]}** | | |")
        for d in (d for d in decided if d.test.claim == claim):
            p = d.planned
            pw = "n/a" if p is None or p.power is None else f"{p.power:.2f}"
            se = "n/a" if d.eval_se is None else f"{d.eval_se:.4f}"
            role = "" if d.test.role == "primary" else f" ({d.test.role})"
            lines.append(f"| | {d.test.id}{role}: {d.test.text} | `{effect_text(d.test)}` | {len(d.iv.diffs)} of "
                         f"{len(design.seeds)} | {d.iv.text()} | {d.threshold:+.2f} | {d.verdict} | {pw} | {se} |")
    return "\n".join(lines)


# The descriptive per-checkpoint rows: (a, b) pairs, effect = pass@1(a) - pass@1(b) at each checkpoint's eval
# of a (drift-push's: the first after it), b read at the same step.
CHECKPOINT_PAIRS = (("v10-i1", "v1-i1"), ("v1-i1-mask", "v1-i1"), ("v1-i1-beta0", "v1-i1"), ("v1-i1", "v1-i10"),
                    ("lag1", "v1-i1"), ("drift-push", "v1-i1"), ("drift-push", "v10-i1"))


def checkpoints_table(points: Points, design: design_lib.Design) -> str:
    lines = ["| effect (descriptive) | checkpoint | seeds | per seed | mean [95% t interval] |",
             "| --- | --- | --- | --- | --- |"]
    at = list(design.checkpoints)
    for a, b in CHECKPOINT_PAIRS:
        seeds = sorted(set(points.get(a, {})) & set(points.get(b, {})))
        per_seed = {}
        for s in seeds:
            found = checkpoint_evals(points[a][s], at)
            other = read_at(points[b][s], [x for x, _ in found]) if found else None
            if other is not None:
                per_seed[s] = [va - vb for (_, va), vb in zip(found, other)]
        for i, step in enumerate(design.checkpoints):
            diffs = [d[i] for d in per_seed.values()]
            iv = Interval.of(diffs, design.level)
            lines.append(f"| pass@1({a}) - pass@1({b}) | {step} | {len(diffs)} | "
                         f"{', '.join(f'{d:+.3f}' for d in diffs)} | {iv.text()} |")
    return "\n".join(lines)


# The arms set side by side at equal samples with the pushes each made (docs/fig2_design.md, "Equal pushes").
PUSH_ARMS = ("v1-i1", "lag1", "drift-push", "v10-i1")


def spread(values: list[float], fmt: str) -> str:
    """mean (min-max), or n/a."""
    if not values:
        return "n/a"
    return f"{sum(values) / len(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def pushes_table(points: Points, design: design_lib.Design) -> str:
    """Per arm and checkpoint, over the arm's counted seeds: the step of the checkpoint's eval, the
    pushes made by then (the eval's weights version) and pass@1; then, per arm, its pushes by reason
    (push_reason) and the tv_staleness of its batches (their first pass)."""
    at = list(design.checkpoints)
    lines = ["| arm | checkpoint | seeds | eval step | pushes | pass@1 |", "| --- | --- | --- | --- | --- | --- |"]
    notes = []
    for arm in PUSH_ARMS:
        runs = [rows for rows in points.get(arm, {}).values() if checkpoint_evals(rows, at)]
        versions = [{r["step"]: r["eval/weights_version"] for r in rows if plot.finite(r.get(PASS))
                     and plot.finite(r.get("eval/weights_version"))} for rows in runs]
        found = [checkpoint_evals(rows, at) for rows in runs]
        for i, checkpoint in enumerate(at):
            steps = [f[i][0] for f in found]
            pushed = [v[s] for v, s in zip(versions, steps) if s in v]
            lines.append(f"| {arm} | {checkpoint} | {len(runs)} | {spread(steps, '.0f')} | {spread(pushed, '.1f')} | "
                         f"{spread([f[i][1] for f in found], '.3f')} |")
        reasons: dict[str, int] = {}
        for rows in runs:
            for r in rows:
                if r.get("push_reason"):
                    reasons[r["push_reason"]] = reasons.get(r["push_reason"], 0) + 1
        staleness = [r["tv_staleness"] for rows in runs for r in rows
                     if "loss" in r and r.get("sgd_iteration", 0) == 0 and plot.finite(r.get("tv_staleness"))]
        if runs:
            notes.append(f"- {arm}: pushes by reason, per run: "
                         + (", ".join(f"{why} {n / len(runs):.1f}" for why, n in sorted(reasons.items())) or "none logged")
                         + "; tv_staleness of its batches: "
                         + (f"mean {sum(staleness) / len(staleness):.3g}, max {max(staleness):.3g}" if staleness else "n/a"))
    return "\n".join(lines + [""] + notes)


def plot_pushes(points: Points, design: design_lib.Design, out: Path, title: str) -> None:
    """pass@1 at step 0 and at each checkpoint's eval, against the eval's step and against the pushes made
    by then: per arm of PUSH_ARMS, the means over its counted seeds, bars from the smallest to the largest
    seed. Points per checkpoint, not a band: drift-push's seeds evaluate at different steps and pushes."""
    import matplotlib.pyplot as plt

    at = list(design.checkpoints)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, arm in enumerate(PUSH_ARMS):
        runs = [rows for rows in points.get(arm, {}).values() if checkpoint_evals(rows, at) and 0 in evals(rows)]
        if not runs:
            continue
        found = [[(0.0, evals(rows)[0])] + checkpoint_evals(rows, at) for rows in runs]
        versions = [{r["step"]: r["eval/weights_version"] for r in rows if plot.finite(r.get(PASS))
                     and plot.finite(r.get("eval/weights_version"))} for rows in runs]
        ys = [[f[j][1] for f in found] for j in range(len(at) + 1)]
        # the float mean of equal values can land an ulp outside them (0.231875 * 3 / 3): clamp it into
        # [min, max], where the exact mean lies, so neither half of a bar is negative
        mean_y = [min(max(sum(y) / len(y), min(y)), max(y)) for y in ys]
        bars = [[m - min(y) for m, y in zip(mean_y, ys)], [max(y) - m for m, y in zip(mean_y, ys)]]
        steps = [sum(f[j][0] for f in found) / len(found) for j in range(len(at) + 1)]
        pushed = [sum(v.get(f[j][0], math.nan) for v, f in zip(versions, found)) / len(found)
                  for j in range(len(at) + 1)]
        for ax, xs in zip(axes, (steps, pushed)):
            ax.errorbar(xs, mean_y, yerr=bars, color=f"C{i}", marker="o", markersize=3, capsize=2,
                        label=f"{arm} (n={len(runs)})")
    for ax, label in zip(axes, ("optimizer step of the eval", "weight pushes made by the eval")):
        ax.set(xlabel=label, ylabel="held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_xscale("symlog", linthresh=1)
    plot.save(fig, out, title)


def runs_table(sweep: Sweep, design: design_lib.Design) -> str:
    """Every arm x seed: counted, or why not; pending arms say what they wait for."""
    lines = ["| arm | counted | not counted |", "| --- | --- | --- |"]
    for arm, spec in design.arms.items():
        if spec.get("pending"):
            lines.append(f"| {arm} | 0 of {len(design.seeds)} | pending: {spec['pending']} |")
            continue
        runs = [sweep.runs[arm, s] for s in design.seeds if (arm, s) in sweep.runs]
        not_counted = "; ".join(f"s{r.seed}: {r.why_not}" for r in runs if not r.counted) or "-"
        lines.append(f"| {arm} | {sum(r.counted for r in runs)} of {len(design.seeds)} | {not_counted} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# the off-policy instruments by lag inside a v-window

LAG_KEYS = ("reward_mean", "tv_pik_alpha", "tv_staleness", "tv_mismatch", "kl_staleness", "is_weight_ess",
            "clip_frac_adv_pos", "clip_frac_adv_neg", "bound_M", "bound_M_nonzero")


def point_v(manifest: dict, point: str, base_v: int = 1) -> int:
    """A grid point's v: its grpo.v override, else the sweep config's."""
    for p in manifest["points"]:
        if p["name"] == point:
            for o in p["overrides"]:
                key, _, value = o.partition("=")
                if key == "grpo.v":
                    return int(value)
    return base_v


def by_lag(seeds: dict[int, list[dict]], v: int, keys=LAG_KEYS) -> dict[str, list[tuple[float, float, int]]]:
    """{key: [(mean, std over seeds, seeds) for lag 0..v-1]}: each seed's mean over its windows of
    the first optimizer step on each batch, the lag being the batch's logged alpha_lag_steps (optimizer
    steps between the push that sampled it and its first step: its place in the window with i = 1).
    A row without alpha_lag_steps (not known: a resume that lost it) is left out."""
    out = {}
    for key in keys:
        per_lag = []
        for lag in range(v):
            per_seed = []
            for rows in seeds.values():
                vals = [r[key] for r in rows if "loss" in r and r.get("sgd_iteration", 0) == 0
                        and r.get("alpha_lag_steps") == lag and plot.finite(r.get(key))]
                if vals:
                    per_seed.append(sum(vals) / len(vals))
            mean = sum(per_seed) / len(per_seed) if per_seed else math.nan
            per_lag.append((mean, plot._std(per_seed), len(per_seed)))
        out[key] = per_lag
    return out


def lag_legend(keys) -> str:
    """What each column holds: its declaration where it is computed (grpo.metrics.declare)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from grpo import metrics

    metrics.load_declarations()
    lines = []
    for key in keys:
        m = metrics.declared(key)
        lines.append(f"- `{key}` ({m.section}/, `{m.module}`): {m.meaning}" if m else f"- `{key}`: not declared")
    return "\n".join(lines)


def lag_table(lags: dict[str, list[tuple[float, float, int]]]) -> str:
    keys = [k for k in lags if any(n for _, _, n in lags[k])]
    lines = ["| lag | " + " | ".join(f"`{k}`" for k in keys) + " |", "| --- |" + " --- |" * len(keys)]
    for lag in range(len(next(iter(lags.values())))):
        cells = []
        for k in keys:
            mean, sd, n = lags[k][lag]
            cells.append(f"{mean:.3g} +- {sd:.2g}" if n else "")
        lines.append(f"| {lag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_lags(lags: dict[str, list[tuple[float, float, int]]], out: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    panels = [("reward (batch mean)", ["reward_mean"]),
              ("TV per token", ["tv_pik_alpha", "tv_staleness", "tv_mismatch"]),
              ("importance weights' ESS", ["is_weight_ess"]),
              ("clip fraction by sign of A", ["clip_frac_adv_pos", "clip_frac_adv_neg"]),
              ("M of eq. 4", ["bound_M", "bound_M_nonzero"])]
    panels = [(name, [k for k in keys if k in lags and any(n for _, _, n in lags[k])]) for name, keys in panels]
    panels = [(name, keys) for name, keys in panels if keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    for ax, (name, keys) in zip(axes[0], panels):
        for i, key in enumerate(keys):
            xs = [lag for lag, (_, _, n) in enumerate(lags[key]) if n]
            mean = [lags[key][x][0] for x in xs]
            sd = [lags[key][x][1] for x in xs]
            ax.plot(xs, mean, marker="o", markersize=3, color=f"C{i}", label=key)
            ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=f"C{i}", alpha=0.2, linewidth=0)
        ax.set(title=name, xlabel="lag in the v-window (optimizer steps since the push)")
        ax.title.set_fontsize(9)
        ax.xaxis.label.set_fontsize(8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    plot.save(fig, out, title)


# ---------------------------------------------------------------------------------------------
# the v-sweep: how far off policy the task goes

def v_runs(sweeps: list[tuple[dict, Points]], wanted: dict[str, int]) -> dict[int, dict[int, list[dict]]]:
    """{v: {seed: rows}} from the points named in `wanted` ({point: v}) of any of the sweeps."""
    out: dict[int, dict[int, list[dict]]] = {}
    for _, points in sweeps:
        for point, seeds in points.items():
            if point in wanted and seeds:
                out.setdefault(wanted[point], {}).update(seeds)
    return dict(sorted(out.items()))


def last_eval(rows: list[dict]) -> Optional[tuple[float, float]]:
    """(step, held-out pass@1) of a run's latest evaluation."""
    curve = evals(rows)
    return (max(curve), curve[max(curve)]) if curve else None


def at_the_end(by_v: dict[int, dict[int, list[dict]]]) -> tuple[float, dict[int, list[list[dict]]], dict[int, list[list[dict]]]]:
    """The v-sweep compares pass@1 after the same iterations: the end is the latest step any run
    evaluated; a run whose latest evaluation is earlier is in progress (--partial), listed apart and
    never averaged in. Returns (end, {v: the runs at the end}, {v: the runs in progress})."""
    last = {v: {seed: last_eval(rows) for seed, rows in seeds.items()} for v, seeds in by_v.items()}
    end = max((e[0] for evs in last.values() for e in evs.values() if e is not None), default=0.0)
    done = {v: [rows for seed, rows in seeds.items() if last[v][seed] and last[v][seed][0] == end]
            for v, seeds in by_v.items()}
    going = {v: [rows for seed, rows in seeds.items() if last[v][seed] and last[v][seed][0] != end]
             for v, seeds in by_v.items()}
    return end, done, going


def vsweep_table(by_v: dict[int, dict[int, list[dict]]]) -> str:
    end, done, going = at_the_end(by_v)
    lines = [f"| v | runs at step {end:g} | pass@1 at step {end:g} (mean, min-max) | pushes | "
             "in progress (step: pass@1) |", "| --- | --- | --- | --- | --- |"]
    for v in by_v:
        finals = [last_eval(rows)[1] for rows in done[v]]
        cell = f"{sum(finals) / len(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})" if finals else "n/a"
        n_push = f"{sum(pushes(rows) for rows in done[v]) / len(done[v]):.1f}" if done[v] else "n/a"
        partial = ", ".join("{:g}: {:.3f}".format(*last_eval(rows)) for rows in going[v]) or "-"
        lines.append(f"| {v} | {len(finals)} | {cell} | {n_push} | {partial} |")
    return "\n".join(lines)


def plot_vsweep(by_v: dict[int, dict[int, list[dict]]], out: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_n) = plt.subplots(1, 2, figsize=(10, 3.6))
    end, done, _ = at_the_end(by_v)
    vs = [v for v in by_v if done[v]]  # runs in progress are in the table only
    finals = {v: [last_eval(rows)[1] for rows in done[v]] for v in vs}
    for v in vs:
        ax_p.scatter([v] * len(finals[v]), finals[v], color="C0", alpha=0.4, s=12)
    means = [sum(finals[v]) / len(finals[v]) for v in vs]
    ax_p.plot(vs, means, color="C0", marker="o", label="mean over seeds (dots: seeds)")
    start = [x for v in vs for rows in by_v[v].values() for s, x in evals(rows).items() if s == 0]
    if start:
        ax_p.axhline(sum(start) / len(start), color="grey", linestyle="--", linewidth=1, label="the initial policy")
    ax_p.set(xscale="log", xlabel="v (push every v iterations)", ylabel=f"held-out pass@1 at step {end:g}",
             title="pass@1 after the same iterations")
    ax_n.plot(vs, [sum(pushes(r) for r in done[v]) / len(done[v]) for v in vs], color="C1", marker="o")
    ax_n.set(xscale="log", yscale="log", xlabel="v", ylabel="weight pushes", title="pushes")
    for ax in (ax_p, ax_n):
        ax.set_xticks(vs, [str(v) for v in vs])
        ax.grid(alpha=0.3)
    ax_p.legend(fontsize=7)
    plot.save(fig, out, title)


# ---------------------------------------------------------------------------------------------
# the replay: objectives compared on the v10-i1 recordings (scripts/compare_objectives.py)

def replay_table(compare_dirs: list[Path]) -> str:
    """Mean cosine to the reference's update and mean gradient norm per objective, by the batch's lag
    (optimizer steps since its push), over the compare.jsonl rows of the given runs (--follow)."""
    rows = []
    for d in compare_dirs:
        path = d / "compare.jsonl" if d.is_dir() else d
        if not path.is_file():
            raise ReportError(f"--compare {d}: no compare.jsonl (run scripts/compare_objectives.py first)")
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if any("alpha_lag_steps" not in r for r in rows):
        raise ReportError(f"--compare {', '.join(map(str, compare_dirs))}: rows without alpha_lag_steps: the batches "
                          "were compared at fixed parameters, where a lag means nothing (compare_objectives.py --follow)")
    names = list(dict.fromkeys(r["objective"] for r in rows))
    lines = ["| lag | " + " | ".join(f"{n}: cos / norm" for n in names) + " |", "| --- |" + " --- |" * len(names)]
    for lag in sorted({r["alpha_lag_steps"] for r in rows}):
        cells = []
        for n in names:
            mine = [r for r in rows if r["objective"] == n and r["alpha_lag_steps"] == lag]
            cos = [r["cosine_to_reference"] for r in mine if plot.finite(r["cosine_to_reference"])]
            norm = [r["grad_norm"] for r in mine if plot.finite(r["grad_norm"])]
            cells.append(f"{sum(cos) / len(cos):.3f} / {sum(norm) / len(norm):.3g}" if cos and norm else "")
        lines.append(f"| {lag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the page

def wall_minutes(sweep: Sweep) -> tuple[float, list[str]]:
    """Wall time of the sweep's runs as scripts/sweep.py records them (its attempts, summed), and the runs
    started more often (provenance.jsonl: a line per start) than the record counts attempts: one running
    now, or one cut off with the sweep (a sitting's end, a lost machine) that no record holds: sweep.py
    counts it, to its log's last line, when the run starts again; records from before it did hold none."""
    total, cut_off = 0.0, []
    for run in sweep.runs.values():
        ended = run_archive.attempts(sweep.dir, run.name)
        total += ended["wall_s"]
        if len(run.starts) > ended["attempts"]:
            cut_off.append(run.name)
    return total / 60, cut_off


def machines(sweeps: list[Sweep]) -> str:
    """The machines the counted runs started on, with how many starts each."""
    seen: dict[str, int] = {}
    for sweep in sweeps:
        for run in sweep.runs.values():
            if run.counted:
                for s in run.starts:
                    text = provenance.machine_text(s.get("machine") or {})
                    seen[text] = seen.get(text, 0) + 1
    return "; ".join(f"{m} ({n} starts)" for m, n in seen.items()) or "no counted run yet"


def provenance_lines(design: design_lib.Design, config: str, history: DesignHistory, commit: Optional[str],
                     sweeps: list[Sweep]) -> list[str]:
    starts = [s for sw in sweeps for r in sw.runs.values() for s in r.starts if s.get("started_unix")]
    dates = sorted(s["started"][:10] for s in starts if s.get("started"))
    lines = [f"- the design: `{design.path.relative_to(ROOT) if design.path.is_relative_to(ROOT) else design.path}` "
             f"([fig2_design.md](fig2_design.md)): seeds {list(design.seeds)}, eval {design.n_problems} problems x "
             f"{design.k} samples, checkpoints {list(design.checkpoints)}, margin {design.margin:g}, "
             f"{design.level:.0%} t intervals"]
    for path, commits in history.commits.items():
        lines.append(f"- `{path}` fixed by: " + "; ".join(f"{h} ({d}) {s}" for h, _, d, s in commits[:1])
                     + (f" (and {len(commits) - 1} earlier commits)" if len(commits) > 1 else ""))
    for problem in history.problems:
        lines.append(f"- **design not traceable**: {problem}")
    lines.append("- before it, the first replica (seeds 0-2, an eval of 40 x 4; underpowered, its verdicts "
                 "descriptive): " + "; ".join(f"{h} {what}" for h, what in FIRST_REPLICA))
    same = (f"; not in this history, whose {history.same_files[:7]} has the same files (the tree the runs "
            f"recorded), read in its place" if history.same_files else "")
    lines.append(f"- the runs' code commit: {commit or 'none recorded'} (every counted run's every start, a clean "
                 f"checkout{same}); machines: {machines(sweeps)}; started {dates[0] + ' to ' + dates[-1] if dates else 'never'}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", default=str(design_lib.DESIGN), help="the design file (default "
                    "configs/designs/fig2_cpu.yaml)")
    ap.add_argument("--sweep", required=True, help="the design's sweep (its arms x its seeds)")
    ap.add_argument("--vsweep", help="the v-sweep (points v<N> with grpo.v=N, the design's vsweep_seeds): descriptive")
    ap.add_argument("--compare", nargs="+", default=[], help="compare_objectives.py outputs on v10-i1 recordings")
    ap.add_argument("--out", default="docs/fig2_cpu.md", help="the page; figures are written beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        design = design_lib.load_design(Path(args.design))
        sweep = load_sweep(Path(args.sweep), design.runnable(), design.seeds, "--sweep")
        sweeps = [sweep]
        if args.vsweep:
            sweeps.append(load_sweep(Path(args.vsweep), {}, design.vsweep_seeds, "--vsweep"))
        replay = replay_table([Path(c) for c in args.compare]) if args.compare else None
    except (ReportError, design_lib.DesignError, plot.PlotError) as e:
        print(f"fig2_report.py: error: {e}", file=sys.stderr)
        return 2
    commit = replica_commit(sweeps)
    check_runs(sweeps, design, commit)
    first = min((s["started_unix"] for sw in sweeps for r in sw.runs.values() for s in r.starts
                 if s.get("started_unix")), default=None)
    config = sweep.manifest["config"]
    history = design_history([design.path, ROOT / config], commit, first, replica_tree(sweeps))
    planned = {p.test.id: p for p in design_lib.plan(design)}
    decided = [decide(t, sweep, design, planned) for t in design_lib.TESTS]
    claims = claim_verdicts(decided)
    points = sweep.points()
    counted = sum(r.counted for r in sweep.runs.values())

    out.parent.mkdir(parents=True, exist_ok=True)
    fig_main = out.with_suffix(".png")
    # drift-push's seeds evaluate at different steps: a band over the steps all of them share would be
    # a line from step 0 to 50; it is drawn per checkpoint in the pushes figure instead
    drawn = {p: s for p, s in points.items() if s and p != "drift-push"}
    if drawn:
        plot.plot_sweep(drawn, [PASS, "reward_mean"], fig_main, "minmax", 0.0,
                        "CPU replica of Fig. 2: held-out pass@1 (mean over counted seeds, min-max band)")
    v10 = point_v(sweep.manifest, "v10-i1")
    lags = by_lag(points.get("v10-i1", {}), v10)
    fig_lag = out.with_name(out.stem + "_lag.png")
    if points.get("v10-i1"):
        plot_lags(lags, fig_lag, "v10-i1: the off-policy instruments by lag (mean over seeds, +-1 std)")
    wanted = {"v1-i1": 1, "v10-i1": v10}
    vs_sweep = sweeps[1] if len(sweeps) > 1 else None
    if vs_sweep is not None:
        wanted.update({p["name"]: point_v(vs_sweep.manifest, p["name"]) for p in vs_sweep.manifest["points"]})
    by_v = v_runs([(sweep.manifest, points)] + ([(vs_sweep.manifest, vs_sweep.points(counted_only=False))]
                                                 if vs_sweep else []), wanted)
    fig_pushes = out.with_name(out.stem + "_pushes.png")
    if any(points.get(a) for a in PUSH_ARMS):
        plot_pushes(points, design, fig_pushes, "Equal samples, equal pushes: pass@1 at each checkpoint's eval "
                    "(mean over counted seeds, bars: min-max)")
    fig_v = out.with_name(out.stem + "_vsweep.png")
    if by_v:
        plot_vsweep(by_v, fig_v, "How far off policy: the same iterations at every v (descriptive)")

    command = "python scripts/fig2_report.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    walls = [wall_minutes(sw) for sw in sweeps]
    wall, cut_off = sum(w for w, _ in walls), [name for _, names in walls for name in names]
    missing = [f"{r.name}: {r.why_not}" for r in sweep.runs.values() if not r.counted]
    page = [
        "# The CPU replica of Fig. 2: verdicts",
        "",
        "Generated by `scripts/fig2_report.py` from the runs of the pre-set design "
        "([fig2_design.md](fig2_design.md)); nothing on this page is written by hand (the reading of it is in "
        "[sweeps.md](sweeps.md#the-cpu-replica-of-figure-2-make-replicate)).",
        "",
        f"- command: `{command}`",
        *provenance_lines(design, config, history, commit, sweeps),
        f"- date: {time.strftime('%Y-%m-%d')}; wall time of the runs: {wall:.0f} min (each attempt as "
        "scripts/sweep.py records it" + (f"; not in it: a start of the run the record does not count (an attempt "
                                         f"cut off with the sweep, or running now), in "
                                         f"{', '.join(cut_off)}" if cut_off else "") + ")",
        "",
        "## The runs",
        "",
        f"{counted} of {len(sweep.runs)} runs of `{sweep.manifest['name']}` counted (finished, at the replica's commit, "
        "a clean checkout, the design's eval). A test is decided only with every seed of its arms counted."
        + ("" if not missing else f" Not counted: {len(missing)}."),
        "",
        runs_table(sweep, design),
        "",
        "## Verdicts (pre-set)",
        "",
        f"Paired by seed; two-sided {design.level:.0%} Student t interval of the mean over the seeds (n - 1 degrees "
        "of freedom). holds: the interval lies above the threshold; does not hold: below it; not resolved: it "
        "straddles; missing runs: a seed of the test's arms is not counted (named below). A claim holds when all its "
        "primary tests hold. L: mean pass@1 over the checkpoints; D: drawdown over them; P: pass@1 at the run's end "
        f"(after {design.equal_samples} pushes); G: L minus step 0; U: D minus the eval noise's mean drawdown. "
        "Planned power: at the planning sd of fig2_power.py (for 'matches', if the arms are equal; else at a "
        f"difference of {design.margin:g}). Eval SE: the eval's binomial standard error of one seed's value.",
        "",
        verdict_table(decided, claims, design),
        "",
        *[f"- {d.test.id} missing: {', '.join(d.missing[:12])}" + (f" and {len(d.missing) - 12} more"
                                                                    if len(d.missing) > 12 else "")
          for d in decided if d.missing],
        *[f"- {d.test.id} per seed: " + ", ".join(f"{x:+.3f}" for x in d.iv.diffs)
          for d in decided if d.iv.diffs and not d.missing],
        "",
        f"![held-out pass@1 per arm]({fig_main.name})" if drawn else "No counted run yet: no figure.",
        "",
        "## Every checkpoint (descriptive)",
        "",
        "Not verdicts: the paired difference at each checkpoint, over the counted seeds both arms have (drift-push "
        "at its eval of the checkpoint, the other arm read at the same step).",
        "",
        checkpoints_table(points, design),
        "",
        "## Equal samples, equal pushes (descriptive)",
        "",
        "Every arm at each checkpoint with the pushes it had made by then. lag1 pushes every iteration as v1-i1 "
        "does, so e1 compares the two at equal pushes too; drift-push's pushes are an outcome of its runs, and "
        "no arm is evaluated at its push counts: its comparisons at equal pushes are this table and the figure "
        "below, without a verdict ([fig2_design.md](fig2_design.md#equal-pushes)). drift-push evaluates right "
        "after a push: at the first push at or after each checkpoint (its eval step); its tests read the other "
        "arm at that step. It is drawn here only, not in the figure above (its seeds share few eval steps).",
        "",
        pushes_table(points, design),
        "",
        f"![pass@1 against steps and pushes, per checkpoint]({fig_pushes.name})" if any(
            points.get(a) for a in PUSH_ARMS) else "",
        "",
        "## Per arm (descriptive)",
        "",
        plot.sweep_table(sweep.dir, sweep.manifest, points),
        "",
        "## Inside a v-window: v10-i1 by lag (descriptive)",
        "",
        "Per lag (`alpha_lag_steps`: optimizer steps since the push that sampled the batch, its place in the "
        "window), each seed's mean over its windows, then mean +- std over seeds. Eq. 4 charges an off-policy "
        "update 2 E TV(pi_k, alpha) (`tv_pik_alpha`, which the instruments split into `tv_staleness` and "
        "`tv_mismatch`) and 2 M sqrt(E TV^2(pi, alpha)), M being `bound_M`.",
        "",
        lag_table(lags) if points.get("v10-i1") else "No counted v10-i1 run yet.",
        "",
        lag_legend(LAG_KEYS),
        "",
        f"![instruments by lag]({fig_lag.name})" if points.get("v10-i1") else "",
        "",
        "## How far off policy: the v-sweep (descriptive)",
        "",
        (f"Seeds {list(design.vsweep_seeds)}: pass@1 after the same iterations at every v, no verdict."
         if vs_sweep else "No v-sweep given."),
        "",
        vsweep_table(by_v) if by_v else "No run yet.",
        "",
        f"![pass@1 and pushes against v]({fig_v.name})" if by_v else "",
    ]
    if replay is not None:
        page += ["", "## Objectives on the v10-i1 recordings (descriptive)", "",
                 "scripts/compare_objectives.py --follow on the recorded batches: each objective's first-step update "
                 "at the parameters the run had when it trained on the batch, its cosine to the reference's (the "
                 "first objective) and its norm, mean over the batches at each lag (optimizer steps since the push "
                 "that sampled the batch).", "", replay]
    out.write_text("\n".join(page) + "\n")
    print("\n".join(f"{design_lib.CLAIMS[c]}: {v}" for c, v in claims.items()))
    print(f"wrote {out} ({counted} of {len(sweep.runs)} runs counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
