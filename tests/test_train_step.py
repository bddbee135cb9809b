"""The FSDP2 update step: 2 ranks give the 1-rank loss and update; both match plain HF + the objective."""
import json
import os
import subprocess
import sys

import pytest
import torch

from grpo import objective as O
from grpo.models import load_model
from tiny_models import make_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fsdp_step_worker.py")
OVERRIDES = ["grpo.batch_prompts=4", "grpo.G=4", "grpo.i=2", "optim.token_budget=48", "optim.lr=1e-3",
             "objective.beta=0.1", "objective.ratio_anchor=exact", "grpo.temperature=0.7", "kernels.chunk_tokens=8"]


def run_worker(model_dir, out, nproc, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           WORKER, str(model_dir), str(out), *OVERRIDES]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    model_dir = make_tiny_model_dir(tmp / "tiny", arch="qwen2", tie_word_embeddings=True)
    one = run_worker(model_dir, tmp / "one.json", 1, tmp)
    two = run_worker(model_dir, tmp / "two.json", 2, tmp)
    return model_dir, one, two


def test_two_ranks_equal_one_rank(results):
    _, one, two = results
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["micro_batches"] > 1  # the token budget forces gradient accumulation
    # i = 2 SGD iterations: the second loss is after one optimizer step, so the update matches too.
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-7)


def test_first_loss_matches_plain_hf_and_objective(results):
    """Independent of the trainer's plumbing: HF logits -> log_softmax(logits / T) -> gather ->
    grpo.objective with the definition's weights, on the same fixed batch."""
    model_dir, one, _ = results
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from fsdp_step_worker import fixed_batch

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


def test_reference_swap_under_bf16_mixed_precision(results):
    """refresh_reference after no-grad forwards (the root left unsharded) copies every shard."""
    model_dir, _, _ = results
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "tests", "ref_swap_worker.py"), str(model_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    gaps = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert gaps["before"] > 1e-3 and gaps["after"] == 0.0
