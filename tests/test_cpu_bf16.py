"""The CPU fence's bf16 decisions (grpo/cpu/bf16.py): which CPUs multiply bf16, and whether oneDNN
honours its bf16 math mode for the LM head's GEMMs on this one."""
import pytest
import torch

import kernels.lm_head
from grpo.cpu.bf16 import _rounded_not_ieee, cpu_has_native_bf16, install_lm_head_bf16_math, onednn_bf16_math_honoured

AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t\t: avx2 avx512f avx512_bf16\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"



def test_which_cpus_multiply_bf16():
    assert [cpu_has_native_bf16(t) for t in (AVX2_EPYC, SAPPHIRE_RAPIDS, ZEN4, GRAVITON3, "")] == [
        False, True, True, True, False]


@pytest.fixture
def head_bf16_math():
    """The LM head as the trainer on this CPU runs it (grpo.cpu.tune_trainer), undone afterwards."""
    installed = install_lm_head_bf16_math()
    yield installed
    kernels.lm_head.set_cpu_bf16_gemms(None)


def test_the_probe_tells_rounded_products_from_ieee_ones():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(9, 33, generator=g) * (1 + 1e-3), torch.randn(33, 17, generator=g) * (1 + 1e-3)
    rounded = (a.bfloat16().double() @ b.bfloat16().double()).float()  # what the mode computes
    ieee = (a.double() @ b.double()).float()  # what an fp32 GEMM that ignores the mode computes
    assert _rounded_not_ieee(rounded, a, b)
    assert not _rounded_not_ieee(ieee, a, b)


def test_the_head_takes_bf16_math_only_where_this_cpu_honours_it(head_bf16_math):
    """Decided by what the CPU does: installed iff the probe saw both GEMM shapes rounded; where it
    is not, the head's bf16 GEMMs are IEEE fp32 GEMMs of upcast operands (the exact path)."""
    from kernels.lm_head import _HeadGemms

    assert head_bf16_math == onednn_bf16_math_honoured()
    weight = torch.randn(64, 32).bfloat16()
    gemms = _HeadGemms(weight)
    assert gemms.strategy == ("bf16_math" if head_bf16_math else "upcast")
    if not head_bf16_math:
        hidden = torch.randn(5, 32).bfloat16()
        dlogits = torch.randn(5, 64) * (1 + 1e-3)
        grad = torch.zeros(64, 32)
        gemms.accumulate_grad_weight(grad, dlogits, hidden)
        unrounded = dlogits.double().t() @ hidden.double()
        assert (grad.double() - unrounded).abs().max().item() < 1e-5  # the IEEE product, as the test above promises


@pytest.mark.skipif(not onednn_bf16_math_honoured(),
                    reason="oneDNN does not run this CPU's fp32 GEMMs in bf16 math (no bf16 hardware, or the mode "
                           "is not honoured): the head keeps IEEE fp32 GEMMs (tested below)")
def test_cpu_bf16_math_gemms_keep_fp32_logits_and_leave_other_gemms_ieee(head_bf16_math):
    """The bf16_math strategy's three GEMMs against fp64 references with the semantics of CUDA's
    out_dtype path: logits from the exact bf16 products (fp32 accuracy, no bf16 output rounding),
    weight gradient from the bf16-rounded dlogits (which shows the mode was on: an IEEE GEMM would
    use them unrounded), hidden gradient in bf16. Afterwards fp32 GEMMs are IEEE again."""
    from kernels.lm_head import _HeadGemms

    torch.manual_seed(0)
    n_tokens, hidden_size, vocab = 37, 96, 1000
    hidden = torch.randn(n_tokens, hidden_size).bfloat16()
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).bfloat16()
    dlogits = torch.randn(n_tokens, vocab) * 1e-3
    gemms = _HeadGemms(weight)
    assert gemms.strategy == "bf16_math"
    precision = torch.backends.mkldnn.matmul.fp32_precision

    logits = gemms.logits(hidden)
    exact = hidden.double() @ weight.double().t()
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    assert (logits.double() - (hidden @ weight.t()).double()).abs().max().item() > 1e-3  # not bf16 output

    grad_weight = torch.zeros(vocab, hidden_size)
    gemms.accumulate_grad_weight(grad_weight, dlogits, hidden)
    rounded = dlogits.bfloat16().double().t() @ hidden.double()
    unrounded = dlogits.double().t() @ hidden.double()
    assert (grad_weight.double() - rounded).abs().max().item() < 1e-3 * (grad_weight.double() - unrounded).abs().max().item()

    grad_hidden = torch.empty(n_tokens, hidden_size, dtype=torch.bfloat16)
    gemms.grad_hidden(dlogits, out=grad_hidden)
    want = (dlogits.bfloat16().double() @ weight.double()).bfloat16()
    assert torch.allclose(grad_hidden.float(), want.float(), rtol=1e-2, atol=1e-6)

    assert torch.backends.mkldnn.matmul.fp32_precision == precision
    a, b = torch.randn(64, 128) * (1 + 1e-3), torch.randn(128, 64)  # values bf16 cannot hold
    assert (a @ b - (a.double() @ b.double()).float()).abs().max().item() < 1e-4  # bf16 operands: ~0.05
