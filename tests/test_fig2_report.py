"""scripts/fig2_report.py: the verdict of each Fig. 2 claim computed from a sweep's runs (synthetic
run directories laid out as scripts/sweep.py lays them out, with the rows train.py writes)."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fig2_report as report  # noqa: E402

POINTS = {"v1-i1": ["eval_every=5"], "v1-i1-mask": ["objective.mask_zero_variance=true"],
          "v10-i1": ["grpo.v=10", "eval_every=10"], "v1-i10": ["grpo.i=10", "grpo.M=5", "eval_every=1"]}
STEPS = {"v1-i1": range(0, 51, 5), "v1-i1-mask": range(0, 51, 5), "v10-i1": range(0, 51, 10), "v1-i10": range(0, 51, 10)}


def pushes_at(point: str, step: int) -> int:
    if point == "v10-i1":
        return step // 10
    if point == "v1-i10":
        return step // 10
    return step


def write_sweep(root: Path, curves: dict, name: str = "fig2") -> Path:
    """curves: {point: {seed: f(step) -> pass@1}}; a finished run per (point, seed), eval rows at the
    point's checkpoints and, for v10-i1, one train row per iteration with the lag instruments."""
    sweep = root / name
    runs = []
    for point, seeds in curves.items():
        for seed, f in seeds.items():
            run = f"{point}-s{seed}"
            runs.append({"name": run, "point": point, "seed": seed, "overrides": POINTS[point]})
            (sweep / run / "final").mkdir(parents=True)
            rows = []
            for step in STEPS[point]:
                rows.append({"step": step, "eval/pass@1": f(step), "eval/weights_version": pushes_at(point, step)})
                if point == "v10-i1" and step < 50:
                    for k in range(step, step + 10):
                        lag = k % 10
                        rows.append({"step": k + 1, "iteration": k, "sgd_iteration": 0, "loss": 0.0, "alpha_lag_steps": lag,
                                     "weights_version": k // 10, "reward_mean": 0.5, "tv_staleness": 0.01 * lag,
                                     "tv_mismatch": 0.002, "tv_pik_alpha": 0.002 + 0.01 * lag,
                                     "is_weight_ess": 1 - 0.01 * lag, "clip_frac_adv_pos": 0.0,
                                     "clip_frac_adv_neg": 0.001 * lag, "bound_M": 2.0, "bound_M_nonzero": 1.5})
            (sweep / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = {"name": name, "config": "configs/cpu_fig2.yaml", "seeds": sorted({r["seed"] for r in runs}),
                "points": [{"name": p, "overrides": POINTS[p]} for p in curves], "runs": runs}
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    return sweep


def linear(gain: float, start: float = 0.2):
    return lambda step: start + gain * step / 50


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228)])
def test_t_quantile_matches_the_tables(df, expected):
    assert report.t_quantile(0.975, df) == pytest.approx(expected, abs=2e-3)


def test_interval_and_verdicts_by_hand():
    iv = report.Interval.of([0.2, 0.25, 0.3])  # mean 0.25, sd 0.05, t(0.975, 2) = 4.303: 0.25 +- 0.124
    assert iv.mean == pytest.approx(0.25) and iv.hi - iv.mean == pytest.approx(4.303 * 0.05 / math.sqrt(3), abs=1e-3)
    assert report.verdict(iv) == report.HOLDS
    assert report.verdict(report.Interval.of([0.1, 0.2, 0.3])) == report.OPEN  # 0.2 +- 0.248 straddles 0
    assert report.verdict(report.Interval.of([-0.2, -0.25, -0.3])) == report.REFUTED
    assert report.verdict(report.Interval.of([-0.1, 0.2, 0.05])) == report.OPEN
    assert report.verdict(report.Interval.of([0.5])) == report.OPEN  # one seed: no interval, nothing decided
    # non-inferiority: a small deficit within the margin holds, a large one is refuted
    assert report.verdict(report.Interval.of([-0.01, -0.02, -0.015]), margin=0.05) == report.HOLDS
    assert report.verdict(report.Interval.of([-0.2, -0.25, -0.22]), margin=0.05) == report.REFUTED
    assert report.either(report.OPEN, report.HOLDS) == report.HOLDS
    assert report.either(report.REFUTED, report.REFUTED) == report.REFUTED
    assert report.either(report.REFUTED, report.OPEN) == report.OPEN


def test_drawdown_is_the_largest_fall_after_a_peak():
    rows = [{"step": s, "eval/pass@1": p} for s, p in [(0, 0.2), (5, 0.6), (10, 0.3), (15, 0.7), (20, 0.5)]]
    assert report.drawdown(rows) == pytest.approx(0.3)
    assert report.drawdown(rows, at=[0, 5, 15, 20]) == pytest.approx(0.2)  # without the checkpoint at 10
    assert report.drawdown([{"step": s, "eval/pass@1": 0.1 * s} for s in range(5)]) == 0.0


def test_the_page_states_each_claims_verdict_from_the_runs(tmp_path):
    """v10-i1 a little ahead of v1-i1 in every seed (holds), masking ahead at the end in no seed and
    with a deeper fall in every seed (refuted), v1-i10 behind in one seed and ahead in two (not
    resolved); the page carries those verdicts, the per-lag table and the v-sweep."""
    wobbly = lambda gain, dip: lambda s: linear(gain)(s) - (dip if s == 30 else 0.0)  # noqa: E731
    curves = {
        "v1-i1": {s: wobbly(0.5, 0.05) for s in (0, 1, 2)},
        "v1-i1-mask": {0: wobbly(0.40, 0.30), 1: wobbly(0.42, 0.25), 2: wobbly(0.38, 0.35)},
        "v10-i1": {0: linear(0.52), 1: linear(0.53), 2: linear(0.51)},
        "v1-i10": {0: linear(0.6), 1: linear(0.3), 2: linear(0.55)},
    }
    sweep = write_sweep(tmp_path, curves)
    out = tmp_path / "docs" / "fig2_cpu.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    found = report.claims(report.plot.load_sweep(sweep)[1])
    assert [c.verdict for c in found] == [report.HOLDS, report.REFUTED, report.OPEN]
    page = out.read_text()
    for c in found:
        assert f"| {c.text} | **{c.verdict}** |" in page
    v10 = found[0]
    assert v10.decided_by[0].at == "step 50" and v10.decided_by[0].iv.diffs == pytest.approx([0.02, 0.03, 0.01])
    assert v10.decided_by[1].at == "pushes 5"  # v10-i1 after 5 pushes (its end) against v1-i1 after 5 (step 5)
    assert "| 9 | 0.5 +- 0 | 0.092 +- " in page  # lag 9: tv_pik_alpha = tv_mismatch + staleness
    assert "- `tv_staleness` (bound/, `grpo.staleness`): the part that is staleness" in page  # its declaration
    lags = report.by_lag(report.plot.load_sweep(sweep)[1]["v10-i1"], 10)
    assert [round(m, 6) for m, _, _ in lags["tv_staleness"]] == [0.01 * lag for lag in range(10)]
    assert all(n == 3 for _, _, n in lags["is_weight_ess"])
    for figure in ("fig2_cpu.png", "fig2_cpu_lag.png", "fig2_cpu_vsweep.png"):
        assert (out.parent / figure).stat().st_size > 0


def test_v10_far_behind_is_refuted_and_batch_reuse_behind_holds(tmp_path):
    curves = {
        "v1-i1": {s: linear(0.6) for s in (0, 1, 2)},
        "v1-i1-mask": {s: linear(0.6) for s in (0, 1, 2)},
        "v10-i1": {0: linear(0.2), 1: linear(0.25), 2: linear(0.3)},
        "v1-i10": {0: linear(0.1), 1: linear(0.05), 2: linear(0.12)},
    }
    found = report.claims(report.plot.load_sweep(write_sweep(tmp_path, curves))[1])
    assert [c.verdict for c in found] == [report.REFUTED, report.OPEN, report.HOLDS]  # masking: equal, no interval width


def test_the_replay_table_is_by_lag_and_needs_followed_rows(tmp_path):
    rows = [{"iteration": k, "objective": name, "alpha_lag_steps": k % 2, "grad_norm": 1.0 + k,
             "cosine_to_reference": 1.0 if name == "grpo" else 0.5 + 0.1 * (k % 2)}
            for k in range(4) for name in ("grpo", "cispo")]
    (tmp_path / "compare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = report.replay_table([tmp_path]).splitlines()
    assert table[0] == "| lag | grpo: cos / norm | cispo: cos / norm |"
    assert table[2:] == ["| 0 | 1.000 / 2 | 0.500 / 2 |", "| 1 | 1.000 / 3 | 0.600 / 3 |"]
    for r in rows:
        del r["alpha_lag_steps"]
    (tmp_path / "compare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(report.ReportError, match="--follow"):
        report.replay_table([tmp_path])


def test_a_sweep_part_way_makes_a_page_that_decides_nothing_it_lacks(tmp_path):
    """Seed 0 of v1-i1 and v1-i1-mask finished, nothing of v10-i1 and v1-i10 (a sweep killed early,
    --partial): the page is written, every claim without two seeds is not resolved."""
    curves = {"v1-i1": {0: linear(0.5)}, "v1-i1-mask": {0: linear(0.6)}, "v10-i1": {}, "v1-i10": {}}
    sweep = write_sweep(tmp_path, curves)
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    assert [c.verdict for c in report.claims(report.plot.load_sweep(sweep)[1])] == [report.OPEN] * 3
    assert "No v10-i1 run yet." in out.read_text() and not (tmp_path / "page_lag.png").exists()


def test_a_run_in_progress_without_its_partner_does_not_move_the_checkpoint(tmp_path):
    """--partial mid-sweep: seed 2 of v1-i1 has reached step 10, seed 2 of the other settings has not
    started. Each claim is decided over the seeds both settings have (0 and 1) at the last checkpoint
    those runs share, step 50, not at the in-progress run's step 10."""
    curves = {
        "v1-i1": {s: linear(0.5) for s in (0, 1, 2)},
        "v1-i1-mask": {0: linear(0.6), 1: linear(0.62)},
        "v10-i1": {0: linear(0.52), 1: linear(0.53)},
        "v1-i10": {0: linear(0.2), 1: linear(0.25)},
    }
    points = report.plot.load_sweep(write_sweep(tmp_path, curves))[1]
    points["v1-i1"][2] = [r for r in points["v1-i1"][2] if r["step"] <= 10]  # in progress
    v10, mask, reuse = report.claims(points)
    for claim, diffs in ((v10, [0.02, 0.03]), (mask, [0.1, 0.12]), (reuse, [0.3, 0.25])):
        assert claim.decided_by[0].at == "step 50", claim.text
        assert claim.decided_by[0].iv.diffs == pytest.approx(diffs), claim.text


def test_the_v_sweep_compares_runs_at_the_end_and_lists_a_run_in_progress_apart(tmp_path):
    """--partial mid v-sweep: v2's seed 1 has been evaluated up to step 20 only. Its pass@1 there is
    not a pass@1 after the same iterations: the table lists it apart, and the means (and the figure's)
    are over the runs evaluated at step 50."""
    def run(v, last_step, final):
        return [{"step": s, "eval/pass@1": final if s == last_step else 0.2, "eval/weights_version": s // v}
                for s in range(0, last_step + 1, 10)]

    by_v = {1: {0: run(1, 50, 0.8), 1: run(1, 50, 0.9)}, 2: {0: run(2, 50, 0.7), 1: run(2, 20, 0.4)}}
    end, done, going = report.at_the_end(by_v)
    assert end == 50 and [len(done[v]) for v in (1, 2)] == [2, 1] and [len(going[v]) for v in (1, 2)] == [0, 1]
    table = report.vsweep_table(by_v).splitlines()
    assert table[0] == "| v | runs at step 50 | pass@1 at step 50 (mean, min-max) | pushes | in progress (step: pass@1) |"
    assert table[2:] == ["| 1 | 2 | 0.850 (0.800-0.900) | 50.0 | - |", "| 2 | 1 | 0.700 (0.700-0.700) | 25.0 | 20: 0.400 |"]
    report.plot_vsweep(by_v, tmp_path / "v.png", "v-sweep")
    assert (tmp_path / "v.png").stat().st_size > 0
