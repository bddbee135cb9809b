"""scripts/fig2_power.py: the power of the Fig. 2 replica's pre-set tests, checked against values
computed by hand or read from tables, and the design file against what the sizing rule picks and
against what `make replicate` runs."""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fig2_power as power  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402


def test_power_of_the_paired_t_interval_by_hand():
    # d = 1, n = 10, a two-sided 95% interval: 0.8031 (G*Power's one-sample t test, two tails; the lower
    # tail's share is ~1e-6); n = 9: 0.7480. At a true difference on the threshold the lower end clears
    # it with probability 0.025, the interval's one-sided level.
    assert power.power(10, 1.0, 1.0, 0.0, 0.95) == pytest.approx(0.8031, abs=5e-4)
    assert power.power(9, 1.0, 1.0, 0.0, 0.95) == pytest.approx(0.7480, abs=5e-4)
    assert power.power(6, 0.05, -0.05, -0.05, 0.95) == pytest.approx(0.025, abs=1e-6)
    # large n: the normal approximation Phi(d sqrt(n) - z_0.975) (n = 400, d = 0.14: Phi(0.8400) = 0.7995)
    assert power.power(400, 1.0, 0.14, 0.0, 0.95) == pytest.approx(0.7995, abs=3e-3)
    # a non-inferiority test is the same test shifted: threshold -m at a true difference 0 = threshold 0 at +m
    assert power.power(10, 0.05, 0.0, -0.05, 0.95) == pytest.approx(power.power(10, 0.05, 0.05, 0.0, 0.95))
    assert power.seeds_for(1.0, 1.0, 0.0, 0.95, 0.80) == 10
    # the difference 10 seeds see with 80% power at sd 1: just under d = 1 (whose power is 0.8031)
    assert 0.9 < power.detectable(10, 1.0, 0.0, 0.95, 0.80) < 1.0


def test_flat_drawdown_of_two_checkpoints_has_its_closed_form():
    """Two checkpoints: D = max(0, X1 - X2), X1 - X2 ~ N(0, 2): mean 1/sqrt(pi), E D^2 = 1, variance 1 - 1/pi."""
    mean, var = power.flat_drawdown(2)
    assert mean == pytest.approx(1 / math.sqrt(math.pi), abs=0.01)
    assert var == pytest.approx(1 - 1 / math.pi, abs=0.01)
    assert power.flat_drawdown(5)[0] == pytest.approx(1.88, abs=0.01)  # the design's floor factor (docs/fig2_design.md)


def test_the_pilot_spreads_by_hand():
    spreads = power.pilot_spreads((10, 20, 30, 40, 50))
    # v10-i1 - v1-i1 per seed, the mean of steps 10-50: -0.134, -0.0888, -0.0386: sd 0.0477
    assert spreads["learning v10-i1 - v1-i1"].sd == pytest.approx(0.0477, abs=1e-4)
    # the drawdown's interval +0.102 [-0.032, +0.236] over 3 seeds: sd = 0.134 sqrt(3) / t(0.975, 2) = 0.0539
    assert spreads["drawdown v1-i1 - v1-i1-mask"].sd == pytest.approx(0.134 * math.sqrt(3) / 4.3027, abs=1e-4)
    # the pilot eval's binomial variance of one seed's L difference: (sum over both arms' levels of p(1-p)) / 160 / 25
    levels = power.PILOT["levels"]
    pq = sum(levels[a][s] * (1 - levels[a][s]) for a in ("v1-i1", "v10-i1") for s in (10, 20, 30, 40, 50))
    assert spreads["learning v10-i1 - v1-i1"].eval_var_pilot == pytest.approx(pq / 160 / 25)
    assert power.binomial_var([0.5, 0.9], 400) == pytest.approx((0.25 + 0.09) / 400)
    # the eval explains all of the mask's spread: its between-seed part cannot be estimated
    assert spreads["learning v1-i1-mask - v1-i1"].between_seed_var() is None
    # 5 evals of 160 completions cost 15.7 - 12.6 = 3.1 min: 0.2325 s a completion
    assert power.eval_minutes_per_sample() * 60 == pytest.approx(0.2325)


def test_the_design_file_holds_what_the_rule_picks():
    """A change to the pilot's numbers, the rule or the design file that breaks the design shows here."""
    design = power.load_design()
    assert power.choose_eval_k(design) == design.k == 16
    assert power.choose_seeds(design) == len(design.seeds) == 10
    c1 = next(p for p in power.plan(design) if p.test.id == "c1")
    assert c1.power >= design.power > power.power(len(design.seeds) - 1, c1.sd, 0.0, -design.margin, design.level)


def test_the_drift_threshold_by_hand():
    """drift-push pushes before batch k once the batch before showed tv_staleness >= the threshold. With the
    pilot's staleness by lag (0, 0.0204, 0.0382, 0.0514, ...): at 0.03 the lag-2 batch crosses, so a push
    before every 3rd batch (3, 6, ..., 48) and one more at the end: 17; its evals right after the first push at
    or after 10, 20, 30, 40 (12, 21, 30, 42) and at 50. At 0.045 the lag-3 batch: every 4th, 12 + 1. A
    threshold no lag reaches: the ceiling of 10 iterations, v10-i1's 5 pushes and checkpoints."""
    plan = power.drift_plan(0.03, 50, 10)
    assert plan.pushes == tuple(range(3, 50, 3)) and plan.total_pushes == 17 and plan.eval_steps == (12, 21, 30, 42, 50)
    plan = power.drift_plan(0.045, 50, 10)
    assert plan.pushes == tuple(range(4, 50, 4)) and plan.total_pushes == 13 and plan.eval_steps == (12, 20, 32, 40, 50)
    plan = power.drift_plan(0.2, 50, 10)
    assert plan.pushes == (10, 20, 30, 40) and plan.total_pushes == 5 and plan.eval_steps == (10, 20, 30, 40, 50)
    # the rule: halfway between neighbouring lags, the pushes nearest sqrt(50 x 5) = 15.8 in ratio: 17 (every 3rd;
    # every 2nd gives 25, every 4th 13), so (0.0204 + 0.0382) / 2 = 0.0293, 0.03 to two decimals; the design holds it
    design = power.load_design()
    chosen = power.choose_drift_threshold(design)
    assert (chosen.threshold, chosen.total_pushes) == (0.03, 17)
    assert float(design.setting("drift-push", "push.tv_threshold")) == chosen.threshold
    assert design.setting("drift-push", "push.max_interval") == "10"  # never fewer pushes than v10-i1
    assert design.checkpoints[-1] // 10 < chosen.total_pushes < design.checkpoints[-1]


def test_an_arm_can_wait_as_pending(tmp_path):
    """An arm whose overrides do not exist yet is `pending`: not run, its tests pending, the rest unchanged."""
    raw = yaml.safe_load(power.DESIGN.read_text())
    raw["arms"]["drift-push"]["pending"] = "needs a push policy"
    path = tmp_path / "design.yaml"
    path.write_text(yaml.safe_dump(raw))
    design = power.load_design(path)
    assert "drift-push" not in design.runnable() and "lag1" in design.runnable()
    tests = {t.id: t for t in power.TESTS}
    assert tests["f1"].pending(design) == tests["f2"].pending(design) == "needs a push policy"
    assert tests["e1"].pending(design) is None and tests["c1"].pending(design) is None


def test_replicate_runs_the_design(tmp_path):
    """The Makefile's replicate target and configs/cpu_fig2.yaml say what the design file says: its
    seeds, its runnable arms and their overrides, its sweep names, its eval and its checkpoints, and
    one precision (fp32) for every run whatever the CPU."""
    design = power.load_design()
    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    var = {m[1]: m[2].strip() for m in re.finditer(r"^([A-Z0-9_]+) := (.*)$", make, re.M)}
    assert [int(s) for s in var["FIG2_SEEDS"].split(",")] == list(design.seeds)
    assert [int(s) for s in var["VSWEEP_SEEDS"].split(",")] == list(design.vsweep_seeds)
    points = [p.split() for p in var["FIG2"].split("--point ")[1:]]
    assert {p[0]: tuple(p[1:]) for p in points} == design.runnable() and [p[0] for p in points] == list(design.runnable())
    assert var["FIG2_DESIGN"] == str(design.path.relative_to(ROOT))
    recipe = make[make.index("\nreplicate:"):make.index("\nbench:")]
    assert f"--name {design.sweep} --seeds $(FIG2_SEEDS)" in recipe
    assert f"--name {design.vsweep} --seeds $(VSWEEP_SEEDS)" in recipe
    for arm, overrides in design.runnable().items():  # each arm's overrides load on the config (as train.py --check)
        loaded = load_config(TrainConfig, ROOT / "configs" / "cpu_fig2.yaml", list(overrides))
        assert (loaded.grpo.lag, loaded.push.policy) == ((1, "every_v") if arm == "lag1" else (0, "drift")
                                                          if arm == "drift-push" else (0, "every_v"))
        # one arithmetic on every CPU a sitting lands on: auto would train and serve bf16 on AMX, fp32 on AVX2
        assert (loaded.model.dtype, loaded.server.dtype) == ("float32", "float32"), arm
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_fig2.yaml").read_text())
    assert (cfg["eval"]["n_problems"], cfg["eval"]["k"]) == (design.n_problems, design.k)
    assert cfg["eval_data"]["arithmetic"]["eval_size"] == design.n_problems  # all of the held-out sums
    assert list(range(cfg["eval_every"], cfg["grpo"]["M"] + 1, cfg["eval_every"])) == list(design.checkpoints)


def test_the_cli_prints_the_plan_and_a_json_line(capsys):
    assert power.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert (last["chosen_eval_k"], last["chosen_seeds"], last["eval_samples"]) == (16, 10, 1600)
    assert last["tests"]["c1"]["power"] == pytest.approx(0.838, abs=1e-3)
    assert all(t["pending"] is None for t in last["tests"].values())
    assert last["tests"]["f1"]["power"] == last["tests"]["e1"]["power"] == last["tests"]["c1"]["power"]
    assert (last["drift"]["chosen_threshold"], last["drift"]["design_threshold"], last["drift"]["pushes"]) == (0.03, 0.03, 17)
    assert any(line.startswith("| c1 | primary | 0.0477 |") for line in out)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("margin"), "missing key 'margin'"),
    (lambda d: d.update(seeds=[1]), "seeds: expected two or more distinct integers"),
    (lambda d: d.update(level=95), "level: expected a number in (0, 1)"),
    (lambda d: d.update(warmup=3), "unknown key 'warmup'"),
    (lambda d: d["arms"]["lag1"].pop("overrides"), "arms: lag1: expected {what: TEXT, overrides:"),
])
def test_a_bad_design_file_is_one_line_and_exit_2(tmp_path, capsys, edit, message):
    raw = yaml.safe_load(power.DESIGN.read_text())
    edit(raw)
    path = tmp_path / "design.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert power.main(["--design", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fig2_power.py: error: {path}: ") and message in err and len(err.splitlines()) == 1
