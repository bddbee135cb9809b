"""Per-token log-probabilities of sampled tokens from logits [N, V], without a [N, V] temporary.

Maths (z = logits / T, T the sampling temperature, so logp matches what vLLM sampled from):

    lse_i     = logsumexp_j z_ij
    logp_i    = z_i,t_i - lse_i                        (log pi_theta(o_t | q, o_<t))
    entropy_i = -sum_j p_ij log p_ij,   p = softmax(z)

    d logp_i    / d logits_ij = (onehot_ij - p_ij) / T
    d entropy_i / d logits_ij = -p_ij (log p_ij + entropy_i) / T

The entropy is differentiable (its gradient costs one extra FMA per element in the backward pass).
A negative target id (e.g. -100) marks an ignored row: its logp (and log-ratio) is 0 and it gets no
log-prob gradient; its entropy is still computed, since it does not depend on the target.

Two implementations of the same (forward, backward) pair, chosen by `kernels.__init__`:
  * torch: readable, row-blocked so temporaries stay ~16 MB whatever N and V are; the CPU path.
  * Triton: one pass over V per row with an online max/sum (flash-softmax style); the GPU path,
    and the path tests run under TRITON_INTERPRET=1. Forward variants, chosen by LogprobImpl's
    launch parameters (the defaults are the plain one): a lane-wise loop (per-lane running max and
    sum, one reduction after the loop), two-buffer prefetch, and a split vocabulary (each row over
    several programs, then a merge kernel). bench/logprob_bandwidth.py measures them on a GPU.
Both backward functions write dlogits into a caller-given `out`, which may alias `logits` (the
fused LM-head path overwrites its chunk of logits with their gradient), so the only full-size
allocation of the backward is the gradient itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of logits handled per torch block: temporaries stay near this many fp32 elements (16 MB).
TORCH_BLOCK_ELEMS = 1 << 22


# --------------------------------------------------------------------------- torch reference


def _row_blocks(n_rows: int, n_cols: int):
    rows = max(1, TORCH_BLOCK_ELEMS // max(n_cols, 1))
    for r0 in range(0, n_rows, rows):
        yield r0, min(n_rows, r0 + rows)


def torch_forward(logits, targets, inv_temperature, with_entropy, logp_alpha=None):
    """(logp, lse, entropy or None, log_ratio or None), each [N] fp32, plain torch, block by block.

    torch's fused log_softmax does the work (one kernel, faster than composing max, exp and sum); lse is recovered as max(z) - max(log_softmax(z)) = max(z) - (max(z) - lse)."""
    n_rows, n_cols = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    logp, lse = torch.zeros(n_rows, **f32), torch.empty(n_rows, **f32)
    entropy = torch.empty(n_rows, **f32) if with_entropy else None
    for r0, r1 in _row_blocks(n_rows, n_cols):
        z = logits[r0:r1].float()
        if inv_temperature != 1.0:
            z = z * inv_temperature
        log_p = torch.log_softmax(z, dim=-1)  # the block's one full-width temporary
        t = targets[r0:r1]
        valid = t >= 0
        logp[r0:r1] = torch.where(valid, log_p.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        lse[r0:r1] = z.amax(dim=-1) - log_p.amax(dim=-1)
        if with_entropy:
            # H = -<p, log p> per row as one dot product: special.entr(p) would take a log per
            # element again.
            # log p clamped finite, so p = 0 (a -inf logit) gives 0, not 0 * -inf.
            entropy[r0:r1] = -torch.linalg.vecdot(log_p.exp(), log_p.clamp_(min=torch.finfo(torch.float32).min))
    log_ratio = None
    if logp_alpha is not None:
        log_ratio = torch.where(targets >= 0, logp - logp_alpha.float(), 0.0)
    return logp, lse, entropy, log_ratio


def torch_backward(logits, targets, lse, grad_logp, entropy, grad_entropy, inv_temperature, out):
    """Write dlogits = (g (onehot - p) - g_H p (log p + H)) / T into `out` (may alias logits).

    grad_logp [N] fp32 must already be 0 on ignored rows; grad_entropy is None when the entropy
    is not differentiated. `logits` may be a slab of the vocabulary (the fused LM head's backward)
    with targets shifted to its columns: a target outside [0, n_cols) contributes no one-hot term. For fp32 the gradient is built in place in `out` (no temporary unless
    the entropy is differentiated); other dtypes go through one fp32 block."""
    n_rows, n_cols = logits.shape
    for r0, r1 in _row_blocks(n_rows, n_cols):
        x, o = logits[r0:r1], out[r0:r1]
        work = o if o.dtype == torch.float32 else torch.empty(o.shape, dtype=torch.float32, device=o.device)
        # log p = z - lse, elementwise: safe when `work` is the very memory of x.
        if inv_temperature == 1.0:
            torch.sub(x.float(), lse[r0:r1, None], out=work)
        else:
            torch.mul(x.float(), inv_temperature, out=work).sub_(lse[r0:r1, None])
        g = grad_logp[r0:r1, None]
        if grad_entropy is None:
            work.exp_().mul_(-g)  # -g p
        else:
            p = torch.exp(work)
            # p (log p + H), with log p clamped finite so that p = 0 gives 0, not 0 * -inf
            work.clamp_(min=torch.finfo(torch.float32).min).add_(entropy[r0:r1, None]).mul_(p)
            work.mul_(-grad_entropy[r0:r1, None]).sub_(p.mul_(g))  # -g_H p (log p + H) - g p
        t = targets[r0:r1]
        valid = (t >= 0) & (t < n_cols)  # a target outside the columns (a slab of V) has no one-hot term here
        rows = torch.arange(r1 - r0, device=x.device)[valid]
        work[rows, t[valid]] += grad_logp[r0:r1][valid]  # + g onehot
        if inv_temperature != 1.0:
            work.mul_(inv_temperature)
        if work is not o:
            o.copy_(work)


# --------------------------------------------------------------------------- Triton kernels

# log2(e): exp(y) = exp2(y * LOG2E); the lane-wise loop folds it into the scale 1/T (one multiply).
LOG2E = tl.constexpr(1.4426950408889634)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_block(row_ptrs, row_mask, start, hi, cols):
    """One [ROWS, BLOCK_V] block of logits (their own dtype) at columns start + cols; -inf past hi."""
    c = start + cols
    mask = row_mask[:, None] & (c < hi)[None, :]
    return tl.load(row_ptrs[:, None] + c[None, :], mask=mask, other=float("-inf"))


@triton.jit
def _step(x, m, s, w, inv_temperature, scale2, WITH_ENTROPY: tl.constexpr, LANEWISE: tl.constexpr,
          GROUP: tl.constexpr):
    """One block x [ROWS, BLOCK_V] folded into the running (m, s, w) (see _row_stats)."""
    if GROUP > 1:
        m, s, w = _grouped_step(x, m, s, w, scale2, GROUP, WITH_ENTROPY)
    elif LANEWISE:
        x = x.to(tl.float32)
        d = x - m
        up = d > 0  # x is the lane's new max
        t = -tl.abs(d)
        if WITH_ENTROPY:
            t = tl.maximum(t, -FP32_MAX)  # x = -inf: t finite, so e * t = 0, not nan
        e = tl.exp2(t * scale2)  # exp(-|x - m| / T)
        if WITH_ENTROPY:
            w = tl.where(up, e * (w + t * s), w + e * t)
        s = tl.where(up, s * e + 1.0, s + e)
        m = tl.where(up, x, m)
    else:
        z = x.to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # Guard fully masked rows (past N): -inf - -inf would be nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(z - m_safe[:, None])
        if WITH_ENTROPY:
            shift = tl.where(m == float("-inf"), 0.0, m - m_safe)
            pz = tl.where(p > 0, p * (z - m_safe[:, None]), 0.0)
            w = alpha * (w + shift * s) + tl.sum(pz, axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
    return m, s, w


@triton.jit
def _grouped_step(x, m, s, w2, scale2, GROUP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One block x [ROWS, BLOCK_V] folded into the running (m, s, w2) [ROWS, BLOCK_V // GROUP] of
    each group of GROUP adjacent columns (see _row_stats, GROUP > 1)."""
    x3 = tl.reshape(x.to(tl.float32), [x.shape[0], x.shape[1] // GROUP, GROUP])
    m_new = tl.maximum(m, tl.max(x3, axis=2))
    # <= 0; -inf the first time (m = -FP32_MAX), clamped so that shift * s = 0, not nan
    shift = tl.maximum((m - m_new) * scale2, -FP32_MAX)
    alpha = tl.exp2(shift)
    y = (x3 - m_new[:, :, None]) * scale2  # log2 of e^(z - m / T), <= 0
    e = tl.exp2(y)
    if WITH_ENTROPY:
        y = tl.maximum(y, -FP32_MAX)  # x = -inf: e * y = 0, not nan
        w2 = alpha * (w2 + shift * s) + tl.sum(e * y, axis=2)
    s = alpha * s + tl.sum(e, axis=2)
    return m_new, s, w2


@triton.jit
def _merge_columns(m_row, s, w, gap, exponent, w_to_z, inv_temperature, ROWS: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """A row's (m, s, w) in z units (see _row_stats) from its columns' running sums, each relative to
    its column's max: m_row the row's max logit, gap each column's max below it in w's units and
    exponent the same in log2 units, w_to_z the factor from w's units to z's."""
    a = tl.exp2(exponent)
    s_row = tl.sum(a * s, axis=1)
    if WITH_ENTROPY:
        w_row = tl.sum(a * (w + gap * s), axis=1) * w_to_z
    else:
        w_row = tl.zeros([ROWS], tl.float32)
    return tl.where(s_row > 0, m_row * inv_temperature, float("-inf")), s_row, w_row


@triton.jit
def _row_stats(row_ptrs, row_mask, lo, hi, inv_temperature,
               ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
               LANEWISE: tl.constexpr, PREFETCH: tl.constexpr, GROUP: tl.constexpr):
    """(m, s, w) [ROWS] fp32 of columns [lo, hi) of each row, with z = logits / T:
    m = max z, s = sum exp(z - m), w = sum exp(z - m) (z - m) (0 without WITH_ENTROPY), so that
    lse = m + log s and entropy = log s - w / s (no cancellation at |z| ~ 1e4). m = -inf (s = w = 0)
    when the range holds no finite logit (an empty split, a row past N).

    Block-wise (LANEWISE=False): one online-logsumexp step per [ROWS, BLOCK_V] block, a max and a
    sum (and with entropy a second sum) across the block each step.
    Lane-wise (LANEWISE=True): every lane keeps its own running (m, s, w) of the raw logits and the
    block is reduced once after the loop: no cross-thread reduction (no barrier) inside the loop.
    One of the two exponentials of an online-softmax step is exp(0) = 1, so a step costs one exp:
    with d = x - m and e = exp(-|d| / T), a new lane max (d > 0) gives s <- s e + 1, w <- e (w - d s),
    else s <- s + e, w <- w + e d. exp is exp2 with log2(e) / T as one factor.
    PREFETCH: two blocks per loop step in two register buffers, each refilled (the load issued)
    as soon as its block is folded in, so one block's loads are in flight while the other block
    is computed. (Refilling one buffer at the top of the step does not do this: the compiler
    sinks that load below the arithmetic, into the registers the arithmetic frees.)"""
    cols = tl.arange(0, BLOCK_V)
    scale2 = inv_temperature * LOG2E  # log2(e) / T
    if GROUP > 1:
        m = tl.full([ROWS, BLOCK_V // GROUP], -FP32_MAX, tl.float32)
        s = tl.zeros([ROWS, BLOCK_V // GROUP], tl.float32)
        w = tl.zeros([ROWS, BLOCK_V // GROUP], tl.float32)
    elif LANEWISE:
        # -FP32_MAX, not -inf: x - m is then never -inf - -inf (nan); a lane that sees no finite
        # logit keeps s = 0 and drops out of the final combine.
        m = tl.full([ROWS, BLOCK_V], -FP32_MAX, tl.float32)
        s = tl.zeros([ROWS, BLOCK_V], tl.float32)
        w = tl.zeros([ROWS, BLOCK_V], tl.float32)
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        w = tl.zeros([ROWS], tl.float32)
    if PREFETCH:
        # A block past hi is all -inf and changes nothing (an odd block count costs one such step).
        xa = _load_block(row_ptrs, row_mask, lo, hi, cols)
        xb = _load_block(row_ptrs, row_mask, lo + BLOCK_V, hi, cols)
        for start in range(lo, hi, 2 * BLOCK_V):
            m, s, w = _step(xa, m, s, w, inv_temperature, scale2, WITH_ENTROPY, LANEWISE, GROUP)
            xa = _load_block(row_ptrs, row_mask, start + 2 * BLOCK_V, hi, cols)
            m, s, w = _step(xb, m, s, w, inv_temperature, scale2, WITH_ENTROPY, LANEWISE, GROUP)
            xb = _load_block(row_ptrs, row_mask, start + 3 * BLOCK_V, hi, cols)
    else:
        for start in range(lo, hi, BLOCK_V):
            x = _load_block(row_ptrs, row_mask, start, hi, cols)
            m, s, w = _step(x, m, s, w, inv_temperature, scale2, WITH_ENTROPY, LANEWISE, GROUP)
    if GROUP > 1:  # combine the groups of each row; their sums are in log2 units
        m_row = tl.max(m, axis=1)
        gap = tl.maximum((m - m_row[:, None]) * scale2, -FP32_MAX)  # <= 0, finite
        m, s, w = _merge_columns(m_row, s, w, gap, gap, LN2, inv_temperature, ROWS, WITH_ENTROPY)
    elif LANEWISE:  # combine the lanes of each row; their sums are in raw logits
        m_row = tl.max(m, axis=1)
        gap = m - m_row[:, None]  # <= 0, finite
        m, s, w = _merge_columns(m_row, s, w, gap, gap * scale2, inv_temperature, inv_temperature, ROWS, WITH_ENTROPY)
    return m, s, w


@triton.jit
def _finish(logits_ptr, stride_logits_row, targets_ptr, logp_alpha_ptr, logp_ptr, lse_ptr, log_ratio_ptr,
            entropy_ptr, rows, row_mask, m, s, w, inv_temperature,
            HAS_ALPHA: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """Store logp, lse (and log_ratio, entropy) of `rows` from their (m, s, w) (see _row_stats)."""
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)
    lse = m_safe + log_s

    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    valid = row_mask & (targets >= 0)
    z_target = tl.load(logits_ptr + rows * stride_logits_row + targets, mask=valid, other=0.0)
    # (z_t - m) - log s rather than z_t - lse: exact subtraction first, full precision at |z| ~ 1e4.
    logp = tl.where(valid, (z_target.to(tl.float32) * inv_temperature - m_safe) - log_s, 0.0)
    tl.store(logp_ptr + rows, logp, mask=row_mask)
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    if HAS_ALPHA:
        logp_alpha = tl.load(logp_alpha_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        tl.store(log_ratio_ptr + rows, tl.where(valid, logp - logp_alpha, 0.0), mask=row_mask)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + rows, log_s - w / s, mask=row_mask)


@triton.jit
def logprob_fwd_kernel(
    logits_ptr, stride_logits_row, targets_ptr, logp_alpha_ptr,
    logp_ptr, lse_ptr, log_ratio_ptr, entropy_ptr,
    n_rows, n_cols, inv_temperature,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_ALPHA: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    LANEWISE: tl.constexpr, PREFETCH: tl.constexpr, GROUP: tl.constexpr,
):
    """One program per ROWS rows, one pass over the whole vocabulary."""
    # int64 row offsets: row * stride overflows int32 at Qwen sizes (2048 * 151936 > 2^31 / 8).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    m, s, w = _row_stats(logits_ptr + rows * stride_logits_row, row_mask, 0, n_cols, inv_temperature,
                         ROWS, BLOCK_V, WITH_ENTROPY, LANEWISE, PREFETCH, GROUP)
    _finish(logits_ptr, stride_logits_row, targets_ptr, logp_alpha_ptr, logp_ptr, lse_ptr, log_ratio_ptr,
            entropy_ptr, rows, row_mask, m, s, w, inv_temperature, HAS_ALPHA, WITH_ENTROPY)


@triton.jit
def logprob_partial_kernel(
    logits_ptr, stride_logits_row, partial_ptr,
    n_rows, n_cols, n_split, inv_temperature,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    LANEWISE: tl.constexpr, PREFETCH: tl.constexpr, GROUP: tl.constexpr,
):
    """Split vocabulary: program (i, k) reduces the k-th of n_split slices of rows i*ROWS.. (whole
    BLOCK_V blocks, the last slices shorter or empty) to partial (m, s, w), stored at
    partial[0..2, k, row] (fp32 [3, n_split, n_rows]); logprob_combine_kernel finishes."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    split = tl.program_id(1)
    blocks_per_split = tl.cdiv(tl.cdiv(n_cols, BLOCK_V), n_split)
    lo = split * blocks_per_split * BLOCK_V
    hi = tl.minimum(lo + blocks_per_split * BLOCK_V, n_cols)
    m, s, w = _row_stats(logits_ptr + rows * stride_logits_row, row_mask, lo, hi, inv_temperature,
                         ROWS, BLOCK_V, WITH_ENTROPY, LANEWISE, PREFETCH, GROUP)
    out = partial_ptr + split.to(tl.int64) * n_rows + rows
    plane = n_split * n_rows  # n_split >= 2 (split=1 runs logprob_fwd_kernel)
    tl.store(out, m, mask=row_mask)
    tl.store(out + plane, s, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(out + 2 * plane, w, mask=row_mask)


@triton.jit
def logprob_combine_kernel(
    partial_ptr, logits_ptr, stride_logits_row, targets_ptr, logp_alpha_ptr,
    logp_ptr, lse_ptr, log_ratio_ptr, entropy_ptr,
    n_rows, n_split, inv_temperature,
    ROWS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HAS_ALPHA: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """Merge the n_split partial (m, s, w) of each row (online-softmax merge: rescale each by
    exp(m_k - m)) and store the row's outputs as logprob_fwd_kernel does."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    k = tl.arange(0, SPLIT_BLOCK)
    mask = row_mask[:, None] & (k < n_split)[None, :]
    ptrs = partial_ptr + k[None, :].to(tl.int64) * n_rows + rows[:, None]
    plane = n_split * n_rows
    m_k = tl.load(ptrs, mask=mask, other=float("-inf"))
    s_k = tl.load(ptrs + plane, mask=mask, other=0.0)
    m = tl.max(m_k, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a = tl.exp(m_k - m_safe[:, None])  # 0 for an empty slice (m_k = -inf)
    s = tl.sum(a * s_k, axis=1)
    if WITH_ENTROPY:
        w_k = tl.load(ptrs + 2 * plane, mask=mask, other=0.0)
        shift = tl.where(m_k == float("-inf"), 0.0, m_k - m_safe[:, None])
        w = tl.sum(a * (w_k + shift * s_k), axis=1)
    else:
        w = tl.zeros([ROWS], tl.float32)
    _finish(logits_ptr, stride_logits_row, targets_ptr, logp_alpha_ptr, logp_ptr, lse_ptr, log_ratio_ptr,
            entropy_ptr, rows, row_mask, m, s, w, inv_temperature, HAS_ALPHA, WITH_ENTROPY)


@triton.jit
def logprob_bwd_kernel(
    logits_ptr, stride_logits_row, dlogits_ptr, stride_dlogits_row, targets_ptr,
    lse_ptr, grad_logp_ptr, entropy_ptr, grad_entropy_ptr,
    n_rows, n_cols, inv_temperature,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, WITH_ENTROPY_GRAD: tl.constexpr,
):
    # Each element is read then written by the same program, so dlogits may alias logits.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_V)
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(grad_logp_ptr + rows, mask=row_mask, other=0.0)
    if WITH_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
        g_entropy = tl.load(grad_entropy_ptr + rows, mask=row_mask, other=0.0)
    for start in range(0, n_cols, BLOCK_V):
        c = (start + cols).to(tl.int64)
        mask = row_mask[:, None] & (c < n_cols)[None, :]
        z = tl.load(logits_ptr + rows[:, None] * stride_logits_row + c[None, :], mask=mask, other=0.0)
        log_p = z.to(tl.float32) * inv_temperature - lse[:, None]
        p = tl.exp(log_p)
        onehot = tl.where(c[None, :] == targets[:, None], 1.0, 0.0)
        dz = g[:, None] * (onehot - p)
        if WITH_ENTROPY_GRAD:
            dz -= g_entropy[:, None] * tl.where(p > 0, p * (log_p + entropy[:, None]), 0.0)
        dz = dz * inv_temperature
        tl.store(dlogits_ptr + rows[:, None] * stride_dlogits_row + c[None, :],
                 dz.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _grid(n_rows, rows_per_program):
    return (triton.cdiv(n_rows, rows_per_program),)


def loop_group(element_size: int, block_v: int) -> int:
    """The grouped loop's group: the logits one thread loads with one 16-byte vector load (8 bf16,
    4 fp32), so that the group's max needs no exchange between threads."""
    return min(16 // element_size, block_v)


def triton_forward(logits, targets, inv_temperature, with_entropy, logp_alpha=None, *,
                   rows_per_program, block_v, num_warps, split=1, lanewise=False, prefetch=False,
                   grouped=False, num_stages=None):
    """Same contract as torch_forward (+ log_ratio when logp_alpha is given). split=1: one Triton
    launch, a program per rows_per_program rows over the whole vocabulary; split > 1: each row's
    vocabulary over `split` programs (logprob_partial_kernel) then one small merge launch
    (logprob_combine_kernel). lanewise, prefetch, grouped: the loop variants of _row_stats (grouped
    implies lanewise; its group is one 16-byte vector load of the logits' dtype). num_stages:
    Triton's software pipelining depth (None: Triton's default)."""
    n_rows, n_cols = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    logp, lse = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
    entropy = torch.empty(n_rows, **f32) if with_entropy else None
    log_ratio = torch.empty(n_rows, **f32) if logp_alpha is not None else None
    if n_rows == 0:
        return logp, lse, entropy, log_ratio
    stages = {} if num_stages is None else {"num_stages": num_stages}
    group = loop_group(logits.element_size(), block_v) if grouped else 1
    lanewise = lanewise or grouped
    outputs = (logp_alpha if logp_alpha is not None else logp, logp, lse,
               log_ratio if log_ratio is not None else logp, entropy if with_entropy else logp)
    if split == 1:
        logprob_fwd_kernel[_grid(n_rows, rows_per_program)](
            logits, logits.stride(0), targets, *outputs,
            n_rows, n_cols, float(inv_temperature),
            ROWS=rows_per_program, BLOCK_V=block_v,
            HAS_ALPHA=logp_alpha is not None, WITH_ENTROPY=with_entropy,
            LANEWISE=lanewise, PREFETCH=prefetch, GROUP=group, num_warps=num_warps, **stages,
        )
        return logp, lse, entropy, log_ratio
    partial = torch.empty((3, split, n_rows), **f32)  # (m, s, w) of each slice of each row
    logprob_partial_kernel[(triton.cdiv(n_rows, rows_per_program), split)](
        logits, logits.stride(0), partial, n_rows, n_cols, split, float(inv_temperature),
        ROWS=rows_per_program, BLOCK_V=block_v, WITH_ENTROPY=with_entropy,
        LANEWISE=lanewise, PREFETCH=prefetch, GROUP=group, num_warps=num_warps, **stages,
    )
    combine_rows = 64
    logprob_combine_kernel[_grid(n_rows, combine_rows)](
        partial, logits, logits.stride(0), targets, *outputs, n_rows, split, float(inv_temperature),
        ROWS=combine_rows, SPLIT_BLOCK=triton.next_power_of_2(split),
        HAS_ALPHA=logp_alpha is not None, WITH_ENTROPY=with_entropy, num_warps=4,
    )
    return logp, lse, entropy, log_ratio


def triton_backward(logits, targets, lse, grad_logp, entropy, grad_entropy, inv_temperature, out, *,
                    rows_per_program, block_v, num_warps):
    """Same contract as torch_backward, one Triton launch."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    with_entropy_grad = grad_entropy is not None
    logprob_bwd_kernel[_grid(n_rows, rows_per_program)](
        logits, logits.stride(0), out, out.stride(0), targets, lse, grad_logp,
        entropy if with_entropy_grad else lse, grad_entropy if with_entropy_grad else lse,
        n_rows, n_cols, float(inv_temperature),
        ROWS=rows_per_program, BLOCK_V=block_v, WITH_ENTROPY_GRAD=with_entropy_grad,
        num_warps=num_warps,
    )


# --------------------------------------------------------------------------- autograd


class LogprobImpl:
    """One backend's (forward, backward) pair with its launch parameters bound.

    rows_per_program, block_v, num_warps: both Triton kernels. forward_block_v (default block_v),
    split, lanewise, prefetch, grouped, num_stages: the forward only (see triton_forward);
    kernels.KernelConfig picks them (its forward_loop)."""

    def __init__(self, backend: str, rows_per_program: int = 1, block_v: int = 4096, num_warps: int = 8, *,
                 forward_block_v=None, split: int = 1, lanewise: bool = False, prefetch: bool = False,
                 grouped: bool = False, num_stages=None):
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend: must be 'torch' or 'triton', got {backend!r}")
        if not isinstance(split, int) or isinstance(split, bool) or split < 1:
            raise ValueError(f"split: must be an integer >= 1 (programs per row), got {split!r}")
        self.backend = backend
        self.launch = dict(rows_per_program=rows_per_program, block_v=block_v, num_warps=num_warps)
        self.forward_launch = dict(self.launch, block_v=forward_block_v or block_v, split=split,
                                   lanewise=bool(lanewise), prefetch=bool(prefetch), grouped=bool(grouped),
                                   num_stages=num_stages)

    def forward(self, logits, targets, inv_temperature, with_entropy, logp_alpha=None):
        if self.backend == "torch":
            return torch_forward(logits, targets, inv_temperature, with_entropy, logp_alpha)
        return triton_forward(logits, targets, inv_temperature, with_entropy, logp_alpha, **self.forward_launch)

    def backward(self, logits, targets, lse, grad_logp, entropy, grad_entropy, inv_temperature, out):
        if self.backend == "torch":
            return torch_backward(logits, targets, lse, grad_logp, entropy, grad_entropy, inv_temperature, out)
        return triton_backward(logits, targets, lse, grad_logp, entropy, grad_entropy, inv_temperature, out,
                               **self.launch)


def merge_grads(targets, *grads):
    """Sum the upstream gradients that exist (None = output unused) into one fp32 [N], 0 on ignored rows."""
    present = [g.float() for g in grads if g is not None]
    if not present:
        return torch.zeros(targets.shape[0], dtype=torch.float32, device=targets.device)
    total = present[0] if len(present) == 1 else sum(present)
    return torch.where(targets >= 0, total, 0.0).contiguous()


class TokenLogprobs(torch.autograd.Function):
    """logits [N, V] -> (logp [N], log_ratio [N] or None, entropy [N] or None), all fp32."""

    @staticmethod
    def forward(ctx, logits, targets, logp_alpha, inv_temperature, with_entropy, impl):
        logp, lse, entropy, log_ratio = impl.forward(logits, targets, inv_temperature, with_entropy, logp_alpha)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.inv_temperature, ctx.impl = inv_temperature, impl
        ctx.set_materialize_grads(False)
        return logp, log_ratio, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_log_ratio, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        # d(logp - logp_alpha)/dlogits = dlogp/dlogits: logp_alpha is data from the sampler.
        g = merge_grads(targets, grad_logp, grad_log_ratio)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().contiguous()
        dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        ctx.impl.backward(logits, targets, lse, g, entropy, grad_entropy, ctx.inv_temperature, dlogits)
        return dlogits, None, None, None, None, None
