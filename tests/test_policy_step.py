"""One small trainer step in-process (the quick tier's): train.py's Policy and objective on a tiny
model against plain HF + the objective's definition, for a per-token loss (the fused LM head, whose
gradients come from its forward) and a sequence-level one (log-probs, then autograd)."""
import os
import sys

import pytest
import torch

from grpo.batching import collate
from grpo.objective import ObjectiveConfig, local_denominators, objective, token_weights
from grpo.policy import ObjectiveInputs, Policy
from kernels import KernelConfig
from tiny_models import make_tiny_model_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_step_worker import fixed_batch  # noqa: E402

T = 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grpo.models import load_model

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("policy") / "tiny", arch="qwen2", tie_word_embeddings=True)
    return load_model(model_dir, dtype=torch.float32)


def reference(model, samples, cfg, num_seqs):
    """HF logits -> log_softmax(z / T) -> gather, then the objective per sequence, summed; and its
    gradient by plain autograd through the whole model."""
    model.zero_grad()
    total = 0.0
    for b, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float() / T
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        n = len(s.completion_ids)
        weights = torch.full((n,), s.seq_weight / (n * num_seqs))
        loss, _ = objective(logp, torch.tensor(s.logp_alpha), None, None, torch.full((n,), s.adv), weights, cfg,
                            seq_index=torch.zeros(n, dtype=torch.long))
        total = total + loss
    total.backward()
    return float(total), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_one_policy_step_equals_hf_and_the_objective(tiny, loss):
    cfg = ObjectiveConfig(loss=loss, ratio_anchor="exact")
    samples = fixed_batch(tiny.config.vocab_size, 2, 4, objective=cfg)
    mb = collate(samples, 0, torch.device("cpu"))
    num_seqs, num_tokens = local_denominators(mb.completion_mask, mb.seq_weight, cfg, mb.truncated)
    mask = mb.completion_mask.bool()
    weights = token_weights(mb.completion_mask, mb.seq_weight, cfg, num_seqs=num_seqs, num_tokens=num_tokens,
                            max_len=64, truncated=mb.truncated)[mask]
    want_loss, want_grads = reference(tiny, samples, cfg, num_seqs)

    tiny.zero_grad()
    policy = Policy(tiny, T, KernelConfig(backend="torch", chunk_tokens=8))
    out = policy(mb.input_ids, mb.completion_index, mb.completion_tokens,
                 objective=ObjectiveInputs(mb.logp_alpha, None, None, mb.adv[mb.seq_of_token], weights, cfg,
                                           seq_index=mb.seq_of_token))
    out.loss.backward()
    assert float(out.loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    for name, grad in want_grads.items():
        got = dict(tiny.named_parameters())[name].grad
        scale = float(grad.abs().max())  # fp32 sums in another order: ~1e-6 of the largest entry
        assert float((got - grad).abs().max()) <= 1e-5 * scale, name
    assert any(g.abs().sum() > 0 for g in want_grads.values())
