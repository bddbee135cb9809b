"""kernels.lm_head_logprobs (chunked, logits never whole) against the naive matmul + log_softmax +
gather, values and gradients for hidden states and the lm_head weight, both backends."""
import pytest
import torch

import kernels
from kernels import KernelConfig

BACKENDS = ["torch", "triton"]
SMALL = KernelConfig(rows_per_program=8, block_v=128)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def naive(hidden, weight, targets, temperature):
    log_probs = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    valid = targets >= 0
    logp = torch.where(valid, log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_naive(backend, dtype):
    torch.manual_seed(0)
    n_tokens, hidden_size, vocab, temperature = 45, 32, 300, 0.9
    hidden = torch.randn(n_tokens, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n_tokens,))
    targets[-20:] = -100  # the last chunks are padding: their backward is skipped
    g_logp, g_entropy = torch.randn(n_tokens), torch.randn(n_tokens)

    logp, entropy = kernels.lm_head_logprobs(hidden, weight, targets, temperature, chunk_tokens=16,
                                             with_entropy=True, backend=backend, config=SMALL)
    grads = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), (hidden, weight))

    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    want_logp, want_entropy = naive(h32, w32, targets, temperature)
    want = torch.autograd.grad((want_logp * g_logp).sum() + (want_entropy * g_entropy).sum(), (h32, w32))

    if dtype == torch.float32:
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    else:  # bf16 matmul (fp32 accumulate) and bf16 gradient storage vs an fp32 reference
        torch.testing.assert_close(logp, want_logp, atol=0.05, rtol=0.02)
        torch.testing.assert_close(entropy, want_entropy, atol=0.05, rtol=0.02)
        for g, w in zip(grads, want):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), w, atol=0.05, rtol=0.05)
    assert (logp[-20:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_equals_token_logprobs_and_frozen_weight(backend):
    # Same maths as token_logprobs on materialised logits; a frozen weight gets no gradient work.
    torch.manual_seed(3)
    hidden = torch.randn(20, 16, requires_grad=True)
    weight = torch.randn(100, 16)
    targets = torch.randint(0, 100, (20,))
    logp, entropy = kernels.lm_head_logprobs(hidden, weight, targets, 1.3, chunk_tokens=7, backend=backend,
                                             config=SMALL)
    assert entropy is None
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    h2 = hidden.detach().requires_grad_()
    logp2, _, _ = kernels.token_logprobs(h2 @ weight.t(), targets, 1.3, backend=backend, config=SMALL)
    (grad2,) = torch.autograd.grad(logp2.sum(), h2)
    torch.testing.assert_close(logp, logp2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, grad2, atol=1e-5, rtol=1e-5)


def test_lm_head_bad_inputs():
    with pytest.raises(ValueError, match="hidden/weight: expected"):
        kernels.lm_head_logprobs(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden/weight: dtypes differ"):
        kernels.lm_head_logprobs(torch.randn(4, 8), torch.randn(10, 8).bfloat16(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens: must be an integer >= 1"):
        kernels.lm_head_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                 chunk_tokens=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_name", ["grpo", "rec_twoside_is"])
@pytest.mark.parametrize("grads", ["slabs", "chunks"])
def test_lm_head_objective_matches_logprobs_then_objective(backend, loss_name, grads):
    # Gradients computed during the forward (by vocabulary slabs, or by token chunks with no
    # recompute) equal autograd through the naive head followed by grpo.objective.objective; the
    # loss is scaled by 3 to check the backward's rescale.
    from grpo.kernel_dispatch import objective_fn_for
    from grpo.objective import ObjectiveConfig, objective

    torch.manual_seed(5)
    n_tokens, hidden_size, vocab = 40, 16, 200
    cfg = ObjectiveConfig(loss=loss_name, ratio_anchor="exact", is_cap=1.5, beta=0.05, kl_estimator="k3")
    hidden = torch.randn(n_tokens, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) / 4).requires_grad_()
    targets = torch.randint(0, vocab, (n_tokens,))
    targets[-6:] = -100
    with torch.no_grad():
        logp_now = naive(hidden, weight, targets, 0.8)[0]
    logp_alpha = logp_now + 0.3 * torch.randn(n_tokens)
    logp_k = logp_now + 0.1 * torch.randn(n_tokens)  # pi moved away from pi_k: some tokens clip
    logp_ref = logp_now + 0.2 * torch.randn(n_tokens)
    adv = torch.randn(n_tokens)
    weights = torch.rand(n_tokens)
    weights[-6:] = 0.0

    loss, stats, logp, entropy = kernels.lm_head_objective(
        hidden, weight, targets, logp_alpha, logp_k, logp_ref, adv, weights, cfg, temperature=0.8, chunk_tokens=16,
        backend=backend, config=KernelConfig(rows_per_program=8, block_v=128, objective_grads=grads), with_entropy=True,
        objective_fn=objective_fn_for(hidden.device, KernelConfig(backend=backend)))
    grads = torch.autograd.grad(3 * loss, (hidden, weight))
    want_loss, want_stats = objective(naive(hidden, weight, targets, 0.8)[0], logp_alpha, logp_k, logp_ref, adv,
                                      weights, cfg)
    want = torch.autograd.grad(3 * want_loss, (hidden, weight))
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, logp_now, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, naive(hidden, weight, targets, 0.8)[1].detach(), atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad and not logp.requires_grad
    for key in want_stats:
        torch.testing.assert_close(stats[key], want_stats[key], atol=1e-4, rtol=1e-5, msg=key)
    assert want_stats["clip_low_sum"] + want_stats["clip_high_sum"] > 0
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("grads", ["slabs", "chunks"])
def test_lm_head_objective_in_bf16_matches_the_fp32_head_of_the_same_values(grads):
    """bf16 hidden and weight: each plan's gradients against autograd through an fp32 naive head of
    the same (bf16-valued) numbers, within bf16's rounding of the gradients themselves."""
    from grpo.kernel_dispatch import objective_with_grad
    from grpo.objective import ObjectiveConfig, objective

    torch.manual_seed(11)
    n_tokens, hidden_size, vocab = 50, 32, 700
    hidden = torch.randn(n_tokens, hidden_size).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size) / 6).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n_tokens,))
    targets[:5] = -100
    zeros, adv, weights = torch.zeros(n_tokens), torch.randn(n_tokens), torch.rand(n_tokens)
    weights[:5] = 0.0
    cfg = ObjectiveConfig(loss="reinforce")
    loss, _, _, _ = kernels.lm_head_objective(hidden, weight, targets, zeros, None, None, adv, weights, cfg,
                                              temperature=0.7, chunk_tokens=16, backend="torch",
                                              config=KernelConfig(objective_grads=grads),
                                              objective_fn=objective_with_grad)
    got = torch.autograd.grad(loss, (hidden, weight))
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    want_loss, _ = objective(naive(h32, w32, targets, 0.7)[0], zeros, None, None, adv, weights, cfg)
    want = torch.autograd.grad(want_loss, (h32, w32))
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, atol=1e-4, rtol=1.6e-2)


def test_lm_head_objective_auto_plan_is_slabs_on_cuda_and_chunks_elsewhere():
    from kernels import _grads_by_slabs

    assert _grads_by_slabs(KernelConfig(), torch.device("cuda", 0))
    assert not _grads_by_slabs(KernelConfig(), torch.device("cpu"))
    assert _grads_by_slabs(KernelConfig(objective_grads="slabs"), torch.device("cpu"))
    assert not _grads_by_slabs(KernelConfig(objective_grads="chunks"), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="objective_grads"):
        KernelConfig(objective_grads="tokens")


def test_lm_head_objective_backward_twice_is_refused():
    from grpo.kernel_dispatch import objective_with_grad
    from grpo.objective import ObjectiveConfig

    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    targets, zeros, ones = torch.randint(0, 30, (6,)), torch.zeros(6), torch.ones(6)
    loss, _, _, _ = kernels.lm_head_objective(hidden, weight, targets, zeros, None, None, ones, ones,
                                              ObjectiveConfig(loss="reinforce"), objective_fn=objective_with_grad)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_weights_give_fp32_logits_at_low_temperature(backend):
    """bf16 hidden and weight with Qwen-like logits (|z| up to ~22 per row) at the paper's T = 0.1.
    The fused head's log-probs are within fp32 rounding of an fp64 reference computed from the same
    bf16-valued inputs. The old path (bf16 logits, rounding step 0.125 at |z| 16-32, then / T) was
    off by up to 0.395 nat on this very data (mean 0.019): enough to move pi/alpha by ~50%."""
    torch.manual_seed(0)
    n_tokens, hidden_size, vocab, temperature = 64, 256, 4096, 0.1
    hidden = torch.randn(n_tokens, hidden_size).bfloat16()
    weight = (torch.randn(vocab, hidden_size) * (6 / hidden_size ** 0.5)).bfloat16()
    z = hidden.double() @ weight.double().t()
    targets = torch.multinomial(torch.softmax(z / temperature, -1).float(), 1,
                                generator=torch.Generator().manual_seed(1))[:, 0]
    want = torch.log_softmax(z / temperature, -1).gather(1, targets[:, None])[:, 0]
    logp, _ = kernels.lm_head_logprobs(hidden, weight, targets, temperature, chunk_tokens=24, backend=backend,
                                       config=SMALL)
    # fp32 rounding of z / T (|z / T| <= ~250): a few units in the last place of 250.
    tol = 4 * torch.finfo(torch.float32).eps * float((z / temperature).abs().max())
    assert (logp.double() - want).abs().max().item() <= tol
    old = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1).gather(1, targets[:, None])[:, 0]
    assert (old.double() - want).abs().max().item() > 100 * tol  # the check tells the two paths apart


def test_gemm_strategy_decision_table():
    from kernels.lm_head import gemm_strategy

    assert gemm_strategy("cuda", torch.float32) == gemm_strategy("cpu", torch.float32) == "native"
    assert gemm_strategy("cuda", torch.bfloat16, mixed_gemm_available=True) == "out_dtype"
    assert gemm_strategy("cuda", torch.float16, mixed_gemm_available=True) == "out_dtype"
    assert gemm_strategy("cuda", torch.bfloat16, mixed_gemm_available=False) == "upcast"  # an older torch
    # no CPU mm.dtype kernel: oneDNN's bf16 math mode where the CPU multiplies bf16, else fp32
    assert gemm_strategy("cpu", torch.bfloat16, mixed_gemm_available=True, cpu_bf16_math=True) == "bf16_math"
    assert gemm_strategy("cpu", torch.bfloat16, mixed_gemm_available=True, cpu_bf16_math=False) == "upcast"
    assert gemm_strategy("cpu", torch.float16, cpu_bf16_math=True) == "upcast"
    assert gemm_strategy("cuda", torch.bfloat16, mixed_gemm_available=False, cpu_bf16_math=True) == "upcast"


def test_the_weight_gradient_accumulates_in_fp32_under_either_addmm_contract(monkeypatch):
    """CUDA's weight-gradient GEMM accumulates bf16 products into the fp32 gradient with
    torch.addmm(..., out_dtype=fp32). Some torch releases refuse an fp32 `self` there ("self and mat2
    must have the same dtype"): then the same sum is an out_dtype mm into a temporary plus an add,
    decided once by the op's own answer. CPU torch has no out_dtype GEMM, so both ops are stood in
    for by their contracts here; scripts/gpu_check.sh runs the real ones first on a GPU."""
    import kernels.lm_head as lh

    calls = []

    def strict_addmm(acc, mat1, mat2, *, out_dtype, out):
        calls.append("addmm")
        if acc.dtype != mat2.dtype:
            raise RuntimeError(f"self and mat2 must have the same dtype, but got {acc.dtype} and {mat2.dtype}")
        raise AssertionError("not reached")

    def relaxed_addmm(acc, mat1, mat2, *, out_dtype, out):
        calls.append("addmm")
        return out.add_(mat1.float() @ mat2.float())

    def out_dtype_mm(mat1, mat2, *, out_dtype):
        calls.append("mm")
        return (mat1.double() @ mat2.double()).to(out_dtype)

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g).bfloat16(), torch.randn(5, 3, generator=g).bfloat16()
    start = torch.randn(7, 3, generator=g)
    want = start.double() + a.double() @ b.double()

    monkeypatch.setattr(lh, "ADDMM_ACCUMULATES_IN_OUT_DTYPE", None)
    acc = start.clone()
    assert lh.accumulate_out_dtype(acc, a, b, addmm=strict_addmm, mm=out_dtype_mm) == "mm+add"
    assert lh.accumulate_out_dtype(acc, a, b, addmm=strict_addmm, mm=out_dtype_mm) == "mm+add"
    assert calls == ["addmm", "mm", "mm"]  # refused once, then never asked again
    torch.testing.assert_close(acc.double(), want + a.double() @ b.double(), rtol=1e-6, atol=1e-6)

    monkeypatch.setattr(lh, "ADDMM_ACCUMULATES_IN_OUT_DTYPE", None)
    calls.clear()
    acc = start.clone()
    assert lh.accumulate_out_dtype(acc, a, b, addmm=relaxed_addmm, mm=out_dtype_mm) == "addmm"
    assert calls == ["addmm"] and lh.ADDMM_ACCUMULATES_IN_OUT_DTYPE is True
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-6)

    def broken_addmm(acc, mat1, mat2, *, out_dtype, out):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(lh, "ADDMM_ACCUMULATES_IN_OUT_DTYPE", None)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # not a contract refusal: raised as it is
        lh.accumulate_out_dtype(start.clone(), a, b, addmm=broken_addmm, mm=out_dtype_mm)


def test_the_weight_gradient_is_written_slab_by_slab_without_a_full_accumulator():
    """lm_head_logprobs' backward goes over slabs of the vocabulary: each slab of the weight
    gradient is one GEMM over all tokens, written once. So the only [V, H] tensor the backward
    makes is the gradient itself; the token-chunked backward before it summed every chunk into an
    fp32 [V, H] accumulator (519 MB at Qwen2.5-0.5B's size) and cast that at the end. Recorded op
    by op with a dispatch mode; the values are test_fused_matches_naive's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    n_tokens, hidden_size, vocab = 64, 16, 1000
    hidden = torch.randn(n_tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,))
    logp, _ = kernels.lm_head_logprobs(hidden, weight, targets, 1.0, chunk_tokens=16, backend="torch")

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.outputs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.outputs.append((str(func), tuple(t.shape)))
            return out

    with Shapes() as mode:
        logp.sum().backward()
    full = [name for name, shape in mode.outputs if shape == (vocab, hidden_size) and "detach" not in name]
    assert full == ["aten.empty.memory_format"], full  # the gradient's own allocation, then only its slabs

    # lm_head_objective by slabs: the same single [V, H] allocation, inside its forward
    from grpo.kernel_dispatch import objective_with_grad
    from grpo.objective import ObjectiveConfig

    ones = torch.ones(n_tokens)
    with Shapes() as objective_mode:
        loss, _, _, _ = kernels.lm_head_objective(
            hidden, weight, targets, torch.zeros(n_tokens), None, None, ones, ones, ObjectiveConfig(loss="reinforce"),
            chunk_tokens=16, backend="torch", config=KernelConfig(objective_grads="slabs"),
            objective_fn=objective_with_grad)
    full = [name for name, shape in objective_mode.outputs if shape == (vocab, hidden_size) and "detach" not in name]
    assert full == ["aten.empty.memory_format"], full
    slabs = {shape[1] for name, shape in mode.outputs if len(shape) == 2 and shape[0] == n_tokens and shape[1] > hidden_size}
    assert max(slabs) < vocab and len(slabs) >= 1  # dlogits by slabs of the vocabulary, never [N, V]
    assert kernels.lm_head.slab_columns(n_tokens, hidden_size, vocab, 16) * (6 * n_tokens + 4 * hidden_size) \
        <= 4 * 16 * vocab + 128 * (6 * n_tokens + 4 * hidden_size)  # a slab's temporaries ~ one forward chunk


def test_slab_columns_keep_the_backward_within_one_forward_chunk():
    from kernels.lm_head import slab_columns

    # Qwen2.5-0.5B: H = 896, V = 151936, chunks of 256 tokens (a 155.6 MB fp32 forward block)
    for n in (1, 256, 2048, 16384):
        cols = slab_columns(n, 896, 151936, 256)
        assert cols % 128 == 0 and 128 <= cols <= 151936
        if cols > 128:
            assert cols * (6 * n + 4 * 896) <= 4 * 256 * 151936
    assert slab_columns(2048, 896, 151936, 256) == 9728
