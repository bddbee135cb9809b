"""Inverse-CDF sampling (grpo.cpu.sampler) against a plain fp64 search of the whole CDF, its law
against the probabilities (chi-square), and the edges: filtered tokens, a single token with mass,
u at 0 and just below 1, vocabularies that are not a whole number of blocks."""
import math

import pytest
import torch

from grpo.cpu.sampler import sample_from_logprobs, search_block, uniforms


def naive(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose fp64 cumulative mass passes u * total."""
    cdf = logprobs.double().exp().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)


@pytest.mark.parametrize("vocab,block", [(1000, 256), (49152, 256), (37, 8), (5, 256), (300, 1)])
def test_matches_a_search_of_the_whole_cdf(vocab, block):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logprobs = (3 * torch.randn(rows, vocab, generator=g)).log_softmax(-1)
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    assert torch.equal(sample_from_logprobs(logprobs, u, block), naive(logprobs, u))


def test_follows_the_distribution():
    """40k draws from one 1000-token distribution: chi-square within 4 standard deviations of its
    mean (dof; 0.9 here), and far outside for the same counts shifted by one token (1.3e5 standard
    deviations here; 200k draws, 5x the time, added nothing to either)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 1000, 40_000
    logprobs = (2 * torch.randn(1, vocab, generator=g)).log_softmax(-1)
    u = torch.rand(n, dtype=torch.float64, generator=g)
    counts = torch.bincount(sample_from_logprobs(logprobs.expand(n, vocab).contiguous(), u), minlength=vocab).double()
    expected = logprobs[0].double().exp() * n
    keep = expected > 5
    dof = int(keep.sum()) - 1

    def chi2(c):
        return float(((c - expected) ** 2 / expected)[keep].sum())

    assert abs(chi2(counts) - dof) < 4 * math.sqrt(2 * dof), (chi2(counts), dof)
    assert chi2(counts.roll(1)) > dof + 40 * math.sqrt(2 * dof)  # the check can tell an off-by-one


def test_filtered_tokens_are_never_picked():
    """top-k/top-p leave -inf: whatever u, the pick has mass, including u = 0 and u just below 1
    with the whole tail of the vocabulary (and of its last block) filtered."""
    vocab, block = 1000, 256
    logits = torch.randn(6, vocab)
    logits[0, 1:] = -math.inf                 # one token left
    logits[1, :-1] = -math.inf                # only the last one
    logits[2, 700:] = -math.inf               # tail filtered, mid-block end
    logits[3, ::2] = -math.inf                # every other token
    logits[4, :512] = -math.inf               # whole blocks without mass first
    logits[5, 255:257] = 30.0                 # nearly all mass on a block boundary
    logprobs = logits.log_softmax(-1)
    for u_value in (0.0, 0.5, 1.0 - 2 ** -53, 1.0 - 1e-9):
        picks = sample_from_logprobs(logprobs, torch.full((6,), u_value, dtype=torch.float64), block)
        assert torch.isfinite(logprobs.gather(1, picks[:, None])).all(), (u_value, picks)
    top = sample_from_logprobs(logprobs, torch.full((6,), 1.0 - 2 ** -53, dtype=torch.float64), block)
    assert top[0] == 0 and top[1] == vocab - 1 and top[2] == 699 and top[3] == vocab - 1
    assert sample_from_logprobs(logprobs, torch.zeros(6, dtype=torch.float64), block)[4] == 512


def test_a_target_past_the_blocks_running_sum_takes_its_last_token_with_mass():
    """Rounding: the block's mass and its running sum are summed in different orders, so the target
    can pass the running sum by an ulp; the pick must still be a token with mass, not the next block."""
    inner = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.5, 0.0, 0.0]])
    past = torch.tensor([[1.0 + 1e-12], [1.0 + 1e-12], [1.0]], dtype=torch.float64)
    assert search_block(inner, past).view(-1).tolist() == [2, 4, 2]
    inside = torch.tensor([[0.3], [0.0], [0.5]], dtype=torch.float64)
    assert search_block(inner, inside).view(-1).tolist() == [1, 4, 2]


def test_rows_with_their_own_generator_draw_from_it():
    torch.manual_seed(3)
    a = uniforms(4, {2: torch.Generator().manual_seed(11)})
    torch.manual_seed(3)
    b = uniforms(4, {2: torch.Generator().manual_seed(12)})
    torch.manual_seed(3)
    c = uniforms(4, {})
    assert a[2] != b[2] and torch.equal(a[[0, 1, 3]], b[[0, 1, 3]]) and torch.equal(a[[0, 1, 3]], c[[0, 1, 3]])
    assert ((a >= 0) & (a < 1)).all()
