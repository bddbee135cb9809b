"""scripts/fig2_report.py: every pre-set test of the Fig. 2 replica decided from a sweep's runs
(synthetic run directories laid out as scripts/sweep.py and train.py lay them out: metrics.jsonl,
config.yaml, provenance.jsonl, final/), the runs it cannot count named, and the page built from them."""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fig2_report as report  # noqa: E402

DESIGN = report.design_lib.load_design()
HEAD = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
OVERRIDES = {**{arm: list(overrides) for arm, overrides in DESIGN.runnable().items()}, "v2": ["grpo.v=2"]}
GRID = [0, 10, 20, 30, 40, 50]


def drift_pushes(seed: int) -> list[int]:
    """The batches a synthetic drift-push run pushes before: every 3rd at even seeds, every 4th at odd ones."""
    return list(range(3 if seed % 2 == 0 else 4, 50, 3 if seed % 2 == 0 else 4))


def eval_steps(arm: str, seed: int) -> list[int]:
    if arm == "drift-push":  # right after the first push at or after each multiple of 10, and at the end
        pushes = drift_pushes(seed)
        return [0] + [min(p for p in pushes if p >= c) for c in (10, 20, 30, 40)] + [50]
    return [0, 5] if arm == "v1-i1-b5" else GRID


def pushes_at(arm: str, step: int, seed: int) -> int:
    if arm == "drift-push":  # the pushes before batches up to `step`; at the end train.finish pushes once more
        return len([p for p in drift_pushes(seed) if p <= step]) + (step == 50)
    return step // 10 if arm in ("v10-i1", "v1-i10") else step // 2 if arm == "v2" else step


def write_run(sweep: Path, arm: str, seed: int, f, *, finished=True, commit=HEAD, dirty=False, k=16,
              provenance=True, started=None, last_step=None, tree=None, starts=1, attempts=1):
    """A run of `arm` at `seed` whose held-out pass@1 at step s is f(s); for v10-i1, train rows with the
    lag instruments. A finished run's record (logs/<run>.json) counts `attempts` of 60 s in all; `starts` > 1:
    the attempts before the last were cut off with the sweep (a start each in provenance.jsonl)."""
    run = sweep / f"{arm}-s{seed}"
    run.mkdir(parents=True)
    if finished:
        (run / "final").mkdir()
        (sweep / "logs").mkdir(exist_ok=True)
        (sweep / "logs" / f"{run.name}.json").write_text(json.dumps({"wall_s": 60.0, "attempts": attempts, "exit": 0}))
    rows = []
    for step in eval_steps(arm, seed):
        if last_step is not None and step > last_step:
            break
        rows.append({"step": step, "eval/pass@1": f(step), "eval/weights_version": pushes_at(arm, step, seed),
                     "eval/n_samples": 100 * k})
        if arm == "drift-push":  # its batches after this eval, up to the next: lag, drift, the push's reason
            pushes = drift_pushes(seed)
            for i in range(step, min([s for s in eval_steps(arm, seed) if s > step], default=50)):
                lag = i - max([0] + [p for p in pushes if p <= i])
                rows.append({"step": i + 1, "iteration": i, "sgd_iteration": 0, "loss": 0.0, "alpha_lag_steps": lag,
                             "weights_version": pushes_at(arm, i, seed), "tv_staleness": 0.02 * lag,
                             **({"push_reason": "drift"} if i in pushes else {})})
        if arm == "v10-i1" and step < 50:
            for i in range(step, step + 10):
                lag = i % 10
                rows.append({"step": i + 1, "iteration": i, "sgd_iteration": 0, "loss": 0.0, "alpha_lag_steps": lag,
                             "weights_version": i // 10, "reward_mean": 0.5, "tv_staleness": 0.01 * lag,
                             "tv_mismatch": 0.002, "tv_pik_alpha": 0.002 + 0.01 * lag,
                             "is_weight_ess": 1 - 0.01 * lag, "clip_frac_adv_pos": 0.0,
                             "clip_frac_adv_neg": 0.001 * lag, "bound_M": 2.0, "bound_M_nonzero": 1.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "eval": {"n_problems": 100, "k": k}}))
    if provenance:
        start = time.time() if started is None else started
        line = {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start)), "started_unix": start,
                "commit": commit, "dirty": dirty, "changed": ["train.py"] if dirty else [],
                "machine": {"cpu": "AMD EPYC 7B13", "cpu_kind": "AVX2 only", "cores": 2, "usable_cores": 2},
                **({"tree": tree} if tree else {})}
        (run / "provenance.jsonl").write_text((json.dumps(line) + "\n") * starts)
    return run


def write_sweep(root: Path, curves: dict, name: str = "fig2", seeds=DESIGN.seeds, overrides=OVERRIDES,
                **special) -> Path:
    """curves: {arm: f(seed) -> f(step) -> pass@1}: a counted run per arm and seed, except those named in
    `special` ({run name: write_run keyword arguments}, or None: not started); each arm run with `overrides`."""
    sweep = root / name
    runs = []
    for seed in seeds:
        for arm, curve in curves.items():
            runs.append({"name": f"{arm}-s{seed}", "point": arm, "seed": seed, "overrides": overrides[arm]})
            kwargs = special.get(f"{arm}-s{seed}", {})
            if kwargs is not None:
                write_run(sweep, arm, seed, curve(seed), **kwargs)
    manifest = {"name": name, "config": "configs/cpu_fig2.yaml", "seeds": list(seeds),
                "points": [{"name": a, "overrides": overrides[a]} for a in curves], "runs": runs}
    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    return sweep


def rising(top: float, start: float = 0.2, speed: float = 0.1, dip=None, noise=0.0):
    """A curve rising from `start` toward `top` at rate `speed` per step, with `noise` varying by seed and a dip."""
    def per_seed(seed):
        def f(step):
            p = top - (top - start) * math.exp(-speed * step) + noise * ((seed * 7 + step) % 5 - 2) / 2
            return min(1.0, max(0.0, p - (dip if dip and step == 30 else 0.0)))
        return f
    return per_seed


def offset(base, shift):
    """base's curve read anywhere (the straight line between its values at GRID, as the report reads an
    arm between its evals) plus shift(seed)."""
    def per_seed(seed):
        f = base(seed)

        def g(step):
            lo, hi = max(x for x in GRID if x <= step), min(x for x in GRID if x >= step)
            at = f(lo) if lo == hi else f(lo) + (f(hi) - f(lo)) * (step - lo) / (hi - lo)
            return at + shift(seed)
        return g
    return per_seed


def lag1_shift(seed):
    return -0.03 + 0.01 * (seed % 3)  # seeds 10-19: -0.02, -0.01, -0.03, ...: mean -0.02, sd sqrt(6e-4 / 9)


def drift_shift(seed):
    return -0.055 + 0.02 * (seed % 3 - 1)  # -0.055, -0.035, -0.075, ...: mean -0.055, sd sqrt(2.4e-3 / 9)


def standard(**changes) -> dict:
    v1_i1 = rising(0.85, dip=0.1, noise=0.01)
    curves = {"v1-i1": v1_i1, "v1-i1-b5": rising(0.85, noise=0.01),
              "v1-i1-mask": rising(0.95, noise=0.01), "v1-i1-beta0": rising(0.9, noise=0.01),
              "v10-i1": rising(0.86, speed=0.09, noise=0.01), "v1-i10": rising(0.6, speed=0.03, noise=0.02),
              "lag1": offset(v1_i1, lag1_shift), "drift-push": offset(v1_i1, drift_shift)}
    curves.update(changes)
    return curves


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (10, 2.228)])
def test_t_quantile_matches_the_tables(df, expected):
    assert report.t_quantile(0.975, df) == pytest.approx(expected, abs=2e-3)


def test_interval_and_verdicts_by_hand():
    iv = report.Interval.of([0.2, 0.25, 0.3])  # mean 0.25, sd 0.05, t(0.975, 2) = 4.303: 0.25 +- 0.124
    assert iv.mean == pytest.approx(0.25) and iv.hi - iv.mean == pytest.approx(4.303 * 0.05 / math.sqrt(3), abs=1e-3)
    assert report.verdict(iv) == report.HOLDS
    assert report.verdict(report.Interval.of([0.1, 0.2, 0.3])) == report.OPEN  # 0.2 +- 0.248 straddles 0
    assert report.verdict(report.Interval.of([-0.2, -0.25, -0.3])) == report.REFUTED
    assert report.verdict(report.Interval.of([0.5])) == report.OPEN  # one seed: no interval, nothing decided
    # "matches": threshold -margin
    assert report.verdict(report.Interval.of([-0.01, -0.02, -0.015]), -0.05) == report.HOLDS
    assert report.verdict(report.Interval.of([-0.2, -0.25, -0.22]), -0.05) == report.REFUTED
    assert report.all_of([report.HOLDS, report.HOLDS]) == report.HOLDS
    assert report.all_of([report.HOLDS, report.OPEN]) == report.OPEN
    assert report.all_of([report.OPEN, report.REFUTED]) == report.REFUTED
    assert report.all_of([report.REFUTED, report.MISSING]) == report.MISSING
    assert report.all_of(["pending: needs issue 49's modes", report.HOLDS]) == report.PENDING


def test_the_metrics_by_hand():
    rows = [{"step": s, "eval/pass@1": p, "eval/n_samples": 1600}
            for s, p in [(0, 0.2), (10, 0.6), (20, 0.8), (30, 0.7), (40, 0.9), (50, 0.8)]]
    at = [10, 20, 30, 40, 50]
    assert report.learning(rows, at) == pytest.approx(0.76)
    assert report.drawdown(rows, at) == pytest.approx(0.1)  # 0.8 -> 0.7 and 0.9 -> 0.8
    assert report.drawdown(rows, [10, 20, 30, 40, 60]) is None  # a checkpoint the run lacks
    t = {x.id: x for x in report.design_lib.TESTS}
    assert report.value(t["a1"], rows, DESIGN) == pytest.approx(0.76 - 0.2)
    floor = 1.88 * math.sqrt(0.76 * 0.24 / 1600)  # the flat curve's mean drawdown at this level
    assert report.value(t["a2"], rows, DESIGN) == pytest.approx(0.1 - floor, abs=2e-4)
    ends = rows + [{"step": 5, "eval/pass@1": 0.5, "eval/weights_version": 5}]
    assert report.value(t["d1"], ends, DESIGN) == 0.5
    assert report.value(t["d1"], rows, DESIGN) is None  # its last eval is not after 5 pushes
    # the eval's standard error of one seed's L difference: sqrt(sum of p(1-p) over both arms' checkpoints / 1600) / 5
    runs = {"v10-i1": [rows], "v1-i1": [rows]}
    se = report.eval_se(t["c1"], runs, DESIGN)
    assert se == pytest.approx(math.sqrt(2 * sum(p * (1 - p) for p in (0.6, 0.8, 0.7, 0.9, 0.8)) / 1600) / 5)


def test_an_arm_evaluated_off_the_checkpoints_is_compared_at_its_own_steps():
    """drift-push evaluates right after a push: at the first at or after each checkpoint. Its L is over those
    evals, and the arm it is tested against is read at the same steps, on the straight line between its
    evals: by hand, v1-i1 at 12 = 0.5 + 0.2 x (0.7 - 0.5) = 0.54, at 21 = 0.71, at 42 = 0.82."""
    at = [10, 20, 30, 40, 50]
    v1 = [{"step": s, "eval/pass@1": p} for s, p in [(0, 0.2), (10, 0.5), (20, 0.7), (30, 0.8), (40, 0.8), (50, 0.9)]]
    drift = [{"step": s, "eval/pass@1": p} for s, p in [(0, 0.2), (12, 0.6), (21, 0.7), (30, 0.8), (42, 0.8), (50, 0.9)]]
    assert report.checkpoint_evals(drift, at) == [(12, 0.6), (21, 0.7), (30, 0.8), (42, 0.8), (50, 0.9)]
    assert report.read_at(v1, [12, 21, 30, 42, 50]) == pytest.approx([0.54, 0.71, 0.8, 0.82, 0.9])
    assert report.learning(drift, at) == pytest.approx(0.76)
    # 0.76 - (0.54 + 0.71 + 0.8 + 0.82 + 0.9) / 5 = 0.76 - 0.754; at the checkpoints themselves it would be 0.02
    assert report.learning_difference(drift, v1, at) == pytest.approx(0.006)
    assert report.learning_difference(v1, v1, at) == 0.0  # an arm at the checkpoints: read at them, exactly
    assert report.checkpoint_evals(drift[:3], at) is None  # no eval of checkpoint 30 or later
    assert report.read_at(v1[:3], [21]) is None  # nothing after step 20 to read it on


def test_the_page_decides_every_pre_set_test_from_complete_runs(tmp_path):
    sweep = write_sweep(tmp_path, standard())
    vsweep = write_sweep(tmp_path, {"v2": rising(0.8)}, name="fig2-v", seeds=DESIGN.vsweep_seeds,
                         **{"v2-s12": {"finished": False, "last_step": 20}})
    out = tmp_path / "docs" / "fig2_cpu.md"
    assert report.main(["--sweep", str(sweep), "--vsweep", str(vsweep), "--out", str(out)]) == 0
    design = DESIGN
    loaded = report.load_sweep(sweep, design.runnable(), design.seeds, "--sweep")
    report.check_runs([loaded], design, HEAD)
    assert all(r.counted for r in loaded.runs.values())
    planned = {p.test.id: p for p in report.design_lib.plan(design)}
    decided = {t.id: report.decide(t, loaded, design, planned) for t in report.design_lib.TESTS}
    verdicts = {k: d.verdict for k, d in decided.items()}
    assert verdicts["a1"] == verdicts["a2"] == report.HOLDS  # learns; the 0.1 dip at step 30 is beyond noise
    assert verdicts["b1"] == verdicts["b2"] == report.HOLDS  # the mask is higher and never falls
    assert verdicts["c1"] == report.HOLDS  # v10-i1 a little slower, within the margin
    assert verdicts["c2"] == report.HOLDS
    assert verdicts["d2"] == report.HOLDS  # v1-i10 far behind per step
    assert verdicts["d1"] == report.REFUTED  # ...but ahead after the same 5 batches (the b5 arm is at step 5)
    assert verdicts["k1"] == report.HOLDS
    # The new arms, by hand. lag1 is v1-i1 + lag1_shift at the same steps: e1's differences are the shifts,
    # mean -0.02, half-width t(0.975, 9) sqrt(6e-4 / 9) / sqrt(10) = 2.262 x 0.002582 = 0.0058: above -0.05.
    seeds = DESIGN.seeds
    assert decided["e1"].iv.diffs == pytest.approx([lag1_shift(s) for s in seeds], abs=1e-9)
    assert (decided["e1"].iv.lo, decided["e1"].iv.hi) == pytest.approx((-0.0258, -0.0142), abs=1e-4)
    assert verdicts["e1"] == report.HOLDS
    # e2: + L(v1-i1) - L(v10-i1), the same at every seed (their seed noise is the same and cancels):
    # (0.6109 - 0.5917 + 0.7620 - 0.7509 + 0.7176 - 0.8156 + 0.8381 - 0.8420 + 0.8456 - 0.8527) / 5 = -0.0157
    # (v1-i1's dip of 0.1 at step 30): mean -0.0357 +- 0.0058, below 0: lag1 is not above v10-i1.
    assert decided["e2"].iv.diffs == pytest.approx([lag1_shift(s) - 0.01572 for s in seeds], abs=1e-4)
    assert verdicts["e2"] == report.REFUTED
    # drift-push is v1-i1 read on the straight line between its evals, + drift_shift, evaluated at 12, 21, 30,
    # 42, 50 (even seeds) or 12, 20, 32, 40, 50 (odd): v1-i1 read at those same steps, f1's differences are the
    # shifts: mean -0.055 +- 2.262 x 0.005164 = 0.0117: [-0.0667, -0.0433] straddles -0.05.
    assert decided["f1"].iv.diffs == pytest.approx([drift_shift(s) for s in seeds], abs=1e-9)
    assert verdicts["f1"] == report.OPEN
    # f2: + v1-i1 - v10-i1 read at drift-push's steps: at 12, 21, 30, 42, 50 (0.6411 - 0.6235 + 0.7576 - 0.7574
    # + 0.7176 - 0.8156 + 0.8396 - 0.8441 + 0.8456 - 0.8527) / 5 = -0.0184; at 12, 20, 32, 40, 50 (0.6411 - 0.6235
    # + 0.7620 - 0.7509 + 0.7417 - 0.8209 + 0.8381 - 0.8420 + 0.8456 - 0.8527) / 5 = -0.0123: mean -0.0703, its
    # interval wholly below -0.05.
    expected = [drift_shift(s) + (-0.01835 if s % 2 == 0 else -0.01227) for s in seeds]
    assert decided["f2"].iv.diffs == pytest.approx(expected, abs=1e-4)
    assert decided["f2"].iv.mean == pytest.approx(-0.0703, abs=1e-4) and decided["f2"].iv.hi < -0.05
    assert verdicts["f2"] == report.REFUTED
    claims = report.claim_verdicts(list(decided.values()))
    assert claims == {"a": report.HOLDS, "b": report.HOLDS, "c": report.HOLDS, "d": report.REFUTED,
                      "control": report.HOLDS, "lag1": report.HOLDS, "drift-push": report.OPEN}
    assert len(decided["c1"].iv.diffs) == 10 and decided["c1"].planned.power == pytest.approx(0.838, abs=1e-3)
    page = out.read_text()
    assert "80 of 80 runs of `fig2` counted" in page
    assert ("wall time of the runs: 82 min (each attempt as scripts/sweep.py records it; not in it: a start of the "
            "run the record does not count (an attempt cut off with the sweep, or running now), in v2-s12)") in page
    assert f"| **{report.design_lib.CLAIMS['c']}** | | | | | | **holds** | | |" in page
    assert "| | c1: off-policy v10-i1 matches or beats v1-i1" in page and "| 10 of 10 |" in page
    assert f"the runs' code commit: {HEAD}" in page and "2 x AMD EPYC 7B13 (AVX2 only) (82 starts)" in page
    assert "bbea659" in page and "6cd80e9" in page  # the first replica's rule, named
    design_commit = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", HEAD, "--",
                                    "configs/designs/fig2_cpu.yaml"], capture_output=True, text=True).stdout.strip()
    assert f"`configs/designs/fig2_cpu.yaml` fixed by: {design_commit} (" in page
    assert "design not traceable" not in page
    assert "| lag1 | 10 of 10 | - |" in page and "| drift-push | 10 of 10 | - |" in page
    # equal pushes, descriptive: drift-push's eval of checkpoint 10 at step 12 after 4 pushes (even seeds) or 3,
    # at the end 17 or 13; lag1 pushes as v1-i1 does; pushes by reason 16 or 12 a run
    assert "| drift-push | 10 | 10 | 12 (12-12) | 3.5 (3.0-4.0) |" in page
    assert "| drift-push | 20 | 10 | 20 (20-21) | 6.0 (5.0-7.0) |" in page
    assert "| drift-push | 50 | 10 | 50 (50-50) | 15.0 (13.0-17.0) |" in page
    assert "| lag1 | 30 | 10 | 30 (30-30) | 30.0 (30.0-30.0) |" in page
    assert "- drift-push: pushes by reason, per run: drift 14.0; tv_staleness of its batches: mean " in page
    assert ", max 0.06" in page
    assert "## Every checkpoint (descriptive)" in page and "| 9 | 0.5 +- 0 | 0.092 +- " in page  # the lag table
    # the v-sweep beside v1-i1 and v10-i1: v2's seeds 10 and 11 at step 50, seed 12 (at step 20) listed apart
    assert "| 2 | 2 | 0.796 (0.796-0.796) | 25.0 | 20: 0.719 |" in page
    assert "- c1 per seed: " + ", ".join(f"{x:+.3f}" for x in decided["c1"].iv.diffs) in page
    for figure in ("fig2_cpu.png", "fig2_cpu_lag.png", "fig2_cpu_vsweep.png", "fig2_cpu_pushes.png"):
        assert (out.parent / figure).stat().st_size > 0


def test_the_wall_time_names_the_runs_whose_cut_off_attempt_it_does_not_hold(tmp_path):
    """An attempt cut off with the sweep (the end of a sitting) leaves its start in provenance.jsonl; the run
    resumes under a later sweep. v1-i10-s13's record counts only the attempt that ended (as sweep.py's
    did before it counted cut-off attempts): named. lag1-s12's counts both (sweep.py's record_start): not
    named. The page's wall time holds the records' 80 runs of 60 s."""
    sweep = write_sweep(tmp_path, standard(), **{"v1-i10-s13": {"starts": 2}, "lag1-s12": {"starts": 2, "attempts": 2}})
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    page = out.read_text()
    assert "80 of 80 runs of `fig2` counted" in page  # a resumed run counts: its every start is at the commit
    assert ("wall time of the runs: 80 min (each attempt as scripts/sweep.py records it; not in it: a start of the "
            "run the record does not count (an attempt cut off with the sweep, or running now), in v1-i10-s13)") in page


def test_a_missing_run_is_named_and_its_tests_wait_for_it(tmp_path):
    """v10-i1-s11 stopped at step 40 (evaluated up to 30, no final/), v1-i10-s12 not started: every test of those arms says
    which run it misses instead of deciding over 9 seeds; the others are decided."""
    sweep = write_sweep(tmp_path, standard(), **{"v10-i1-s11": {"finished": False, "last_step": 30},
                                                 "v1-i10-s12": None})
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    page = out.read_text()
    assert "78 of 80 runs of `fig2` counted" in page
    assert "| v10-i1 | 9 of 10 | s11: stopped at step 40 |" in page and "| v1-i10 | 9 of 10 | s12: not started |" in page
    assert "- c1 missing: v10-i1-s11 (stopped at step 40)" in page
    assert "- d1 missing: v1-i10-s12 (not started)" in page
    assert "- f2 missing: v10-i1-s11 (stopped at step 40)" in page  # the new arms' tests against v10-i1 wait too
    assert "| | f1: the drift-driven push policy matches v1-i1" in page and "- f1 per seed: " in page  # f1 has them all
    assert "| | c1: off-policy v10-i1 matches or beats v1-i1: mean pass@1 over the checkpoints, not below by the " \
           "margin | `L(v10-i1) - L(v1-i1)` | 9 of 10 |" in page
    rows = [line for line in page.splitlines() if line.startswith("| | c1:") or line.startswith("| | b1:")]
    assert "| missing runs |" in rows[1] and "| holds |" in rows[0]  # b1 comes first: it has every run
    assert f"| **{report.design_lib.CLAIMS['c']}** | | | | | | **missing runs** |" in page


def test_runs_of_another_commit_a_changed_checkout_or_another_eval_are_not_counted(tmp_path):
    other = "0123456789abcdef0123456789abcdef01234567"
    sweep = write_sweep(tmp_path, standard(), **{
        "v1-i1-mask-s13": {"commit": other}, "v1-i1-beta0-s14": {"dirty": True},
        "v1-i10-s15": {"provenance": False}, "v10-i1-s16": {"k": 4},
        "v1-i1-s10": {"started": time.time() - 3600}})  # the earliest start: its commit is the replica's
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    page = out.read_text()
    assert f"s13: ran 0123456, not the replica's {HEAD[:7]}" in page
    assert "s14: a changed checkout (train.py)" in page
    assert "s15: no provenance.jsonl (run before train.py recorded its commit)" in page
    assert "s16: eval 100 x 4, not the design's 100 x 16" in page
    assert "76 of 80 runs of `fig2` counted" in page
    for test in ("b1", "k1", "d1", "c1"):
        assert f"- {test} missing: " in page


def test_runs_whose_commit_left_the_history_are_read_at_the_commit_with_their_files(tmp_path):
    # every run recorded a commit since rewritten (squashed, rebased): not in this history
    lost = "fedcba9876543210fedcba9876543210fedcba98"
    tree = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD^{tree}"], capture_output=True,
                          text=True).stdout.strip()
    same = report.commit_with_tree(tree)
    assert same and subprocess.run(["git", "-C", str(ROOT), "rev-parse", f"{same}^{{tree}}"], capture_output=True,
                                   text=True).stdout.strip() == tree
    curves = standard()
    for recorded, traceable in ((tree, True), ("0" * 40, False), (None, False)):
        sweep = write_sweep(tmp_path / str(recorded), curves, **{
            f"{arm}-s{seed}": {"commit": lost, "tree": recorded} for arm in curves for seed in DESIGN.seeds})
        out = tmp_path / str(recorded) / "page.md"
        assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
        page = out.read_text()
        assert "80 of 80 runs of `fig2` counted" in page  # one commit for all: each run is the replica's
        if traceable:
            assert f"not in this history, whose {same[:7]} has the same files" in page
            assert "design not traceable" not in page and "- `configs/designs/fig2_cpu.yaml` fixed by: " in page
        else:
            assert f"**design not traceable**: the runs' commit {lost[:7]} is not in this repository's history" in page
            assert ("nor is a commit with their files (tree 0000000)" in page) == (recorded is not None)


def test_a_design_changed_after_the_first_run_started_is_flagged(tmp_path):
    sweep = write_sweep(tmp_path, standard(), **{"v1-i1-s10": {"started": 1_000_000.0}})  # 1970
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    assert "- **design not traceable**: configs/designs/fig2_cpu.yaml changed at " in out.read_text()
    assert "after the first run started (1970-01-12 13:46 UTC): the design was not fixed before its runs" \
        in out.read_text()


def test_a_sweep_of_other_seeds_or_arms_is_refused(tmp_path, capsys):
    sweep = write_sweep(tmp_path, standard(), seeds=(0, 1, 2))
    assert report.main(["--sweep", str(sweep), "--out", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fig2_report.py: error: {sweep}/sweep.json: seeds [0, 1, 2] are not the design's {list(DESIGN.seeds)}"
    curves = standard()
    del curves["v1-i1-beta0"]
    sweep = write_sweep(tmp_path, curves, name="other")
    assert report.main(["--sweep", str(sweep), "--out", str(tmp_path / "p.md")]) == 2
    assert "points ['v1-i1', 'v1-i1-b5', 'v1-i1-mask', 'v10-i1', 'v1-i10', 'lag1', 'drift-push'] are not the " \
           "design's arms" in capsys.readouterr().err
    # the same arms with another drift threshold: another design's sweep, refused
    other = ["push.policy=drift", "push.tv_threshold=0.05", "push.max_interval=10"]
    sweep = write_sweep(tmp_path, standard(), name="threshold", overrides={**OVERRIDES, "drift-push": other})
    assert report.main(["--sweep", str(sweep), "--out", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fig2_report.py: error: {sweep}/sweep.json: point drift-push ran push.policy=drift "
                   "push.tv_threshold=0.05 push.max_interval=10, not the design's push.policy=drift "
                   "push.tv_threshold=0.03 push.max_interval=10")


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


def test_the_v_sweep_compares_runs_at_the_end_and_lists_a_run_in_progress_apart(tmp_path):
    """v2's seed 1 has been evaluated up to step 20 only. Its pass@1 there is not a pass@1 after the same
    iterations: the table lists it apart, and the means (and the figure's) are over the runs evaluated at
    step 50."""
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


def test_a_part_way_sweep_whose_seeds_share_a_step_0_eval_is_plotted(tmp_path):
    """Three seeds of each arm, all evaluating the one starting model to 0.231875 at step 0: their float
    mean lies an ulp below that (0.231875 * 3 / 3), and the spread bar's lower half came out negative,
    which matplotlib refuses. The mean of equal values is that value: the page and its figures are written."""
    started = (10, 11, 12)
    not_started = {f"{arm}-s{seed}": None for arm in standard() for seed in DESIGN.seeds if seed not in started}
    sweep = write_sweep(tmp_path, {arm: rising(0.85, start=0.231875) for arm in standard()}, **not_started)
    out = tmp_path / "page.md"
    assert report.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    assert f"{3 * len(standard())} of {len(DESIGN.seeds) * len(standard())} runs of `fig2` counted" in out.read_text()
