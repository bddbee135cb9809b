"""The CPU fence: everything that exists only because the trainer or the vLLM engine runs on this
machine's CPU (the test bench and the demo's home, not the target). A GPU run never enters it.

    cores.py    which cores a CPU engine binds; how trainer and engine split shared cores
    memory.py   glibc malloc settings that keep freed memory (no page fault per re-allocation)
    bf16.py     whether the CPU multiplies bf16; oneDNN's bf16 math mode for the LM head, where honoured
    serving.py  a CPU engine as the server launches and drives it (environment, threads, sampler)
    engine.py   inside the CPU engine: the model in the engine-core process, bound to its cores
    worker.py   the CPU engine's methods of vLLM's worker
    sampler.py  inverse-CDF sampling in place of the CPU engine's per-token Gumbel noise

The trainer enters it once, `tune_trainer` at set-up (nothing happens off CPU); the server once
when it launches a CPU engine (`serving.engine_env`) and once when the engine is up
(`serving.EngineControl.start`). Settings live in the config's `cpu:` section (`CPUConfig`).
docs/cpu.md explains each piece and docs/benchmarks/ has what it measured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch


@dataclass
class CPUConfig:
    """The `cpu:` section: settings that matter only where the trainer or the server runs on a CPU."""

    split_cores: bool = True  # trainer + CPU engine on shared cores with grpo.sample_ahead on: split them by phase
    engine_cores: Optional[str] = None  # cores a launched CPU engine binds, e.g. "0-1"; None: upper half with >= 4, else all
    engine_kv_cache_gb: float = 1.0  # the CPU engine's KV cache, whole GiB (VLLM_CPU_KVCACHE_SPACE)
    engine_sampler: Literal["inverse_cdf", "vllm"] = "inverse_cdf"  # how the CPU engine draws tokens (grpo/cpu/sampler.py)
    engine_executor: Literal["in_process", "vllm"] = "in_process"  # the model in the engine-core process, or vLLM's choice
    keep_freed_memory: bool = True  # glibc malloc keeps freed memory in the trainer's and engine's heaps (grpo/cpu/memory.py)

    def __post_init__(self):
        if self.engine_kv_cache_gb < 1 or self.engine_kv_cache_gb != int(self.engine_kv_cache_gb):
            raise ValueError(f"engine_kv_cache_gb: must be a whole number of GiB >= 1 (vLLM reads an integer), "
                             f"got {self.engine_kv_cache_gb}")
        if self.engine_cores is not None and not all(
                p.replace("-", "").isdigit() for p in self.engine_cores.split(",")):
            raise ValueError(f"engine_cores: must be a CPU list like '0-1' or '2,3', got {self.engine_cores!r}")


def tune_trainer(cfg: CPUConfig, layout, world_size: int, modules: list, sample_ahead, server) -> Optional[object]:
    """The trainer's one entry into the fence, at set-up. Off CPU (layout.trainer_device is a GPU)
    it does nothing. On CPU: malloc keeps freed memory, the LM head gets oneDNN's bf16 math mode where
    this CPU honours it, and where this trainer and a launched CPU engine share cores and
    `cpu.split_cores` is on, the two split them while a batch is sampled ahead: the engine's threads
    per batch through `sample_ahead.engine_threads`, the trainer's around every forward of `modules`.
    server: the launched grpo.serving.inference.InferenceServer (None on ranks > 0). Returns the
    CoreSharing installed, or None."""
    if layout.trainer_device != "cpu":
        return None
    from grpo.cpu.bf16 import install_lm_head_bf16_math
    from grpo.cpu.cores import CoreSharing, core_split
    from grpo.cpu.memory import keep_freed_memory

    if cfg.keep_freed_memory:
        keep_freed_memory()  # every micro-batch re-allocates the same big tensors: no page faults for them
    install_lm_head_bf16_math()
    engine = getattr(server, "cpu_cores", None)
    split = core_split(layout, world_size, torch.get_num_threads(), set(os.sched_getaffinity(0)), engine)
    if split is None or not cfg.split_cores:
        return None
    sharing = CoreSharing(split, sample_ahead.busy)
    sample_ahead.engine_threads = sharing.engine_threads
    for module in modules:
        if module is not None:
            sharing.attach(module)
    return sharing
