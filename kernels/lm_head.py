"""Fused LM head + token log-probs: hidden [N, H] and lm_head weight [V, H] -> logp [N], in chunks
so that the [N, V] logits never exist.

Forward, per chunk of tokens c:   logits_c = hidden_c @ weight^T;   (logp, lse, entropy)_c = log-prob
                                  kernel (at most one [chunk_tokens, V] block alive).
Backward, per slab of the vocabulary s (columns v0..v1), over the rows with a gradient (padding and
ignored rows dropped first):
                                  recompute logits_s = hidden @ weight[s]^T (one extra matmul),
                                  overwrite it in place with dlogits_s = g (onehot - p) / T (+ entropy
                                  term; p from the forward's lse, so a slab needs no other column),
                                  grad_weight[s]  = dlogits_s^T @ hidden   (the slab's rows, final)
                                  grad_hidden    += dlogits_s @ weight[s]  (fp32 [N, H])
Slabs rather than token chunks in the backward: each slab of the weight gradient is complete after
one GEMM over all tokens (fp32 accumulation inside the GEMM, rounded once into the weight's dtype),
so no fp32 [V, H] accumulator exists (519 MB at Qwen2.5-0.5B's V x H; docs/benchmarks). The fp32
accumulator moves to grad_hidden, N x H. `slab_columns` sizes a slab so that its temporaries (fp32
dlogits, their bf16 copy for the GEMMs, the fp32 slab of the weight gradient) hold no more than the
forward's one [chunk_tokens, V] fp32 block.

Why recompute instead of computing the gradients during the forward (as fused linear-cross-entropy
does): our output is a per-token logp whose upstream gradient g_i is not known at forward time, and
grad_weight = sum_i g_i (onehot_i - p_i)^T hidden_i / T mixes all tokens' g_i with [V]-sized rows,
so it cannot be prepared without keeping [N, V] of state. Recomputing costs one matmul of the three
of a plain forward+backward (4 GEMMs instead of 3). LMHeadObjective, whose loss IS a function of
logp alone, knows every g_i at the end of its forward and computes the gradients there, by one of
two plans (`objective_grads`):
  "slabs"   the chunked forward gives every token's g and lse, then the slab backward above runs
            inside the forward: 4 GEMMs, each slab of the weight gradient final after one large
            GEMM, no [V, H] accumulator. On an H200 at Qwen2.5-0.5B sizes (bf16, 2048 tokens):
            1.21x the naive head's time and 0.046x its memory above the gradients
            (docs/benchmarks/gpu-h200.md).
  "chunks"  dlogits of each token chunk as soon as its logits exist: 3 GEMMs, but each chunk's
            weight-gradient GEMM (K = chunk_tokens) reads and writes a whole fp32 [V, H]
            accumulator (519 MB at 0.5B sizes): 1.57x and 0.158x in the same run. On a CPU, where
            the GEMMs' flops are the cost, the saved GEMM is worth more (0.68x the slabs' time at
            SmolLM2-135M sizes on 2 AVX2 cores).

Numerics: logits are always fp32, whatever the weights' dtype. bf16 logits have a rounding step of
0.125 at |z| ~ 16-32; divided by the paper's temperature 0.1 that is up to ~0.6 nat of log-prob
error, which the ratio pi/alpha, the IS weight and the TV/KL diagnostics would all carry. How fp32
logits come out of bf16 operands is `gemm_strategy`'s decision (per device and dtype): cuBLAS's
bf16-in / fp32-out GEMMs on CUDA (fp32 accumulation at bf16 tensor-core speed); on a CPU, fp32
GEMMs of the bf16 values, in a bf16 math mode that multiplies them exactly and accumulates in fp32
where the CPU's platform code registered one (grpo/cpu/bf16.py: oneDNN's mode, where this CPU
honours it), else IEEE fp32 GEMMs of upcast operands. The two gradient GEMMs take the bf16-rounded
dlogits on CUDA and in the bf16 math mode, as any bf16 backward does. No host synchronisation inside
the chunk loops.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch

from .logprobs import LogprobImpl, merge_grads

MIXED_GEMM = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out")


# A CPU whose fp32 GEMMs can run as bf16 x bf16 -> fp32 (the CPU's twin of CUDA's out_dtype GEMMs)
# registers a context manager for that mode here, from outside (grpo/cpu/bf16.py decides by what the
# CPU does); None: the head's bf16 GEMMs on a CPU are fp32 GEMMs of upcast operands.
CPU_BF16_GEMMS: Optional[Callable[[], ContextManager]] = None


def set_cpu_bf16_gemms(context: Optional[Callable[[], ContextManager]]) -> None:
    """Register (or with None remove) the CPU's bf16-math context for the head's GEMMs."""
    global CPU_BF16_GEMMS
    CPU_BF16_GEMMS = context


def gemm_strategy(device_type: str, dtype: torch.dtype, mixed_gemm_available: bool = MIXED_GEMM,
                  cpu_bf16_math: Optional[bool] = None) -> str:
    """How the LM head's GEMMs give fp32 logits (and fp32 weight gradients) from `dtype` operands:
    "native" (fp32 operands), "out_dtype" (bf16/fp16 operands, fp32 output and accumulation:
    torch.mm / torch.addmm with out_dtype, CUDA), "bf16_math" (bf16 operands on a CPU whose fp32
    GEMMs run in a registered bf16 math mode: exact products of the bf16 values with fp32
    accumulation and output, the CPU's equivalent of out_dtype), or "upcast" (an IEEE fp32 GEMM of
    upcast operands: any other CPU, fp16 on CPU, or a CUDA torch without out_dtype).
    cpu_bf16_math: None reads whether a mode is registered (set_cpu_bf16_gemms)."""
    if cpu_bf16_math is None:
        cpu_bf16_math = CPU_BF16_GEMMS is not None
    if dtype == torch.float32 or dtype == torch.float64:
        return "native"
    if device_type == "cuda" and mixed_gemm_available and dtype in (torch.bfloat16, torch.float16):
        return "out_dtype"
    if device_type == "cpu" and cpu_bf16_math and dtype == torch.bfloat16:
        return "bf16_math"
    return "upcast"


# Whether torch.addmm with out_dtype=fp32 accepts an fp32 `self` beside bf16/fp16 mats (decided by
# the op itself on first use). Its CUDA contract changed between torch releases: some require `self`
# in the mats' dtype ("self and mat2 must have the same dtype"), later ones allow out_dtype.
ADDMM_ACCUMULATES_IN_OUT_DTYPE: Optional[bool] = None


def accumulate_out_dtype(acc: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, addmm=None, mm=None) -> str:
    """acc (fp32) += mat1 @ mat2 (bf16/fp16 operands, fp32 accumulation and output): one fused GEMM
    that accumulates into acc where torch.addmm's out_dtype contract allows an fp32 `self`, else the
    same sum as an out_dtype GEMM into a temporary and an add (the fp32 product is rounded once either
    way). The contract is checked before any work, so a refusal costs nothing; the answer is kept.
    Returns the path taken ("addmm" or "mm+add"). addmm / mm: torch's, replaceable in tests."""
    global ADDMM_ACCUMULATES_IN_OUT_DTYPE
    addmm = addmm or torch.addmm
    mm = mm or torch.mm
    if ADDMM_ACCUMULATES_IN_OUT_DTYPE is not False:
        try:
            addmm(acc, mat1, mat2, out_dtype=torch.float32, out=acc)
            ADDMM_ACCUMULATES_IN_OUT_DTYPE = True
            return "addmm"
        except RuntimeError as e:
            if "dtype" not in str(e) or ADDMM_ACCUMULATES_IN_OUT_DTYPE:
                raise
            ADDMM_ACCUMULATES_IN_OUT_DTYPE = False
    acc.add_(mm(mat1, mat2, out_dtype=torch.float32))
    return "mm+add"


class _HeadGemms:
    """The three GEMMs of the chunked LM head under one strategy (operands prepared once per call)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.strategy = gemm_strategy(weight.device.type, weight.dtype)
        # upcast, bf16_math: one fp32 copy of the weight per call, not one per chunk
        self.weight32 = weight.float() if self.strategy in ("upcast", "bf16_math") else weight
        self.math = CPU_BF16_GEMMS if self.strategy == "bf16_math" else contextlib.nullcontext

    def logits(self, hidden_c: torch.Tensor) -> torch.Tensor:
        """[c, V] fp32 = hidden_c @ weight^T."""
        if self.strategy == "out_dtype":
            return torch.mm(hidden_c, self.weight.t(), out_dtype=torch.float32)
        with self.math():
            return hidden_c.to(self.weight32.dtype) @ self.weight32.t()

    def grad_hidden(self, dlogits: torch.Tensor, out: torch.Tensor) -> None:
        """out [c, H] (hidden's dtype) = dlogits [c, V] fp32 @ weight."""
        if self.strategy in ("out_dtype", "bf16_math") and out.dtype == self.weight.dtype:
            # bf16 operands as in any bf16 backward (dlogits rounded once), fp32 accumulation inside
            # (cuBLAS; a CPU's registered bf16 math mode), the output in hidden's bf16.
            torch.mm(dlogits.to(self.weight.dtype), self.weight, out=out)
        elif out.dtype == self.weight32.dtype:
            torch.mm(dlogits, self.weight32, out=out)
        else:
            out.copy_(dlogits @ self.weight32)

    def accumulate_grad_weight(self, grad_weight: torch.Tensor, dlogits: torch.Tensor, hidden_c: torch.Tensor) -> None:
        """grad_weight [V, H] fp32 += dlogits^T @ hidden_c, in place (no [V, H] temporary where the
        GEMM can accumulate into it)."""
        if self.strategy == "out_dtype":
            accumulate_out_dtype(grad_weight, dlogits.t().to(hidden_c.dtype), hidden_c)
        else:
            with self.math():  # bf16_math: dlogits rounded to bf16 inside, as out_dtype's cast above
                grad_weight.addmm_(dlogits.t(), hidden_c.to(grad_weight.dtype))


    def slab_logits(self, hidden: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """[n, v1 - v0] fp32 = hidden @ weight[v0:v1]^T."""
        if self.strategy == "out_dtype":
            return torch.mm(hidden, self.weight[v0:v1].t(), out_dtype=torch.float32)
        with self.math():
            return hidden.to(self.weight32.dtype) @ self.weight32[v0:v1].t()

    def slab_grads(self, dlogits: torch.Tensor, hidden: torch.Tensor, v0: int, v1: int,
                   grad_weight: Optional[torch.Tensor], grad_hidden: Optional[torch.Tensor]) -> None:
        """grad_weight[v0:v1] = dlogits^T @ hidden (fp32 sums over every token, rounded once into
        grad_weight's dtype); grad_hidden (fp32) += dlogits @ weight[v0:v1]. dlogits [n, v1 - v0]
        fp32; on out_dtype and bf16_math it enters both GEMMs rounded to bf16, as any bf16 backward."""
        if self.strategy == "out_dtype":
            d = dlogits.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight[v0:v1].copy_(torch.mm(d.t(), hidden, out_dtype=torch.float32))
            if grad_hidden is not None:
                accumulate_out_dtype(grad_hidden, d, self.weight[v0:v1])
            return
        with self.math():
            if grad_weight is not None:
                grad_weight[v0:v1].copy_(dlogits.t() @ hidden.to(self.weight32.dtype))
            if grad_hidden is not None:
                grad_hidden.addmm_(dlogits, self.weight32[v0:v1])


def slab_columns(n_rows: int, hidden_size: int, vocab: int, chunk_tokens: int) -> int:
    """Vocabulary columns per backward slab: its temporaries (fp32 dlogits [n, s] and their bf16
    copy, 6 n s bytes; the fp32 weight-gradient slab [s, H], 4 s H) within the forward's fp32
    [chunk_tokens, V] block (4 chunk_tokens V bytes); a multiple of 128, at least 128."""
    cols = 4 * chunk_tokens * vocab // max(1, 6 * n_rows + 4 * hidden_size)
    return max(128, min(vocab, cols) // 128 * 128)


def _chunks(n_rows: int, chunk_tokens: int):
    for c0 in range(0, n_rows, chunk_tokens):
        yield c0, min(n_rows, c0 + chunk_tokens)


def slab_backward(hidden, weight, targets, lse, g, entropy, grad_entropy, inv_temperature, chunk_tokens,
                  impl: LogprobImpl, need_hidden: bool, need_weight: bool):
    """(grad_hidden or None, grad_weight or None) of sum_i g_i logp_i (+ grad_entropy_i entropy_i),
    slab by slab of the vocabulary (the module's docstring): g [N] fp32, 0 on ignored rows; lse and
    entropy from the forward; grad_weight in weight's dtype, every row of it written."""
    live = g != 0
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
        live |= grad_entropy != 0
    # Rows with no gradient at all (padding, ignored tokens) cost nothing: which ones, in ONE
    # host sync per call; the slabs run over the others.
    rows = live.nonzero().squeeze(1)
    n_live = rows.numel()
    every_row = n_live == hidden.shape[0]

    def live_part(t):
        return None if t is None else (t if every_row else t.index_select(0, rows))

    hidden_l, targets_l, lse_l, g_l = live_part(hidden), live_part(targets), live_part(lse), live_part(g)
    entropy_l, grad_entropy_l = live_part(entropy), live_part(grad_entropy)
    grad_weight = None
    if need_weight:  # written slab by slab, every row of it; zero where no token had a gradient
        grad_weight = (torch.empty if n_live else torch.zeros)(weight.shape, dtype=weight.dtype, device=weight.device)
    grad_hidden32 = torch.zeros(n_live, hidden.shape[1], dtype=torch.float32, device=hidden.device) if need_hidden else None
    gemms = _HeadGemms(weight)
    vocab = weight.shape[0]
    step = slab_columns(n_live, hidden.shape[1], vocab, chunk_tokens)
    for v0 in range(0, vocab if n_live and (need_hidden or need_weight) else 0, step):
        v1 = min(vocab, v0 + step)
        logits = gemms.slab_logits(hidden_l, v0, v1)
        # targets shifted into the slab's columns: a target outside them adds no one-hot term
        impl.backward(logits, targets_l - v0, lse_l, g_l, entropy_l, grad_entropy_l, inv_temperature, out=logits)
        gemms.slab_grads(logits, hidden_l, v0, v1, grad_weight, grad_hidden32)
        del logits
    grad_hidden = None
    if need_hidden:
        grad_hidden = grad_hidden32.to(hidden.dtype) if every_row else torch.zeros_like(hidden).index_copy_(
            0, rows, grad_hidden32.to(hidden.dtype))
    return grad_hidden, grad_weight


class LMHeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logp [N] fp32, entropy [N] fp32 or None)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature, with_entropy, chunk_tokens, impl: LogprobImpl):
        n_rows = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp, lse = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
        entropy = torch.empty(n_rows, **f32) if with_entropy else None
        gemms = _HeadGemms(weight)
        for c0, c1 in _chunks(n_rows, chunk_tokens):
            logits = gemms.logits(hidden[c0:c1])
            lp, ls, ent, _ = impl.forward(logits, targets[c0:c1], inv_temperature, with_entropy)
            logp[c0:c1], lse[c0:c1] = lp, ls
            if with_entropy:
                entropy[c0:c1] = ent
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temperature, ctx.chunk_tokens, ctx.impl = inv_temperature, chunk_tokens, impl
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight = slab_backward(
            hidden, weight, targets, lse, merge_grads(targets, grad_logp), entropy, grad_entropy,
            ctx.inv_temperature, ctx.chunk_tokens, ctx.impl, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None, None, None, None


class LMHeadObjective(torch.autograd.Function):
    """hidden, weight -> (loss, stats vector, logp, entropy) of the objective, gradients computed
    DURING the forward: the per-token objective gives d loss / d logp_i from token i alone, so every
    g_i is known once the chunked forward has run. grads_by_slabs: the slab backward
    (slab_backward) then runs inside the forward; else each chunk's dlogits and gradients are
    computed as soon as its logits are (3 matmuls, no recomputation, an fp32 [V, H] accumulator;
    the module's docstring weighs the two). Backward only scales them.

    All per-token inputs are flat [N] fp32 (adv per token); objective_fn(logp, logp_alpha, logp_k,
    logp_ref, adv, weights, cfg, block) -> (loss, stats vector, grad_logp) is the fused kernel
    (loss.triton_objective) or the caller's torch reference."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg,
                inv_temperature, chunk_tokens, impl: LogprobImpl, objective_fn, loss_block, with_entropy,
                grads_by_slabs):
        from .contract import merge_stat_vectors

        n_rows = hidden.shape[0]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        by_slabs = grads_by_slabs and (need_hidden or need_weight)
        in_chunks = not grads_by_slabs and (need_hidden or need_weight)
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if in_chunks and need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if in_chunks and need_weight else None
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp = torch.empty(n_rows, **f32)
        entropy = torch.empty(n_rows, **f32) if with_entropy else None
        lse, g = (torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)) if by_slabs else (None, None)
        loss, stats = None, None
        gemms = _HeadGemms(weight)

        def part(t, c0, c1):
            return None if t is None else t[c0:c1]

        for c0, c1 in _chunks(n_rows, chunk_tokens):
            hidden_c = hidden[c0:c1]
            logits = gemms.logits(hidden_c)
            logp_c, lse_c, entropy_c, _ = impl.forward(logits, targets[c0:c1], inv_temperature, with_entropy)
            logp[c0:c1] = logp_c
            if with_entropy:
                entropy[c0:c1] = entropy_c
            loss_c, stats_c, g_c = objective_fn(logp_c, logp_alpha[c0:c1], part(logp_k, c0, c1),
                                                part(logp_ref, c0, c1), adv[c0:c1], weights[c0:c1], cfg, loss_block)
            loss = loss_c if loss is None else loss + loss_c
            stats = merge_stat_vectors(stats, stats_c)
            g_c = torch.where(targets[c0:c1] >= 0, g_c, 0.0).contiguous()
            if by_slabs:
                lse[c0:c1], g[c0:c1] = lse_c, g_c
            elif in_chunks:
                impl.backward(logits, targets[c0:c1], lse_c, g_c, None, None, inv_temperature, out=logits)
                if need_hidden:
                    gemms.grad_hidden(logits, out=grad_hidden[c0:c1])
                if need_weight:
                    gemms.accumulate_grad_weight(grad_weight, logits, hidden_c)
            del logits
        if loss is None:  # no rows (an empty micro-batch): a zero loss that still reaches the graph
            loss, stats, _ = objective_fn(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, loss_block)
        if by_slabs:
            grad_hidden, grad_weight = slab_backward(hidden, weight, targets, lse, g, None, None, inv_temperature,
                                                     chunk_tokens, impl, need_hidden, need_weight)
        elif need_weight and weight.dtype != torch.float32:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        outputs = (stats, logp) + ((entropy,) if with_entropy else ())
        ctx.mark_non_differentiable(*outputs)
        return (loss, stats, logp, entropy)

    @staticmethod
    def backward(ctx, grad_loss, grad_stats, grad_logp, grad_entropy):
        if getattr(ctx, "used", False):
            raise RuntimeError("lm_head_objective: backward twice (retain_graph) is not supported: "
                               "its gradients are computed once in the forward and scaled in place")
        ctx.used = True
        grad_hidden, grad_weight = ctx.saved_tensors
        # The loss is a scalar: its gradients were computed for d loss = 1; rescale in place (a copy
        # of the weight gradient would cost another [V, H]). A device-side multiply, no host sync.
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_loss.to(grad.dtype))
        return (grad_hidden, grad_weight) + (None,) * 14
