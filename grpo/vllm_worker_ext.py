"""Methods added to vLLM's workers (vLLM's --worker-extension-cls), called by name through
`engine.collective_rpc`: nothing is pickled across processes.

`grpo_reseed(seed)` resets the global RNGs that vLLM's sampler draws from for requests without a
per-request seed. Per-request seeds would be the usual way, but they kill the CPU engine
("CPU Generator does not use offset"); reseeding right before a batch that the server schedules
as a whole makes each training batch's samples a function of (weights, prompts, seed), so a
resumed run samples exactly what the uninterrupted run sampled.
"""
import random


class GRPOWorkerExtension:
    def grpo_reseed(self, seed: int) -> None:
        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def grpo_weights_fingerprint(self) -> dict:
        """What the engine holds now, per parameter: (numel, sum, sum of squares), computed
        from the worker's own parameters after a load, plus the model's packed-module map (fused
        qkv_proj / gate_up_proj) so the trainer can fold its HF tensors the same way. Sums and sums
        of squares do not change under the re-layouts a backend may apply (transposes, blocking,
        zero padding), but any changed value moves them."""
        from grpo.weight_sync import tensor_moments

        model = self.model_runner.get_model()
        params = {name: tensor_moments(p) for name, p in model.named_parameters()}
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        return {"params": params, "packed": packed}

    def grpo_set_threads(self, threads: int) -> int:
        """Run the model on `threads` OpenMP threads from the next engine step on (0: all the cores
        vLLM bound at start; more is capped there, so threads 0..n-1 stay on their own cores).
        Returns the count now in use. This runs on the worker's busy-loop thread, the one that runs
        the model steps, and vLLM's kernels share torch's libgomp, so the count reaches both."""
        import torch

        if not hasattr(self, "_grpo_bound_threads"):
            self._grpo_bound_threads = torch.get_num_threads()
        n = self._grpo_bound_threads if threads <= 0 else min(int(threads), self._grpo_bound_threads)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op once its threads are bound
        # (more would run unbound); fewer, or back up to the bound count, is safe: call the original
        torch._C.set_num_threads(n)
        return torch.get_num_threads()

    def grpo_freeze_heap(self) -> dict:
        """Move everything alive now (vLLM, torch, the model) out of the garbage collector's reach
        (gc.freeze) and say what a full collection cost before and after, in seconds.

        vLLM freezes its engine-core process after start-up but not a worker in a process of its
        own (vLLM's multiprocess executor): there a full collection scanned the whole start-up
        heap, 0.41-0.44 s each time, in the middle of a push every few pushes and of generation
        steps. Our engines run the model in the engine core (grpo.vllm_executor on CPU, vLLM's own
        choice on one GPU), where this only freezes what came after vLLM's freeze and measures; it
        stays so that an engine with a worker process of its own is covered too. Frozen objects
        are still freed by reference counting."""
        import gc
        import time

        from vllm.utils.gc_utils import freeze_gc_heap

        t0 = time.perf_counter()
        freeze_gc_heap()  # collects every generation, then freezes
        before = time.perf_counter() - t0
        after = []
        for _ in range(3):  # the least of three: a core shared with the other processes starting up
            t0 = time.perf_counter()
            gc.collect()
            after.append(time.perf_counter() - t0)
        return {"frozen": gc.get_freeze_count(), "full_collection_s": before, "full_collection_frozen_s": min(after)}

    def grpo_use_inverse_cdf_sampler(self) -> bool:
        """Sample with one uniform per row from the log-probs the sampler computes anyway instead of
        the CPU engine's per-token Gumbel noise (grpo.vllm_sampler). Returns whether it was
        installed: only in place of vLLM's CPU sampler, never on another backend."""
        from grpo.vllm_sampler import install

        return install(self.model_runner.sampler.topk_topp_sampler)
