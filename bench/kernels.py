"""Memory and time of the LM-head + log-prob step, forward + backward, three ways:

  (a) naive:   logits = hidden @ W^T; log_softmax(logits / T).gather(targets)     (plain autograd)
  (b) logits:  logits = hidden @ W^T; kernels.token_logprobs(logits, targets, T)  (no [N, V] temporaries
               beyond the logits and their gradient)
  (c) fused:   kernels.lm_head_logprobs(hidden, W, targets, T)                    (chunks: [N, V] never exists)
  (d) fused_objective: kernels.lm_head_objective(...) with loss="reinforce" (-A logp), A = -g: the same
               loss, gradients computed during the forward, by the device's default plan
               (KernelConfig.objective_grads "auto": vocabulary slabs on CUDA, token chunks on CPU)
  (d_slabs or d_chunks) (d) again by the other plan, as its baseline in the same run
  (c_ieee, d_ieee) with --dtype bfloat16 on a CPU that multiplies bf16 (AMX / AVX512-BF16): (c) and (d)
               again with the head's GEMMs as IEEE fp32 GEMMs of upcast operands, the strategy before
               oneDNN's bf16 math mode (kernels.lm_head.gemm_strategy), as the baseline of that mode

at Qwen2.5-0.5B sizes (N=2048 tokens, H=896, V=151936, fp32) by default; backend "auto" = the torch
implementation on CPU, Triton on CUDA. Each variant runs in its own subprocess, first once on one
chunk of tokens at the full H and V (what runs the first time is not the kernel's: library code pages,
GEMM buffers), then measured. Memory on CPU is the RSS high-water mark (/proc/self/status VmHWM,
reset to the resident set after the warm-up) minus that resident set; glibc returns every freed
block of 1 MiB or more to the system there (MALLOC_MMAP_THRESHOLD_), so the mark follows the
tensors alive, not what the allocator kept of earlier ones (a heap that kept the forward's 16 MB
log-softmax blocks into the backward added 0 to 90 MB, run to run). On CUDA,
torch.cuda.max_memory_allocated minus the allocation after the inputs. "above floor" also subtracts
the gradients that any method must return (grad of hidden and of the weight: fp32 [V, H] = 519 MiB
at these sizes). Then the shared memory of every Triton kernel variant, compiled ahead of time for
sm_90 (kernels/aot.py, no GPU needed).

    .venv/bin/python bench/kernels.py            # full sizes, ~1-2 min on 2 cores
    .venv/bin/python bench/kernels.py --quick    # small sizes, seconds
    .venv/bin/python bench/kernels.py --chunk-sweep 128 256 512   # (c) at several chunk sizes

Every variant computes loss = sum(g * logp) for one fixed random g, so the
checksums of the gradients agree. Then the fused loss kernel (kernels.grpo_objective) against the
torch objective (grpo.objective.objective + autograd), forward + backward on --loss-tokens tokens
(CUDA only for the kernel: on CPU Triton runs through its interpreter). Last line: JSON with each
variant's figures and ratios to (a), and the loss kernel's ratios to the torch objective.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MB = 1024 * 1024
# glibc: blocks of this size or more are mapped and unmapped one by one (setting it also stops glibc
# from raising its threshold to the largest block freed so far, which kept 16 MB blocks in the heap)
MMAP_THRESHOLD = 1 << 20


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_status_bytes(key: str) -> int:
    """VmRSS / VmHWM of this process from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_rss_peak() -> bool:
    """Give freed heap memory back (malloc_trim) and reset the high-water mark to the resident set
    (Linux >= 4.0: "5" > /proc/self/clear_refs); False where that cannot be done."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def forward(args, hidden, weight, targets, upstream):
    """(loss = sum(upstream * logp), logp [N]) of the variant named args.variant (the kernel alone:
    the head's CPU GEMM mode is set once by the worker)."""
    import torch

    import kernels

    if args.variant == "naive":
        log_probs = torch.log_softmax((hidden @ weight.t()).float() / args.temperature, dim=-1)
        logp = log_probs.gather(1, targets[:, None])[:, 0]
    elif args.variant == "logits":
        logits = hidden @ weight.t()
        logp = kernels.token_logprobs(logits, targets, args.temperature, backend=args.backend)[0]
    elif args.variant == "fused":
        logp = kernels.lm_head_logprobs(hidden, weight, targets, args.temperature, chunk_tokens=args.chunk_tokens,
                                        backend=args.backend)[0]
    else:  # fused_objective: REINFORCE (-A logp) with A = -upstream, weights 1 -> loss = sum(upstream * logp)
        from grpo.kernel_dispatch import objective_fn_for
        from grpo.objective import ObjectiveConfig

        plan = args.variant.removeprefix("fused_objective").removeprefix("_") or "auto"  # slabs, chunks
        zeros, ones = torch.zeros_like(upstream), torch.ones_like(upstream)
        loss, _, logp, _ = kernels.lm_head_objective(
            hidden, weight, targets, zeros, None, None, -upstream, ones, ObjectiveConfig(loss="reinforce"),
            objective_fn=objective_fn_for(hidden.device, kernels.KernelConfig(backend=args.backend)),
            temperature=args.temperature, chunk_tokens=args.chunk_tokens, backend=args.backend,
            config=kernels.KernelConfig(objective_grads=plan))
        return loss, logp
    return (logp * upstream).sum(), logp


def rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(args) -> dict:
    """One variant, one process: allocate inputs, measure the baseline, run forward + backward."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.device == "cpu":  # as the trainer on this CPU runs it: oneDNN's bf16 math mode where honoured
        from grpo.cpu.bf16 import install_lm_head_bf16_math

        install_lm_head_bf16_math()
    if args.variant.endswith("_ieee"):  # the head's GEMMs without oneDNN's bf16 math mode
        import kernels

        kernels.lm_head.set_cpu_bf16_gemms(None)
        args = argparse.Namespace(**{**vars(args), "variant": args.variant.removesuffix("_ieee")})
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    # Filled in place: a temporary here would raise the RSS high-water mark above the baseline's
    # true resident size and hide that much of the variant's peak.
    hidden = torch.empty(args.n_tokens, args.hidden, device=device, dtype=dtype).normal_().requires_grad_()
    weight = torch.empty(args.vocab, args.hidden, device=device, dtype=dtype).normal_(std=args.hidden ** -0.5)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.n_tokens,), device=device)
    upstream = torch.randn(args.n_tokens, device=device)  # d loss / d logp, as the objective would give
    # Warm-up: the variant once on one chunk of tokens at the full H and V, so one-off initialisation
    # (library code pages, thread pools, BLAS/oneDNN buffers, Triton JIT) is not counted against it.
    warm = min(args.n_tokens, args.chunk_tokens)
    hidden_w = hidden.detach()[:warm].clone().requires_grad_()
    forward(args, hidden_w, weight, targets[:warm], upstream[:warm])[0].backward()
    del hidden_w
    weight.grad = None
    gc.collect()
    on_cuda = device.type == "cuda"
    reset = False
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    elif (reset := reset_rss_peak()):
        baseline = rss_status_bytes("VmRSS")  # inputs are allocated and written: they are resident
    else:
        baseline = rss_peak_bytes()  # inputs are allocated and written: they are in the high-water mark
        resident = rss_now_bytes()
        if baseline > resident + 64 * MB:  # an earlier transient would make "peak - baseline" too small
            raise SystemExit(f"baseline high-water {baseline / MB:.0f} MB exceeds resident {resident / MB:.0f} MB")
    cpu0 = cpu_seconds()

    # One pass on the CPU (seconds long); the fastest of several on a GPU, where one pass takes
    # milliseconds and a single launch's jitter would be a large part of it.
    seconds = t_forward = float("inf")
    for _ in range(args.cuda_repeats if on_cuda else 1):
        hidden.grad = weight.grad = None
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, logp = forward(args, hidden, weight, targets, upstream)
        if on_cuda:
            torch.cuda.synchronize()
        t_forward = min(t_forward, time.perf_counter() - t0)
        loss.backward()
        if on_cuda:
            torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - t0)
    cpu = cpu_seconds() - cpu0

    if on_cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = (rss_status_bytes("VmHWM") if reset else rss_peak_bytes()) - baseline
    floor = hidden.grad.numel() * hidden.grad.element_size() + weight.grad.numel() * weight.grad.element_size()
    return dict(variant=args.variant, seconds=round(seconds, 5), forward_seconds=round(t_forward, 5),
                cpu_seconds=round(cpu, 3),
                peak_above_baseline_mb=round(peak / MB, 1), floor_mb=round(floor / MB, 1),
                above_floor_mb=round((peak - floor) / MB, 1), chunk_tokens=args.chunk_tokens if args.variant.startswith("fused") else None,
                memory="cuda max_memory_allocated" if on_cuda else
                "RSS high-water (VmHWM) after a reset" if reset else "RSS high-water (getrusage ru_maxrss)",
                # checksums: the three variants compute the same thing
                logp_sum=round(float(logp.detach().double().sum()), 3),
                grad_weight_norm=round(float(weight.grad.double().norm()), 5),
                grad_hidden_norm=round(float(hidden.grad.double().norm()), 5))


def loss_worker(args) -> dict:
    """The objective alone, forward + backward on N per-token inputs (an off-policy GRPO batch with
    ratios off 1, exact anchor, is_cap and a k3 KL term): grpo.objective.objective with autograd
    ("loss_torch") or the fused Triton kernel ("loss_triton": one pass for loss, gradient, stats)."""
    import torch

    import kernels
    from grpo.objective import ObjectiveConfig, objective

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ObjectiveConfig(loss="grpo", ratio_anchor="exact", is_cap=2.0, beta=0.04, kl_estimator="k3")
    run = (lambda *a: objective(*a, cfg)) if args.variant == "loss_torch" else \
        (lambda *a: kernels.grpo_objective(*a, cfg, backend="triton"))

    def inputs(n):
        g = torch.Generator(device=device).manual_seed(0)
        logp_alpha = -torch.rand(n, generator=g, device=device) * 3
        logp_k = logp_alpha + 0.2 * torch.randn(n, generator=g, device=device)
        logp = (logp_k + 0.2 * torch.randn(n, generator=g, device=device)).requires_grad_()
        logp_ref = logp_k + 0.1 * torch.randn(n, generator=g, device=device)
        return logp, logp_alpha, logp_k, logp_ref, torch.randn(n, generator=g, device=device), \
            torch.rand(n, generator=g, device=device)

    warm = inputs(1024)
    run(*warm)[0].backward()  # one-off start-up (thread pools, Triton JIT) not counted
    del warm
    x = inputs(args.loss_tokens)
    gc.collect()
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = rss_peak_bytes()
    cpu0 = cpu_seconds()
    times = []
    for _ in range(args.loss_repeats):
        x[0].grad = None
        t0 = time.perf_counter()
        loss, stats = run(*x)
        loss.backward()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if on_cuda else rss_peak_bytes()) - baseline
    floor = x[0].grad.numel() * x[0].grad.element_size()  # the gradient any method returns
    return dict(variant=args.variant, tokens=args.loss_tokens, seconds=round(min(times), 4),
                cpu_seconds=round((cpu_seconds() - cpu0) / args.loss_repeats, 4),
                peak_above_baseline_mb=round(peak / MB, 1), above_floor_mb=round((peak - floor) / MB, 1),
                loss=round(float(loss), 4), grad_norm=round(float(x[0].grad.double().norm()), 4),
                clip_frac=round(float(stats["clip_low_sum"] + stats["clip_high_sum"]) / float(stats["num_tokens"]), 4))


def run_variant(args, variant: str, chunk_tokens: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--chunk-tokens", str(chunk_tokens),
           "--n-tokens", str(args.n_tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
           "--dtype", args.dtype, "--temperature", str(args.temperature), "--device", args.device,
           "--backend", args.backend, "--threads", str(args.threads), "--loss-tokens", str(args.loss_tokens),
           "--loss-repeats", str(args.loss_repeats), "--cuda-repeats", str(args.cuda_repeats)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by glibc at the worker's start
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/kernels.py: variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shared_memory_report(quick: bool) -> list[dict]:
    """Shared memory (bytes) of each Triton kernel variant, compiled for sm_90 in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "kernels.aot", "--arch", "90"] + (["--cover"] if quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"(AOT compile failed: {proc.stderr[-2000:]})")
        return []
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")][:-1]
    return [dict(kernel=r["kernel"], variant=r["variant"], shared=r["shared"], num_warps=r["num_warps"]) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (N=512, H=128, V=16384), seconds")
    ap.add_argument("--n-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="(c)'s chunk; default KernelConfig's")
    ap.add_argument("--chunk-sweep", type=int, nargs="*", default=[], help="also run (c) at these chunk sizes")
    ap.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads per variant (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all variants; the fastest round counts")
    ap.add_argument("--cuda-repeats", type=int, default=10, help="timed passes per variant on a GPU; the fastest counts")
    ap.add_argument("--no-shared", action="store_true", help="skip the AOT shared-memory report")
    ap.add_argument("--loss-tokens", type=int, default=1 << 20, help="tokens of the loss-kernel comparison")
    ap.add_argument("--loss-repeats", type=int, default=5, help="forward+backward passes of the loss; the fastest counts")
    ap.add_argument("--worker", choices=["naive", "logits", "fused", "fused_objective", "fused_objective_slabs",
                                         "fused_objective_chunks", "fused_ieee", "fused_objective_ieee",
                                         "loss_torch", "loss_triton"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chunk_tokens is None:
        from kernels import KernelConfig
        args.chunk_tokens = KernelConfig().chunk_tokens
    if args.worker:
        ns = argparse.Namespace(**{**vars(args), "variant": args.worker})
        print(json.dumps(loss_worker(ns) if args.worker.startswith("loss_") else worker(ns)))
        return
    if args.quick:
        args.n_tokens, args.hidden, args.vocab, args.loss_tokens = 512, 128, 16384, 1 << 16

    print(f"LM head + log-probs, forward+backward: N={args.n_tokens} H={args.hidden} V={args.vocab} "
          f"{args.dtype} on {args.device}, backend {args.backend}, torch threads {args.threads or 'default'}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    plan = [("a_naive", "naive", args.chunk_tokens), ("b_logits", "logits", args.chunk_tokens),
            ("c_fused", "fused", args.chunk_tokens), ("d_fused_objective", "fused_objective", args.chunk_tokens)] + [(f"c_fused_chunk{c}", "fused", c) for c in args.chunk_sweep]
    other_plan = "chunks" if args.device == "cuda" else "slabs"  # the plan "auto" does not pick here
    plan.append((f"d_{other_plan}", f"fused_objective_{other_plan}", args.chunk_tokens))
    from grpo.cpu.bf16 import onednn_bf16_math_honoured

    if args.device == "cpu" and args.dtype == "bfloat16" and onednn_bf16_math_honoured():
        plan += [("c_fused_ieee", "fused_ieee", args.chunk_tokens),
                 ("d_fused_objective_ieee", "fused_objective_ieee", args.chunk_tokens)]
    results = {}
    # Rounds of a, b, c, ... in turn; each variant keeps its fastest round (the machine is shared,
    # so the minimum is the least disturbed figure). Memory is deterministic enough: the max is kept.
    for round_ in range(args.repeats):
        for label, variant, chunk in plan:
            r = run_variant(args, variant, chunk)
            print(json.dumps({label: r, "round": round_}))
            if label in results:
                best = min(results[label], r, key=lambda x: x["seconds"])
                best = {**best, "peak_above_baseline_mb": max(results[label]["peak_above_baseline_mb"], r["peak_above_baseline_mb"]),
                        "above_floor_mb": max(results[label]["above_floor_mb"], r["above_floor_mb"])}
                r = best
            results[label] = r

    # The fused loss kernel (Liger's triple: kernel, test, benchmark) against the torch objective.
    # On CPU Triton runs only through its interpreter (numpy, one program at a time): a speed figure
    # from it would mean nothing, so there the torch objective is measured alone.
    loss_plan = ["loss_torch"] + (["loss_triton"] if args.device == "cuda" else [])
    for variant in loss_plan:
        r = run_variant(args, variant, args.chunk_tokens)
        print(json.dumps({variant: r}))
        results[variant] = r
    if args.device != "cuda":
        print("loss_triton: not measured on CPU (Triton needs CUDA; scripts/gpu_check.sh runs it)")

    if not args.no_shared:
        print("Triton kernels compiled for sm_90: shared memory per variant (bytes)")
        shared = shared_memory_report(args.quick)
        for r in shared:
            print(f"  {r['kernel']:<22} {r['variant']:<62} shared={r['shared']:<6} warps={r['num_warps']}")
        results["shared_memory_max_bytes"] = max((r["shared"] for r in shared), default=None)

    base = results["a_naive"]
    summary = {"sizes": dict(N=args.n_tokens, H=args.hidden, V=args.vocab, dtype=args.dtype, device=args.device)}
    for label, r in results.items():
        if not isinstance(r, dict) or label.startswith("loss_"):
            continue
        summary[label] = dict(seconds=r["seconds"], cpu_seconds=r["cpu_seconds"], above_floor_mb=r["above_floor_mb"],
                              peak_above_baseline_mb=r["peak_above_baseline_mb"])
        if label != "a_naive":
            summary[label]["time_ratio_vs_a"] = round(r["seconds"] / base["seconds"], 3)
            summary[label]["cpu_time_ratio_vs_a"] = round(r["cpu_seconds"] / base["cpu_seconds"], 3)
            summary[label]["mem_above_floor_ratio_vs_a"] = round(r["above_floor_mb"] / base["above_floor_mb"], 3)
    summary["loss_torch"] = {k: results["loss_torch"][k] for k in ("tokens", "seconds", "above_floor_mb")}
    if "loss_triton" in results:
        t, f = results["loss_torch"], results["loss_triton"]
        summary["loss_triton"] = {"seconds": f["seconds"], "above_floor_mb": f["above_floor_mb"],
                                  "time_ratio_vs_torch": round(f["seconds"] / t["seconds"], 3),
                                  "mem_above_floor_ratio_vs_torch": round(f["above_floor_mb"] / max(t["above_floor_mb"], 1e-9), 3)}
    for fast, slow in (("c_fused", "c_fused_ieee"), ("d_fused_objective", "d_fused_objective_ieee")):
        if slow in results:  # oneDNN's bf16 math mode against IEEE fp32 GEMMs, same run
            summary[fast]["time_ratio_vs_ieee_gemms"] = round(results[fast]["seconds"] / results[slow]["seconds"], 3)
    summary["floor_mb"] = base["floor_mb"]
    summary["shared_memory_max_bytes"] = results.get("shared_memory_max_bytes")
    c = summary["c_fused"]
    summary["load_average_end"] = round(os.getloadavg()[0], 2)
    # Target: (c) <= 10% of (a)'s memory above the floor, <= 1.5x its time (wall; CPU time alongside,
    # since on a shared machine wall time also measures the neighbours).
    summary["target_memory_met"] = bool(c["mem_above_floor_ratio_vs_a"] <= 0.10)
    summary["target_time_met_wall"] = bool(c["time_ratio_vs_a"] <= 1.5)
    summary["target_time_met_cpu"] = bool(c["cpu_time_ratio_vs_a"] <= 1.5)
    print(json.dumps(summary))


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
