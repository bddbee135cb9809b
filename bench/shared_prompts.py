"""Where the time of optim.share_prompts goes: a GRPO batch at the paper's GSM8K shape (groups of
G=16 completions of <=200 tokens behind a <=150-token prompt) through Qwen2.5-0.5B's shape in bf16,
a row per sequence against one row per group with each shared-prompt attention (grpo.shared_prompt:
sdpa, flex), forward + backward: wall seconds, GPU seconds and the top GPU kernels of one profiled
pass each (torch.profiler), and the host calls that take the most CPU time (a layout whose wall time
exceeds its GPU time waits on the host). The pass/fail check of the same layouts is
scripts/gpu_check.py's shared_prompts step; this script says why a layout costs what it does.

    python bench/shared_prompts.py                 # on cuda:0 (random weights: no model download)
    python bench/shared_prompts.py --groups 6      # a micro-batch of 6 groups instead of 2
    python bench/shared_prompts.py --device cpu --toy   # seconds; SDPA rows only (no flex backward on a CPU)

Last line: JSON, {layout: {wall_s, gpu_s, host_s, aten_calls, tokens, groups}}.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from grpo.batching import collate, collate_groups  # noqa: E402
from grpo.policy import Policy  # noqa: E402
from grpo.rollout import Sample  # noqa: E402
from grpo.shared_prompt import use_shared_prompt_attention  # noqa: E402

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--toy", action="store_true", help="a 2-layer model and short sequences")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="GPU kernels listed per layout")
    args = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    P, C, G = (13, 21, 4) if args.toy else (150, 200, 16)
    torch.manual_seed(0)
    with torch.device(device):
        lm = Qwen2ForCausalLM(Qwen2Config(**(TOY if args.toy else QWEN_05B), max_position_embeddings=32768))
    if on_gpu:
        lm = lm.to(torch.bfloat16)
    policy = Policy(lm, 1.0, kernels.KernelConfig())
    rng = random.Random(0)
    vocab = lm.config.vocab_size
    batch = []
    for g in range(args.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(P - rng.randrange(0, P // 4))]
        batch.append([Sample(group=g, prompt_ids=prompt, logp_alpha=[0.0] * n, truncated=False,
                             completion_ids=[rng.randrange(3, vocab) for _ in range(n)])
                      for n in (C - rng.randrange(0, C // 3) for _ in range(G))])
    layouts = [("plain", collate([s for gr in batch for s in gr], 0, device), None),
               ("shared_sdpa", collate_groups(batch, 0, device), "sdpa")]
    if on_gpu:
        layouts.append(("shared_flex", layouts[1][1], "flex"))
    from torch.profiler import ProfilerActivity, profile

    figures = {}
    for layout, mb, impl in layouts:
        if impl is None:
            lm.set_attn_implementation("sdpa")
        else:
            use_shared_prompt_attention(lm, impl)
        kw = {} if mb.segments is None else {"position_ids": mb.position_ids, "segments": mb.segments}

        def forward_backward():
            lm.zero_grad(set_to_none=True)
            logp, _ = policy(mb.input_ids, mb.completion_index, mb.completion_tokens, **kw)
            logp.sum().backward()
            if on_gpu:
                torch.cuda.synchronize()

        for _ in range(3):  # warm-up (flex compiles on its first call)
            forward_backward()
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            forward_backward()
            walls.append(time.perf_counter() - t0)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            forward_backward()
        events = prof.key_averages()
        gpu_s = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        # Host time of the profiled pass (the profiler's own cost included) and its op calls: where a
        # layout's wall time exceeds its GPU time, these say which calls the host spends it on.
        host_s = sum(e.self_cpu_time_total for e in events) / 1e6
        calls = sum(e.count for e in events if e.key.startswith("aten::"))
        figures[layout] = dict(wall_s=min(walls), gpu_s=gpu_s if on_gpu else None, host_s=host_s, aten_calls=calls,
                               tokens=int(mb.input_ids.numel()), groups=args.groups)
        print(f"===== {layout}: {figures[layout]}")
        if on_gpu:
            print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
