"""The inference engine end to end, with its LM head in fp32 and in the model's dtype.

For each `--heads` entry (server.head_dtype) one server is launched (grpo.serving.server, on the GPU
where there is one, else this CPU) and:

  push      the model's own weights as version 1 (write, load, the engine's fingerprint checked)
  generate  B prompts x G completions at each temperature, seeded (time, tokens/s)
  score     /grpo/score of the just-sampled batch at the same temperature: its log-probs against
            those the sampler returned (the same engine, weights and tokens: the gap is the batch shape)
  parity    the parity probe (grpo/parity.py) on the whole batch: the trainer's log-probs of the
            sampled tokens (train.py's Policy, fp32 logits) against the engine's scores of them, same
            weights: parity_kl, parity_max_abs, ...

What scripts/gpu_check.sh's engine step runs (a GPU learns the engine there); on a CPU, the demo
model's figures in docs/benchmarks/. The fp32 head matters where the engine computes in bf16:
at T = 0.1 a logit's bf16 rounding is multiplied by 10 before the softmax.

    .venv/bin/python bench/engine.py --model smollm2 --dtype bfloat16       # the demo model, minutes on 2 cores
    .venv/bin/python bench/engine.py --model tiny --prompts 2 --G 2 --max-tokens 8   # seconds: CI's smoke size
    .venv/bin/python bench/engine.py --model /models/Qwen2.5-0.5B-Instruct --dtype bfloat16   # any HF directory

The trainer side runs on cuda:0 with bf16 weights where there is a GPU (as train.py's mixed
precision computes), else on this CPU in fp32 (the model's values upcast exactly). Last line: JSON,
with "ok": every server served the head it was asked for, every push passed its fingerprint, every
score and parity figure is finite.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo.data import DataConfig, build_prompt, encode_prompt, load_problems  # noqa: E402
from grpo.models import build_smollm2_dir, load_model, load_tokenizer  # noqa: E402
from grpo.parity import ParityConfig, ParityProbe, ProbeSequence, parity_stats, trainer_logprobs  # noqa: E402
from grpo.policy import Policy  # noqa: E402
from grpo.rollout import Sample  # noqa: E402
from grpo.serving.inference import InferenceServer, ServerConfig  # noqa: E402
from kernels import KernelConfig  # noqa: E402


def model_directory(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from tests.tiny_models import make_tiny_model_dir

        return make_tiny_model_dir(tmp / "tiny", arch="qwen2")
    if name == "smollm2":
        return build_smollm2_dir(ROOT / ".cache/models/smollm2")
    return Path(name)


def prompts(tokenizer, count: int) -> list[list[int]]:
    data = DataConfig(dataset="arithmetic", system_prompt="Solve the arithmetic problem.",
                      instruction="End with: The answer is <number>.")
    return [encode_prompt(tokenizer, build_prompt(tokenizer, p, data)) for p in load_problems(data)[:count]]


def max_abs_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """max |a - b| over the entries both hold finite (-inf: outside a kept top-k/top-p set)."""
    gaps = [abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb) if math.isfinite(x) and math.isfinite(y)]
    return max(gaps, default=0.0)


def one_temperature(server: InferenceServer, policy: Policy, prompt_ids: list[list[int]], args, T: float,
                    pad_id: int, device: torch.device) -> dict:
    policy.temperature = T
    t0 = time.perf_counter()
    batch = server.generate(prompt_ids, n=args.G, max_tokens=args.max_tokens, temperature=T, seed=args.seed)
    seconds = time.perf_counter() - t0
    samples = [Sample(group=j, prompt_ids=prompt_ids[j], completion_ids=c.token_ids, logp_alpha=c.logprobs,
                      truncated=c.finish_reason == "length")
               for j, group in enumerate(batch.completions) for c in group]
    tokens = sum(len(s.completion_ids) for s in samples)
    probe = ParityProbe([ProbeSequence(s.prompt_ids, s.completion_ids) for s in samples], {"temperature": T})
    scored = server.score(probe.pairs(), temperature=T)  # one request per token: the slow part on a CPU
    trainer = trainer_logprobs(policy, probe, pad_id, device, share_prompts=False)
    stats = parity_stats(scored.logprobs, trainer, ParityConfig().threshold)
    return {"generate_s": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "weights_version": batch.weights_version,
            "score_vs_sampled_max_abs": max_abs_gap(scored.logprobs, [s.logp_alpha for s in samples]),
            **{k: v for k, v in stats.items()}}


def one_head(head: str, model_dir: Path, args, run_dir: Path, policy: Policy, prompt_ids, pad_id: int,
             device: torch.device, state_dict: dict) -> dict:
    cfg = ServerConfig(dtype=args.dtype, head_dtype=head, max_model_len=args.max_model_len, seed=args.seed,
                       startup_timeout_s=args.startup_timeout_s, request_timeout_s=args.request_timeout_s,
                       enforce_eager=head in args.eager)
    gpu = "0" if device.type == "cuda" else None
    t0 = time.perf_counter()
    with InferenceServer.launch(model_dir, cfg, run_dir, gpu=gpu) as server:
        out = {"startup_s": round(time.perf_counter() - t0, 1), "enforce_eager": cfg.enforce_eager,
               "head_dtype": server.client.request("GET", "/grpo/health").get("head_dtype"),
               "serve_dtype": str(server.serve_dtype).removeprefix("torch.")}
        server.generate(prompt_ids[:1], n=1, max_tokens=2, temperature=1.0)  # warm-up: the first request compiles
        push = server.push(state_dict, version=1, step=1)  # raises if the engine's fingerprint differs
        out["push_s"] = round(push["seconds"], 3)
        for T in args.temperatures:
            out[f"T={T:g}"] = one_temperature(server, policy, prompt_ids, args, T, pad_id, device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF model directory")
    ap.add_argument("--dtype", default="bfloat16", help="server.dtype (the engine's compute dtype)")
    ap.add_argument("--heads", nargs="+", default=["float32", "model"], choices=["float32", "model"])
    ap.add_argument("--eager", nargs="*", default=[], choices=["float32", "model"],
                    help="heads whose server starts with server.enforce_eager (no compilation, no CUDA graphs)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.1])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="where the servers' run directories (and logs) stay; default: a temporary one")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--request-timeout-s", type=float, default=3600.0, help="a bf16 engine on a CPU without bf16 is slow")
    args = ap.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(args.work or tmp)
        model_dir = model_directory(args.model, tmp).resolve()
        tokenizer = load_tokenizer(model_dir)
        prompt_ids = prompts(tokenizer, args.prompts)
        lm = load_model(model_dir, dtype=torch.float32)
        state_dict = {k: v.clone() for k, v in lm.state_dict().items()}  # pushed as version 1: the same weights
        if device.type == "cuda":
            lm = lm.to(device, torch.bfloat16)  # train.py's mixed precision: bf16 weights, fp32 logits
        policy = Policy(lm.eval(), 1.0, KernelConfig())
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        heads = {head: one_head(head, model_dir, args, tmp / f"run-{head}", policy, prompt_ids, pad_id, device,
                                state_dict) for head in args.heads}
    expected = {"float32": "float32"}
    ok = all(h["head_dtype"] == expected.get(name, h["serve_dtype"]) for name, h in heads.items())
    figures = [v for h in heads.values() for key, t in h.items() if key.startswith("T=")
               for v in (t["score_vs_sampled_max_abs"], t.get("parity_kl", math.nan), t.get("parity_max_abs", math.nan))]
    ok = ok and all(math.isfinite(v) for v in figures)
    print(json.dumps({"model": args.model, "dtype": args.dtype, "device": str(device), "threads": torch.get_num_threads(),
                      "prompts": args.prompts, "G": args.G, "max_tokens": args.max_tokens,
                      "load_avg_1min": round(os.getloadavg()[0], 2), "heads": heads, "ok": ok}))


if __name__ == "__main__":
    main()
