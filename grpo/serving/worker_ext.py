"""Methods added to vLLM's workers (vLLM's --worker-extension-cls), called by name through
`engine.collective_rpc`: nothing is pickled across processes.

`grpo_reseed(seed)` resets the global RNGs that vLLM's sampler draws from for requests without a
per-request seed. Per-request seeds would be the usual way, but they kill the CPU engine
("CPU Generator does not use offset"); reseeding right before a batch that the server schedules
as a whole makes each training batch's samples a function of (weights, prompts, seed), so a
resumed run samples exactly what the uninterrupted run sampled.

`grpo_score_temperature(T)` divides the model's logits by T until it is called with 1: a score at
T != 1 (grpo/serving/routes.py) then reads log softmax(logits / T) from the prompt log-probs of
one request per sequence, which vLLM computes from the raw logits (no temperature) otherwise.
"""
import random
import sys

from grpo.cpu.worker import CPUWorkerMethods


def started_by() -> str:
    """How this process was started: "spawn" (multiprocessing imported the parent's main module
    again, as __mp_main__) or "fork" (it runs on in the parent's own __main__)."""
    return "spawn" if sys.modules["__main__"].__name__ == "__mp_main__" else "fork"


class GRPOWorkerExtension(CPUWorkerMethods):
    def grpo_reseed(self, seed: int) -> None:
        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def grpo_score_temperature(self, temperature: float) -> float:
        """From the next engine step on, the model's logits come out divided by `temperature` (1:
        as the model computes them), at every position: the prompt positions, whose log-probs vLLM
        takes from these logits with no temperature of its own, and the sampled ones. The division
        is the sampler's own (fp32 logits, `div_` by an fp32 tensor: vllm/v1/sample/sampler.py,
        apply_temperature), so a request at temperature 1 then gets the numbers a request at
        `temperature` gets from the sampler. Engine-global: the caller runs nothing else meanwhile
        (routes.py holds every other request out). Installed once per model, as a wrapper of its
        compute_logits, which both of vLLM's model runners call outside any captured graph (and
        which a weight reload, copying into the same parameters, leaves in place)."""
        import torch

        model = self.model_runner.get_model()
        if not hasattr(model, "_grpo_logits_temperature"):
            unscaled = model.compute_logits

            def compute_logits(*args, **kwargs):
                logits = unscaled(*args, **kwargs)
                temperature = model._grpo_logits_temperature
                if logits is None or temperature == 1.0:  # None: a tensor-parallel rank the logits are not gathered on
                    return logits
                return logits.to(torch.float32).div_(
                    torch.full((1, 1), temperature, dtype=torch.float32, device=logits.device))

            model.compute_logits = compute_logits
        model._grpo_logits_temperature = float(temperature)
        return model._grpo_logits_temperature

    def grpo_weights_fingerprint(self) -> dict:
        """What the engine holds now, per parameter: (numel, sum, sum of squares), computed
        from the worker's own parameters after a load, plus the model's packed-module map (fused
        qkv_proj / gate_up_proj) so the trainer can fold its HF tensors the same way. Sums and sums
        of squares do not change under the re-layouts a backend may apply (transposes, blocking,
        zero padding), but any changed value moves them."""
        from grpo.serving.fingerprint import counted_part, tensor_moments

        model = self.model_runner.get_model()
        params, seen = {}, set()
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) not in seen:  # a tensor shared by two modules, once (as named_parameters does)
                    seen.add(id(p))
                    params[f"{module_name}.{name}" if module_name else name] = tensor_moments(counted_part(module, p))
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        return {"params": params, "packed": packed}

    def grpo_freeze_heap(self) -> dict:
        """Move everything alive now (vLLM, torch, the model) out of the garbage collector's reach
        (gc.freeze) and say what a full collection cost before and after, in seconds.

        vLLM freezes its engine-core process after start-up but not a worker in a process of its
        own (vLLM's multiprocess executor, e.g. tensor parallelism): there a full collection scanned
        the whole start-up heap in the middle of pushes and generation steps. Where the model runs
        in the engine core this only freezes what came after vLLM's freeze. Frozen objects are
        still freed by reference counting."""
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
        return {"frozen": gc.get_freeze_count(), "full_collection_s": before, "full_collection_frozen_s": min(after),
                "started_by": started_by()}
