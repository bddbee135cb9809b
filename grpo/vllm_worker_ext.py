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
        """What the engine holds now, per parameter: (numel, sum, sum of squares) in fp64, computed
        from the worker's own parameters after a load, plus the model's packed-module map (fused
        qkv_proj / gate_up_proj) so the trainer can fold its HF tensors the same way. Sums and sums
        of squares do not change under the re-layouts a backend may apply (transposes, blocking,
        zero padding), but any changed value moves them."""
        import torch

        model = self.model_runner.get_model()
        params = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                params[name] = (int(p.numel()), float(torch.sum(p, dtype=torch.float64)),
                                float(torch.linalg.vector_norm(p, dtype=torch.float64) ** 2))
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        return {"params": params, "packed": packed}
