"""The pre-set design of the CPU replica of Fig. 2: its tests, its statistics, and its power.

    python scripts/fig2_power.py                       # the plan of configs/designs/fig2_cpu.yaml
    python scripts/fig2_power.py --design FILE         # another design file

Prints, for every pre-set test (docs/fig2_design.md), the planning standard deviation taken from
the first replica's runs (PILOT below: three seeds, an eval of 40 sums x 4 samples), the eval's
binomial share of it at the design's eval size, and the power at the design's seeds; then the eval
size and the seeds that the sizing rule below picks from those numbers, what they cost on 2 cores,
and a final line of JSON with all of it. The design file must hold the eval size and the seeds
the rule picks (tests/test_fig2_power.py checks that), so a change to the pilot's numbers or to
the rule shows up as a design that no longer follows from them.

The drift-push arm's threshold follows a rule too (`choose_drift_threshold`): the pilot's tv_staleness by
lag, run through the push policy's own decisions, predicts its pushes; the design file's threshold
must be the one the rule picks.

The sizing rule, fixed with the design:
  eval  all held-out problems x the smallest k of EVAL_K whose binomial variance is at most
        EVAL_SHARE of the planning variance of every primary test whose between-seed variance the
        pilot can estimate (its observed variance minus its eval's binomial variance, when positive);
  seeds the fewest seeds that give "v10-i1 matches v1-i1" (test c1) at least the design's power
        if it is true (a difference of exactly 0), at the planning standard deviation as measured
        (the pilot's spread at its smaller eval: a larger eval can only lower it).

The test of every row: the seeds' paired differences, the mean and its two-sided `level` Student
t interval (n - 1 degrees of freedom); the claim holds when the interval lies above its threshold
(0, or -margin for "matches"), does not hold when it lies below, and is not resolved when it
straddles. Power is that of the interval's lower end clearing the threshold, computed from the
noncentral t distribution (no scipy on these machines: the integral is done by Simpson's rule).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import sys
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo.push_policy import PushConfig, PushSchedule  # noqa: E402  (the drift-push arm's own decisions)

DESIGN = ROOT / "configs" / "designs" / "fig2_cpu.yaml"

EVAL_K = (4, 8, 16, 32)  # samples per problem the rule chooses from (the issue: 16-32 over all problems)
EVAL_SHARE = 0.10  # the eval's binomial variance: at most this share of a primary test's planning variance
MAX_SEEDS = 60


class DesignError(Exception):
    """A design file this script cannot read; the message names the file and the key."""


# ---------------------------------------------------------------------------------------------
# the first replica's numbers (the pilot of this design)

PILOT = {
    "source": "docs/fig2_cpu.md at b30a775 (12 runs of Fig. 2, seeds 0-2, commits bbea659 + 6cd80e9 "
              "fixed the rule) and its figure docs/fig2_cpu.png",
    "eval_samples": 160,  # 40 held-out sums x 4 samples per checkpoint
    "seeds": [0, 1, 2],
    # per seed (0, 1, 2): the paired difference of held-out pass@1 at each optimizer step ("Every shared checkpoint")
    "diffs": {
        "v10-i1 - v1-i1": {10: [-0.394, -0.344, -0.150], 20: [-0.169, 0.000, -0.062], 30: [-0.113, -0.094, -0.006],
                           40: [0.037, -0.019, 0.031], 50: [-0.031, 0.013, -0.006]},
        "v1-i1-mask - v1-i1": {10: [0.019, -0.025, 0.088], 20: [0.050, 0.131, 0.031], 30: [-0.050, 0.094, 0.081],
                               40: [0.137, 0.056, 0.075], 50: [0.112, 0.062, 0.144]},
        "v1-i1 - v1-i10": {10: [0.569, 0.637, 0.387], 20: [0.469, 0.419, 0.350], 30: [0.469, 0.575, 0.406],
                           40: [0.000, 0.519, 0.400], 50: [0.106, 0.350, 0.344]},
    },
    # v10-i1 after its 5 pushes (step 50) against v1-i1 after 5 pushes (step 5), per seed
    "pushes_5": {"v10-i1 - v1-i1": [0.119, 0.219, 0.394]},
    # drawdown(v1-i1) - drawdown(v1-i1-mask) over the shared checkpoints: the page kept the mean and
    # its 95% t interval only (the per-seed values are in the runs, not on this machine)
    "drawdown": {"v1-i1 - v1-i1-mask": (0.102, -0.032, 0.236)},
    # mean pass@1 over the seeds, read off docs/fig2_cpu.png (+- 0.02): the levels the binomial error is taken at
    "levels": {
        "v1-i1": {0: 0.195, 5: 0.61, 10: 0.82, 20: 0.82, 30: 0.90, 40: 0.85, 50: 0.86},
        "v1-i1-mask": {0: 0.195, 10: 0.845, 20: 0.89, 30: 0.94, 40: 0.935, 50: 0.965},
        "v10-i1": {0: 0.195, 10: 0.52, 20: 0.74, 30: 0.825, 40: 0.865, 50: 0.85},
        "v1-i10": {0: 0.195, 10: 0.29, 20: 0.41, 30: 0.41, 40: 0.54, 50: 0.59},
    },
    # wall minutes per run (mean over 3 seeds, every attempt; "Per setting") and its evals: on a
    # 2-core AMD EPYC (AVX2, fp32) shared with other work, so an upper bound for a quiet machine
    "run_minutes": {"v1-i1": (15.7, 11), "v1-i1-mask": (12.6, 6), "v10-i1": (14.1, 6), "v1-i10": (6.4, 6)},
    # v10-i1's tv_staleness (TV(pi_k, pi_push) on the batch's first pass) at lags 0-9 of its window, mean over
    # the seeds ("Inside a v-window: v10-i1 by lag"): what drift-push's threshold is picked from
    "tv_staleness_by_lag": [0.0, 0.0204, 0.0382, 0.0514, 0.0669, 0.0698, 0.0753, 0.0863, 0.0906, 0.0913],
}


def eval_minutes_per_sample(pilot: dict = PILOT) -> float:
    """Minutes one eval completion costs: v1-i1 (11 evals) and v1-i1-mask (6) differ in nothing
    else that costs time, so their difference is 5 evals of the pilot's size."""
    (plain, n_plain), (mask, n_mask) = pilot["run_minutes"]["v1-i1"], pilot["run_minutes"]["v1-i1-mask"]
    return (plain - mask) / (n_plain - n_mask) / pilot["eval_samples"]


# ---------------------------------------------------------------------------------------------
# statistics

def normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom: the density integrated
    by Simpson's rule and the quantile bracketed by bisection."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # P(T <= x) for x >= 0
        n = 400
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


@functools.lru_cache(maxsize=None)
def _chi_grid(df: int) -> tuple[tuple[float, float], ...]:
    """Simpson's nodes of noncentral_t_sf's integral for df: (weight x h / 3 x chi density at u,
    u / sqrt(df)), u = sqrt(V) on [0, sqrt(df) + 12]. The same for every c and ncp, so computed
    once per df (a power search evaluates thousands of (c, ncp) at a handful of df)."""
    log_norm = (1 - df / 2) * math.log(2) - math.lgamma(df / 2)
    top = math.sqrt(df) + 12.0
    n = 600
    h = top / n
    nodes = []
    for j in range(n + 1):
        u = j * h
        density = 0.0 if u == 0 else math.exp(log_norm + (df - 1) * math.log(u) - u * u / 2)
        nodes.append(((1 if j in (0, n) else 4 if j % 2 else 2) * density * h / 3, u / math.sqrt(df)))
    return tuple(nodes)


def noncentral_t_sf(c: float, df: int, ncp: float) -> float:
    """P(T > c) for T = (Z + ncp) / sqrt(V / df), Z standard normal, V chi-square(df): the integral
    over u = sqrt(V) of the chi density times P(Z > c u / sqrt(df) - ncp), by Simpson's rule."""
    return sum(w * normal_cdf(ncp - c * x) for w, x in _chi_grid(df) if w)


@functools.lru_cache(maxsize=None)  # a pure function of numbers; the report asks the same ones per sweep
def power(n: int, sd: float, effect: float, threshold: float, level: float) -> float:
    """The chance that the two-sided `level` t interval of the mean of n paired differences lies
    above `threshold` when the differences have mean `effect` and standard deviation `sd`."""
    if n < 2:
        return 0.0
    c = t_quantile(0.5 + level / 2, n - 1)
    return noncentral_t_sf(c, n - 1, (effect - threshold) * math.sqrt(n) / sd)


def seeds_for(sd: float, effect: float, threshold: float, level: float, target: float) -> Optional[int]:
    """The fewest seeds (>= 2) whose power reaches `target`; None past MAX_SEEDS."""
    return next((n for n in range(2, MAX_SEEDS + 1) if power(n, sd, effect, threshold, level) >= target), None)


def detectable(n: int, sd: float, threshold: float, level: float, target: float) -> float:
    """The smallest true difference whose power reaches `target` with n seeds (bisection on the power,
    which rises with the difference)."""
    lo, hi = threshold, threshold + 20 * sd
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(n, sd, mid, threshold, level) < target else (lo, mid)
    return hi


def sample_sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def binomial_var(levels: list[float], samples: int) -> float:
    """The eval's binomial variance of sum(pass@1 over `levels`), each estimated from `samples`
    completions: an upper bound on a fixed set of problems (their different difficulties make it
    smaller) and for a paired difference (both evals draw the same sampling seeds)."""
    return sum(p * (1 - p) for p in levels) / samples


@functools.lru_cache(maxsize=None)
def flat_drawdown(checkpoints: int, draws: int = 100_000) -> tuple[float, float]:
    """(mean, variance) of the drawdown of a flat curve whose checkpoints carry only independent
    standard normal noise: in units of the eval's standard error (resp. its square). Monte Carlo
    with a fixed seed; two checkpoints have the closed form (1 / sqrt(pi), 1 - 1 / pi)."""
    rng = random.Random(0)
    total = total_sq = 0.0
    for _ in range(draws):
        peak, worst = -math.inf, 0.0
        for _ in range(checkpoints):
            x = rng.gauss(0.0, 1.0)
            peak = max(peak, x)
            worst = max(worst, peak - x)
        total += worst
        total_sq += worst * worst
    mean = total / draws
    return mean, total_sq / draws - mean * mean


# ---------------------------------------------------------------------------------------------
# the design file

@dataclasses.dataclass(frozen=True)
class Design:
    path: Path
    sweep: str
    vsweep: str
    seeds: tuple[int, ...]
    vsweep_seeds: tuple[int, ...]
    n_problems: int
    k: int
    checkpoints: tuple[int, ...]
    equal_samples: int  # batches: v1-i10 after these against v1-i1 after these
    margin: float
    level: float
    power: float
    arms: dict  # name -> {"what": ..., "overrides": "key=value ...", "pending": reason (absent when the arm can run)}

    @property
    def eval_samples(self) -> int:
        return self.n_problems * self.k

    def runnable(self) -> dict[str, tuple[str, ...]]:
        """{arm: its overrides} of the arms that can run: the Makefile's FIG2 points, in order."""
        return {a: tuple(spec["overrides"].split()) for a, spec in self.arms.items() if not spec.get("pending")}

    def setting(self, arm: str, key: str) -> Optional[str]:
        """The value an arm's overrides give `key` (None: the config's)."""
        found = [o.partition("=")[2] for o in self.arms[arm]["overrides"].split() if o.partition("=")[0] == key]
        return found[-1] if found else None


def load_design(path: Path = DESIGN) -> Design:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise DesignError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise DesignError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise DesignError(f"{path}: expected a mapping of design keys")
    known = {"sweep", "vsweep", "seeds", "vsweep_seeds", "eval", "checkpoints", "equal_samples", "margin", "level", "power", "arms"}
    for key in sorted(set(raw) - known):
        raise DesignError(f"{path}: unknown key {key!r}")
    for key in sorted(known - set(raw)):
        raise DesignError(f"{path}: missing key {key!r}")
    ev = raw["eval"]
    if not isinstance(ev, dict) or set(ev) != {"n_problems", "k"}:
        raise DesignError(f"{path}: eval: expected n_problems and k")
    for key in ("seeds", "vsweep_seeds"):
        seeds = raw[key]
        if not isinstance(seeds, list) or len(seeds) < 2 or not all(isinstance(s, int) for s in seeds) \
                or len(set(seeds)) != len(seeds):
            raise DesignError(f"{path}: {key}: expected two or more distinct integers, got {seeds!r}")
    arms = raw["arms"]
    if not isinstance(arms, dict):
        raise DesignError(f"{path}: arms: expected NAME: {{what: ..., overrides: ...}} entries")
    for name, spec in arms.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("what"), str) \
                or not isinstance(spec.get("overrides"), str) or set(spec) - {"what", "overrides", "pending"}:
            raise DesignError(f"{path}: arms: {name}: expected {{what: TEXT, overrides: \"key=value ...\"}} "
                              f"(and pending: REASON while it cannot run), got {spec!r}")
    for key in ("margin", "level", "power"):
        if not isinstance(raw[key], (int, float)) or not 0 < raw[key] < 1:
            raise DesignError(f"{path}: {key}: expected a number in (0, 1), got {raw[key]!r}")
    return Design(path, raw["sweep"], raw["vsweep"], tuple(raw["seeds"]), tuple(raw["vsweep_seeds"]),
                  int(ev["n_problems"]), int(ev["k"]),
                  tuple(int(c) for c in raw["checkpoints"]), int(raw["equal_samples"]), float(raw["margin"]),
                  float(raw["level"]), float(raw["power"]), arms)


# ---------------------------------------------------------------------------------------------
# the pre-set tests

@dataclasses.dataclass(frozen=True)
class Test:
    """One pre-set test: `metric` of arm a minus (or against) arm b, oriented so the claim says "above
    the threshold". metric: learning (mean pass@1 over the design's checkpoints: each checkpoint's eval,
    which for drift-push is the first after it, at its first push there; arm b is read at arm a's eval
    steps, interpolated linearly between b's evals where they differ), drawdown, at (pass@1 after the
    design's equal_samples batches, arm a and b each at its own step), gain (a's learning minus its
    step-0 pass@1), unstable (a's drawdown minus the mean drawdown eval noise alone gives a flat curve).
    threshold: "zero" or "margin" (non-inferiority: above -margin)."""

    id: str
    claim: str  # a, b, c, d, control, or a pending arm's name
    text: str
    metric: str
    a: str
    b: Optional[str]
    threshold: str
    role: str  # primary (its claim's verdict), secondary (decided and shown, not in the verdict)
    pilot: Optional[str] = None  # the pilot's spread that plans it (PLANNING key)
    pilot_note: str = ""

    def pending(self, design: Design) -> Optional[str]:
        reasons = [design.arms[x]["pending"] for x in (self.a, self.b) if x and design.arms.get(x, {}).get("pending")]
        return "; ".join(reasons) or None


TESTS = (
    Test("a1", "a", "on-policy v1-i1 learns: its mean pass@1 over the checkpoints above its step-0 pass@1",
         "gain", "v1-i1", None, "zero", "primary",
         pilot_note="no pilot spread: the page kept no per-seed levels; the measured gain was ~0.6"),
    Test("a2", "a", "on-policy v1-i1 is unstable: its drawdown above what the eval's noise gives a flat curve",
         "unstable", "v1-i1", None, "zero", "primary",
         pilot_note="no pilot spread: the page kept drawdowns only as a difference"),
    Test("b1", "b", "eq. 8 masking improves: mean pass@1 over the checkpoints, mask above v1-i1",
         "learning", "v1-i1-mask", "v1-i1", "zero", "primary", pilot="learning v1-i1-mask - v1-i1"),
    Test("b2", "b", "eq. 8 masking stabilises: drawdown of v1-i1 above the mask's", "drawdown", "v1-i1", "v1-i1-mask",
         "zero", "primary", pilot="drawdown v1-i1 - v1-i1-mask"),
    Test("c1", "c", "off-policy v10-i1 matches or beats v1-i1: mean pass@1 over the checkpoints, not below by the "
         "margin", "learning", "v10-i1", "v1-i1", "margin", "primary", pilot="learning v10-i1 - v1-i1"),
    Test("c2", "c", "off-policy v10-i1 stabilises: drawdown of v1-i1 above v10-i1's", "drawdown", "v1-i1", "v10-i1",
         "zero", "primary", pilot="drawdown v1-i1 - v1-i1-mask",
         pilot_note="planned with the mask's drawdown spread (the same metric; the pilot kept no other)"),
    Test("c3", "c", "with ~10x fewer pushes: v10-i1 after 5 pushes (step 50) not below v1-i1 after 5 (step 5) by "
         "the margin", "at", "v10-i1", "v1-i1-b5", "margin", "secondary", pilot="pushes v10-i1 - v1-i1"),
    Test("d1", "d", "batch reuse v1-i10 is slower over an epoch: after the same 5 batches (v1-i10: 50 steps, "
         "v1-i1: 5), v1-i1 above v1-i10", "at", "v1-i1-b5", "v1-i10", "zero", "primary",
         pilot="checkpoint v1-i1 - v1-i10",
         pilot_note="planned with the spread of one checkpoint's difference at equal steps (the pilot had no "
                    "equal-samples row)"),
    Test("d2", "d", "and per optimizer step: mean pass@1 over the checkpoints, v1-i1 above v1-i10", "learning",
         "v1-i1", "v1-i10", "zero", "secondary", pilot="learning v1-i1 - v1-i10"),
    Test("k1", "control", "the masking explanation's control: without the KL term (beta = 0) v1-i1 learns faster",
         "learning", "v1-i1-beta0", "v1-i1", "zero", "primary", pilot="learning v10-i1 - v1-i1",
         pilot_note="planned with v10-i1's spread against v1-i1 (an arm against v1-i1 on the same metric)"),
    Test("e1", "lag1", "lag-1 pipelining matches v1-i1 at equal samples and equal pushes (both push every "
         "iteration): mean pass@1, not below by the margin", "learning", "lag1", "v1-i1", "margin", "primary",
         pilot="learning v10-i1 - v1-i1", pilot_note="planned with v10-i1's spread against v1-i1"),
    Test("e2", "lag1", "lag-1 pipelining against v10-i1 at equal samples: mean pass@1, lag1 above", "learning",
         "lag1", "v10-i1", "zero", "secondary", pilot="learning v10-i1 - v1-i1",
         pilot_note="planned with v10-i1's spread against v1-i1"),
    Test("f1", "drift-push", "the drift-driven push policy matches v1-i1 at equal samples: mean pass@1 at its "
         "evals, v1-i1 read at the same steps, not below by the margin", "learning", "drift-push", "v1-i1", "margin",
         "primary", pilot="learning v10-i1 - v1-i1", pilot_note="planned with v10-i1's spread against v1-i1"),
    Test("f2", "drift-push", "the drift-driven push policy matches v10-i1 at equal samples: mean pass@1 at its "
         "evals, v10-i1 read at the same steps, not below by the margin", "learning", "drift-push", "v10-i1",
         "margin", "secondary", pilot="learning v10-i1 - v1-i1", pilot_note="planned with v10-i1's spread against v1-i1"),
)

CLAIMS = {
    "a": "Fig. 2(a): on-policy GRPO (v1-i1) learns but is unstable",
    "b": "Fig. 2(b): eq. 8 masking stabilises on-policy GRPO and improves it",
    "c": "Fig. 2(c): off-policy v10-i1 matches or beats on-policy v1-i1 and stabilises it, with ~10x fewer pushes",
    "d": "Fig. 2(d): batch reuse (v1-i10) is slower over an epoch",
    "control": "Control: the masking explanation (on this task eq. 8 only drops beta * KL of solved groups)",
    "lag1": "New arm: lag-1 pipelining",
    "drift-push": "New arm: a drift-driven push policy",
}


# ---------------------------------------------------------------------------------------------
# the plan: each test's planning spread, its eval share and its power

@dataclasses.dataclass
class Spread:
    """A pilot's spread of one paired metric: sd as measured (at the pilot's eval), and the part of its
    variance that the pilot's eval explains (binomial bound) and that a design's eval would add."""

    sd: float
    eval_var_pilot: float
    eval_var_unit: float  # the eval's variance of the difference with one completion per checkpoint

    def between_seed_var(self) -> Optional[float]:
        """The measured variance less the pilot eval's; None when the eval's bound explains all of it."""
        rest = self.sd ** 2 - self.eval_var_pilot
        return rest if rest > 0 else None

    def eval_share(self, samples: int) -> Optional[float]:
        between = self.between_seed_var()
        if between is None:
            return None
        ev = self.eval_var_unit / samples
        return ev / (between + ev)


def pilot_spreads(checkpoints: tuple[int, ...], pilot: dict = PILOT) -> dict[str, Spread]:
    """The spreads the pilot measured, by PLANNING key."""
    n_eval, levels = pilot["eval_samples"], pilot["levels"]
    out = {}
    for name, by_step in pilot["diffs"].items():
        a, b = (x.strip() for x in name.split(" - "))
        steps = [s for s in checkpoints if s in by_step]
        per_seed = [sum(by_step[s][i] for s in steps) / len(steps) for i in range(len(pilot["seeds"]))]
        unit = (binomial_var([levels[a][s] for s in steps], 1) + binomial_var([levels[b][s] for s in steps], 1)) \
            / len(steps) ** 2
        out[f"learning {name}"] = Spread(sample_sd(per_seed), unit / n_eval, unit)
        # one checkpoint's difference: the pooled variance over the checkpoints
        pooled = sum(sample_sd(by_step[s]) ** 2 for s in steps) / len(steps)
        unit_one = sum(levels[a][s] * (1 - levels[a][s]) + levels[b][s] * (1 - levels[b][s]) for s in steps) / len(steps)
        out[f"checkpoint {name}"] = Spread(math.sqrt(pooled), unit_one / n_eval, unit_one)
    for name, values in pilot["pushes_5"].items():
        a, b = (x.strip() for x in name.split(" - "))
        unit = levels[a][50] * (1 - levels[a][50]) + levels["v1-i1"][5] * (1 - levels["v1-i1"][5])
        out[f"pushes {name}"] = Spread(sample_sd(values), unit / n_eval, unit)
    for name, (mean, lo, hi) in pilot["drawdown"].items():
        a, b = (x.strip() for x in name.split(" - "))
        n = len(pilot["seeds"])
        sd = (hi - mean) * math.sqrt(n) / t_quantile(0.975, n - 1)
        _, var_flat = flat_drawdown(len(checkpoints))
        plateau = [sum(levels[x][s] for s in checkpoints) / len(checkpoints) for x in (a, b)]
        unit = var_flat * sum(p * (1 - p) for p in plateau)
        out[f"drawdown {name}"] = Spread(sd, unit / n_eval, unit)
    return out


@dataclasses.dataclass
class Planned:
    test: Test
    sd: Optional[float]  # planning sd (None: the pilot has none)
    effect: float  # the true difference the power is computed at
    threshold: float
    eval_share: Optional[float]  # the design eval's share of the planning variance (None: not estimable)
    power: Optional[float]
    seeds_needed: Optional[int]
    detectable: Optional[float]  # the true difference the design's seeds see with the design's power
    pending: Optional[str]


def plan(design: Design, pilot: dict = PILOT) -> list[Planned]:
    """Every test's power at the design's seeds: planned at the pilot's spread as measured, at a true
    difference of 0 for "matches" (threshold -margin) and of one margin for "above" (threshold 0)."""
    spreads = pilot_spreads(design.checkpoints, pilot)
    out = []
    for t in TESTS:
        threshold = -design.margin if t.threshold == "margin" else 0.0
        effect = 0.0 if t.threshold == "margin" else design.margin
        spread = spreads.get(t.pilot) if t.pilot else None
        if spread is None:
            out.append(Planned(t, None, effect, threshold, None, None, None, None, t.pending(design)))
            continue
        n = len(design.seeds)
        out.append(Planned(t, spread.sd, effect, threshold, spread.eval_share(design.eval_samples),
                           power(n, spread.sd, effect, threshold, design.level),
                           seeds_for(spread.sd, effect, threshold, design.level, design.power),
                           detectable(n, spread.sd, threshold, design.level, design.power), t.pending(design)))
    return out


def largest_eval_share(design: Design, k: int, pilot: dict = PILOT) -> float:
    """The eval's largest share of an estimable primary test's planning variance with k samples per
    problem (a test whose pilot spread the eval's bound explains whole is not estimable)."""
    spreads = pilot_spreads(design.checkpoints, pilot)
    primary = [spreads[t.pilot] for t in TESTS if t.role == "primary" and t.pilot and not t.pending(design)]
    return max(share for s in primary if (share := s.eval_share(design.n_problems * k)) is not None)


def choose_eval_k(design: Design, pilot: dict = PILOT) -> int:
    """The smallest k of EVAL_K (all n_problems) at which the eval's share of every estimable
    primary test's planning variance is at most EVAL_SHARE (the largest k if none reaches it)."""
    return next((k for k in EVAL_K if largest_eval_share(design, k, pilot) <= EVAL_SHARE), EVAL_K[-1])


def choose_seeds(design: Design, pilot: dict = PILOT) -> Optional[int]:
    """The fewest seeds giving the matching test c1 the design's power if it is true."""
    c1 = next(t for t in TESTS if t.id == "c1")
    spread = pilot_spreads(design.checkpoints, pilot)[c1.pilot]
    return seeds_for(spread.sd, 0.0, -design.margin, design.level, design.power)


# ---------------------------------------------------------------------------------------------
# the drift-push arm: its threshold, picked from the pilot's drift by lag

DRIFT_ARM = "drift-push"
OFF_POLICY_V = 10  # v10-i1's v: drift-push must push less often than v1-i1 and more often than v10-i1


@dataclasses.dataclass(frozen=True)
class DriftPlan:
    threshold: float
    min_interval: int
    max_interval: int
    pushes: tuple[int, ...]  # the batches a push comes before
    total_pushes: int  # at the last eval (train.finish pushes once more): what eval/weights_version says there
    eval_steps: tuple[int, ...]  # the step of each checkpoint's eval


def drift_plan(threshold: float, iterations: int, eval_every: int, min_interval: int = 1, max_interval: int = 10,
               pilot: dict = PILOT) -> DriftPlan:
    """The pushes drift-push makes if every batch shows the pilot's mean tv_staleness at its lag (the
    last lag's beyond the pilot's table), decided by grpo.push_policy's own PushSchedule; and where its
    evals land: right after the first push at or after each multiple of eval_every (train.eval_due), the
    last one after training (train.finish)."""
    staleness = pilot["tv_staleness_by_lag"]
    schedule = PushSchedule(PushConfig(policy="drift", tv_threshold=threshold, min_interval=min_interval,
                                       max_interval=max_interval), v=1)
    pushes, pushed_at, eval_steps = [], 0, []
    for k in range(iterations):
        if k > 0 and schedule.due(k, since=k - pushed_at).push:
            if k // eval_every > pushed_at // eval_every or k % eval_every == 0:
                eval_steps.append(k)
            pushes.append(k)
            pushed_at = k
        schedule.measured({"tv_staleness": staleness[min(k - pushed_at, len(staleness) - 1)]})
    return DriftPlan(threshold, min_interval, max_interval, tuple(pushes), len(pushes) + 1,
                     tuple(eval_steps) + (iterations,))


def choose_drift_threshold(design: Design, pilot: dict = PILOT) -> DriftPlan:
    """The threshold halfway between the pilot's tv_staleness at two neighbouring lags (rounded to two
    decimals, still strictly between them) whose predicted pushes by the last checkpoint are nearest, in
    ratio, to the geometric mean of v1-i1's and v10-i1's: as far from one as from the other. The
    intervals come from the design's drift-push overrides (the config's defaults where it sets none)."""
    iterations = design.checkpoints[-1]
    target = math.sqrt(iterations * iterations / OFF_POLICY_V)
    defaults = PushConfig()
    min_interval = int(design.setting(DRIFT_ARM, "push.min_interval") or defaults.min_interval)
    max_interval = int(design.setting(DRIFT_ARM, "push.max_interval") or defaults.max_interval)
    staleness = pilot["tv_staleness_by_lag"]
    candidates = []
    for low, high in zip(staleness, staleness[1:]):
        threshold = round((low + high) / 2, 2)
        if low < threshold < high:
            candidates.append(drift_plan(threshold, iterations, design.checkpoints[0], min_interval, max_interval,
                                         pilot))
    return min(candidates, key=lambda c: abs(math.log(c.total_pushes / target)))


def run_minutes(design: Design, pilot: dict = PILOT) -> dict[str, float]:
    """Minutes per run of each runnable arm at the design's eval: the pilot's minutes without its evals
    (a shared machine's: an upper bound), plus the design's evals at the pilot's cost per completion.
    Arms the pilot did not run take the nearest one's: v1-i1-beta0 v1-i1's (it also skips the
    reference's forward), v1-i1-b5 v1-i10's (the start-up and 5 batches, fewer steps), lag1 and
    drift-push v10-i1's, the dearer of the pilot's 50-step arms without the eval (like v10-i1 they score
    every batch with a copy of the pushed weights for the staleness split; a push is ~3% of an iteration)."""
    per_sample = eval_minutes_per_sample(pilot)
    base = {arm: minutes - evals * per_sample * pilot["eval_samples"]
            for arm, (minutes, evals) in pilot["run_minutes"].items()}
    base["v1-i1-beta0"] = base["v1-i1"]
    base["v1-i1-b5"] = base["v1-i10"]
    base["lag1"] = base["drift-push"] = base["v10-i1"]
    evals = {arm: 1 + len(design.checkpoints) for arm in base}
    evals["v1-i1-b5"] = 2  # step 0 and after its 5 batches
    return {arm: base[arm] + evals[arm] * design.eval_samples * per_sample
            for arm in design.runnable() if arm in base}


def vsweep_minutes(design: Design, pilot: dict = PILOT) -> float:
    """Minutes per seed of the v-sweep (v2, v5: an eval every 10 steps; v20: every 20): v1-i1's
    minutes without its evals, plus theirs."""
    per_sample = eval_minutes_per_sample(pilot)
    plain, n_evals = pilot["run_minutes"]["v1-i1"]
    base = plain - n_evals * per_sample * pilot["eval_samples"]
    return sum(base + evals * design.eval_samples * per_sample for evals in (6, 6, 4))


def report(design: Design) -> dict:
    planned = plan(design)
    drift = choose_drift_threshold(design) if DRIFT_ARM in design.runnable() else None
    minutes = run_minutes(design)
    per_seed = sum(minutes.values())
    alternatives = {}
    for k in EVAL_K:
        other = dataclasses.replace(design, k=k)
        alternatives[k] = {"eval_minutes": round(other.eval_samples * eval_minutes_per_sample(), 2),
                           "hours_all_seeds": round(sum(run_minutes(other).values()) * len(design.seeds) / 60, 1),
                           "largest_eval_share": round(largest_eval_share(other, k), 3)}
    return {
        "design": str(design.path.relative_to(ROOT) if design.path.is_relative_to(ROOT) else design.path),
        "seeds": len(design.seeds), "eval_samples": design.eval_samples, "margin": design.margin,
        "level": design.level, "power_target": design.power,
        "chosen_eval_k": choose_eval_k(design), "chosen_seeds": choose_seeds(design),
        "eval_minutes": round(design.eval_samples * eval_minutes_per_sample(), 2),
        "run_minutes": {a: round(m, 1) for a, m in minutes.items()},
        "minutes_per_seed": round(per_seed, 1), "hours_all_seeds": round(per_seed * len(design.seeds) / 60, 1),
        "vsweep_hours": round(vsweep_minutes(design) * len(design.vsweep_seeds) / 60, 1),
        "eval_k_alternatives": alternatives,
        "drift": None if drift is None else {
            "chosen_threshold": drift.threshold, "design_threshold": float(design.setting(DRIFT_ARM, "push.tv_threshold")
                                                                        or PushConfig().tv_threshold),
            "interval": drift.pushes[1] - drift.pushes[0] if len(drift.pushes) > 1 else None,
            "pushes": drift.total_pushes, "eval_steps": list(drift.eval_steps),
            "pushes_v1_i1": design.checkpoints[-1], "pushes_v10_i1": design.checkpoints[-1] // OFF_POLICY_V},
        "tests": {p.test.id: {"sd": None if p.sd is None else round(p.sd, 4), "effect": p.effect,
                              "threshold": p.threshold,
                              "eval_share": None if p.eval_share is None else round(p.eval_share, 3),
                              "power": None if p.power is None else round(p.power, 3),
                              "seeds_needed": p.seeds_needed,
                              "detectable": None if p.detectable is None else round(p.detectable, 3),
                              "pending": p.pending} for p in planned},
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", default=str(DESIGN), help="the design file (default configs/designs/fig2_cpu.yaml)")
    args = ap.parse_args(argv)
    try:
        design = load_design(Path(args.design))
    except DesignError as e:
        print(f"fig2_power.py: error: {e}", file=sys.stderr)
        return 2
    out = report(design)
    print(f"design {out['design']}: {len(design.seeds)} seeds, eval {design.n_problems} problems x {design.k} "
          f"samples, margin {design.margin:g}, {design.level:.0%} t intervals; pilot: {PILOT['source']}")
    print("| test | role | planning sd | true difference | threshold | eval share | power | seeds for "
          f"{design.power:.0%} | seen with {design.power:.0%} power |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in plan(design):
        sd = "n/a" if p.sd is None else f"{p.sd:.4f}"
        share = "n/a" if p.eval_share is None else f"{p.eval_share:.1%}"
        pw = "n/a" if p.power is None else f"{p.power:.2f}"
        role = f"{p.test.role}, pending" if p.pending else p.test.role
        seen = "n/a" if p.detectable is None else f"{p.detectable:+.3f}"
        print(f"| {p.test.id} | {role} | {sd} | {p.effect:+.2f} | {p.threshold:+.2f} | {share} | {pw} | "
              f"{p.seeds_needed or f'> {MAX_SEEDS}' if p.sd else 'n/a'} | {seen} |")
    print(f"eval: {out['eval_minutes']} min per eval of {design.eval_samples} completions; per run (min): "
          + ", ".join(f"{a} {m}" for a, m in out["run_minutes"].items())
          + f"; {out['minutes_per_seed']} min per seed, {out['hours_all_seeds']} h for {len(design.seeds)} seeds, "
          f"the v-sweep {out['vsweep_hours']} h more (upper bounds: the pilot's shared machine)")
    print("other eval sizes: " + "; ".join(
        f"k = {k}: {alt['eval_minutes']} min per eval, {alt['hours_all_seeds']} h, the eval's largest share "
        f"{alt['largest_eval_share']:.0%}" for k, alt in out["eval_k_alternatives"].items()))
    print(f"the rule picks: eval k = {out['chosen_eval_k']} (all {design.n_problems} problems), "
          f"{out['chosen_seeds']} seeds; the design holds k = {design.k}, {len(design.seeds)} seeds")
    if out["drift"]:
        d = out["drift"]
        print(f"{DRIFT_ARM}: the rule picks tv_threshold {d['chosen_threshold']:g} (the design holds "
              f"{d['design_threshold']:g}): at the pilot's drift by lag a push every {d['interval']} iterations, "
              f"{d['pushes']} pushes by step {design.checkpoints[-1]} (v1-i1 {d['pushes_v1_i1']}, v10-i1 "
              f"{d['pushes_v10_i1']}), its checkpoints evaluated at steps {d['eval_steps']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
