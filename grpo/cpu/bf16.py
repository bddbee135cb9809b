"""bf16 on a CPU: whether this CPU multiplies it, and the LM head's fp32 GEMMs in bf16 math.

Compute dtype. Without bf16 hardware (Intel AMX, AVX512-BF16 on Intel and AMD Zen 4+, aarch64
"bf16") PyTorch and vLLM emulate bf16 matmuls, many times slower than fp32; `model.dtype: auto`
and `server.dtype: auto` then choose fp32 on that CPU (`multiplies_bf16`).

The LM head. Its logits must be fp32 (a bf16 logit is off by up to 0.125 at |z| ~ 16-32, ~0.6 nat
after the paper's T = 0.1), and a CPU has no bf16-in / fp32-out GEMM like CUDA's out_dtype GEMMs,
so kernels/lm_head.py multiplies fp32 copies of the bf16 operands. oneDNN's bf16 math mode for fp32
GEMMs (`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`) gives CUDA's semantics at bf16
speed: fp32 operands that hold bf16 values are multiplied exactly and accumulated in fp32, and the
weight gradient takes the bf16-rounded dlogits as on CUDA. Whether oneDNN honours the mode is
decided by what it does, not by a CPU flag: on a CPU with AVX512-BF16 but no AMX it ran the weight
gradient's GEMM as the IEEE fp32 product, which is not the semantics the strategy promises.
`onednn_bf16_math_honoured` runs each of the head's GEMM shapes once in the mode and compares it
with the bf16-rounded and the unrounded products; `install_lm_head_bf16_math` registers the mode
with kernels/lm_head.py only where both are honoured (else the head keeps its exact fp32 GEMMs).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

# /proc/cpuinfo flags of CPUs that multiply bf16 in hardware: x86 (AMX, AVX512-BF16), aarch64 (bf16).
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware, from /proc/cpuinfo's flags (x86 "flags",
    aarch64 "Features"). cpuinfo: its text (read when None; a machine without it counts as no)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & NATIVE_BF16_FLAGS)


@functools.lru_cache(maxsize=1)
def multiplies_bf16() -> bool:
    """This machine's CPU multiplies bf16 in hardware (read once)."""
    return cpu_has_native_bf16()


@contextlib.contextmanager
def onednn_bf16_math():
    """fp32 GEMMs inside run as bf16 x bf16 -> fp32 where oneDNN honours the mode. The flag is
    process-global, so it is set around the head's GEMMs only; no other thread of the trainer runs a
    GEMM meanwhile (the sample-ahead thread waits on the server and the reward workers)."""
    matmul = torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def _mode_exists() -> bool:
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return matmul is not None and hasattr(matmul, "fp32_precision") and torch.backends.mkldnn.is_available()


def _rounded_not_ieee(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """result (of a @ b in the mode) is the product of bf16-rounded operands, not the IEEE one."""
    rounded = a.bfloat16().double() @ b.bfloat16().double()
    unrounded = a.double() @ b.double()
    off_rounded = (result.double() - rounded).abs().max().item()
    off_unrounded = (result.double() - unrounded).abs().max().item()
    return off_rounded < 1e-2 * off_unrounded


@functools.lru_cache(maxsize=1)
def onednn_bf16_math_honoured() -> bool:
    """Run the LM head's two in-mode GEMM shapes once in oneDNN's bf16 math mode, on operands bf16
    cannot hold, and say whether both came out as bf16-rounded products: the logits GEMM
    (hidden [n, H] @ weight^T) and the weight gradient's accumulation (grad += dlogits^T @ hidden).
    False where the mode does not exist, where the CPU has no bf16 hardware (oneDNN would emulate
    bf16, slower than the fp32 GEMM it replaces), or where either GEMM ignored the mode."""
    if not _mode_exists() or not multiplies_bf16():
        return False
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 96, 256
    hidden = torch.randn(n, h, generator=g) * (1 + 1e-3)
    weight = torch.randn(v, h, generator=g) * (1 + 1e-3)
    dlogits = torch.randn(n, v, generator=g) * (1 + 1e-3)
    grad = torch.zeros(v, h)
    with onednn_bf16_math():
        logits = hidden @ weight.t()
        grad.addmm_(dlogits.t(), hidden)
    return _rounded_not_ieee(logits, hidden, weight.t()) and _rounded_not_ieee(grad, dlogits.t(), hidden)


def install_lm_head_bf16_math() -> bool:
    """Give kernels/lm_head.py oneDNN's bf16 math mode for its bf16 GEMMs on this CPU where the mode
    is honoured (see the module docstring); returns whether it was installed."""
    from kernels import lm_head

    honoured = onednn_bf16_math_honoured()
    lm_head.set_cpu_bf16_gemms(onednn_bf16_math if honoured else None)
    return honoured


@contextlib.contextmanager
def lm_head_bf16_math_installed():
    """install_lm_head_bf16_math for a block, then the head's previous mode back: for a tool that
    takes the trainer's arithmetic inside another program's process (scripts/compare_objectives.py
    under a test or a notebook), where the mode must not outlive the call."""
    from kernels import lm_head

    previous = lm_head.CPU_BF16_GEMMS
    install_lm_head_bf16_math()
    try:
        yield
    finally:
        lm_head.set_cpu_bf16_gemms(previous)
