"""Sampling throughput: the project's rollout path (grpo.serving.server, seeded /grpo/generate, token ids and
log-probs returned) against Hugging Face `generate` on the same model, dtype, prompts and counts.

    .venv/bin/python bench/rollout.py [--prompts 8] [--G 8] [--max-tokens 128] [--repeats 2] [--model tiny]
                                      [--samplers inverse_cdf,vllm] [--servers 1,2]

Both sample B prompts x G completions at temperature 1.0 with the log-prob of every sampled token
(HF: output_scores + compute_transition_scores), on the same threads (torch.get_num_threads() in
this process; the server's OpenMP threads are bound to the same cores). Tokens counted are the
completion tokens up to and including EOS. The server is measured after one warm-up request (its
first request compiles); HF's first call is left out too. Reported: tokens/s of each, median over
repeats, and the ratio server / HF (target >= 6x on this 2-core machine). The server runs once per
`--samplers` entry (cpu.engine_sampler: the default inverse-CDF sampler, then vLLM's own CPU Gumbel
sampler as the baseline of the same run). Final line: JSON.

`--servers 1,2` measures a fleet instead (grpo/serving/fleet.py; no HF run): the same batch through a
ServerFleet of each size in turn, launched on this CPU as a run launches its servers (each engine with
its own 1 GiB KV cache, its threads bound to the same cores as the others': on a 2-core machine the
engines share the cores), one warm-up batch each, then tokens/s per size (median over repeats) and
the ratio of each size over the first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo.data import DataConfig, build_prompt, encode_prompt, load_problems  # noqa: E402
from grpo.cpu import CPUConfig  # noqa
from grpo.serving.fleet import ServerFleet  # noqa: E402
from grpo.serving.inference import InferenceServer, ServerConfig, serving_dtype  # noqa: E402
from grpo.models import build_smollm2_dir, load_model, load_tokenizer  # noqa: E402


def server_rate(server: InferenceServer | ServerFleet, prompt_ids: list[list[int]], G: int, max_tokens: int,
                seed: int) -> tuple:
    t0 = time.perf_counter()
    result = server.generate(prompt_ids, n=G, max_tokens=max_tokens, temperature=1.0, seed=seed)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for group in result.completions for c in group)
    assert all(len(c.logprobs) == len(c.token_ids) for group in result.completions for c in group)
    return tokens / seconds, tokens, seconds


def hf_rate(model, tokenizer, prompt_ids: list[list[int]], G: int, max_tokens: int, seed: int) -> tuple:
    """HF generate on the left-padded batch, G return sequences each, with per-token log-probs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_tokens, num_return_sequences=G, pad_token_id=pad,
                             output_scores=True, return_dict_in_generate=True)
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    seconds = time.perf_counter() - t0
    completions = out.sequences[:, width:]
    eos = tokenizer.eos_token_id
    tokens = 0
    for row in completions.tolist():
        n = len(row)
        if eos in row:
            n = row.index(eos) + 1
        tokens += n
    assert logprobs.shape == completions.shape
    return tokens / seconds, tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--samplers", default="inverse_cdf,vllm", help="cpu.engine_sampler values, one server each")
    ap.add_argument("--servers", default="", help="fleet sizes, e.g. 1,2: the same batch through a ServerFleet of "
                                                  "each size (the first sampler), instead of server against HF")
    args = ap.parse_args()
    sizes = args.servers.split(",") if args.servers else []
    if not all(r.isdigit() and int(r) >= 1 for r in sizes):
        print(f"--servers {args.servers}: fleet sizes are whole numbers >= 1, e.g. 1,2", file=sys.stderr)
        sys.exit(2)
    sizes = [int(r) for r in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model == "tiny":
            from tests.tiny_models import make_tiny_model_dir

            model_dir = make_tiny_model_dir(tmp / "tiny", arch="qwen2")
        else:
            model_dir = build_smollm2_dir(ROOT / ".cache/models/smollm2")
        samplers = args.samplers.split(",")
        cfg = ServerConfig(max_model_len=1024)
        dtype = serving_dtype(cfg, model_dir, on_cpu=True)  # the dtype the trainer's server would use here
        tokenizer = load_tokenizer(model_dir)
        data = DataConfig(dataset="arithmetic", system_prompt="Solve the arithmetic problem.",
                          instruction="End with: The answer is <number>.")
        problems = load_problems(data)[:args.prompts]
        prompt_ids = [encode_prompt(tokenizer, build_prompt(tokenizer, p, data)) for p in problems]
        if sizes:
            return fleet_bench(args, sizes, model_dir, cfg, dtype, prompt_ids, CPUConfig(engine_sampler=samplers[0]),
                               tmp)

        hf = load_model(model_dir, dtype=dtype).eval()
        hf_rate(hf, tokenizer, prompt_ids[:1], 1, 8, seed=0)  # warm-up
        hf_runs = [hf_rate(hf, tokenizer, prompt_ids, args.G, args.max_tokens, seed=r) for r in range(args.repeats)]
        del hf

        runs = {}
        for sampler in samplers:
            with InferenceServer.launch(model_dir, cfg, tmp / f"run-{sampler}",
                                        cpu=CPUConfig(engine_sampler=sampler)) as server:
                server_rate(server, prompt_ids, args.G, args.max_tokens, seed=100)  # warm-up (compiles)
                runs[sampler] = [server_rate(server, prompt_ids, args.G, args.max_tokens, seed=r)
                                 for r in range(args.repeats)]
                print(f"server ({sampler}): {statistics.median(r[0] for r in runs[sampler]):.1f} tokens/s", flush=True)
    hf_tps = statistics.median(r[0] for r in hf_runs)
    tps = {sampler: statistics.median(r[0] for r in server_runs) for sampler, server_runs in runs.items()}
    server_tps = tps[samplers[0]]
    result = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts, "G": args.G,
        "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "sampler": samplers[0],
        "server_tokens_per_s": round(server_tps, 1), "hf_tokens_per_s": round(hf_tps, 1),
        "server_over_hf": round(server_tps / hf_tps, 2),
        "by_sampler": {s: {"tokens_per_s": round(v, 1), "over_hf": round(v / hf_tps, 2)} for s, v in tps.items()},
        "server_runs": {s: [{"tokens": t, "seconds": round(sec, 2)} for _, t, sec in r] for s, r in runs.items()},
        "hf_runs": [{"tokens": t, "seconds": round(s, 2)} for _, t, s in hf_runs],
        "load_avg_1min": round(os.getloadavg()[0], 2), "target_ratio": 6.0,
    }
    print(json.dumps(result))


def fleet_bench(args, sizes: list[int], model_dir: Path, cfg: ServerConfig, dtype: torch.dtype,
                prompt_ids: list[list[int]], cpu: CPUConfig, tmp: Path) -> None:
    """The same batch through a fleet of each size, one fleet at a time (never two fleets' engines at once)."""
    runs, cores = {}, {}
    for R in sizes:
        with ServerFleet.launch(model_dir, replace(cfg, replicas=R), tmp / f"fleet{R}", gpus=(None,) * R,
                                cpu=cpu) as fleet:
            server_rate(fleet, prompt_ids, args.G, args.max_tokens, seed=100)  # warm-up (each engine compiles)
            runs[R] = [server_rate(fleet, prompt_ids, args.G, args.max_tokens, seed=r) for r in range(args.repeats)]
            cores[str(R)] = [server.cpu_cores for server in fleet.servers]
        print(f"{R} server(s): {statistics.median(r[0] for r in runs[R]):.1f} tokens/s", flush=True)
    tps = {R: statistics.median(r[0] for r in fleet_runs) for R, fleet_runs in runs.items()}
    base = sizes[0]
    result = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts, "G": args.G,
        "max_tokens": args.max_tokens, "temperature": 1.0, "sampler": cpu.engine_sampler,
        "servers": sizes, "engine_cores": cores,
        "by_servers": {str(R): {"tokens_per_s": round(v, 1), f"over_{base}": round(v / tps[base], 2)}
                       for R, v in tps.items()},
        "fleet_runs": {str(R): [{"tokens": t, "seconds": round(sec, 2)} for _, t, sec in r] for R, r in runs.items()},
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    if len(sizes) == 2:
        result[f"ratio_{sizes[1]}_over_{sizes[0]}"] = round(tps[sizes[1]] / tps[sizes[0]], 2)
        print(f"{sizes[1]} servers / {sizes[0]}: {tps[sizes[1]] / tps[sizes[0]]:.2f}x", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
