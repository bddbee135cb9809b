"""Plot reward and evaluation curves of one or more runs (the paper's Figure 2) into a PNG.

    python scripts/plot.py runs/v1-i1 runs/v10-i1 --out fig.png [--smooth 0.9] [--keys reward_mean eval/pass@1]
    python scripts/plot.py --sweep runs/sweeps/fig2 --out fig2.png [--band minmax|std]

A sweep (scripts/sweep.py) is drawn per grid point: the mean over its seeds with a band (min-max,
or mean +- 1 std), against optimizer steps and against weight pushes (the paper's case for v > 1:
the same accuracy for fewer pushes), and summarised in a Markdown table (printed, and written next
to the PNG as .md): final held-out pass@1 mean +- std over seeds, pushes, optimizer steps, wall
time, mean TV(pi_k, alpha) and clip fraction.

Each argument is a run directory holding metrics.jsonl (or a metrics.jsonl path itself): one JSON
object per line with "step" and scalar metrics, written by train.py. One panel per key (by
default reward_mean and every eval/pass@k and eval/maj@k any run logged), one line per run. Rows without a key
(eval runs only every N steps) are skipped for that key. --smooth applies an exponential moving
average (debiased, as in TensorBoard) to the per-step training curves, with the raw values drawn
faintly; eval/* points are already means over many samples and sparse, so they are drawn raw.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_archive  # noqa: E402  (scripts/run_archive.py: a run finished here or archived)

import matplotlib

matplotlib.use("Agg")  # no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402


class PlotError(Exception):
    """Input the script cannot plot; its message names the file and the line."""


def metrics_path(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run}: no metrics.jsonl found (expected a run directory or a .jsonl file)")
    return path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise PlotError(f"{path}:{line_no}: expected a JSON object with a 'step' key")
        rows.append(row)
    if not rows:
        raise PlotError(f"{path}: holds no metrics rows")
    return rows


def finite(value) -> bool:
    """A number to aggregate. A statistic of an empty set is missing from the row (grpo.metrics.defined);
    runs logged before that hold NaN there instead, and a divergence may log an infinity: every
    mean, band and table here skips them, so one such row never turns an aggregate NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that logged a finite number under `key`."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if finite(value):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with the start-up bias removed (TensorBoard's smoothing)."""
    if weight <= 0:
        return list(values)
    out, running, norm = [], 0.0, 0.0
    for v in values:
        running = weight * running + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(running / norm)
    return out


def default_keys(runs: dict[str, list[dict]]) -> list[str]:
    keys = ["reward_mean"]
    # The accuracy curves; counts and timings the trainer also logs under eval/ (n_problems,
    # wall_time_s, ...) are left to --keys.
    eval_keys = {k for rows in runs.values() for row in rows for k in row if k.startswith(("eval/pass@", "eval/maj@"))}
    # pass@k before maj@k, each by k (pass@1, the paper's metric, first).
    def order(key: str) -> tuple:
        k = key.rsplit("@", 1)[1]
        return key.startswith("eval/maj@"), int(k) if k.isdigit() else 0, key

    eval_keys = sorted(eval_keys, key=order)
    return keys + eval_keys


def save(fig, out: Path, title: str | None) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot(runs: dict[str, list[dict]], keys: list[str], out: Path, smooth: float, title: str | None) -> list[str]:
    """Draw one panel per key that some run has; return the keys drawn."""
    drawn = [k for k in keys if any(series(rows, k)[0] for rows in runs.values())]
    if not drawn:
        raise PlotError(f"none of the keys {keys} appear in the metrics of {list(runs)}")
    cols = min(len(drawn), 3)
    nrows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, drawn):
        for i, (name, rows) in enumerate(runs.items()):
            steps, values = series(rows, key)
            if not steps:
                continue
            color = f"C{i}"
            weight = 0.0 if key.startswith("eval/") else smooth
            if weight > 0:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, ema(values, weight), color=color, label=name, marker="o" if len(steps) < 30 else None,
                    markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    save(fig, out, title)
    return drawn


# ---------------------------------------------------------------------------------------------
# sweeps: seeds of a grid point aggregated into a mean and a band

SWEEP_KEYS = ("reward_mean", "eval/pass@1")
AXES = {"step": "optimizer step", "weights_version": "weight pushes"}


def load_sweep(sweep_dir: Path, partial: bool = False) -> tuple[dict, dict[str, dict[int, list[dict]]]]:
    """sweep.json and, per grid point, {seed: metrics rows} of the finished runs (final/ exported, or
    its archived record);
    with `partial`, of every run that has logged (its "final" pass@1 is then its latest)."""
    manifest_path = sweep_dir / "sweep.json"
    if not manifest_path.is_file():
        raise PlotError(f"{sweep_dir}: no sweep.json (is it a directory made by scripts/sweep.py?)")
    manifest = json.loads(manifest_path.read_text())
    points: dict[str, dict[int, list[dict]]] = {p["name"]: {} for p in manifest["points"]}
    for run in manifest["runs"]:
        path = sweep_dir / run["name"] / "metrics.jsonl"
        finished = run_archive.finished(sweep_dir / run["name"])
        if path.is_file() and path.stat().st_size and (finished or partial):
            points[run["point"]][run["seed"]] = read_metrics(path)
    if not any(points.values()):
        raise PlotError(f"{sweep_dir}: none of its {len(manifest['runs'])} runs has finished "
                        f"(--partial draws runs in progress)")
    return manifest, points


def curve(rows: list[dict], key: str, axis: str) -> dict[float, float]:
    """{x: mean of the row values at x} for one seed; x is the step or the weights version (several
    iterations share a version inside a v-window: their rewards are averaged)."""
    sums: dict[float, list[float]] = {}
    for row in rows:
        # An eval row names the version it evaluated eval/weights_version (its own summary's field).
        value, x = row.get(key), row.get(axis, row.get(f"eval/{axis}"))
        if finite(value) and finite(x):
            sums.setdefault(x, []).append(float(value))
    return {x: sum(v) / len(v) for x, v in sorted(sums.items())}


def band(curves: list[dict[float, float]], kind: str) -> tuple[list, list, list, list]:
    """(xs, mean, low, high) over seeds at the x every seed has (all x if the seeds share none)."""
    common = set.intersection(*(set(c) for c in curves))
    xs = sorted(common or set.union(*(set(c) for c in curves)))
    mean, low, high = [], [], []
    for x in xs:
        values = [c[x] for c in curves if x in c]
        m = sum(values) / len(values)
        if kind == "std":
            sd = _std(values)
            lo, hi = m - sd, m + sd
        else:
            lo, hi = min(values), max(values)
        mean.append(m)
        low.append(lo)
        high.append(hi)
    return xs, mean, low, high


def _std(values: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for a single value."""
    if len(values) < 2:
        return 0.0
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def plot_sweep(points: dict[str, dict[int, list[dict]]], keys: list[str], out: Path, band_kind: str,
               smooth: float, title: str | None) -> dict[str, dict[str, int]]:
    """One row of panels per key, one column per x axis; returns {panel: {point: seeds drawn}}."""
    keys = [k for k in keys if any(curve(rows, k, "step") for seeds in points.values() for rows in seeds.values())]
    if not keys:
        raise PlotError("none of the keys appear in the sweep's metrics")
    fig, axes = plt.subplots(len(keys), len(AXES), figsize=(5.5 * len(AXES), 3.8 * len(keys)), squeeze=False)
    drawn: dict[str, dict[str, int]] = {}
    for row_axes, key in zip(axes, keys):
        for ax, (axis, label) in zip(row_axes, AXES.items()):
            panel = drawn.setdefault(f"{key} vs {axis}", {})
            for i, (point, seeds) in enumerate(points.items()):
                curves = [c for c in (curve(rows, key, axis) for rows in seeds.values()) if c]
                if not curves:
                    continue
                if smooth > 0 and not key.startswith("eval/"):
                    curves = [dict(zip(c, ema(list(c.values()), smooth))) for c in curves]
                xs, mean, low, high = band(curves, band_kind)
                ax.plot(xs, mean, color=f"C{i}", label=f"{point} (n={len(curves)})",
                        marker="o" if len(xs) < 30 else None, markersize=3)
                ax.fill_between(xs, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
                panel[point] = len(curves)
            ax.set_title(f"{key}: mean over seeds, band {'+-1 std' if band_kind == 'std' else 'min-max'}",
                         fontsize=9)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, out, title)
    return drawn


def sweep_table(sweep_dir: Path, manifest: dict, points: dict[str, dict[int, list[dict]]]) -> str:
    """Markdown: per grid point, over seeds, the final held-out pass@1 (mean +- std), pushes,
    optimizer steps, wall time of the run (scripts/sweep.py's record, under the manifest's run
    name), mean TV(pi_k, alpha) and clip fraction over the optimizer steps that have them (a batch
    whose groups are all masked has neither, see `finite`)."""
    run_names = {(run["point"], run["seed"]): run["name"] for run in manifest["runs"]}
    lines = ["| grid point | seeds | final pass@1 | pushes | optimizer steps | wall time (min) | TV(pi_k, alpha) "
             "| clip fraction |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for point, seeds in points.items():
        if not seeds:
            lines.append(f"| {point} | 0 | | | | | | |")
            continue
        finals, pushes, steps, walls, tvs, clips = [], [], [], [], [], []
        for seed, rows in seeds.items():
            evals = [r["eval/pass@1"] for r in rows if finite(r.get("eval/pass@1"))]
            if evals:
                finals.append(evals[-1])
            train = [r for r in rows if "loss" in r]
            versions = [r.get("eval/weights_version") for r in rows] + [r.get("weights_version") for r in train]
            pushes.append(max((v for v in versions if finite(v)), default=0))
            steps.append(max((r["step"] for r in rows if finite(r["step"])), default=0))
            tvs.extend(r["tv_pik_alpha"] for r in train if finite(r.get("tv_pik_alpha")))
            clips.extend(r["clip_frac"] for r in train if finite(r.get("clip_frac")))
            record = run_archive.attempts(sweep_dir, run_names[point, seed])
            if record["attempts"]:
                walls.append(record["wall_s"] / 60)

        def mean(values, fmt):
            return format(sum(values) / len(values), fmt) if values else "n/a"

        final = f"{mean(finals, '.3f')} +- {_std(finals):.3f}" if finals else "n/a"
        lines.append(f"| {point} | {len(seeds)} | {final} | {mean(pushes, '.1f')} | {mean(steps, '.0f')} | "
                     f"{mean(walls, '.1f')} | {mean(tvs, '.2e')} | {mean(clips, '.4f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="run directories (with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--sweep", help="a sweep directory (scripts/sweep.py): mean and band per grid point, and a table")
    parser.add_argument("--partial", action="store_true", help="a sweep: draw unfinished runs too (default: finished only)")
    parser.add_argument("--band", choices=["minmax", "std"], default="minmax",
                        help="the band of a sweep: min-max over seeds or mean +- 1 std (default minmax)")
    parser.add_argument("--out", default="fig.png", help="PNG file to write (default fig.png)")
    parser.add_argument("--keys", nargs="+", help="metric keys to plot (default: reward_mean, eval/pass@*, eval/maj@*)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1), e.g. 0.9 (default 0: raw)")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: the directory names)")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.smooth < 1:
            raise PlotError(f"--smooth: must be in [0, 1), got {args.smooth}")
        if bool(args.sweep) == bool(args.runs):
            raise PlotError("give run directories or --sweep DIR (one of the two)")
        if args.sweep:
            sweep_dir = Path(args.sweep)
            manifest, points = load_sweep(sweep_dir, args.partial)
            out = Path(args.out)
            drawn = plot_sweep(points, args.keys or list(SWEEP_KEYS), out, args.band, args.smooth,
                               args.title or f"sweep {manifest['name']}")
            table = sweep_table(sweep_dir, manifest, points)
            out.with_suffix(".md").write_text(table + "\n")
            print(table)
            print(f"wrote {out} and {out.with_suffix('.md')}: {', '.join(drawn)}")
            return 0
        if args.labels and len(args.labels) != len(args.runs):
            raise PlotError(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs")
        runs: dict[str, list[dict]] = {}
        for i, run in enumerate(args.runs):
            path = metrics_path(run)
            name = args.labels[i] if args.labels else (path.parent.name if path.name == "metrics.jsonl" else path.stem)
            if name in runs:
                name = f"{name} ({i})"
            runs[name] = read_metrics(path)
        keys = args.keys or default_keys(runs)
        drawn = plot(runs, keys, Path(args.out), args.smooth, args.title)
    except PlotError as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {', '.join(drawn)} for {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
