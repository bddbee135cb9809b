"""The CPU replica of Fig. 2 as a page: each claim of the paper decided from the sweep's runs.

    python scripts/fig2_report.py --sweep runs/sweeps/fig2-cpu --vsweep runs/sweeps/fig2-cpu-v \\
        --compare runs/sweeps/fig2-cpu/v10-i1-s0/compare --out docs/fig2_cpu.md

Reads the runs scripts/sweep.py made (`make replicate`: the four settings of Fig. 2 x seeds, and the
v-sweep) and writes the page (--out) with its figures beside it: <out>.png (held-out pass@1 per
setting against optimizer steps and against pushes, mean over seeds and min-max band),
<out>_lag.png (the off-policy instruments by lag inside a v-window) and <out>_vsweep.png (pass@1
and pushes against v). Nothing on the page is written by hand: every number, interval and verdict
comes from the runs' metrics.jsonl.

The claims of Section 5.1 / Fig. 2, each an effect on held-out pass@1 oriented so that the claim
says "the effect is positive", paired by seed (the runs of a seed share the data order, the
sampling seeds and the eval's seeds):

  1. off-policy v10-i1 matches or beats on-policy v1-i1 at equal iterations (optimizer steps), with
     ~10x fewer pushes: pass@1(v10-i1) - pass@1(v1-i1) >= -MARGIN (non-inferiority);
  2. eq. 8 masking improves or stabilises on-policy training: pass@1(mask) - pass@1(plain) > 0, or
     the largest drop of the pass@1 curve (drawdown(plain) - drawdown(mask)) > 0;
  3. v1-i10 (batch reuse) learns less per iteration: pass@1(v1-i1) - pass@1(v1-i10) > 0 at equal
     optimizer steps (both start from the same weights and the same eval seeds, so this is the
     difference of their gains).

Each is decided at the last checkpoint the two settings share (the end of the runs); the page also
lists the difference at every shared checkpoint, and for v10-i1 at equal pushes. The interval is a
two-sided 95% Student t interval of the mean paired difference over seeds. A verdict:
  holds            the interval lies on the claim's side (above 0; above -MARGIN for "matches");
  refuted          it lies on the other side (below 0; below -MARGIN);
  not resolved     it straddles (at this scale: the seeds disagree or the effect is small).
Claim 2 holds if either part holds and is refuted if both are.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # noqa: E402  (scripts/plot.py: the sweep's runs, curves and bands)

MARGIN = 0.05  # pass@1: "matches" = not worse by more than this (fixed before the sweep ran)
LEVEL = 0.95  # the intervals' coverage
PASS = "eval/pass@1"
HOLDS, REFUTED, OPEN = "holds", "refuted", "not resolved at this scale"


class ReportError(Exception):
    """A sweep the page cannot be made from; the message names the directory or the point."""


# ---------------------------------------------------------------------------------------------
# statistics

@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom: the density integrated
    by Simpson's rule and the quantile bracketed by bisection (no scipy on these machines)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # P(T <= x) for x >= 0
        n = 2000
        h = x / n
        density = [math.exp(log_c - (df + 1) / 2 * math.log1p((j * h) ** 2 / df)) for j in range(n + 1)]
        total = sum((1 if j in (0, n) else 4 if j % 2 else 2) * f for j, f in enumerate(density))
        return 0.5 + total * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Interval:
    """The mean of paired differences and its two-sided t interval (lo, hi: None with < 2 pairs)."""

    diffs: list[float]
    mean: float
    lo: Optional[float]
    hi: Optional[float]

    @classmethod
    def of(cls, diffs: list[float], level: float = LEVEL) -> "Interval":
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


def verdict(iv: Interval, margin: float = 0.0) -> str:
    """The claim "effect > -margin" (margin 0: "effect > 0") against the interval."""
    if iv.lo is None:
        return OPEN
    if iv.lo > -margin:
        return HOLDS
    if iv.hi < -margin:
        return REFUTED
    return OPEN


def either(a: str, b: str) -> str:
    """The verdict of "A or B"."""
    if HOLDS in (a, b):
        return HOLDS
    return REFUTED if a == b == REFUTED else OPEN


# ---------------------------------------------------------------------------------------------
# what one run shows

def evals(rows: list[dict], axis: str = "step") -> dict[float, float]:
    """{step or pushes: held-out pass@1} of a run's eval rows (pushes: the version evaluated)."""
    key = "step" if axis == "step" else "eval/weights_version"
    return {row[key]: float(row[PASS]) for row in rows if plot.finite(row.get(PASS)) and plot.finite(row.get(key))}


def drawdown(rows: list[dict], at: Optional[list[float]] = None) -> Optional[float]:
    """The largest drop of the pass@1 curve, over the checkpoints `at` (default: all of the run's):
    max over checkpoints s < t of pass@1(s) - pass@1(t), 0 for a curve that never falls (the
    instability eq. 8 masking is said to remove). Two runs compare on the same checkpoints: more
    of them can only find a deeper fall."""
    curve = evals(rows)
    values = [curve[x] for x in sorted(curve) if at is None or x in at]
    if not values:
        return None
    peak, worst = values[0], 0.0
    for v in values:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst


def pushes(rows: list[dict]) -> int:
    """Weight pushes the run made (the newest version trained on or evaluated)."""
    versions = [row.get("weights_version", row.get("eval/weights_version")) for row in rows]
    return int(max((v for v in versions if plot.finite(v)), default=0))


# ---------------------------------------------------------------------------------------------
# the claims

Points = dict[str, dict[int, list[dict]]]  # grid point -> {seed: metrics rows}


@dataclass
class Row:
    """One paired comparison at one checkpoint."""

    effect: str
    at: str
    iv: Interval
    verdict: str = ""


@dataclass
class Claim:
    text: str
    verdict: str
    decided_by: list[Row]
    checkpoints: list[Row] = field(default_factory=list)  # the same effect at every shared checkpoint
    note: str = ""


def paired(points: Points, a: str, b: str, value: Callable[[list[dict]], Optional[float]]) -> Interval:
    """value(a's run) - value(b's run), seed by seed, over the seeds where both have a value."""
    diffs = []
    for seed in sorted(set(points.get(a, {})) & set(points.get(b, {}))):
        va, vb = value(points[a][seed]), value(points[b][seed])
        if va is not None and vb is not None:
            diffs.append(va - vb)
    return Interval.of(diffs)


def shared_checkpoints(points: Points, a: str, b: str, axis: str) -> list[float]:
    """The checkpoints (steps or pushes, after the start) at which every run of a and b evaluated, over
    the seeds both have: a run whose partner has not started yet (--partial) pairs with nothing, so it
    must not hold the decision back at its own latest checkpoint."""
    seeds = set(points.get(a, {})) & set(points.get(b, {}))
    runs = [points[p][s] for s in sorted(seeds) for p in (a, b)]
    if not runs:
        return []
    common = set.intersection(*(set(evals(rows, axis)) for rows in runs))
    return sorted(x for x in common if x > 0)


def at_checkpoint(axis: str, x: float) -> Callable[[list[dict]], Optional[float]]:
    return lambda rows: evals(rows, axis).get(x)


def compare_curves(points: Points, a: str, b: str, axis: str, effect: str, margin: float = 0.0) -> list[Row]:
    """effect = pass@1(a) - pass@1(b) at every shared checkpoint, each with its verdict."""
    unit = "step" if axis == "step" else "pushes"
    rows = []
    for x in shared_checkpoints(points, a, b, axis):
        iv = paired(points, a, b, at_checkpoint(axis, x))
        rows.append(Row(effect, f"{unit} {x:g}", iv, verdict(iv, margin)))
    return rows


def claims(points: Points, margin: float = MARGIN) -> list[Claim]:
    out = []
    # 1. v10-i1 vs v1-i1: at equal optimizer steps (the claim), and at equal pushes
    steps = compare_curves(points, "v10-i1", "v1-i1", "step", "pass@1(v10-i1) - pass@1(v1-i1)", margin)
    by_push = compare_curves(points, "v10-i1", "v1-i1", "pushes", "pass@1(v10-i1) - pass@1(v1-i1)")
    ratio = [pushes(points["v1-i1"][s]) / max(pushes(points["v10-i1"][s]), 1)
             for s in sorted(set(points.get("v1-i1", {})) & set(points.get("v10-i1", {})))]
    decided = steps[-1:] + by_push[-1:]
    out.append(Claim(
        "off-policy v10-i1 matches or beats on-policy v1-i1 at equal iterations, with ~10x fewer pushes",
        steps[-1].verdict if steps else OPEN, decided, steps + by_push,
        f"matching = not worse by more than {margin:g} pass@1; pushes v1-i1 / v10-i1 at the end: "
        + (", ".join(f"{r:.1f}" for r in ratio) if ratio else "n/a")
        + ". The equal-pushes row (v10-i1 ahead?) is shown, not part of the verdict."))
    # 2. eq. 8 masking vs plain on-policy GRPO: the end point, and the largest drop of the curve
    final = compare_curves(points, "v1-i1-mask", "v1-i1", "step", "pass@1(mask) - pass@1(v1-i1)")
    shared = [0.0] + shared_checkpoints(points, "v1-i1-mask", "v1-i1", "step")
    stab = paired(points, "v1-i1", "v1-i1-mask", lambda rows: drawdown(rows, shared))
    stab_row = Row("drawdown(v1-i1) - drawdown(mask)", "whole run", stab, verdict(stab))
    improves = final[-1].verdict if final else OPEN
    out.append(Claim("eq. 8 masking improves or stabilises on-policy training", either(improves, stab_row.verdict),
                     final[-1:] + [stab_row], final,
                     "drawdown: the largest fall of held-out pass@1 between a checkpoint and a later one, "
                     "over the checkpoints both settings evaluated"))
    # 3. batch reuse: v1-i1 vs v1-i10 at equal optimizer steps
    reuse = compare_curves(points, "v1-i1", "v1-i10", "step", "pass@1(v1-i1) - pass@1(v1-i10)")
    out.append(Claim("v1-i10 (batch reuse) learns less per iteration than v1-i1", reuse[-1].verdict if reuse else OPEN,
                     reuse[-1:], reuse, "iterations = optimizer steps; v1-i10 takes 10 on each batch"))
    return out


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

def wall_minutes(sweep_dir: Path, manifest: dict) -> float:
    """Wall time of the sweep's runs (scripts/sweep.py's record of each run, summed)."""
    total = 0.0
    for run in manifest["runs"]:
        record = sweep_dir / "logs" / f"{run['name']}.json"
        if record.is_file():
            total += json.loads(record.read_text())["wall_s"]
    return total / 60


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
        kind = ("AMX" if any(f.startswith("amx") for f in flags) else
                "AVX512-BF16" if "avx512_bf16" in flags else "AVX2 only" if "avx2" in flags else "no AVX2")
        cores = sum(1 for line in info.splitlines() if line.startswith("processor"))
        cpu = f"{cores} x {cpu} ({kind})"
    except (OSError, StopIteration):
        pass
    return cpu


def claims_table(found: list[Claim]) -> str:
    lines = ["| claim | verdict | decided by (paired by seed, mean [95% t interval]) |", "| --- | --- | --- |"]
    for c in found:
        by = "; ".join(f"{r.effect} at {r.at}: {r.iv.text()} ({r.verdict})" for r in c.decided_by) or "no shared checkpoint"
        lines.append(f"| {c.text} | **{c.verdict}** | {by} |")
    return "\n".join(lines)


def checkpoints_table(found: list[Claim]) -> str:
    lines = ["| effect | checkpoint | seeds | per seed | mean [95% t interval] | verdict at this checkpoint |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in found:
        for r in c.checkpoints:
            seeds = ", ".join(f"{d:+.3f}" for d in r.iv.diffs)
            lines.append(f"| {r.effect} | {r.at} | {len(r.iv.diffs)} | {seeds} | {r.iv.text()} | {r.verdict} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", required=True, help="the Fig. 2 sweep (points v1-i1, v1-i1-mask, v10-i1, v1-i10)")
    ap.add_argument("--vsweep", help="the v-sweep (points v<N> with grpo.v=N); v1-i1 and v10-i1 of --sweep join it")
    ap.add_argument("--compare", nargs="+", default=[], help="compare_objectives.py outputs on v10-i1 recordings")
    ap.add_argument("--out", default="docs/fig2_cpu.md", help="the page; figures are written beside it")
    ap.add_argument("--partial", action="store_true", help="use unfinished runs too (their latest checkpoint)")
    ap.add_argument("--margin", type=float, default=MARGIN, help=f"pass@1 margin of 'matches' (default {MARGIN})")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        sweep_dir = Path(args.sweep)
        manifest, points = plot.load_sweep(sweep_dir, args.partial)
        missing = [p for p in ("v1-i1", "v1-i1-mask", "v10-i1", "v1-i10") if p not in points]
        if missing:
            raise ReportError(f"{sweep_dir}: no grid point {', '.join(missing)} (the Fig. 2 points)")
        sweeps = [(manifest, points)]
        vs_manifest = None
        if args.vsweep:
            vs_manifest, vs_points = plot.load_sweep(Path(args.vsweep), args.partial)
            sweeps.append((vs_manifest, vs_points))
        found = claims(points, args.margin)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig_main = out.with_suffix(".png")
        plot.plot_sweep(points, [PASS, "reward_mean"], fig_main, "minmax", 0.0,
                        "CPU replica of Fig. 2: held-out pass@1 (mean over seeds, min-max band)")
        v10 = point_v(manifest, "v10-i1")
        lags = by_lag(points["v10-i1"], v10)
        fig_lag = out.with_name(out.stem + "_lag.png")
        if points["v10-i1"]:
            plot_lags(lags, fig_lag, "v10-i1: the off-policy instruments by lag (mean over seeds, +-1 std)")
        wanted = {"v1-i1": 1, "v10-i1": v10}
        if vs_manifest is not None:
            wanted.update({p["name"]: point_v(vs_manifest, p["name"]) for p in vs_manifest["points"]})
        by_v = v_runs(sweeps, wanted)
        fig_v = out.with_name(out.stem + "_vsweep.png")
        if by_v:
            plot_vsweep(by_v, fig_v, "How far off policy: the same iterations at every v")
        replay = replay_table([Path(c) for c in args.compare]) if args.compare else None
    except (ReportError, plot.PlotError) as e:
        print(f"fig2_report.py: error: {e}", file=sys.stderr)
        return 2
    seeds = sorted({s for p in points.values() for s in p})
    def progress_of(sweep_dir: Path, manifest: dict, points: Points) -> str:
        finished = sum((sweep_dir / r["name"] / "final").is_dir() for r in manifest["runs"])
        drawn = sum(len(p) for p in points.values())
        return (f"{finished} of {len(manifest['runs'])} runs finished"
                + (f", {drawn - finished} in progress drawn at their latest checkpoint (--partial)" if drawn > finished else ""))

    sweeps_run = [(args.sweep, manifest)] + ([(args.vsweep, vs_manifest)] if vs_manifest else [])
    wall = sum(wall_minutes(Path(d), m) for d, m in sweeps_run)
    command = "python scripts/fig2_report.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    page = [
        "# The CPU replica of Fig. 2: verdicts",
        "",
        "Generated by `scripts/fig2_report.py` from the sweep's runs; nothing on this page is written by hand "
        "(the reading of it is in [sweeps.md](sweeps.md#the-cpu-replica-of-figure-2-make-replicate)).",
        "",
        f"- command: `{command}`",
        f"- sweep `{manifest['name']}` of `{manifest['config']}`, seeds {seeds}: {progress_of(sweep_dir, manifest, points)}"
        + (f"; v-sweep `{vs_manifest['name']}`: {progress_of(Path(args.vsweep), vs_manifest, vs_points)}"
           if vs_manifest else ""),
        f"- machine: {machine()}",
        f"- date: {time.strftime('%Y-%m-%d')}; wall time of the runs: {wall:.0f} min (every attempt, as scripts/sweep.py records it)",
        "",
        "## Verdicts",
        "",
        f"Paired by seed; interval: two-sided {LEVEL:.0%} Student t interval of the mean difference over the seeds "
        f"(n - 1 degrees of freedom). holds: the interval lies on the claim's side; refuted: on the other side; "
        "not resolved at this scale: it straddles.",
        "",
        claims_table(found),
        "",
        *[f"- {c.text}: {c.note}" for c in found if c.note],
        "",
        f"![held-out pass@1 per setting]({fig_main.name})",
        "",
        "## Every shared checkpoint",
        "",
        checkpoints_table(found),
        "",
        "## Per setting",
        "",
        plot.sweep_table(sweep_dir, manifest, points),
        "",
        "## Inside a v-window: v10-i1 by lag",
        "",
        "Per lag (`alpha_lag_steps`: optimizer steps since the push that sampled the batch, its place in the "
        "window), each seed's mean over its windows, then mean +- std over seeds. Eq. 4 charges an off-policy "
        "update 2 E TV(pi_k, alpha) (`tv_pik_alpha`, which the instruments split into `tv_staleness` and "
        "`tv_mismatch`) and 2 M sqrt(E TV^2(pi, alpha)), M being `bound_M`.",
        "",
        lag_table(lags) if points["v10-i1"] else "No v10-i1 run yet.",
        "",
        lag_legend(LAG_KEYS),
        "",
        f"![instruments by lag]({fig_lag.name})" if points["v10-i1"] else "",
        "",
        "## How far off policy: the v-sweep",
        "",
        vsweep_table(by_v) if by_v else "No run yet.",
        "",
        f"![pass@1 and pushes against v]({fig_v.name})" if by_v else "",
    ]
    if replay is not None:
        page += ["", "## Objectives on the v10-i1 recordings", "",
                 "scripts/compare_objectives.py --follow on the recorded batches: each objective's first-step update "
                 "at the parameters the run had when it trained on the batch, its cosine to the reference's (the "
                 "first objective) and its norm, mean over the batches at each lag (optimizer steps since the push "
                 "that sampled the batch).", "", replay]
    out.write_text("\n".join(page) + "\n")
    print(claims_table(found))
    print(f"wrote {out}, {fig_main.name}, {fig_lag.name}, {fig_v.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
