"""The FSDP2 update step: 2 ranks give the 1-rank loss and update; both match plain HF + the objective.

Every case runs in one of two torchrun launches of tests/fsdp_step_worker.py, one of 1 rank and one
of 2 ranks (fixtures `one_rank` and `two_ranks`), one case after another in the same process group.
A launch pays ~20 s of start-up (torchrun, imports, gloo) for steps of a second or two: with a launch
per case, this file paid it 33 times. Each case builds its models, optimizer and Trainer from its own
config as a launch of its own did; the tests read the cases' figures by name.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from fsdp_step_worker import CASE_TIMEOUT_S, fixed_batch
from grpo import objective as O
from grpo.models import load_model
from tiny_models import make_tiny_model_dir

# Every test here reads steps that train.py's own functions took under torchrun (the launches below).
pytestmark = pytest.mark.torchrun
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fsdp_step_worker.py")
# fp32 compute whatever the machine (model.dtype auto is bf16 where the CPU multiplies bf16): these
# tests compare steps number for number, with each other and with plain fp32 HF.
OVERRIDES = ["grpo.batch_prompts=4", "grpo.G=4", "grpo.i=2", "optim.token_budget=48", "optim.lr=1e-3",
             "objective.beta=0.1", "objective.ratio_anchor=exact", "grpo.temperature=0.7", "kernels.chunk_tokens=8",
             "model.dtype=float32"]
RATIO_TAIL = os.path.join(ROOT, "examples", "ratio_tail.py")  # a user's instrument (docs/extending.md): it measures only
SKEWED_BUDGET = 120
# test_shared_prompts_give_the_same_step's (ranks, batch, token budget) and
# test_skipping_masked_groups_gives_the_same_update's (ranks, objective.count_masked)
SHARED_PROMPT_CASES = [(1, "grouped", 48), (2, "grouped", 48), (1, "grouped-masked", 48), (1, "grouped", 20)]
MASKED_CASES = [(1, True), (1, False), (2, False)]


def with_budget(tokens: int) -> list[str]:
    return [o for o in OVERRIDES if not o.startswith("optim.token_budget")] + [f"optim.token_budget={tokens}"]


def case(name: str, batch: str = "fixed", overrides: list[str] = OVERRIDES, **settings) -> dict:
    return {"name": name, "batch": batch, "overrides": overrides, **settings}


def skip_pair(name: str, batch: str, overrides: list[str]) -> list[dict]:
    """The same step with masked sequences skipped (the trainer) and run (no_skip): `name`-skip, `name`-full."""
    return [case(f"{name}-skip", batch, overrides), case(f"{name}-full", batch, overrides, no_skip=True)]


def shared_prompt_name(batch: str, budget: int) -> str:
    return f"share-{batch}-{budget}"


def cases(nproc: int) -> list[dict]:
    """Every case of the launch of `nproc` ranks, in the order they run: "base" last, since the plugin
    it names stays registered in the process (fsdp_step_worker refuses a case after it)."""
    run = [case(loss, overrides=OVERRIDES + [f"objective.loss={loss}"]) for loss in ("gspo", "gspo_token")]
    run += [case("bf16", overrides=[o for o in OVERRIDES if not o.startswith("model.dtype")] + ["model.dtype=bfloat16"]),
            case("skewed", "skewed", with_budget(SKEWED_BUDGET)),
            case("one_micro_batch", overrides=with_budget(4096))]
    for ranks, batch, budget in SHARED_PROMPT_CASES:
        if ranks == nproc:
            overrides = with_budget(budget) + (["objective.mask_zero_variance=true"] if "masked" in batch else [])
            name = shared_prompt_name(batch, budget)
            run += [case(f"{name}-plain", batch, overrides), case(f"{name}-shared", batch, overrides + ["optim.share_prompts=true"])]
    for ranks, count_masked in MASKED_CASES:
        if ranks == nproc:
            run += skip_pair(f"masked-{str(count_masked).lower()}", "masked",
                             OVERRIDES + ["objective.mask_zero_variance=true", f"objective.count_masked={str(count_masked).lower()}"])
    if nproc == 1:
        run += [case("compiled", overrides=OVERRIDES + ["model.compile=true"])]
    else:
        run += skip_pair("allmasked", "allmasked", OVERRIDES + ["objective.mask_zero_variance=true", "optim.weight_decay=0.1"])
        run += [case("activation_checkpointing", overrides=OVERRIDES + ["model.activation_checkpointing=true"]),
                case("every_micro_batch", overrides=OVERRIDES + ["optim.grad_sync=every_micro_batch"]),
                case("ref_swap", overrides=["model.dtype=bfloat16", "objective.beta=0.1"], kind="ref_swap"),
                # Rank 0 reads 1 kB of device memory, rank 1 a petabyte. Next to last: before the fix the
                # ranks hung here, and the cases before it keep their figures.
                case("unlike_memory", rank_memory=[1000, 2**50])]
    return run + [case("base", overrides=OVERRIDES + [f"plugins=[{RATIO_TAIL}]"])]


class CaseFigures(dict):
    """A launch's figures by case name ("closed": the process group's close after the last case); a
    case without figures (the launch failed or hung before it was done) fails the test that reads it
    with the launch's own failure."""

    failure = ""

    def __missing__(self, name):
        raise AssertionError(f"case {name!r} has no figures: {self.failure or 'no such case'}")


def launch(model_dir, tmp_path, nproc: int) -> CaseFigures:
    """One torchrun launch of nproc ranks over cases(nproc). The worker ends a case that hangs
    (fsdp_step_worker.CASE_TIMEOUT_S); `timeout` bounds the launch should the worker itself not end."""
    timeout = CASE_TIMEOUT_S * (len(cases(nproc)) + 1)
    out_dir = tmp_path / "figures"
    out_dir.mkdir()
    cases_path = tmp_path / "cases.json"
    cases_path.write_text(json.dumps(cases(nproc)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           WORKER, str(model_dir), str(cases_path), str(out_dir)]
    figures = CaseFigures()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        (tmp_path / "launch.log").write_text(proc.stdout + proc.stderr)  # each case's time, for whoever reads it
        if proc.returncode != 0:
            figures.failure = f"the launch exited {proc.returncode}: " + proc.stdout[-2000:] + proc.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        out_text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        figures.failure = f"the ranks did not finish within {timeout} s; they printed {out_text[-2000:]}"
    for path in out_dir.glob("*.json"):
        figures[path.stem] = json.loads(path.read_text())
    return figures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("fsdp") / "tiny", arch="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    """The 1-rank launch, over 60 s: its start-up (~20 s) and the 1-rank cases of every test here
    (a step of a second or two each, and model.compile's first compilation)."""
    return launch(model_dir, tmp_path_factory.mktemp("one_rank"), 1)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    """The 2-rank launch, over 60 s: its start-up (~20 s) and the 2-rank cases of every test here."""
    return launch(model_dir, tmp_path_factory.mktemp("two_ranks"), 2)


def test_two_ranks_equal_one_rank(one_rank, two_ranks):
    """Over 60 s in its set-up: the first test of the file starts both launches (fixtures one_rank and
    two_ranks, every case of every test here); the tests after it read their figures."""
    one, two = one_rank["base"], two_ranks["base"]
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["micro_batches"] > 1  # the token budget forces gradient accumulation
    # i = 2 SGD iterations: the second loss is after one optimizer step, so the update matches too.
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-7)


def test_a_registered_instrument_is_reduced_over_both_ranks_as_over_one(one_rank, two_ranks):
    """The trainer's own state (train.Trainer) carries the registered instruments into this worker:
    a user's per-pass statistic (examples/ratio_tail.py) is the same on 2 ranks as on 1, pass by pass."""
    one, two = one_rank["base"], two_ranks["base"]
    tails = [row["ratio_tail_frac"] for row in one["instruments"]]
    assert len(tails) == 2 and tails[0] == 0.0 and tails[1] > 0  # the first pass: pi_theta is pi_old; then it moved
    assert [row["ratio_tail_frac"] for row in two["instruments"]] == pytest.approx(tails, abs=1e-12)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
def test_a_sequence_level_loss_gives_the_same_step_on_two_ranks(one_rank, two_ranks, loss):
    """GSPO needs whole sequences (log-probs, then its torch definition with autograd, not the fused
    head): 2 ranks give the 1-rank losses, gradient norms and update, with micro-batches."""
    one, two = one_rank[loss], two_ranks[loss]
    assert one["micro_batches"] > 1
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-7)
    assert one["grad_norms"][0] > 0


def test_the_reference_policy_is_resharded_after_its_forwards(one_rank, two_ranks):
    """Bug: pi_ref's no-grad forwards left FSDP2's root (embeddings, final norm, lm_head) gathered on
    every rank for the rest of the step (0.27 GB at 0.5B, 0.93 GB at 1.5B per rank); the step
    reshards it after its last forward on the batch, as it does the pushed copy."""
    one, two = one_rank["base"], two_ranks["base"]
    assert one["ref_resharded"] and two["ref_resharded"]


def test_reduce_scattering_every_micro_batch_gives_the_same_step(two_ranks):
    """optim.grad_sync trades memory for communication, not the update: 2 ranks that reduce-scatter
    after every micro-batch (no unsharded gradients kept) equal 2 ranks that wait for the last."""
    every, two = two_ranks["every_micro_batch"], two_ranks["base"]
    assert two["micro_batches"] > 1
    assert every["losses"] == pytest.approx(two["losses"], rel=1e-6, abs=1e-8)
    assert every["grad_norms"] == pytest.approx(two["grad_norms"], rel=1e-5)
    assert every["param_abs_sum"] == pytest.approx(two["param_abs_sum"], rel=1e-8)


def test_ranks_that_read_unlike_memory_take_one_gradient_sync_path(two_ranks):
    """optim.grad_sync auto decides from the device memory a rank reads. Bug: each rank decided from
    its own, so ranks on unlike nodes (an H100 beside an H200 at 1.5B) took different paths, one
    reduce-scattering after every micro-batch and the other after the last only: their collectives
    paired wrongly (here the ranks hung). Now every rank plans with the least memory of any rank.
    Rank 0 reads 1 kB (reduce-scatter every micro-batch), rank 1 a petabyte (wait for the last)."""
    unlike, two = two_ranks["unlike_memory"], two_ranks["base"]
    assert [plan[0] for plan in unlike["gradient_sync_plans"]] == [True, True]
    assert all("of 0 GiB" in why for _, why in unlike["gradient_sync_plans"])  # the least figure, on both
    assert two["micro_batches"] > 1
    assert unlike["losses"] == pytest.approx(two["losses"], rel=1e-6, abs=1e-8)
    assert unlike["param_abs_sum"] == pytest.approx(two["param_abs_sum"], rel=1e-8)


def test_closing_frees_the_process_group_while_python_runs(one_rank, two_ranks):
    """close_distributed() leaves no gloo thread behind. destroy_process_group alone left them
    running (FSDP2's mesh holds the group, DTensor's caches hold the mesh), and tearing them down at
    interpreter exit aborted ~1 in 25 finished 2-rank runs ("terminate called without an active
    exception", exit -6): a CI failure, and a finished training run reported as crashed. Here the
    group is closed after the last case of each launch, every case's models released."""
    for result in (one_rank["closed"], two_ranks["closed"]):
        assert result["group_freed"]
        assert "python" in result["threads_after_close"]  # the names are read
        assert not [name for name in result["threads_after_close"] if "gloo" in name]


def test_first_loss_matches_plain_hf_and_objective(model_dir, one_rank):
    """Independent of the trainer's plumbing: HF logits -> log_softmax(logits / T) -> gather ->
    grpo.objective with the definition's weights, on the same fixed batch."""
    one = one_rank["base"]
    model = load_model(model_dir)
    cfg = O.ObjectiveConfig(beta=0.1, ratio_anchor="exact")
    samples = fixed_batch(model.config.vocab_size, 4, 4)
    num_seqs = len(samples)
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.7
            logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            n = len(s.completion_ids)
            weights = torch.full((n,), s.seq_weight / (n * num_seqs), dtype=torch.float64)
            # pi = pi_k = pi_ref at the first step: KL is 0 and the loss is -A * pi_k/alpha per token (eq. 6, exact).
            loss, _ = O.objective(logp, torch.tensor(s.logp_alpha, dtype=torch.float64), logp, logp,
                                  torch.full((n,), s.adv, dtype=torch.float64), weights, cfg)
            total += loss
    assert one["losses"][0] == pytest.approx(float(total), rel=1e-5, abs=1e-7)


def test_reference_swap_under_bf16_mixed_precision(two_ranks):
    """copy_policy after no-grad forwards (the root left unsharded) copies every shard, and the frozen
    copy's parameters stay leaves without gradient (no graph back to pi_theta), before and after a
    forward of the copy."""
    gaps = two_ranks["ref_swap"]
    assert gaps["before"] > 1e-3 and gaps["after"] == 0.0
    assert gaps["frozen_parameters"] == gaps["leaves_without_grad"] > 0


def test_bf16_mixed_precision_keeps_the_objective_inputs_in_fp32(one_rank, two_ranks):
    """Bug: FSDP2 casts a module's floating forward inputs to its param dtype, and the policy's root
    forward takes the objective's per-token tensors (log-probs of alpha, pi_k, pi_ref, advantages,
    weights): in bf16 they were rounded by up to 0.03 nat, so KL(pi || pi_ref) at pi = pi_ref (the
    first step, both loaded from the same weights) was 5e-5 instead of 0, and every ratio and IS
    weight was off as much. The root now leaves its inputs as they are (1 and 2 ranks)."""
    for run in (one_rank["bf16"], two_ranks["bf16"]):
        assert run["kls"][0] == 0.0
        assert run["kls"][1] > 0  # after one update the estimator is live: the check is not vacuous


def test_skewed_lengths_respect_the_budget_on_one_and_two_ranks(one_rank, two_ranks):
    """Ranks with different micro-batch counts: rank 0 holds the long sequences (one longer than the
    budget), rank 1 the short ones, so rank 1's plan is split to rank 0's count."""
    one, two = one_rank["skewed"], two_ranks["skewed"]
    for run in (one, two):
        for rank_shapes in run["shapes"]:
            for padded_tokens, rows in rank_shapes:
                # The budget bounds every micro-batch, except a single sequence longer than it.
                assert padded_tokens <= SKEWED_BUDGET or rows == 1, (padded_tokens, rows)
        assert any(rows == 1 and tokens > SKEWED_BUDGET for tokens, rows in sum(run["shapes"], []))
    counts = [len(rank_shapes) for rank_shapes in two["shapes"]]
    assert counts[0] == counts[1] > 1  # lockstep, however different the two shares are
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-7)


def test_entropy_with_one_micro_batch_and_two_sgd_iterations(one_rank, two_ranks):
    """Bug: with one micro-batch the cached entropy tensor was all-reduced in place, so the logged
    entropy doubled on 2 ranks at the second SGD iteration (5.28 -> 10.55 on this batch)."""
    one, two = one_rank["one_micro_batch"], two_ranks["one_micro_batch"]
    assert one["micro_batches"] == two["micro_batches"] == 1
    assert len(one["entropies"]) == 2 and one["entropies"][0] == one["entropies"][1] > 0  # pi_k's, logged twice
    assert two["entropies"] == pytest.approx(one["entropies"], rel=1e-6)


def test_activation_checkpointing_gives_the_same_step(two_ranks):
    """Recomputing each decoder layer in backward (the DeepScaleR configs' setting) changes memory,
    not the update: 2 ranks with it on equal 2 ranks with it off."""
    ac, two = two_ranks["activation_checkpointing"], two_ranks["base"]
    assert ac["losses"] == pytest.approx(two["losses"], rel=1e-6, abs=1e-8)
    assert ac["grad_norms"] == pytest.approx(two["grad_norms"], rel=1e-6)
    assert ac["param_abs_sum"] == pytest.approx(two["param_abs_sum"], rel=1e-9)


def test_compiled_layers_give_the_same_step(one_rank):
    """model.compile compiles each decoder layer (dynamic shapes; the micro-batches here have
    several shapes): the update is the uncompiled one up to fp32 reassociation in the fused ops."""
    compiled, one = one_rank["compiled"], one_rank["base"]
    assert compiled["micro_batches"] == one["micro_batches"] > 1
    assert compiled["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    assert compiled["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert compiled["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-6)


@pytest.mark.parametrize("nproc,batch,budget", SHARED_PROMPT_CASES)
def test_shared_prompts_give_the_same_step(one_rank, two_ranks, nproc, batch, budget):
    """optim.share_prompts runs a group's prompt once and its completions as slots of one row
    (grpo.shared_prompt): losses, KL, entropies, gradient norms and updated weights equal the
    plain layout's (i = 2, so the second SGD iteration is after an update), on 1 and 2 ranks, with
    eq. 8 masking (masked groups are not in any row), and with a budget that cuts groups into
    several rows (20 tokens: prompts 3-7, completions 1-9, G = 4); the micro-batches are smaller."""
    figures = {1: one_rank, 2: two_ranks}[nproc]
    name = shared_prompt_name(batch, budget)
    plain, shared = figures[f"{name}-plain"], figures[f"{name}-shared"]
    assert shared["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-5, abs=1e-7)
    # The second loss is after an AdamW step at lr 1e-3, which moves every weight of the tiny model by
    # about lr (a few % of its scale): the second forward amplifies the two layouts' fp32 rounding
    # (1.5e-5 relative measured on an AVX2 CPU), so it gets the gradient norms' tolerance; the update
    # itself is pinned by param_abs_sum below.
    assert shared["losses"][1] == pytest.approx(plain["losses"][1], rel=1e-4, abs=1e-7)
    assert shared["kls"] == pytest.approx(plain["kls"], rel=1e-4, abs=1e-8)
    assert shared["entropies"] == pytest.approx(plain["entropies"], rel=1e-5)
    assert shared["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-4)
    assert shared["param_abs_sum"] == pytest.approx(plain["param_abs_sum"], rel=1e-7)
    padded = lambda r: sum(n for rank in r["shapes"] for n, _ in rank)  # noqa: E731
    assert padded(shared) < padded(plain)
    if budget == 20:  # some group really was cut: more rows than groups (1 rank holds all 4)
        assert shared["rows"] > 4


def _assert_same_step(skipped, full):
    assert skipped["losses"] == pytest.approx(full["losses"], rel=1e-5, abs=1e-7)
    assert skipped["grad_norms"] == pytest.approx(full["grad_norms"], rel=1e-5, abs=1e-9)
    assert skipped["param_abs_sum"] == pytest.approx(full["param_abs_sum"], rel=1e-7)
    assert skipped["entropies"] == pytest.approx(full["entropies"], rel=1e-5)


@pytest.mark.parametrize("nproc,count_masked", MASKED_CASES)
def test_skipping_masked_groups_gives_the_same_update(one_rank, two_ranks, nproc, count_masked):
    """eq. 8 multiplies the whole per-prompt term (KL included) by the indicator, so masked groups
    contribute exactly zero: the trainer skips their forward/backward, and loss, gradient norm,
    entropy and the updated weights equal those of running them (beta > 0, i = 2)."""
    figures = {1: one_rank, 2: two_ranks}[nproc]
    name = f"masked-{str(count_masked).lower()}"
    skipped, full = figures[f"{name}-skip"], figures[f"{name}-full"]
    _assert_same_step(skipped, full)
    live = lambda r: sum(rows for rank in r["shapes"] for _, rows in rank)  # noqa: E731
    assert live(skipped) < live(full)  # half the groups never ran


def test_an_all_masked_batch_still_takes_the_optimizer_step(two_ranks):
    """Nothing to run on any rank: one empty micro-batch per rank gives every parameter a zero
    gradient, so AdamW's step (moments, decay) is exactly the full forward's."""
    skipped, full = two_ranks["allmasked-skip"], two_ranks["allmasked-full"]
    _assert_same_step(skipped, full)
    assert skipped["losses"] == [0.0, 0.0]
    assert skipped["micro_batches"] == 1 and all(rows == 0 for rank in skipped["shapes"] for _, rows in rank)
