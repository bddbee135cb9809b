"""Bandwidth of the per-token log-prob forward (kernels/logprobs.py) on one GPU, variant by variant.

Each variant of triton_forward (block-wise, lane-wise or grouped loop, two-buffer prefetch, split vocabulary,
Triton's num_stages) runs over a launch sweep, at N = 256 (one LM-head chunk of the trainer, fp32
logits), 2048 and 16384 rows, V = 151936, T = 0.1, bf16 and fp32 logits, with and without the
entropy. Figure of merit: bytes of logits read per second (N V itemsize / time), as a fraction of the
device's nominal HBM peak (scripts/gpu_check.py HBM_PEAK) and of two measured ceilings on the same
bytes: a device copy (reads + writes, 2x the bytes) and torch.amax over the rows (a read-only
reduction). Time: the fastest of --reps launches, each timed with CUDA events behind a 1 GiB fill that
keeps the GPU busy while the host enqueues (so the host's launch cost is not timed) and evicts L2.
Each variant's outputs are checked on the device against torch_forward (the definition): max abs
difference relative to the reference's largest value, FAIL above 1e-4 (lse, logp) / 1e-3 (entropy).

    python bench/logprob_bandwidth.py [--out lp.json] [--budget-s 200] [--reps 25]
    python bench/logprob_bandwidth.py --smoke      # CPU, Triton interpreter, tiny sizes (a test runs it)

Needs only torch, triton and numpy (imports kernels/, which imports nothing else). Prints one table
per case, the elapsed time, then one JSON line. Variants past --budget-s are skipped and say so.
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and "--smoke" in sys.argv[1:]:
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU smoke runs the interpreter

import argparse
import importlib.util
import json
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels.logprobs import torch_forward, triton_forward  # noqa: E402

V, TEMPERATURE, FLUSH_BYTES = 151936, 0.1, 1 << 30
BLOCK = dict(rows_per_program=1, block_v=4096, num_warps=8)  # the block-wise loop's launch (the default before lanewise)
LAUNCH_DEFAULTS = dict(split=1, lanewise=False, prefetch=False, grouped=False, num_stages=None)


def default_launch() -> dict:
    """triton_forward's launch that kernels.KernelConfig() picks for V columns on a GPU."""
    return dict(kernels._logprob_impl(kernels.KernelConfig(), torch.device("cuda"), V).forward_launch)
TOLERANCE = {"logp": 1e-4, "lse": 1e-4, "entropy": 1e-3}


def hbm_peak(name: str):
    """Nominal HBM bytes/s of a device name, from scripts/gpu_check.py's table (None if unknown)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check._hbm_peak(name)


def variants(smoke: bool) -> list[tuple[str, dict]]:
    """(name, triton_forward launch kwargs), the most telling first (the budget cuts from the end)."""
    if smoke:  # one of each family, small tiles: several blocks per row, ragged edges
        small = dict(rows_per_program=2, block_v=64, num_warps=4)
        return [("block", small), ("lane", dict(small, lanewise=True)),
                ("lane+prefetch", dict(small, lanewise=True, prefetch=True)), ("prefetch", dict(small, prefetch=True)),
                ("split3 lane", dict(small, lanewise=True, split=3)), ("split2 block", dict(small, split=2)),
                ("block stages1", dict(small, num_stages=1)),
                ("grouped+prefetch", dict(small, grouped=True, prefetch=True)),
                ("split3 grouped", dict(small, grouped=True, split=3))]

    def launch(bv, w, r=1, **kw):
        return dict(rows_per_program=r, block_v=bv, num_warps=w, **kw)

    # the block-wise and the lane-wise loops' defaults first, for the ratios against them
    out = [("block bv4096 w8", dict(BLOCK)), ("lane+prefetch bv2048 w8", launch(2048, 8, lanewise=True, prefetch=True))]
    out += [(f"grouped+prefetch bv{bv} w{w}", launch(bv, w, lanewise=True, grouped=True, prefetch=True))
            for bv, w in ((2048, 8), (1024, 4), (2048, 4), (4096, 8), (4096, 16))]
    out += [("grouped bv2048 w8", launch(2048, 8, lanewise=True, grouped=True)),
            ("split2 grouped+prefetch bv2048 w4", launch(2048, 4, lanewise=True, grouped=True, prefetch=True, split=2))]
    out += [(f"lane bv{bv} w{w}", launch(bv, w, lanewise=True)) for bv, w in ((1024, 4), (2048, 4), (2048, 8),
                                                                             (4096, 8), (4096, 16))]
    out += [(f"lane+prefetch bv{bv} w{w}", launch(bv, w, lanewise=True, prefetch=True))
            for bv, w in ((1024, 4), (2048, 4), (4096, 8))]
    out += [(f"split{k} lane bv2048 w4", launch(2048, 4, lanewise=True, split=k)) for k in (2, 4, 8)]
    out += [(f"split{k} lane+prefetch bv2048 w4", launch(2048, 4, lanewise=True, prefetch=True, split=k))
            for k in (2, 4, 8)]
    out += [(f"split{k} block bv4096 w8", launch(4096, 8, split=k)) for k in (2, 4, 8)]
    out += [(f"prefetch bv{bv} w{w}", launch(bv, w, prefetch=True)) for bv, w in ((2048, 4), (4096, 8), (8192, 8))]
    out += [(f"block bv{bv} w{w}", launch(bv, w)) for bv, w in ((2048, 4), (8192, 8))]
    out += [(f"block bv4096 w8 stages{s}", dict(BLOCK, num_stages=s)) for s in (1, 2, 4)]
    # the launch the trainer uses, named so and measured first (the budget cuts from the end)
    default = {**LAUNCH_DEFAULTS, **default_launch()}
    is_default = [{**LAUNCH_DEFAULTS, **launch} == default for _, launch in out]
    return ([(f"{name} (default)", launch) for (name, launch), d in zip(out, is_default) if d]
            + [v for v, d in zip(out, is_default) if not d])


def cases(smoke: bool) -> list[tuple[int, int, torch.dtype, bool]]:
    """(N, V, logits dtype, with_entropy)."""
    if smoke:
        return [(5, 300, torch.bfloat16, True), (5, 300, torch.float32, False)]
    big = [(n, V, dtype, ent) for n in (2048, 16384) for dtype in (torch.bfloat16, torch.float32)
           for ent in (False, True)]
    return big + [(256, V, torch.float32, ent) for ent in (False, True)]  # the trainer's chunk: fp32 logits


class Timer:
    """Fastest of `reps` runs of fn(): CUDA events behind a fill of FLUSH_BYTES on the GPU, perf_counter on CPU."""

    def __init__(self, device, reps):
        self.device, self.reps = device, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES if self.cuda else 1, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        if not self.cuda:  # the interpreter: one run, for the plumbing, not the figure
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        fn()
        fn()  # the first call compiled; the second settles the caches
        pairs = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return min(s.elapsed_time(e) for s, e in pairs) / 1e3


def max_rel_diff(got, want) -> float:
    scale = float(want.abs().max().clamp_min(1e-6))
    return float((got.float() - want.float()).abs().max()) / scale


def measure_ceilings(logits, timer) -> dict:
    """Bytes of logits per second of a device copy (2x the bytes: read + write) and of torch.amax."""
    read = logits.numel() * logits.element_size()
    copy_dst = torch.empty_like(logits)
    return {"copy": 2 * read / timer(lambda: copy_dst.copy_(logits)),
            "amax": read / timer(lambda: torch.amax(logits, dim=1))}


def wall_seconds(fn, device, reps) -> float:
    """scripts/gpu_check.py's method, for comparison with its figures: fastest perf_counter interval
    around fn() and a synchronize, so the host's work (kernels.token_logprobs' checks, one of which
    reads targets.max() back, and the launch) is counted."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def run_case(case, device, timer, configs, peak, deadline):
    n, v, dtype, with_entropy = case
    g = torch.Generator(device=device).manual_seed(n + v)
    logits = torch.randn(n, v, device=device, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    targets[::7] = -100  # ignored rows
    inv_t = 1.0 / TEMPERATURE
    read = logits.numel() * logits.element_size()
    ref = torch_forward(logits, targets, inv_t, with_entropy)
    ceilings = measure_ceilings(logits, timer)
    wall = wall_seconds(lambda: kernels.token_logprobs(logits, targets, TEMPERATURE, with_entropy=with_entropy,
                                                       backend="triton"), device, 20 if device.type == "cuda" else 1)
    results = {}
    for name, kw in configs:
        if time.perf_counter() > deadline:
            results[name] = {"skipped": "budget"}
            continue
        try:
            got = triton_forward(logits, targets, inv_t, with_entropy, **kw)
            diffs = {"logp": max_rel_diff(got[0], ref[0]), "lse": max_rel_diff(got[1], ref[1])}
            if with_entropy:
                diffs["entropy"] = max_rel_diff(got[2], ref[2])
            ok = all(d <= TOLERANCE[k] for k, d in diffs.items())
            sec = timer(lambda: triton_forward(logits, targets, inv_t, with_entropy, **kw))
        except Exception as e:  # a launch the device refuses (e.g. out of resources): recorded, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        results[name] = dict(seconds=sec, bytes_per_s=read / sec, fraction_of_peak=read / sec / peak if peak else None,
                             fraction_of_copy=read / sec / ceilings["copy"], max_rel_diff=diffs, ok=ok)
    done = {k: r for k, r in results.items() if "seconds" in r}
    best = max(done, key=lambda k: done[k]["bytes_per_s"]) if done else None
    return dict(n=n, v=v, dtype=str(dtype).split(".")[-1], with_entropy=with_entropy, bytes_read=read,
                ceilings=ceilings, default_wall_bytes_per_s=read / wall, results=results, best=best)


def print_case(key, r, peak):
    def pct(bps):
        return f"{100 * bps / peak:5.1f}%" if peak else "    -"

    print(f"\n== {key}: {r['bytes_read'] / 1e6:.0f} MB read; copy {r['ceilings']['copy'] / 1e12:.2f} TB/s "
          f"({pct(r['ceilings']['copy'])}), amax read {r['ceilings']['amax'] / 1e12:.2f} TB/s "
          f"({pct(r['ceilings']['amax'])}); default launch through kernels.token_logprobs, host time "
          f"included (gpu_check's method): {r['default_wall_bytes_per_s'] / 1e12:.2f} TB/s "
          f"({pct(r['default_wall_bytes_per_s'])}) ==")
    print(f"{'variant':38s} {'us':>9s} {'TB/s':>6s} {'peak':>6s} {'/copy':>6s}  max rel diff")
    for name, x in r["results"].items():
        if "seconds" not in x:
            print(f"{name:38s} {x.get('skipped') or x.get('error')}")
            continue
        diffs = " ".join(f"{k}={d:.1e}" for k, d in x["max_rel_diff"].items())
        mark = "" if x["ok"] else "  FAIL"
        best = "  <- best" if name == r["best"] else ""
        print(f"{name:38s} {x['seconds'] * 1e6:9.1f} {x['bytes_per_s'] / 1e12:6.2f} {pct(x['bytes_per_s'])} "
              f"{100 * x['fraction_of_copy']:5.1f}%  {diffs}{mark}{best}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny sizes")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    parser.add_argument("--reps", type=int, default=25, help="timed launches per variant (the fastest counts)")
    parser.add_argument("--budget-s", type=float, default=180.0, help="skip the variants left after this many seconds")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter evaluates masked lanes
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("logprob_bandwidth: no CUDA device (use --smoke for the CPU interpreter run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    name = "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(0)
    peak = None if smoke else hbm_peak(name)
    timer = Timer(device, 1 if smoke else args.reps)
    configs = variants(smoke)
    deadline = t0 + args.budget_s
    import triton

    report = dict(device=name, torch=torch.__version__, triton=triton.__version__, hbm_peak_bytes_per_s=peak,
                  temperature=TEMPERATURE, reps=args.reps, cases={})
    for case in cases(smoke):
        n, v, dtype, ent = case
        key = f"N={n} V={v} {str(dtype).split('.')[-1]} entropy={'on' if ent else 'off'}"
        r = run_case(case, device, timer, configs, peak, deadline)
        report["cases"][key] = r
        print_case(key, r, peak)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    failed = [f"{key}: {name}" for key, r in report["cases"].items() for name, x in r["results"].items()
              if x.get("ok") is False or "error" in x]
    report.update(failed=failed, elapsed_s=round(time.perf_counter() - t0, 1),
                  best={key: (r["best"], r["results"][r["best"]]["fraction_of_peak"] if r["best"] else None)
                        for key, r in report["cases"].items()})
    print(f"\nelapsed {report['elapsed_s']} s; {len(failed)} variant(s) off the reference or failed to launch")
    line = json.dumps(report, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
