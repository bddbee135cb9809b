"""The CPU engine's methods of vLLM's worker, mixed into grpo.serving.worker_ext.GRPOWorkerExtension
and called by name through collective_rpc: per-batch thread counts and the inverse-CDF sampler.
On a GPU engine the server never calls them."""


class CPUWorkerMethods:
    """The CPU engine's methods of vLLM's worker (mixed into grpo.serving.worker_ext)."""

    def grpo_set_threads(self, threads: int) -> int:
        """Run the model on `threads` OpenMP threads from the next engine step on (0: all the cores
        vLLM bound at start; more is capped there, so threads 0..n-1 stay on their own cores).
        Returns the count now in use. This runs on the thread that runs the model steps, and vLLM's
        kernels share torch's libgomp, so the count reaches both."""
        import torch

        if not hasattr(self, "_grpo_bound_threads"):
            self._grpo_bound_threads = torch.get_num_threads()
        n = self._grpo_bound_threads if threads <= 0 else min(int(threads), self._grpo_bound_threads)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op once its threads are bound
        # (more would run unbound); fewer, or back up to the bound count, is safe: call the original
        torch._C.set_num_threads(n)
        return torch.get_num_threads()

    def grpo_use_inverse_cdf_sampler(self) -> bool:
        """Sample with one uniform per row from the log-probs the sampler computes anyway instead of
        the CPU engine's per-token Gumbel noise (grpo.cpu.sampler). Returns whether it was
        installed: only in place of vLLM's CPU sampler, never on another backend."""
        from grpo.cpu.sampler import install

        return install(self.model_runner.sampler.topk_topp_sampler)
