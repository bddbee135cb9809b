"""The fused kernels: Triton on CUDA, plain torch on CPU, chosen here.

    token_logprobs(logits, targets, temperature, logp_alpha, with_entropy)  -> (logp, log_ratio, entropy)
    lm_head_logprobs(hidden, weight, targets, temperature, chunk_tokens, with_entropy) -> (logp, entropy)
    grpo_objective(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg)  -> (loss, stats)     [Triton]
    lm_head_objective(hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg, *,
                      objective_fn, with_entropy, ...)                     -> (loss, stats, logp, entropy)

Memory: lm_head_logprobs / lm_head_objective never hold more than one [chunk_tokens, V] block of
logits (bench/kernels.py measures it against the naive path; docs/benchmarks). lm_head_logprobs
recomputes the logits slab by slab in backward (4 matmuls instead of 3); lm_head_objective, when the
loss is exactly the objective of logp, computes the gradients during the forward (by slabs as
lm_head_logprobs' backward, or by token chunks in 3 matmuls: KernelConfig.objective_grads). Logits are fp32 whatever the weights' dtype (see lm_head.py).
Target ids < 0 are ignored rows.

backend (KernelConfig.backend, the `kernels.backend` config key; the `backend=` argument of each
function overrides it):
  "auto"    Triton for CUDA tensors, torch otherwise (the default: what the trainer should use);
  "triton"  Triton always; on CPU tensors only when TRITON_INTERPRET=1 was set before triton was
            imported (how the tests run the kernels through the interpreter), else a ValueError;
  "torch"   plain torch everywhere (to rule a kernel out while debugging).
The loss is the exception: torch is its definition (grpo/losses.py), and the Triton loss kernel
runs only for the losses and IS-weight corrections it has a code for (kernels/loss.py LOSS_CODES,
CORRECTION_CODES, per-token ones only); for any other the objective's torch definition runs, on
CUDA too (grpo.kernel_dispatch.objective_fn_for warns once), and a loss that needs whole sequences
(GSPO) goes through lm_head_logprobs and autograd instead of lm_head_objective.

kernels/ imports nothing from grpo/. The objective's maths lives in grpo/losses.py and
grpo/objective.py (the source of truth); kernels/loss.py is the fused Triton version of its
per-token losses, kernels/contract.py what the two share (input checks, statistic names). Where a
torch objective is wanted (lm_head_objective on CPU, or a loss without a kernel), the caller
passes it as `objective_fn` (grpo.kernel_dispatch.objective_fn_for picks). Every op is in its own module:
kernels/logprobs.py, kernels/lm_head.py, kernels/loss.py, each with its Triton kernels, its torch
implementation and its autograd.Function; kernels/aot.py compiles every Triton variant for sm_90
without a GPU (python -m kernels.aot).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .contract import STAT_KEYS, check_objective_inputs, check_weights
from .lm_head import LMHeadLogprobs, LMHeadObjective
from .logprobs import LogprobImpl, TokenLogprobs
from .loss import (CORRECTION_CODES, LOSS_CODES, GRPOObjective, check_stat_slots, missing_kernel,
                   triton_objective)

BACKENDS = ("auto", "triton", "torch")


@dataclass
class KernelConfig:
    """Knobs of the fused kernels; the defaults are what the trainer should use."""

    backend: Literal["auto", "triton", "torch"] = "auto"  # auto: Triton on CUDA tensors, torch on CPU
    chunk_tokens: int = 256  # tokens per LM-head chunk: one [chunk_tokens, V] logits block alive at a time
    rows_per_program: Optional[int] = None  # rows per Triton program; None: 1 on GPU, 16 in the interpreter
    block_v: Optional[int] = None  # vocab columns per Triton tile (power of 2); None: 4096 GPU, 2048 interpreter
    num_warps: int = 8  # warps per Triton program of the log-prob kernels
    # The log-prob forward's loop (kernels/logprobs.py, _row_stats). grouped: a running max and sums
    # per group of the logits one thread loads with one vector load, rescaled once per group (on an
    # H200, bf16 with the entropy: 80-93% of HBM peak, 1.29-1.35x the lane-wise loop); lanewise: the
    # same per lane, rescaled at every logit with selects (1.2-1.4x the block-wise loop in bf16);
    # both load the next tile while they reduce this one (docs/benchmarks/gpu-h200.md); blockwise: a
    # max and a sum across the tile every step.
    forward_loop: Literal["grouped", "lanewise", "blockwise"] = "grouped"
    loss_block: int = 1024  # tokens per Triton program of the loss kernel (power of 2)
    # How lm_head_objective computes its gradients (kernels/lm_head.py weighs the two): "slabs"
    # (4 GEMMs, each weight-gradient slab final after one GEMM over every token: 1.21x the naive
    # head's time and 0.046x its memory on an H200 at Qwen2.5-0.5B sizes), "chunks" (3 GEMMs, an
    # fp32 [V, H] accumulator that each token chunk reads and writes: 1.57x and 0.158x there);
    # "auto": slabs on CUDA, chunks elsewhere (a CPU pays for flops, not for the accumulator).
    objective_grads: Literal["auto", "slabs", "chunks"] = "auto"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be an integer >= 1, got {self.chunk_tokens!r}")
        if self.rows_per_program is not None and not _is_pow2(self.rows_per_program):
            raise ValueError(f"rows_per_program: must be a power of 2 (a Triton tile dim), got {self.rows_per_program!r}")
        if self.block_v is not None and (not _is_pow2(self.block_v) or self.block_v < 16):
            raise ValueError(f"block_v: must be a power of 2 >= 16, got {self.block_v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps: must be a power of 2 in [1, 32], got {self.num_warps!r}")
        if self.forward_loop not in ("grouped", "lanewise", "blockwise"):
            raise ValueError(f"forward_loop: must be 'grouped', 'lanewise' or 'blockwise', got {self.forward_loop!r}")
        if self.objective_grads not in ("auto", "slabs", "chunks"):
            raise ValueError(f"objective_grads: must be 'auto', 'slabs' or 'chunks', got {self.objective_grads!r}")
        if not _is_pow2(self.loss_block) or self.loss_block < 16:
            raise ValueError(f"loss_block: must be a power of 2 >= 16, got {self.loss_block!r}")


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and (x & (x - 1)) == 0


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'triton' or 'torch' for tensors on `device`; a clear error when Triton cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not triton_interpreter_on():
        raise ValueError(
            f"backend: 'triton' on a {device.type} tensor needs the Triton interpreter "
            "(TRITON_INTERPRET=1 in the environment before triton is imported); use 'torch' or 'auto'"
        )
    return backend


def _pick(backend: str, config: Optional[KernelConfig]) -> KernelConfig:
    """The config to use: `config` (default KernelConfig()) with its backend replaced by `backend`
    unless that is "auto"."""
    config = config or KernelConfig()
    if backend != "auto":
        config = KernelConfig(**{**config.__dict__, "backend": backend})
    return config


def _logprob_impl(config: KernelConfig, device: torch.device, n_cols: int) -> LogprobImpl:
    """The log-prob implementation and launch parameters for tensors on `device` with n_cols columns."""
    if resolve_backend(config.backend, device) == "torch":
        return LogprobImpl("torch")
    on_gpu = device.type == "cuda"
    rows = config.rows_per_program or (1 if on_gpu else 16)
    fits = max(16, 1 << (n_cols - 1).bit_length())
    block_v = min(config.block_v or (4096 if on_gpu else 2048), fits)
    grouped = config.forward_loop == "grouped"
    lanewise = grouped or config.forward_loop == "lanewise"
    # the lane-wise forward's best tile on an H200 (bench/logprob_bandwidth.py) is 2048 wide
    forward_block_v = min(config.block_v or (2048 if lanewise else block_v), fits)
    return LogprobImpl("triton", rows_per_program=rows, block_v=block_v, num_warps=config.num_warps,
                       forward_block_v=forward_block_v, lanewise=lanewise, prefetch=lanewise, grouped=grouped)


def _check_targets(targets: torch.Tensor, n_rows: int, n_cols: int, what: str):
    if targets.dim() != 1 or targets.shape[0] != n_rows:
        raise ValueError(f"targets: expected shape [{n_rows}] (one id per row of {what}), got {list(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets: expected int64 or int32 token ids, got {targets.dtype}")
    if n_rows and int(targets.max()) >= n_cols:
        raise ValueError(f"targets: id {int(targets.max())} out of range for a vocabulary of {n_cols}")


def _check_lm_head(hidden, weight, targets) -> tuple[int, int]:
    """Shapes and dtypes of the fused LM-head entry points; returns (N, V)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden/weight: expected [N, H] and [V, H], got {list(hidden.shape)} and {list(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden/weight: dtypes differ ({hidden.dtype} vs {weight.dtype}); cast one first")
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    _check_targets(targets, n_rows, n_cols, "hidden")
    return n_rows, n_cols


def _check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature!r}")
    return 1.0 / float(temperature)


def token_logprobs(logits, targets, temperature=1.0, logp_alpha=None, with_entropy=False, backend="auto",
                   config: Optional[KernelConfig] = None):
    """Log-prob of each row's target under softmax(logits / temperature).

    logits [N, V] fp32/bf16/fp16 (any row stride, columns contiguous), targets [N] int (negative =
    ignored row: logp 0, no gradient). Returns (logp [N] fp32, logp - logp_alpha [N] fp32 or None,
    entropy [N] fp32 or None); all three differentiable w.r.t. logits. `backend` other than "auto"
    overrides config.backend."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, V], got shape {list(logits.shape)} (flatten batch and time first)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_rows, n_cols = logits.shape
    _check_targets(targets, n_rows, n_cols, "logits")
    if logp_alpha is not None and logp_alpha.shape != (n_rows,):
        raise ValueError(f"logp_alpha: expected shape [{n_rows}], got {list(logp_alpha.shape)}")
    inv_temperature = _check_temperature(temperature)
    config = _pick(backend, config)
    impl = _logprob_impl(config, logits.device, n_cols)
    targets = targets.to(torch.int64).contiguous()  # the kernels are compiled for int64 ids
    if logp_alpha is not None:
        logp_alpha = logp_alpha.detach().float().contiguous()
    logp, log_ratio, entropy = TokenLogprobs.apply(logits, targets, logp_alpha, inv_temperature,
                                                   bool(with_entropy), impl)
    return logp, log_ratio, entropy


def lm_head_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=None, with_entropy=False,
                     backend="auto", config: Optional[KernelConfig] = None):
    """token_logprobs(hidden @ weight^T, ...) without materialising the [N, V] logits.

    hidden [N, H], weight [V, H] (same dtype), targets [N]. Returns (logp [N] fp32, entropy [N] fp32
    or None), differentiable w.r.t. hidden and weight. chunk_tokens (default config.chunk_tokens)
    bounds the live logits to [chunk_tokens, V]."""
    n_rows, n_cols = _check_lm_head(hidden, weight, targets)
    inv_temperature = _check_temperature(temperature)
    config = _pick(backend, config)
    if chunk_tokens is not None:
        config = KernelConfig(**{**config.__dict__, "chunk_tokens": chunk_tokens})
    impl = _logprob_impl(config, hidden.device, n_cols)
    logp, entropy = LMHeadLogprobs.apply(hidden, weight, targets.to(torch.int64).contiguous(), inv_temperature,
                                         bool(with_entropy), config.chunk_tokens, impl)
    return logp, entropy


def grpo_objective(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, backend="auto",
                   config: Optional[KernelConfig] = None):
    """The fused Triton loss: grpo.objective.objective's arguments and (loss, stats) contract, in one
    pass that computes the loss, d loss / d logp and every statistic. Triton only: on a device
    where Triton cannot run, the same error as resolve_backend (the torch reference is
    grpo.objective.objective itself); for a loss or correction without a kernel (missing_kernel),
    a ValueError naming it."""
    config = _pick(backend, config)
    if resolve_backend("triton" if config.backend == "auto" else config.backend, logp.device) != "triton":
        raise ValueError("backend: grpo_objective is the Triton kernel; use grpo.objective.objective for torch")
    why = missing_kernel(cfg)
    if why is not None:
        raise ValueError(f"{why}; use grpo.objective.objective, its torch definition")
    check_weights(weights, logp)
    adv = check_objective_inputs(logp, logp_alpha, logp_k, logp_ref, adv, cfg.beta)
    try:
        adv = adv.expand(logp.shape)
    except RuntimeError:
        raise ValueError(f"adv: shape {tuple(adv.shape)} does not broadcast per token over {tuple(logp.shape)}") from None
    loss, stats = GRPOObjective.apply(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, config.loss_block)
    return loss, {key: stats[i] for i, key in enumerate(STAT_KEYS)}


def _grads_by_slabs(config: KernelConfig, device: torch.device) -> bool:
    if config.objective_grads == "auto":
        return device.type == "cuda"
    return config.objective_grads == "slabs"


def lm_head_objective(hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg, *, objective_fn,
                      temperature=1.0, with_entropy=False, chunk_tokens=None, backend="auto",
                      config: Optional[KernelConfig] = None):
    """objective(lm_head_logprobs(hidden, weight, targets, temperature), ...) in one call that
    computes the gradients of hidden and weight during the forward (KernelConfig.objective_grads:
    by vocabulary slabs, 4 matmuls, or by token chunks, 3 matmuls and an fp32 [V, H] accumulator).

    Per-token tensors (logp_alpha, logp_k or None, logp_ref or None, adv, weights) are flat [N],
    aligned with the rows of hidden; targets < 0 are ignored rows (give them weight 0 too).
    objective_fn(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, block) -> (loss, stats
    vector, grad_logp): kernels.triton_objective or the caller's torch reference
    (grpo.kernel_dispatch.objective_with_grad). Returns (loss, stats keyed by STAT_KEYS, logp [N] detached,
    entropy [N] detached or None): with_entropy adds each row's entropy of softmax(z / T), from the
    same logits (not differentiated: the loss has no entropy term). Use it when the loss is exactly
    the objective of logp (nothing else differentiates logp)."""
    n_rows, n_cols = _check_lm_head(hidden, weight, targets)
    for name, t in (("logp_alpha", logp_alpha), ("logp_k", logp_k), ("logp_ref", logp_ref), ("adv", adv),
                    ("weights", weights)):
        if t is not None and t.shape != (n_rows,):
            raise ValueError(f"{name}: expected a flat [{n_rows}] tensor aligned with hidden's rows, got {list(t.shape)}")
    if cfg.beta > 0 and logp_ref is None:
        raise ValueError("logp_ref: beta > 0 needs the reference policy's log-probs")
    inv_temperature = _check_temperature(temperature)
    config = _pick(backend, config)
    if chunk_tokens is not None:
        config = KernelConfig(**{**config.__dict__, "chunk_tokens": chunk_tokens})
    impl = _logprob_impl(config, hidden.device, n_cols)
    flat = [None if t is None else t.detach().float().contiguous() for t in (logp_alpha, logp_k, logp_ref, adv, weights)]
    loss, stats, logp, entropy = LMHeadObjective.apply(
        hidden, weight, targets.to(torch.int64).contiguous(), *flat, cfg, inv_temperature, config.chunk_tokens,
        impl, objective_fn, config.loss_block, bool(with_entropy), _grads_by_slabs(config, hidden.device))
    return loss, {key: stats[i] for i, key in enumerate(STAT_KEYS)}, logp, entropy


__all__ = ["KernelConfig", "token_logprobs", "lm_head_logprobs", "grpo_objective", "lm_head_objective",
           "triton_objective", "resolve_backend", "BACKENDS", "STAT_KEYS", "LOSS_CODES", "CORRECTION_CODES",
           "missing_kernel", "check_stat_slots"]
