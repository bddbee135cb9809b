"""Statistics of an empty set are missing, never NaN (issue #29, item 6).

A batch whose groups are all masked (eq. 8) has no active token: every mean over tokens, and the
reward bound over nonzero-variance groups, is a statistic of an empty set. The logged row leaves
them out, and every aggregation (plots, sweep tables, W&B) skips missing and non-finite values,
so one such batch, or an old run that logged NaN there, never turns a mean NaN.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

from grpo import metrics, parity, staleness
from grpo import objective as objective_module
from grpo.advantages import group_advantages
from grpo.batching import collate
from grpo.objective import finalize_stats, local_denominators, objective, token_weights
from grpo.progress import Progress
from grpo.rollout import Rollout, Sample, batch_stats
from grpo.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import plot  # noqa: E402

# the statistics an all-masked batch has no value for (the objective's means over tokens and
# sequences, the bound over nonzero-variance groups, pi_k's entropy per token)
EMPTY_SET_KEYS = {*objective_module.STEP_STATS, *objective_module.DRIFT_STATS} - {"loss", "num_tokens"} \
    | {"bound_M_nonzero", "entropy"}


def config(B: int = 2, G: int = 4, **objective) -> TrainConfig:
    cfg = TrainConfig()
    cfg.grpo = replace(cfg.grpo, G=G, batch_prompts=B, max_new_tokens=8)
    cfg.objective = replace(cfg.objective, mask_zero_variance=True, beta=0.04, **objective)
    return cfg


def rollout_of(cfg: TrainConfig, reward=lambda j: 1.0, seed: int = 5, version: int = 0) -> Rollout:
    """A batch as sample_rollout returns it, built from test data: completion j of prompt p has
    j + 2 tokens with log-probs that are not float32 numbers, the last of each group is truncated,
    rewards come from reward(index) (all 1.0 by default: every group has zero variance, so eq. 8
    masks them all); advantages, weights and their statistics from the real group_advantages."""
    G, B = cfg.grpo.G, cfg.grpo.batch_prompts
    rewards = [reward(j) for j in range(B * G)]
    adv, seq_weight, stats = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, cfg.objective,
                                              generator=torch.Generator().manual_seed(seed))
    samples = [Sample(group=j // G, prompt_ids=[3 + j // G, 4, 5], completion_ids=[7 + j + t for t in range(j % G + 2)],
                      logp_alpha=[-0.1 * (t + 1) - 1e-9 * seed for t in range(j % G + 2)],
                      truncated=j % G == G - 1, reward=rewards[j], correct=rewards[j], adv=float(adv[j]),
                      seq_weight=float(seq_weight[j]), weights_version=version) for j in range(B * G)]
    stats.update(batch_stats(samples), reward_timeouts=0.0, time_generate=0.1, time_reward=0.1,
                 time_wait_generate=0.0, engine={})
    return Rollout(samples, stats)


def step_stats(cfg: TrainConfig, rollout) -> tuple[dict, float]:
    """The objective's statistics on the whole batch, as train.sgd_iteration computes them (one
    micro-batch, one rank), and pi_k's entropy summed over active tokens."""
    mb = collate(rollout.samples, 0, torch.device("cpu"))
    seqs, tokens = local_denominators(mb.completion_mask, mb.seq_weight, cfg.objective, mb.truncated)
    weights = token_weights(mb.completion_mask, mb.seq_weight, cfg.objective, num_seqs=max(seqs, 1),
                            num_tokens=max(tokens, 1), max_len=cfg.grpo.max_new_tokens,
                            truncated=mb.truncated)[mb.completion_mask.bool()]
    logp = mb.logp_alpha + 0.01
    _, stats = objective(logp, mb.logp_alpha, None, mb.logp_alpha - 0.02, mb.adv[mb.seq_of_token], weights,
                         cfg.objective, seq_index=mb.seq_of_token)
    entropy = torch.full_like(logp, 0.7)
    return finalize_stats(stats), float((entropy * (weights != 0)).sum())


def row_of(cfg: TrainConfig, rollout, progress: Progress = Progress(step=1), sgd_iteration: int = 0,
           instruments: dict = None) -> dict:
    train_stats, entropy_sum = step_stats(cfg, rollout)
    return metrics.train_row(progress=progress, stage=0, iteration=0, sgd_iteration=sgd_iteration,
                             rollout_stats=rollout.stats, train_stats=objective_module.logged_stats(train_stats),
                             sampled_version=rollout.weights_version, entropy=metrics.per_token(entropy_sum, train_stats["num_tokens"]), grad_norm=0.0,
                             lr=1e-6, time_train=0.1, time_sync=0.0, sync_bytes=0.0, iteration_seconds=0.2,
                             shape={"train_tokens": 10.0, "train_padded_tokens": 12.0}, instruments=instruments)


def no_nan(row: dict) -> bool:
    return not any(isinstance(v, float) and math.isnan(v) for v in row.values())


def test_an_all_masked_batch_logs_no_nan_and_leaves_empty_set_statistics_out():
    cfg = config()
    rollout = rollout_of(cfg)
    assert rollout.stats["masked_frac"] == 1.0 and all(s.seq_weight == 0 for s in rollout.samples)
    assert math.isnan(rollout.stats["bound_M_nonzero"])  # computed as NaN where it is computed
    train_stats, _ = step_stats(cfg, rollout)
    assert train_stats["num_tokens"] == 0 and math.isnan(train_stats["clip_frac"])
    row = row_of(cfg, rollout)
    assert no_nan(row), {k: v for k, v in row.items() if isinstance(v, float) and math.isnan(v)}
    assert not EMPTY_SET_KEYS & set(row), sorted(EMPTY_SET_KEYS & set(row))
    # what exists is there: the batch's rewards, the loss (0, a sum), the step's own numbers
    assert row["reward_mean"] == 1.0 and row["masked_frac"] == 1.0 and row["loss"] == 0.0
    assert {"grad_norm", "lr", "bound_M", "time_train", "weights_version"} <= set(row)


def test_every_key_of_a_row_is_declared():
    """No allow-list: a row holds whatever the components return, and each key has its one
    declaration (W&B section, meaning, docs/metrics.md) where it is computed."""
    metrics.load_declarations()
    cfg = config()
    rollout = rollout_of(cfg, reward=lambda j: float(j % 2))
    rollout.stats["engine"] = {"server_threads": 2.0}
    instruments = {**dict.fromkeys(staleness.SPLIT_KEYS, 0.1), **dict.fromkeys(parity.PARITY_KEYS, 0.1),
                   "time_parity": 1.0}
    row = row_of(cfg, rollout, instruments=instruments)
    assert set(instruments) < set(row) and "server_threads" in row and "num_tokens" in row
    undeclared = sorted(key for key in row if metrics.declared(key) is None)
    assert not undeclared, f"declare these where they are computed (grpo.metrics.declare): {undeclared}"


def test_a_batch_with_signal_logs_every_statistic():
    cfg = config()
    rollout = rollout_of(cfg, reward=lambda j: float(j % 2))
    row = row_of(cfg, rollout)
    assert no_nan(row)
    per_token = {"clip_frac", "clip_frac_adv_pos", "clip_frac_adv_neg", "kl", "tv_pik_alpha", "kl_pik_alpha",
                 "ratio_mean", "is_weight_mean", "entropy", "bound_M_nonzero"}
    assert per_token <= set(row), sorted(per_token - set(row))
    assert math.isclose(row["entropy"], 0.7, rel_tol=1e-6)


def test_an_all_positive_advantage_batch_leaves_the_negative_clip_fraction_out():
    # Every active token has A > 0 (the batch with signal, its advantages made positive): the clip
    # fraction among A < 0 tokens is a statistic of an empty set, NaN in finalize_stats, absent from
    # the row; the A > 0 one is there (0: pi = pi_k, nothing clipped).
    cfg = config()
    signal = rollout_of(cfg, reward=lambda j: float(j % 2))
    rollout = Rollout([replace(s, adv=abs(s.adv)) for s in signal.samples], signal.stats)
    assert all(s.adv >= 0 for s in rollout.samples) and any(s.adv > 0 and s.seq_weight > 0 for s in rollout.samples)
    train_stats, _ = step_stats(cfg, rollout)
    assert train_stats["num_tokens"] > 0 and math.isnan(train_stats["clip_frac_adv_neg"])
    assert train_stats["clip_frac_adv_pos"] == 0.0
    row = row_of(cfg, rollout)
    assert no_nan(row) and "clip_frac_adv_neg" not in row
    assert row["clip_frac_adv_pos"] == 0.0 and row["clip_frac"] == 0.0


def test_missing_is_nan_of_any_number_type_and_never_an_infinity():
    import numpy as np

    assert metrics.missing(math.nan) and metrics.missing(np.float32("nan")) and metrics.missing(torch.tensor(math.nan))
    assert not metrics.missing(math.inf) and not metrics.missing(0) and not metrics.missing(True)
    assert metrics.per_token(3.0, 0.0) != metrics.per_token(3.0, 0.0)  # NaN
    assert metrics.defined({"a": torch.tensor(math.nan), "b": 1.5, "c": np.float64("nan")}) == {"b": 1.5}
    assert metrics.eval_row(3, {"pass@1": math.nan, "n_problems": 4}) == {"step": 3, "eval/n_problems": 4}


def test_wandb_gets_no_nan_that_a_caller_passed():
    """metrics.jsonl keeps what it is given; W&B's payload (its summary is built from it) skips NaN."""
    assert metrics.wandb_payload({"step": 1, "kl": math.nan, "clip_frac": 0.25, "run": "x"}) == {"train/clip_frac": 0.25}


# ---------------------------------------------------------------------------------------------
# aggregations: plots and the sweep table over rows where a statistic is missing or NaN


def write_sweep(sweep_dir: Path) -> None:
    """One grid point, two finished seeds: seed 0 logged an all-masked batch the new way (the keys
    left out), seed 1 is an old run that logged NaN there."""
    runs = [{"name": f"p-s{seed}", "point": "p", "seed": seed, "overrides": []} for seed in (0, 1)]
    manifest = {"name": "sw", "config": "c.yaml", "seeds": [0, 1], "points": [{"name": "p", "overrides": []}],
                "runs": runs}
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest))
    rows = {
        0: [{"step": 1, "weights_version": 0, "loss": 0.0, "reward_mean": 0.5, "tv_pik_alpha": 0.01, "clip_frac": 0.1},
            {"step": 2, "weights_version": 1, "loss": 0.0, "reward_mean": 1.0},  # all masked: keys missing
            {"step": 2, "eval/pass@1": 0.5}],
        1: [{"step": 1, "weights_version": 0, "loss": 0.0, "reward_mean": 0.7, "tv_pik_alpha": 0.03, "clip_frac": 0.3},
            {"step": 2, "weights_version": 1, "loss": 0.0, "reward_mean": 1.0, "tv_pik_alpha": math.nan,
             "clip_frac": math.nan, "entropy": 0.0},
            {"step": 2, "eval/pass@1": 0.7}, {"step": 2, "eval/pass@1": math.nan}],  # a NaN last eval
    }
    for seed, seed_rows in rows.items():
        run_dir = sweep_dir / f"p-s{seed}"
        (run_dir / "final").mkdir(parents=True)
        # Python's json writes NaN as NaN, as metrics.jsonl of an old run holds it
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seed_rows))


def test_the_sweep_table_and_bands_skip_missing_and_nan(tmp_path):
    sweep_dir = tmp_path / "sw"
    write_sweep(sweep_dir)
    manifest, points = plot.load_sweep(sweep_dir)
    table = plot.sweep_table(sweep_dir, manifest, points)
    last = table.splitlines()[-1]
    assert "nan" not in last.lower(), last
    # final pass@1 over seeds (0.5, 0.7), pushes 1, steps 2, no wall record, TV mean of 0.01 and 0.03,
    # clip fraction mean of 0.1 and 0.3
    assert last == "| p | 2 | 0.600 +- 0.141 | 1.0 | 2 | n/a | 2.00e-02 | 0.2000 |"
    for key in ("tv_pik_alpha", "clip_frac"):
        curves = [plot.curve(rows, key, "step") for rows in points["p"].values()]
        xs, mean, low, high = plot.band(curves, "minmax")
        assert xs == [1] and math.isclose(mean[0], 0.2 if key == "clip_frac" else 0.02)
        assert all(math.isfinite(v) for v in mean + low + high)


def test_plot_cli_draws_a_sweep_and_runs_with_missing_and_nan(tmp_path, capsys):
    sweep_dir = tmp_path / "sw"
    write_sweep(sweep_dir)
    out = tmp_path / "fig.png"
    assert plot.main(["--sweep", str(sweep_dir), "--out", str(out), "--keys", "reward_mean", "tv_pik_alpha"]) == 0
    assert out.is_file() and "nan" not in out.with_suffix(".md").read_text().lower()
    runs_out = tmp_path / "runs.png"
    assert plot.main([str(sweep_dir / "p-s0"), str(sweep_dir / "p-s1"), "--out", str(runs_out),
                      "--keys", "clip_frac", "entropy", "eval/pass@1", "--smooth", "0.5"]) == 0
    for run in ("p-s0", "p-s1"):
        rows = plot.read_metrics(sweep_dir / run / "metrics.jsonl")
        for key in ("clip_frac", "entropy", "eval/pass@1"):
            steps, values = plot.series(rows, key)
            assert all(math.isfinite(v) for v in plot.ema(values, 0.5))
    assert plot.series(plot.read_metrics(sweep_dir / "p-s1" / "metrics.jsonl"), "clip_frac") == ([1], [0.3])
