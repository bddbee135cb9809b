"""Ahead-of-time compilation of every kernel variant the dispatch can launch, for a GPU target,
without a GPU: catches what the interpreter cannot (it runs Python semantics, not the compiler).

    python -m kernels.aot [--arch 90] [--only logprob|loss] [--cover] [--jobs 2]
prints one JSON line per variant ({"kernel", "variant", "shared", "num_warps", "ptx_target",
"cubin_bytes", "seconds"}) then a summary line. Must run WITHOUT TRITON_INTERPRET (the tests set
it in conftest, so tests call this in a subprocess).

Variants: the log-prob kernels at the GPU launch defaults of kernels.KernelConfig (1 row per program,
BLOCK_V 4096 (2048 and the grouped loop for the forward), 8 warps) for fp32 / bf16 / fp16 logits and each constexpr flag; the loss kernel for
every LOSS x EXACT_ANCHOR x CORRECTION x KL combination that an ObjectiveConfig can select (the
names in kernels/loss.py's LOSS_CODES and CORRECTION_CODES).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

GPU_ROWS, GPU_BLOCK_V, GPU_FORWARD_BLOCK_V, GPU_WARPS, GPU_LOSS_BLOCK = 1, 4096, 2048, 8, 1024
LOGIT_DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
LOGIT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def variants(only: str | None = None, cover: bool = False) -> list[dict]:
    """Plain descriptions (picklable) of every variant: kernel name, signature, constexprs, options.

    cover=True keeps a covering subset of the loss kernel (every LOSS with each of its anchors and
    CORRECTION values, and every KL value at least once) for a quick check; the log-prob kernels are
    always all there."""
    from .logprobs import loop_group
    from .loss import ANCHORED_LOSSES, CORRECTION_CODES, KL_CODES, LOSS_CODES

    out = []
    if only in (None, "logprob"):
        for dtype, ptr in LOGIT_DTYPES.items():
            for has_alpha, with_entropy in itertools.product((False, True), repeat=2):
                sig = {"logits_ptr": ptr, "stride_logits_row": "i32", "targets_ptr": "*i64",
                       "logp_alpha_ptr": "*fp32", "logp_ptr": "*fp32", "lse_ptr": "*fp32",
                       "log_ratio_ptr": "*fp32", "entropy_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32",
                       "inv_temperature": "fp32"}
                cx = dict(ROWS=GPU_ROWS, BLOCK_V=GPU_FORWARD_BLOCK_V, HAS_ALPHA=has_alpha, WITH_ENTROPY=with_entropy,
                          LANEWISE=True, PREFETCH=True, GROUP=loop_group(LOGIT_BYTES[dtype], GPU_FORWARD_BLOCK_V))
                out.append(dict(kernel="logprob_fwd_kernel", dtype=dtype, signature=sig, constexprs=cx,
                                num_warps=GPU_WARPS))
            for with_entropy_grad in (False, True):
                sig = {"logits_ptr": ptr, "stride_logits_row": "i32", "dlogits_ptr": ptr,
                       "stride_dlogits_row": "i32", "targets_ptr": "*i64", "lse_ptr": "*fp32",
                       "grad_logp_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_entropy_ptr": "*fp32",
                       "n_rows": "i32", "n_cols": "i32", "inv_temperature": "fp32"}
                cx = dict(ROWS=GPU_ROWS, BLOCK_V=GPU_BLOCK_V, WITH_ENTROPY_GRAD=with_entropy_grad)
                out.append(dict(kernel="logprob_bwd_kernel", dtype=dtype, signature=sig, constexprs=cx,
                                num_warps=GPU_WARPS))
    if only in (None, "loss"):
        sig = {name: "*fp32" for name in ("logp_ptr", "logp_alpha_ptr", "logp_k_ptr", "logp_ref_ptr", "adv_ptr",
                                          "weights_ptr", "grad_logp_ptr", "partials_ptr")}
        sig["n_tokens"] = "i32"
        for name in ("eps_low", "eps_high", "rec_lower", "rec_upper", "ring_lower", "ring_upper", "cispo_lower",
                     "cispo_upper", "is_cap", "is_floor", "beta"):
            sig[name] = "fp32"
        corrections = sorted(set(CORRECTION_CODES.values()))
        for loss, code in LOSS_CODES.items():
            anchors = (False, True) if loss in ANCHORED_LOSSES else (False,)
            combos = list(itertools.product(anchors, corrections, KL_CODES.values()))
            if cover:  # for each (anchor, correction): one KL code, rotating so that every code appears
                combos = [(exact, corr, (code + 3 * i + j) % len(KL_CODES))
                          for i, exact in enumerate(anchors) for j, corr in enumerate(corrections)]
            for exact, correction, kl in combos:
                cx = dict(LOSS=code, EXACT_ANCHOR=exact, CORRECTION=correction, KL=kl, BLOCK=GPU_LOSS_BLOCK)
                out.append(dict(kernel="loss_and_grad_kernel", dtype="fp32", signature=sig, constexprs=cx,
                                num_warps=4))
    return out


def compile_variant(v: dict, arch: int = 90) -> dict:
    """Compile one variant to PTX + cubin for sm_<arch>; returns its metadata (raises on error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import logprobs, loss

    fn = getattr(logprobs, v["kernel"], None) or getattr(loss, v["kernel"])
    signature = {**v["signature"], **{k: "constexpr" for k in v["constexprs"]}}
    t0 = time.perf_counter()
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=dict(v["constexprs"]))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": v["num_warps"]})
    ptx = compiled.asm["ptx"]
    target = next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), None)
    return dict(kernel=v["kernel"], variant=f'{v["dtype"]} ' + " ".join(f"{k}={x}" for k, x in v["constexprs"].items()),
                shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps, ptx_target=target,
                cubin_bytes=len(compiled.asm["cubin"]), seconds=round(time.perf_counter() - t0, 3))


def _compile_star(args):
    return compile_variant(*args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100")
    parser.add_argument("--only", choices=["logprob", "loss"], default=None, help="compile one kernel family")
    parser.add_argument("--cover", action="store_true", help="a covering subset of the loss variants (quick)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiler processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernels.aot: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    todo = [(v, args.arch) for v in variants(args.only, args.cover)]
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_compile_star, todo))
    else:
        results = [_compile_star(t) for t in todo]
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"compiled": len(results), "arch": args.arch, "seconds": round(time.perf_counter() - t0, 1),
                      "max_shared": max(r["shared"] for r in results)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
