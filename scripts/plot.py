"""Plot reward and evaluation curves of one or more runs (the paper's Figure 2) into a PNG.

    python scripts/plot.py runs/v1-i1 runs/v10-i1 --out fig.png [--smooth 0.9] [--keys reward_mean eval/pass@1]

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


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that logged a finite number under `key`."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", default="fig.png", help="PNG file to write (default fig.png)")
    parser.add_argument("--keys", nargs="+", help="metric keys to plot (default: reward_mean, eval/pass@*, eval/maj@*)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1), e.g. 0.9 (default 0: raw)")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: the directory names)")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.smooth < 1:
            raise PlotError(f"--smooth: must be in [0, 1), got {args.smooth}")
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
