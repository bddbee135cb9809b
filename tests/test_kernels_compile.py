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
from kernels.loss import kernel_constexprs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90


def compile_in_subprocess(*flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--arch", "90", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]


def test_covering_variants_compile_for_sm90():
    # All log-prob variants (each logits dtype and flag) + every loss-kernel constexpr value at least
    # once: ~30 compilations, ~20 s on 2 cores with an empty Triton cache, ~2 s with a warm one.
    results, summary = compile_in_subprocess("--cover")
    assert summary["compiled"] == len(results) == len(aot.variants(cover=True))
    check(results)


@pytest.mark.slow
def test_every_variant_compiles_for_sm90():
    # The full matrix the dispatch can pick (74 compilations, ~30-60 s on 2 cores with an empty cache).
    results, summary = compile_in_subprocess()
    assert summary["compiled"] == len(results) == len(aot.variants())
    check(results)


def check(results):
    for r in results:
        assert r["ptx_target"] == "sm_90a", r
        assert r["cubin_bytes"] > 0, r
        assert r["shared"] <= H100_MAX_SHARED, r


def test_compiled_variants_cover_what_the_dispatch_picks():
    # Loss kernel: every ObjectiveConfig option maps onto a compiled constexpr set.
    compiled = {tuple(sorted(v["constexprs"].items())) for v in aot.variants("loss")}
    for loss, anchor, cap, kl, with_ref in itertools.product(
            ["grpo", "reinforce", "rec_oneside_is", "rec_oneside_nois", "rec_twoside_is", "rec_ring_nois"],
            ["exact", "approx"], [None, 2.0], ["k1", "k2", "k3"], [False, True]):
        cfg = ObjectiveConfig(loss=loss, ratio_anchor=anchor, is_cap=cap, kl_estimator=kl)
        key = {**kernel_constexprs(cfg, with_ref), "BLOCK": kernels.KernelConfig().loss_block}
        assert tuple(sorted(key.items())) in compiled, key
    # Log-prob kernels: the GPU launch defaults of the dispatch are the compiled ones (Qwen vocab).
    impl = kernels._logprob_impl(kernels.KernelConfig(backend="triton"), torch.device("cuda"), 151936)
    assert impl.launch == dict(rows_per_program=aot.GPU_ROWS, block_v=aot.GPU_BLOCK_V, num_warps=aot.GPU_WARPS)


def test_covering_subset_has_every_constexpr_value():
    full, cover = aot.variants("loss"), aot.variants("loss", cover=True)
    for name in ("LOSS", "EXACT_ANCHOR", "HAS_CAP", "KL"):
        assert {v["constexprs"][name] for v in cover} == {v["constexprs"][name] for v in full}, name
    assert len(cover) == 14 and len(full) == 56
