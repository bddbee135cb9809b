"""grpo.shared_prompt's two attentions over the shared-prompt rows: the per-row SDPA one and the
FlexAttention one (the micro-batch flattened into one sequence with a block-sparse mask), against
each other and against a dense mask built from the layout's definition; the block mask computed from
the intervals against FlexAttention's own dense evaluation of the same mask function.

FlexAttention has no backward on a CPU, so its gradients are checked on a GPU (scripts/gpu_check.py,
shared_prompts step); here the flex path runs forward and its mask's definition is checked with
gradients through SDPA."""
import pytest
import torch
import torch.nn.functional as F

from grpo import shared_prompt as sp

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def dense_allowed(segments, row_len):
    """[R, T, T] bool from the layout's definition: a prompt token sees the prompt up to itself; a
    slot token sees the whole prompt and its own slot up to itself; padding sees nothing."""
    q = torch.arange(row_len)[:, None]
    k = torch.arange(row_len)[None, :]
    out = []
    for p, w, n in segments:
        slot_q = (q - p) // max(w, 1)
        slot_k = (k - p) // max(w, 1)
        same_slot = (q >= p) & (k >= p) & (slot_q == slot_k)
        out.append((q < p + n * w) & (k <= q) & ((k < p) | same_slot))
    return torch.stack(out)


LAYOUTS = [
    ((5, 7, 3), (11, 4, 2), (3, 0, 0)),  # a row with no slots, rows of different widths, padding
    ((1, 1, 1),),
    ((130, 9, 3), (2, 50, 5)),  # a prompt longer than a FlexAttention block
]


@pytest.mark.parametrize("segments", LAYOUTS)
def test_flex_and_sdpa_attentions_agree_with_the_dense_definition(segments):
    torch.manual_seed(0)
    row_len = max(p + n * w for p, w, n in segments) + 3
    heads, kv_heads, dim = 6, 2, 16  # grouped-query attention, 3 query heads per key head
    rows = len(segments)
    q = torch.randn(rows, heads, row_len, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(rows, kv_heads, row_len, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(rows, kv_heads, row_len, dim, dtype=torch.float64, requires_grad=True)
    allowed = dense_allowed(segments, row_len)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                         attn_mask=allowed[:, None])
    ref = torch.where(allowed.any(-1)[:, None, :, None], ref, 0.0).transpose(1, 2)  # padding rows: 0
    got, _ = sp.sdpa_attention(None, q, k, v, segments=segments)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    upstream = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), (q, k, v)),
                    torch.autograd.grad((ref * upstream).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    with torch.no_grad():
        flex, _ = sp.flex_attention_rows(None, q.float(), k.float(), v.float(), segments=segments)
    assert flex.shape == ref.shape
    torch.testing.assert_close(flex, ref.float(), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("segments", LAYOUTS + [((150, 200, 16),), ((100, 60, 8), (130, 50, 8), (90, 70, 8))])
def test_the_block_mask_from_intervals_equals_flex_attentions_dense_evaluation(segments):
    """SlotMask.block_mask classifies each (query block, key block) as full, partial or empty from
    the key intervals alone; create_block_mask evaluates the same mask function at every
    (query, key) pair. The two must be the same BlockMask (GSM8K's 16 x 200 behind 150: 89% of the
    blocks skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    row_len = max(p + n * w for p, w, n in segments) + 1
    length = sp.padded_length(len(segments) * row_len)
    mask = sp.SlotMask.of(segments, row_len, length, torch.device("cpu"))
    ours = mask.block_mask()
    theirs = create_block_mask(mask.mask_mod(), 1, 1, length, length, device="cpu", BLOCK_SIZE=sp.FLEX_BLOCK)
    for a, b in zip(ours.as_tuple()[2:6], theirs.as_tuple()[2:6]):  # kv_num_blocks, kv_indices, full_*
        assert torch.equal(a, b)
    # and the mask function is the layout's definition, flattened
    q_idx = torch.arange(length)[:, None]
    k_idx = torch.arange(length)[None, :]
    flat = mask.mask_mod()(0, 0, q_idx, k_idx)
    want = torch.zeros(length, length, dtype=torch.bool)
    for r, block in enumerate(dense_allowed(segments, row_len)):
        want[r * row_len:(r + 1) * row_len, r * row_len:(r + 1) * row_len] = block
    assert torch.equal(flat, want)


def test_padded_lengths_are_few_and_whole_blocks():
    lengths = [sp.padded_length(n) for n in range(1, 40000, 97)]
    assert all(x % sp.FLEX_BLOCK == 0 and x >= n for x, n in zip(lengths, range(1, 40000, 97)))
    assert sorted(set(lengths)) == [128 * b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384)]
    assert sp.padded_length(3350) == 4096 and sp.padded_length(4097) == 6144  # at most 1.5x the tokens


def test_auto_picks_sdpa_on_a_cpu_and_a_wrong_name_is_refused():
    assert sp.resolve_implementation("auto", torch.device("cpu")) == "sdpa"
    assert sp.resolve_implementation("auto", torch.device("cuda")) == "flex"
    assert sp.resolve_implementation("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="must be one of"):
        sp.resolve_implementation("flash", torch.device("cpu"))
