"""A CPU vLLM engine as the server launches and drives it: its environment, its thread counts, its
sampler. grpo/serving calls `engine_env` when it launches a server on the CPU and
`EngineControl.start` once its engine is up; on a GPU engine the control does nothing.
"""
from __future__ import annotations

import os
from typing import Optional

from grpo import metrics
from grpo.cpu.cores import engine_cores
from grpo.cpu.memory import malloc_env

metrics.declare("server_threads", "time", "a CPU engine's thread count for this batch ([cpu.md](cpu.md)); absent on a "
                "GPU engine")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def engine_env(cfg) -> dict[str, str]:
    """Environment of a server launched on this machine's CPU (cfg: the `cpu:` section): its KV cache,
    the cores its OpenMP threads bind, and glibc malloc settings that keep the memory a push frees
    (every push re-allocates the engine's layers)."""
    return {"CUDA_VISIBLE_DEVICES": "",  # a CPU engine never touches the trainers' GPUs
            KV_CACHE_ENV: str(int(cfg.engine_kv_cache_gb)),
            BIND_ENV: engine_cores(cfg.engine_cores),
            # the caller's own malloc settings win
            **({k: os.environ.get(k, v) for k, v in malloc_env().items()} if cfg.keep_freed_memory else {})}


class EngineControl:
    """A CPU engine's OpenMP thread count, as each generate request and each push asks, and which
    sampler draws its tokens.

    vLLM's CPU kernels round differently with another thread count, so a batch's samples depend on
    it: each request names its count (None: all bound cores), never the previous request. Changed
    through the worker (grpo.cpu.worker), between engine steps, only when it differs. bound: the
    cores the engine's threads are bound to (0: a GPU engine, never changed)."""

    def __init__(self, engine, bound: int = 0, sampler: str = "vllm") -> None:
        self.engine = engine
        self.bound = bound
        self.sampler = sampler  # what draws tokens: "inverse_cdf" (grpo.cpu.sampler) or "vllm"
        self.asked: Optional[int] = None  # what the last change asked for (None: all bound cores, as started)
        self.now = bound  # the count the worker reported

    @classmethod
    async def start(cls, engine, on_cpu: bool, sampler: str) -> "EngineControl":
        """The control of a started engine. On CPU: this process's own tensor work (a push's
        finiteness check) runs beside the engine's threads on the same cores, so on one thread it
        never takes a core from their team; the inverse-CDF sampler replaces vLLM's CPU sampler if
        asked. Elsewhere: a control that changes nothing."""
        if not on_cpu:
            return cls(engine)
        import torch

        torch.set_num_threads(1)
        bound = (await engine.collective_rpc("grpo_set_threads", args=(0,)))[0]
        used = "vllm"
        if sampler == "inverse_cdf" and all(await engine.collective_rpc("grpo_use_inverse_cdf_sampler")):
            used = "inverse_cdf"
        return cls(engine, bound, used)

    async def use(self, threads: Optional[int]) -> None:
        if self.bound and threads != self.asked:
            self.now = (await self.engine.collective_rpc("grpo_set_threads", args=(threads or 0,)))[0]
            self.asked = threads

    async def for_reload(self) -> None:
        """A push: the engine reloads on all its cores but one, which the push's hash and finiteness
        check (a thread of this process, meanwhile) takes: with both at full width each stalls the
        other (an OpenMP team waits at every barrier for the thread that lost its core)."""
        await self.use(self.bound - 1 if self.bound >= 2 else None)

    def batch_figures(self) -> dict[str, float]:
        """What a generate reply reports of the engine: a CPU engine's threads for the batch
        (logged as server_threads); nothing for a GPU engine."""
        return {"server_threads": float(self.now)} if self.bound else {}
