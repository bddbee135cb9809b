"""Which path runs a config's objective, and the kernels it calls there.

  - a per-token loss with a fused Triton kernel (kernels/loss.py LOSS_CODES): on CUDA that kernel,
    inside kernels.lm_head_objective; on CPU the torch definition (grpo/objective.py) in the same place;
  - a per-token loss without a kernel: its torch definition inside lm_head_objective, on CUDA too
    (objective_fn_for warns once);
  - a loss or correction that needs whole sequences (grpo.losses.needs_sequences: GSPO, sequence /
    geometric corrections): kernels.lm_head_logprobs, then `objective` with each token's sequence,
    then autograd (objective_of_hidden).

The kernels' side of the objective: kernels/ imports nothing from grpo/, so what picks among its
ops for a config (and hands the torch definition to kernels.lm_head_objective) lives here, between
the registry (grpo/losses.py), the definition (grpo/objective.py) and the kernels.
tests/test_kernels_loss.py keeps every kernel equal to its torch definition (generated from the
registry), tests/test_kernels_lm_head.py the fused LM-head path against the plain head followed by
`objective`.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

import kernels
from grpo.losses import CORRECTIONS, LOSSES, needs_sequences
from grpo.objective import ObjectiveConfig, objective
from kernels.contract import STAT_KEYS


def objective_with_grad(logp: Tensor, logp_alpha: Tensor, logp_k: Optional[Tensor], logp_ref: Optional[Tensor],
                        adv: Tensor, weights: Tensor, cfg: ObjectiveConfig, block=None) -> tuple[Tensor, Tensor, Tensor]:
    """`objective` in the fused kernel's contract (kernels.triton_objective): flat inputs ->
    (loss, stats vector in kernels.contract.STAT_KEYS order, d loss / d logp), by autograd. Per-token
    configs only: the LM head calls it chunk by chunk, and a chunk may cut a sequence."""
    if needs_sequences(cfg):
        raise ValueError(f"loss {cfg.loss!r} with is_correction {cfg.correction!r} needs whole sequences: "
                         "use objective_of_hidden, not the fused LM head")
    with torch.enable_grad():
        leaf = logp.detach().requires_grad_()
        loss, stats = objective(leaf, logp_alpha, logp_k, logp_ref, adv, weights, cfg)
        (grad_logp,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), torch.stack([stats[key].float() for key in STAT_KEYS]), grad_logp


def has_kernel(cfg: ObjectiveConfig) -> bool:
    """Whether the fused Triton loss kernel computes cfg's objective (kernels.LOSS_CODES /
    CORRECTION_CODES name its loss and correction, and the objective is per token)."""
    return not needs_sequences(cfg) and kernels.missing_kernel(cfg) is None


def objective_path(cfg: ObjectiveConfig, device: torch.device, kernel_config: "kernels.KernelConfig") -> str:
    """How the trainer runs cfg's objective on `device`:
      "sequence": a loss or correction that needs whole sequences: kernels.lm_head_logprobs, then
                  `objective` with each token's sequence, then autograd (objective_of_hidden);
      "kernel":   kernels.lm_head_objective with the fused Triton loss (kernels.triton_objective);
      "torch":    kernels.lm_head_objective with this module's torch maths (objective_with_grad):
                  on CPU, and on CUDA for a per-token loss without a kernel."""
    if needs_sequences(cfg):
        return "sequence"
    if kernels.resolve_backend(kernel_config.backend, device) == "triton" and has_kernel(cfg):
        return "kernel"
    return "torch"


_warned: set = set()


def _warn_no_kernel(cfg: ObjectiveConfig, path: str) -> None:
    key = (cfg.loss, cfg.correction, path)
    if key in _warned:
        return
    _warned.add(key)
    why = ("it needs whole sequences: log-probs, then its torch definition with autograd" if path == "sequence"
           else f"{kernels.missing_kernel(cfg)}: its torch definition runs inside the fused LM head")
    warnings.warn(f"objective: loss {cfg.loss!r} with is_correction {cfg.correction!r} runs no Triton loss kernel "
                  f"on this device ({why})", stacklevel=3)


def objective_fn_for(device: torch.device, kernel_config: "kernels.KernelConfig",
                     cfg: Optional[ObjectiveConfig] = None):
    """The objective inside kernels.lm_head_objective: the fused Triton kernel where the kernels run
    Triton (CUDA; the interpreter in tests) and it has cfg's loss and correction, this module's torch
    maths elsewhere (a loss without a kernel warns once: it runs, never a KeyError). cfg None: the
    choice by device alone (the kernel on Triton). A config that needs whole sequences has no place
    here (objective_of_hidden runs it)."""
    if cfg is not None and needs_sequences(cfg):
        raise ValueError(f"loss {cfg.loss!r} with is_correction {cfg.correction!r} needs whole sequences, but the "
                         "fused LM head computes each token's gradient from that token alone: use objective_of_hidden")
    if kernels.resolve_backend(kernel_config.backend, device) == "triton":
        if cfg is None or has_kernel(cfg):
            return kernels.triton_objective
        _warn_no_kernel(cfg, "torch")
    return objective_with_grad


def check_objective_path(cfg: ObjectiveConfig, device: torch.device, kernel_config: "kernels.KernelConfig") -> str:
    """The trainer's start-up check of its objective (call once, before the first step): the path
    (objective_path); on a Triton device, one warning when the config runs no loss kernel, and where
    it does, a launch proving the kernel stores every statistic slot of kernels.contract (a RuntimeError
    naming the slots it leaves unwritten, which would otherwise be silent garbage)."""
    path = objective_path(cfg, device, kernel_config)
    if kernels.resolve_backend(kernel_config.backend, device) == "triton":
        if path == "kernel":
            kernels.check_stat_slots(cfg, has_ref=cfg.beta > 0, device=device)
        else:
            _warn_no_kernel(cfg, path)
    return path


def objective_of_hidden(hidden: Tensor, weight: Tensor, targets: Tensor, logp_alpha: Tensor, logp_k: Optional[Tensor],
                        logp_ref: Optional[Tensor], adv: Tensor, weights: Tensor, cfg: ObjectiveConfig, *,
                        seq_index: Optional[Tensor], temperature: float, with_entropy: bool,
                        kernel_config: "kernels.KernelConfig"
                        ) -> tuple[Tensor, dict[str, Tensor], Tensor, Optional[Tensor]]:
    """The objective of the LM head's log-probs, by the path cfg needs: kernels.lm_head_objective's
    arguments (flat [N] per-token tensors aligned with hidden's rows) plus seq_index [N], each
    token's sequence (required by the configs that need whole sequences); the same returns (loss, stats keyed by STAT_KEYS, logp [N] detached, entropy
    [N] detached or None).
      per-token configs: kernels.lm_head_objective with objective_fn_for(..., cfg) (gradients during
        the forward; backward is a multiply);
      configs that need whole sequences: kernels.lm_head_logprobs (differentiable), then `objective`
        with seq_index; backward goes through autograd (the head's backward recomputes its logits)."""
    if not needs_sequences(cfg):
        return kernels.lm_head_objective(
            hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg,
            objective_fn=objective_fn_for(hidden.device, kernel_config, cfg), temperature=temperature,
            with_entropy=with_entropy, config=kernel_config)
    if seq_index is None:
        raise ValueError(f"seq_index: loss {cfg.loss!r} with is_correction {cfg.correction!r} needs each token's "
                         "sequence (the micro-batch's seq_of_token)")
    logp, entropy = kernels.lm_head_logprobs(hidden, weight, targets, temperature=temperature,
                                             with_entropy=with_entropy, config=kernel_config)
    loss, stats = objective(logp, logp_alpha, logp_k, logp_ref, adv, weights, cfg, seq_index=seq_index)
    return loss, stats, logp.detach(), None if entropy is None else entropy.detach()


def _check_kernel_codes() -> None:
    """kernels/ names the losses and corrections it has kernels for; each must be a registered
    per-token one (a kernel without a torch definition would have nothing to be tested against)."""
    for name in kernels.LOSS_CODES:
        if name not in LOSSES or LOSSES[name].per != "token":
            raise RuntimeError(f"kernels/loss.py LOSS_CODES has a kernel for {name!r}, which grpo/losses.py does "
                               "not register as a per-token loss")
        if LOSSES[name].anchored != (name in kernels.loss.ANCHORED_LOSSES):
            raise RuntimeError(f"kernels/loss.py ANCHORED_LOSSES and grpo/losses.py disagree on whether {name!r} "
                               "reads ratio_anchor")
    for name in kernels.CORRECTION_CODES:
        if name not in CORRECTIONS or CORRECTIONS[name].level not in ("none", "token"):
            raise RuntimeError(f"kernels/loss.py CORRECTION_CODES has {name!r}, which grpo/losses.py does not "
                               "register as a token-level correction")


_check_kernel_codes()
