"""A group's prompt runs forward once: the shared-prompt row layout and its attention.

The G completions of a GRPO group share one prompt. The plain layout puts each sequence in a row of
its own, prompt + completion, so the prompt goes through every linear layer G times. Here a group is
ONE row (`optim.share_prompts`):

    [ prompt (P) | slot 1 (W) | slot 2 (W) | ... | slot n (W) | padding ]

each slot one completion of the group, right-padded to the group's longest (W). Positions restart
at P in every slot, and the attention lets a slot see the prompt and itself only, so every real
token gets exactly the hidden state it has in the plain layout (up to float reassociation): the
same log-probs, loss and gradients, with (n - 1) * P fewer tokens through the model. GSM8K with
G = 8 (prompts ~100 tokens, completions ~125): 39% fewer tokens.

The attention reads the row layout from the `segments` keyword ((P, W, n) per row, plain ints),
which the model passes down to every attention call. Plain ints, not a tensor: FSDP2 moves a
tensor among the forward's inputs to the GPU, and reading it back would cost a device-to-host
synchronisation in every layer. Two implementations of the same attention, registered with
transformers under their own names:

- "sdpa" (`sdpa_attention`): per row, two SDPA calls: causal over the prompt, then the n slots as a
  batch against [prompt keys | own keys] with a [W, P + W] boolean mask. Plain torch, no
  compilation: the CPU's path. On a GPU the boolean mask rules out the FlashAttention kernels, and
  the prompt's keys are copied once per slot (at GSM8K sizes on an H200 it took 1.3-1.8x the time
  of a row per sequence: docs/benchmarks/gpu-h200.md).
- "flex" (`flex_attention_rows`): the whole micro-batch as one sequence through FlexAttention
  with a block-sparse mask (`SlotMask`): one kernel for every row, no copies of the prompt, and
  blocks that no query sees are skipped, so the work is what the mask allows. Compiled on CUDA
  (flex_attention must be, to be fast); the sequence is padded to a few lengths
  (`padded_length`) so that the compiled kernel is reused rather than rebuilt for every
  micro-batch (a new micro-batch of the same padded length compiled nothing on an H200).

`use_shared_prompt_attention(lm, "auto")` picks flex for a model on CUDA and sdpa elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = {"sdpa": "grpo_shared_prompt", "flex": "grpo_shared_prompt_flex"}
IMPLEMENTATIONS = ("auto", "sdpa", "flex")

# FlexAttention's sparse block (query and key tiles of the block mask). 128 is the kernels' own
# tile: another block size must be a multiple of the tile the autotuner picks, or compilation fails.
FLEX_BLOCK = 128


def slot_mask(prompt_len: int, width: int, device: torch.device) -> torch.Tensor:
    """[W, P + W] bool: slot token t sees the whole prompt and the slot's tokens 0..t."""
    return torch.ones(width, prompt_len + width, dtype=torch.bool, device=device).tril(diagonal=prompt_len)


def sdpa_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                   scaling=None, segments=None, **kwargs):
    """transformers' attention signature: query [R, H, T, D], key/value [R, Hkv, T, D] ->
    ([R, T, H, D], None); segments: (P, W, n) of each row. Padding (past P + n * W in a row) gets zeros: no real token sees it."""
    if segments is None:
        raise ValueError("the shared-prompt attention needs the rows' segments (P, W, n)")
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for r, (p, w, n) in enumerate(segments):
        q, k, v = query[r], key[r], value[r]  # [H, T, D]
        parts = [F.scaled_dot_product_attention(q[None, :, :p], k[None, :, :p], v[None, :, :p], is_causal=True,
                                                scale=scaling, enable_gqa=gqa)[0]]
        if n * w > 0:
            def slots(x):  # [H, n*W, D] -> [n, H, W, D]
                return x[:, p:p + n * w].unflatten(1, (n, w)).transpose(0, 1)

            keys = torch.cat([k[None, :, :p].expand(n, -1, -1, -1), slots(k)], dim=2)
            values = torch.cat([v[None, :, :p].expand(n, -1, -1, -1), slots(v)], dim=2)
            out = F.scaled_dot_product_attention(slots(q), keys, values, attn_mask=slot_mask(p, w, q.device),
                                                 scale=scaling, enable_gqa=gqa)  # [n, H, W, D]
            parts.append(out.transpose(0, 1).flatten(1, 2))
        tail = q.shape[1] - p - n * w
        if tail:
            parts.append(q.new_zeros(q.shape[0], tail, q.shape[2]))
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows).transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------------- FlexAttention


def padded_length(n: int) -> int:
    """The length the flattened micro-batch is padded to: the next of 1, 2, 3, 4, 6, 8, 12, 16, ...
    FLEX_BLOCKs (2^k and 1.5 * 2^k). The compiled kernel is specialised to its length, so a run
    meets a few lengths (a token budget's micro-batches span about one doubling) instead of one per
    micro-batch; the padding is masked out entirely, so its blocks cost no attention work."""
    blocks = 1
    while blocks * FLEX_BLOCK < n:
        blocks = blocks * 3 // 2 if blocks >= 2 and blocks & (blocks - 1) == 0 else 1 << blocks.bit_length()
    return blocks * FLEX_BLOCK


@dataclass
class SlotMask:
    """Who sees whom in the flattened micro-batch [row 0 | row 1 | ...] (each row T long), as two
    key intervals per query token q, in flat positions:
        the prompt part [lo1, hi1): its row's prompt, up to q itself for a prompt token;
        the slot part   [lo2, q]:   its own slot up to itself (empty, lo2 = q + 1, for a prompt token).
    Padding (past a row's P + n * W, and past the rows) sees nothing, so its output is 0."""

    lo1: torch.Tensor  # [L] int32
    hi1: torch.Tensor
    lo2: torch.Tensor

    @classmethod
    def of(cls, segments, row_len: int, length: int, device) -> "SlotMask":
        lo1 = torch.zeros(length, dtype=torch.int32)
        hi1 = torch.zeros(length, dtype=torch.int32)
        lo2 = torch.arange(1, length + 1, dtype=torch.int32)  # q + 1: an empty slot part
        for r, (p, w, n) in enumerate(segments):
            start = r * row_len
            prompt = torch.arange(start, start + p, dtype=torch.int32)
            lo1[start:start + p] = start
            hi1[start:start + p] = prompt + 1
            if n * w:
                lo1[start + p:start + p + n * w] = start
                hi1[start + p:start + p + n * w] = start + p
                slot_starts = start + p + w * torch.arange(n, dtype=torch.int32)
                lo2[start + p:start + p + n * w] = slot_starts.repeat_interleave(w)
        return cls(lo1.to(device), hi1.to(device), lo2.to(device))

    def mask_mod(self):
        """FlexAttention's mask function (evaluated inside the kernel on the partial blocks)."""
        lo1, hi1, lo2 = self.lo1, self.hi1, self.lo2

        def sees(b, h, q, kv):
            return ((kv >= lo1[q]) & (kv < hi1[q])) | ((kv >= lo2[q]) & (kv <= q))

        return sees

    def block_mask(self):
        """The BlockMask of this mask, computed from the intervals (no [L, L] mask is built): per
        query and key block, how many keys of the block the query sees; a block is full where every
        query of its query block sees all FLEX_BLOCK keys, partial where some see some."""
        from torch.nn.attention.flex_attention import BlockMask

        length = self.lo1.numel()
        blocks = length // FLEX_BLOCK
        k0 = torch.arange(0, length, FLEX_BLOCK, device=self.lo1.device, dtype=torch.int32)[None, :]
        k1 = k0 + FLEX_BLOCK
        q = torch.arange(length, device=self.lo1.device, dtype=torch.int32)[:, None]
        seen = ((torch.minimum(self.hi1[:, None], k1) - torch.maximum(self.lo1[:, None], k0)).clamp_(min=0)
                + (torch.minimum(q + 1, k1) - torch.maximum(self.lo2[:, None], k0)).clamp_(min=0))  # [L, blocks]
        seen = seen.view(blocks, FLEX_BLOCK, blocks)
        full = seen.amin(dim=1) == FLEX_BLOCK
        partial = (seen.amax(dim=1) > 0) & ~full

        def ordered(dense):  # (blocks per query block, their indices first), as flex_attention's own
            dense = dense.to(torch.int32)[None, None]
            return (dense.sum(dim=-1).to(torch.int32),
                    torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

        return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                        mask_mod=self.mask_mod(), seq_lengths=(length, length))


_FLEX = {}  # device type -> flex_attention, compiled on CUDA (eager elsewhere: tests' reference)
_MASKS: dict = {}  # (segments, T, device) -> BlockMask of the micro-batch being run (one entry)


def _flex_fn(device: torch.device):
    if device.type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device.type] = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    return _FLEX[device.type]


@torch.compiler.disable
def _block_mask_of(segments, row_len: int, rows: int, device):
    """The micro-batch's BlockMask, built at its first layer and reused by the others (and by the
    backward): one entry, replaced by the next micro-batch's."""
    key = (tuple(segments), row_len, rows, str(device))
    if key not in _MASKS:
        _MASKS.clear()
        mask = SlotMask.of(segments, row_len, padded_length(rows * row_len), device)
        _MASKS[key] = mask.block_mask()
    return _MASKS[key]


def flex_attention_rows(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                        scaling=None, segments=None, **kwargs):
    """sdpa_attention's contract through one FlexAttention call: the R rows flattened into one
    sequence (padded to padded_length), the block mask of SlotMask."""
    if segments is None:
        raise ValueError("the shared-prompt attention needs the rows' segments (P, W, n)")
    rows, heads, row_len, dim = query.shape
    block_mask = _block_mask_of(segments, row_len, rows, query.device)
    length = block_mask.seq_lengths[0]

    def flat(x):  # [R, h, T, D] -> [1, h, length, D]
        x = x.transpose(0, 1).reshape(1, x.shape[1], rows * row_len, dim)
        return F.pad(x, (0, 0, 0, length - rows * row_len))

    # Key/value heads repeated to the query heads rather than enable_gqa: FlexAttention's dK/dV
    # programs are one per (key block, key head), each looping over its query heads, so with
    # Qwen2.5-0.5B's 14 query heads on 2 key heads the backward ran 128 programs, the prompt's
    # blocks (seen by every query of their row) 7 x 26 query blocks long: 1.0 ms per layer on an
    # H200, five times the forward (docs/benchmarks/gpu-h200.md). Repeated, each program has one head.
    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _flex_fn(query.device)(flat(query), flat(key), flat(value), block_mask=block_mask, scale=scaling)
    out = out[0, :, :rows * row_len].unflatten(1, (rows, row_len))  # [H, R, T, D]
    return out.permute(1, 2, 0, 3).contiguous(), None


def resolve_implementation(impl: str, device: torch.device) -> str:
    """auto: flex on CUDA, sdpa elsewhere (eager FlexAttention on a CPU builds the dense mask)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"shared-prompt attention: must be one of {list(IMPLEMENTATIONS)}, got {impl!r}")
    if impl == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return impl


def use_shared_prompt_attention(lm: torch.nn.Module, impl: str = "auto") -> str:
    """Switch an HF model's attention to a shared-prompt one (every forward then needs `segments`);
    impl: auto, sdpa or flex (see the module docstring). Returns the implementation chosen."""
    from transformers import AttentionInterface

    impl = resolve_implementation(impl, next(lm.parameters()).device)
    AttentionInterface.register(ATTENTION[impl], flex_attention_rows if impl == "flex" else sdpa_attention)
    lm.set_attn_implementation(ATTENTION[impl])
    return impl
