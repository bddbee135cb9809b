"""Every Triton kernel variant the dispatch can launch compiles ahead of time for an H100 (sm_90),
on this GPU-less machine. The interpreter (TRITON_INTERPRET=1, set by conftest) runs Python
semantics and misses compiler errors (types, layouts, shared memory), so this runs `python -m
kernels.aot` in a subprocess with the interpreter switched off."""
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

import kernels
from grpo.objective import ObjectiveConfig
from kernels import aot
from kernels.loss import ANCHORED_LOSSES, KL_CODES, kernel_constexprs

pytestmark = pytest.mark.torchrun  # the AOT compiler runs in a child process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90


def compile_in_subprocess():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--arch", "90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]


@pytest.mark.slow
def test_every_variant_compiles_for_sm90():
    # The full matrix the dispatch can pick (kernels.aot.variants()); the covering subset that
    # `--cover` compiles is part of it (test_covering_subset_has_every_constexpr_value), so compiling
    # that too would check nothing more.
    results, summary = compile_in_subprocess()
    assert summary["compiled"] == len(results) == len(aot.variants())
    check(results)


def check(results):
    for r in results:
        assert r["ptx_target"] == "sm_90a", r
        assert r["cubin_bytes"] > 0, r
        assert r["shared"] <= H100_MAX_SHARED, r


def kernel_configs():
    """Every ObjectiveConfig the dispatch sends to the loss kernel, from the registry: each loss and
    correction with a kernel code, each anchor, KL estimator and threshold setting."""
    from grpo.losses import LOSSES

    for loss, correction, anchor, kl in itertools.product(kernels.LOSS_CODES, kernels.CORRECTION_CODES,
                                                          ["exact", "approx"], ["k1", "k2", "k3"]):
        taken = LOSSES[loss].corrections
        if taken is not None and correction not in taken:
            continue
        floors = [None, 0.5] if correction == "token_mask" else [0.5] if correction == "icepop" else [None]
        cap = None if correction == "none" else 2.0
        for floor in floors:
            yield ObjectiveConfig(loss=loss, ratio_anchor=anchor, is_correction=correction, is_cap=cap,
                                  is_floor=floor, kl_estimator=kl)
        if correction == "token_truncate":  # is_cap alone: the same correction
            yield ObjectiveConfig(loss=loss, ratio_anchor=anchor, is_cap=2.0, kl_estimator=kl)


def test_compiled_variants_cover_what_the_dispatch_picks():
    # Loss kernel: every ObjectiveConfig option maps onto a compiled constexpr set.
    compiled = {tuple(sorted(v["constexprs"].items())) for v in aot.variants("loss")}
    configs = list(kernel_configs())
    assert {cfg.loss for cfg in configs} == set(kernels.LOSS_CODES)
    for cfg, with_ref in itertools.product(configs, [False, True]):
        key = {**kernel_constexprs(cfg, with_ref), "BLOCK": kernels.KernelConfig().loss_block}
        assert tuple(sorted(key.items())) in compiled, key
    # Log-prob kernels: the GPU launch defaults of the dispatch are the compiled ones (Qwen vocab).
    impl = kernels._logprob_impl(kernels.KernelConfig(backend="triton"), torch.device("cuda"), 151936)
    assert impl.launch == dict(rows_per_program=aot.GPU_ROWS, block_v=aot.GPU_BLOCK_V, num_warps=aot.GPU_WARPS)
    forward = {v["constexprs"]["BLOCK_V"] for v in aot.variants("logprob") if v["kernel"] == "logprob_fwd_kernel"}
    assert forward == {impl.forward_launch["block_v"]}
    assert impl.forward_launch["lanewise"] and impl.forward_launch["prefetch"] and impl.forward_launch["grouped"]
    assert {(v["constexprs"]["LANEWISE"], v["constexprs"]["PREFETCH"]) for v in aot.variants("logprob")
            if v["kernel"] == "logprob_fwd_kernel"} == {(True, True)}
    # the grouped loop's group is one 16-byte load of each dtype: 4 fp32, 8 bf16 / fp16
    assert {(v["dtype"], v["constexprs"]["GROUP"]) for v in aot.variants("logprob")
            if v["kernel"] == "logprob_fwd_kernel"} == {("fp32", 4), ("bf16", 8), ("fp16", 8)}


def test_covering_subset_has_every_constexpr_value():
    full, cover = aot.variants("loss"), aot.variants("loss", cover=True)
    for name in ("LOSS", "EXACT_ANCHOR", "CORRECTION", "KL"):
        assert {v["constexprs"][name] for v in cover} == {v["constexprs"][name] for v in full}, name
    # every loss with each of its anchors and corrections (the branches that interact), KL rotating
    pairs = lambda vs: {(v["constexprs"]["LOSS"], v["constexprs"]["EXACT_ANCHOR"], v["constexprs"]["CORRECTION"])  # noqa: E731
                        for v in vs}
    assert pairs(cover) == pairs(full) and len(cover) == len(pairs(full))
    # each a variant of the full matrix: test_every_variant_compiles_for_sm90 compiles it
    key = lambda v: (v["kernel"], v["dtype"], tuple(sorted(v["constexprs"].items())), v["num_warps"])  # noqa: E731
    assert {key(v) for v in aot.variants(cover=True)} <= {key(v) for v in aot.variants()}
    assert {key(v) for v in aot.variants("logprob")} <= {key(v) for v in aot.variants(cover=True)}
    # the full matrix: LOSS x its anchors x CORRECTION x KL, counted from the kernel's own code tables
    anchors = sum(2 if loss in ANCHORED_LOSSES else 1 for loss in kernels.LOSS_CODES)
    assert len(full) == anchors * len(set(kernels.CORRECTION_CODES.values())) * len(KL_CODES)
