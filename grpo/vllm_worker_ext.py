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
