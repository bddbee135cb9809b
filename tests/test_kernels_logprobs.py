"""kernels.token_logprobs against hand-computed values and a naive torch formula (log_softmax + gather),
for both backends: "torch" (the CPU path) and "triton" (run by the interpreter, TRITON_INTERPRET=1)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import kernels
from kernels import KernelConfig

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["torch", "triton"]
# Small Triton tiles so that several programs and several V-blocks run, with ragged edges.
SMALL = KernelConfig(rows_per_program=8, block_v=256)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter evaluates masked lanes


def naive(logits, targets, temperature, logp_alpha=None):
    """The textbook formula, differentiable by autograd: what every path must reproduce."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    valid = targets >= 0
    logp = torch.where(valid, log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(torch.where(log_probs > -float("inf"), log_probs.exp() * log_probs, 0.0)).sum(-1)
    log_ratio = torch.where(valid, logp - logp_alpha, 0.0) if logp_alpha is not None else None
    return logp, log_ratio, entropy


def grads_of(outputs, weights, x):
    loss = sum((o * w).sum() for o, w in zip(outputs, weights) if o is not None)
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_two_token_vocab(backend):
    # softmax([0, ln 3]) = [1/4, 3/4]; target 1 -> logp = ln(3/4); entropy = ln 4 - (3/4) ln 3.
    # d logp / d logits = onehot - p = [-1/4, +1/4].  At T = 2 the logits are halved: [0, ln 3 / 2]
    # -> p = [1/(1+sqrt3), sqrt3/(1+sqrt3)], and the gradient is (onehot - p) / 2.
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    targets = torch.tensor([1])
    logp, log_ratio, entropy = kernels.token_logprobs(logits, targets, 1.0, torch.tensor([-1.0]), True,
                                                      backend=backend, config=SMALL)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert log_ratio.item() == pytest.approx(math.log(0.75) + 1.0, abs=1e-6)
    assert entropy.item() == pytest.approx(math.log(4.0) - 0.75 * math.log(3.0), abs=1e-6)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.25]]), atol=1e-6, rtol=0)

    logp2, _, _ = kernels.token_logprobs(logits, targets, 2.0, backend=backend, config=SMALL)
    p1 = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    assert logp2.item() == pytest.approx(math.log(p1), abs=1e-6)
    (grad2,) = torch.autograd.grad(logp2.sum(), logits)
    torch.testing.assert_close(grad2, torch.tensor([[-(1 - p1) / 2, (1 - p1) / 2]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_naive_values_and_grads(backend, dtype):
    torch.manual_seed(0)
    n_rows, vocab, temperature = 37, 1000, 0.7  # neither a multiple of 8 rows nor of 256 columns
    wide = (torch.randn(n_rows, vocab + 24) * 4).to(dtype)
    logits = wide[:, 5:5 + vocab].detach().requires_grad_()  # row stride != V: non-contiguous rows
    assert not logits.is_contiguous()
    targets = torch.randint(0, vocab, (n_rows,))
    targets[[3, 20]] = -100  # ignored rows
    logp_alpha = torch.randn(n_rows) - 5
    upstream = [torch.randn(n_rows) for _ in range(3)]

    got = kernels.token_logprobs(logits, targets, temperature, logp_alpha, True, backend=backend, config=SMALL)
    grad = grads_of(got, upstream, logits)
    x = logits.detach().float().requires_grad_()
    want = naive(x, targets, temperature, logp_alpha)
    want_grad = grads_of(want, upstream, x)

    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
    assert got[0][3] == 0 and got[1][20] == 0
    assert grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)
    else:  # the gradient is stored in bf16: equal to the fp32 one up to bf16 rounding
        torch.testing.assert_close(grad.float(), want_grad, atol=1e-3, rtol=8e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_vocab_few_rows(backend):
    torch.manual_seed(1)
    vocab = 151936  # Qwen2.5: past int32 offsets once N > 14k rows; ragged against every power-of-2 tile
    logits = (torch.randn(3, vocab) * 2).requires_grad_()
    targets = torch.tensor([0, vocab - 1, 77777])
    config = KernelConfig(rows_per_program=4, block_v=16384)
    got = kernels.token_logprobs(logits, targets, 1.0, None, True, backend=backend, config=config)
    grad = grads_of(got, [torch.ones(3), None, torch.ones(3)], logits)
    x = logits.detach().requires_grad_()
    want = naive(x, targets, 1.0)
    want_grad = grads_of(want, [torch.ones(3), None, torch.ones(3)], x)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_stay_finite(backend):
    # Rows of +-1e4: a naive exp() overflows; one-hot-like rows have entropy ~0 and logp ~0 or -2e4.
    vocab = 300
    logits = torch.full((4, vocab), -1e4)
    logits[0, 7] = 1e4          # peaked row, target on the peak
    logits[1, 7] = 1e4          # peaked row, target elsewhere: logp = -2e4
    logits[2] = 1e4             # flat row at +1e4: uniform, logp = -ln V, entropy = ln V
    logits[3, :150] = float("-inf")  # masked half of the vocabulary (e.g. a banned-token mask)
    logits.requires_grad_()
    targets = torch.tensor([7, 8, 123, 200])
    logp, _, entropy = kernels.token_logprobs(logits, targets, 1.0, None, True, backend=backend, config=SMALL)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert logp[0].item() == pytest.approx(0.0, abs=1e-6)
    assert logp[1].item() == pytest.approx(-2e4, rel=1e-6)
    assert logp[2].item() == pytest.approx(-math.log(vocab), abs=1e-4)
    assert entropy[2].item() == pytest.approx(math.log(vocab), abs=1e-4)
    assert logp[3].item() == pytest.approx(-math.log(150), abs=1e-4)  # uniform over the 150 allowed
    assert entropy[0].item() == pytest.approx(0.0, abs=1e-6)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    assert torch.isfinite(grad).all()
    assert grad[3, :150].abs().max() == 0  # masked logits get no gradient
    assert grad[0, 7].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_ignored_rows_give_zero_logp_and_zero_grad(backend):
    torch.manual_seed(2)
    logits = torch.randn(10, 50, requires_grad=True)
    targets = torch.full((10,), -100)
    logp, log_ratio, entropy = kernels.token_logprobs(logits, targets, 1.0, torch.randn(10), True,
                                                      backend=backend, config=SMALL)
    assert logp.abs().max() == 0 and log_ratio.abs().max() == 0
    torch.testing.assert_close(entropy, naive(logits.detach(), targets, 1.0)[2])
    (grad,) = torch.autograd.grad(logp.sum() + log_ratio.sum(), logits)
    assert grad.abs().max() == 0


def test_entropy_off_returns_none_and_auto_on_cpu_is_torch():
    logits = torch.randn(4, 20)
    logp, log_ratio, entropy = kernels.token_logprobs(logits, torch.tensor([1, 2, 3, 4]))
    assert log_ratio is None and entropy is None
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"


def test_bad_inputs_name_the_problem(monkeypatch):
    logits = torch.randn(4, 20)
    with pytest.raises(ValueError, match="targets: id 20 out of range"):
        kernels.token_logprobs(logits, torch.tensor([1, 2, 3, 20]))
    with pytest.raises(ValueError, match=r"targets: expected shape \[4\]"):
        kernels.token_logprobs(logits, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="temperature: must be > 0"):
        kernels.token_logprobs(logits, torch.tensor([1, 2, 3, 4]), temperature=0.0)
    with pytest.raises(ValueError, match="backend: must be one of"):
        kernels.token_logprobs(logits, torch.tensor([1, 2, 3, 4]), backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs the Triton interpreter"):
        kernels.resolve_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("field,value,message", [
    ("backend", "gpu", "backend: must be one of"),
    ("chunk_tokens", 0, "chunk_tokens: must be an integer >= 1"),
    ("rows_per_program", 3, "rows_per_program: must be a power of 2"),
    ("block_v", 1000, "block_v: must be a power of 2"),
    ("num_warps", 3, "num_warps: must be a power of 2"),
    ("loss_block", 100, "loss_block: must be a power of 2"),
])
def test_kernel_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**{field: value})


# --------------------------------------------------------------------------- forward variants
# kernels/logprobs.py's loop variants (lane-wise and grouped accumulators, two-buffer prefetch) and the
# split-vocabulary kernels, each against torch_forward (the definition). V = 600 in blocks of 64:
# 10 blocks, so split=3 gives slices of 4, 4, 2 blocks, split=4 of 3, 3, 3, 1 and split=6 leaves the
# last slice empty; 19 rows in programs of 8; rows at +-1e4 and a row half -inf.

VARIANTS = {
    "lanewise": dict(lanewise=True),
    "prefetch": dict(prefetch=True),
    "lanewise+prefetch": dict(lanewise=True, prefetch=True, num_stages=1),
    "split3": dict(split=3),
    "split4 lanewise": dict(split=4, lanewise=True),
    "split6 lanewise+prefetch": dict(split=6, lanewise=True, prefetch=True),
    "grouped": dict(grouped=True),
    "grouped+prefetch": dict(grouped=True, prefetch=True),
    "split3 grouped+prefetch": dict(split=3, grouped=True, prefetch=True),
}
TILES = dict(rows_per_program=8, block_v=64, num_warps=4)


def variant_inputs(dtype, masked_row=True):
    torch.manual_seed(3)
    n_rows, vocab = 19, 600
    wide = torch.randn(n_rows, vocab + 24) * 4
    wide[14, 5:5 + vocab] = -1e4
    wide[14, 5 + 7] = 1e4  # peaked: entropy ~0
    wide[15, 5:5 + vocab] = 1e4  # flat at +1e4: uniform
    if masked_row:  # (the naive formula's autograd gives nan on -inf logits: not in the gradient test)
        wide[16, 5:5 + 300] = float("-inf")  # half the vocabulary masked
    logits = wide.to(dtype)[:, 5:5 + vocab]  # row stride != V
    targets = torch.randint(0, vocab, (n_rows,))
    targets[[3, 10]] = -100  # ignored rows
    targets[14], targets[16] = 7, 500
    return logits, targets, torch.randn(n_rows) - 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_variants_match_torch_forward(variant, dtype):
    from kernels.logprobs import torch_forward, triton_forward

    logits, targets, logp_alpha = variant_inputs(dtype)
    for with_entropy, alpha in ((True, logp_alpha), (False, None)):
        got = triton_forward(logits, targets, 1 / 0.7, with_entropy, alpha, **TILES, **VARIANTS[variant])
        want = torch_forward(logits, targets, 1 / 0.7, with_entropy, alpha)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                assert g.dtype == torch.float32 and torch.isfinite(g).all()
                torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
        assert got[0][3] == 0 and got[0][10] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["lanewise+prefetch", "split4 lanewise", "grouped+prefetch"])
def test_forward_variants_through_autograd(variant, dtype):
    # The backward reads the forward's lse and entropy: a variant's gradients equal the naive formula's.
    from kernels.logprobs import LogprobImpl, TokenLogprobs

    logits, targets, logp_alpha = variant_inputs(dtype, masked_row=False)
    logits = logits.detach().requires_grad_()
    upstream = [torch.randn(logits.shape[0]) for _ in range(3)]
    impl = LogprobImpl("triton", TILES["rows_per_program"], TILES["block_v"], TILES["num_warps"], **VARIANTS[variant])
    got = TokenLogprobs.apply(logits, targets, logp_alpha, 1 / 0.7, True, impl)
    grad = grads_of(got, upstream, logits)
    x = logits.detach().float().requires_grad_()
    want = naive(x, targets, 0.7, logp_alpha)
    want_grad = grads_of(want, upstream, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(grad.float(), want_grad, atol=1e-3, rtol=8e-3)


def test_split_must_be_a_positive_integer():
    from kernels.logprobs import LogprobImpl

    with pytest.raises(ValueError, match="split: must be an integer >= 1"):
        LogprobImpl("triton", split=0)


def load_bandwidth_bench():
    spec = importlib.util.spec_from_file_location("logprob_bandwidth", ROOT / "bench" / "logprob_bandwidth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bandwidth_bench_smoke(tmp_path):
    # bench/logprob_bandwidth.py --smoke: every variant through the interpreter, checked against torch.
    bench = load_bandwidth_bench()
    assert bench.main(["--smoke", "--out", str(tmp_path / "lp.json")]) == 0
    report = json.loads((tmp_path / "lp.json").read_text())
    assert report["failed"] == [] and len(report["cases"]) == 2
    for case in report["cases"].values():
        assert set(case["results"]) == {name for name, _ in bench.variants(smoke=True)}
        for r in case["results"].values():
            assert r["ok"] and r["seconds"] > 0 and set(r["max_rel_diff"]) >= {"logp", "lse"}


def test_the_bandwidth_bench_names_the_trainers_launch_as_its_default():
    """The variant labelled "(default)" is the launch kernels.KernelConfig() gives a GPU (it was a
    fixed block-wise launch, left so after the lane-wise loop became the default), and it runs first."""
    bench = load_bandwidth_bench()
    named = bench.variants(smoke=False)
    defaults = [(name, launch) for name, launch in named if name.endswith("(default)")]
    assert len(defaults) == 1 and named[0] == defaults[0]
    launch = {**bench.LAUNCH_DEFAULTS, **defaults[0][1]}
    assert launch == {**bench.LAUNCH_DEFAULTS, **kernels._logprob_impl(KernelConfig(), torch.device("cuda"), bench.V).forward_launch}
    assert launch["grouped"] and launch["prefetch"] and defaults[0][0].startswith("grouped+prefetch")


def test_bandwidth_bench_flags_a_variant_off_the_reference(tmp_path, monkeypatch):
    bench = load_bandwidth_bench()
    monkeypatch.setattr(bench, "variants", lambda smoke: [("block", dict(rows_per_program=2, block_v=64, num_warps=4))])
    monkeypatch.setattr(bench, "cases", lambda smoke: [(5, 300, torch.float32, False)])
    reference = bench.torch_forward
    monkeypatch.setattr(bench, "torch_forward", lambda *a: (reference(*a)[0] - 1e-2,) + reference(*a)[1:])
    assert bench.main(["--smoke", "--out", str(tmp_path / "lp.json")]) == 1
    report = json.loads((tmp_path / "lp.json").read_text())
    assert report["failed"] == ["N=5 V=300 float32 entropy=off: block"]
