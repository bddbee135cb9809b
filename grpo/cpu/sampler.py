"""Inverse-CDF sampling for vLLM's CPU engine: one uniform per row instead of one Gumbel per token.

vLLM's CPU sampler (`TopKTopPSampler.forward_cpu`) draws a SplitMix64 Gumbel number for every
vocabulary entry of every row and takes the argmax, as costly as all of attention for a small model
with a large vocabulary. The sampler has already computed the processed log-probs it returns
(`--logprobs-mode processed_logprobs`), so one uniform per row and a search through the cumulative
distribution picks the same law of tokens: exp, block sums in fp64, a search among the blocks,
then one within the block (docs/benchmarks has the timings). GPU engines keep vLLM's sampler.

Samples are still a function of the global RNG that the server reseeds before each batch
(grpo.serving.worker_ext.grpo_reseed): the uniforms come from torch's default generator, or from a
request's own generator where it has one.
"""
from typing import Optional

import torch

BLOCK = 256  # entries per block: 192 blocks over a 49k vocabulary, two short searches


def sample_from_logprobs(logprobs: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Token index per row with P(j) = exp(logprobs[row, j]) / sum_j exp(...), given one uniform
    u[row] in [0, 1) per row. -inf entries (top-k/top-p filtered) are never picked.

    The mass is renormalised (target = u * total) so fp32 rounding of the log-softmax does not bias
    the last token; sums are fp64 so a 2^-24 token in a 49k vocabulary is still reachable."""
    rows, vocab = logprobs.shape
    probs = logprobs.float().exp()
    pad = (-vocab) % block
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, block)
    block_mass = blocks.sum(-1, dtype=torch.float64)                      # (rows, nblocks)
    block_cdf = block_mass.cumsum(-1)
    target = u.to(torch.float64).view(rows, 1) * block_cdf[:, -1:]        # (rows, 1)
    # first block whose cumulative mass passes the target: its own mass is > 0
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)
    inner = blocks.gather(1, b.view(rows, 1, 1).expand(rows, 1, block)).view(rows, block)
    before = block_cdf.gather(1, b) - block_mass.gather(1, b)             # mass of the blocks before b
    return (b * block + search_block(inner, target - before)).view(rows)


def search_block(inner: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """Index in each row of `inner` (rows, block) of the first token whose running fp64 mass passes
    `within` (rows, 1): a token with mass. The block's running sum is summed in another order than
    its mass was, so `within` can pass it by an ulp (about 1 row in 5000 with u near 1): then the
    block's last token with mass."""
    j = torch.searchsorted(inner.to(torch.float64).cumsum(-1), within, right=True)
    last_with_mass = inner.shape[1] - 1 - (inner > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    return torch.where(j >= inner.shape[1], last_with_mass, j)


def uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform per row from torch's default generator; rows with their own generator draw theirs."""
    u = torch.rand(rows, dtype=torch.float64)
    for i, gen in generators.items():
        u[i] = torch.rand(1, dtype=torch.float64, generator=gen)[0]
    return u


def make_forward(sampler):
    """A replacement for `sampler.forward` (a vLLM TopKTopPSampler) with its signature and returns:
    (sampled token ids, the logits or log-probs its logprobs_mode asks for)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    mode = sampler.logprobs_mode

    def forward(logits: torch.Tensor, generators: dict[int, torch.Generator],
                k: Optional[torch.Tensor], p: Optional[torch.Tensor]):
        logits = apply_top_k_top_p(logits, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        to_return = logprobs if mode == "processed_logprobs" else logits if mode == "processed_logits" else None
        return sample_from_logprobs(logprobs, uniforms(logits.shape[0], generators)), to_return

    return forward


def install(sampler) -> bool:
    """Replace the CPU Gumbel sampler on this TopKTopPSampler instance (vLLM binds `forward` per
    instance at construction). Only where it is the CPU path: other backends, and fp64 Gumbel noise
    that someone asked for on purpose, keep theirs. Returns whether it was replaced."""
    bound = getattr(sampler.forward, "__func__", None)
    if bound is not type(sampler).forward_cpu or getattr(sampler, "use_fp64_gumbel", False):
        return False
    sampler.forward = make_forward(sampler)
    return True
