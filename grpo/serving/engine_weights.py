"""What the engine serves now, and the one place that changes it: a checked directory is loaded
under the write side of the version gate, its hashes and finiteness checked in a thread meanwhile,
and on any failure the previous weights are reloaded before the gate opens again, so no request
ever sees rejected weights. After a load the engine's fingerprint (grpo/serving/fingerprint.py)
goes back to the trainer.

No KV computed with the old weights outlives a push. The gate keeps our requests out, but the engine
may still run one it does not see (a request whose handler is gone); its KV blocks are held, and
vLLM's prefix-cache reset then fails with only a warning (vllm/v1/core/block_pool.py), leaving the
old weights' KV for equal prefixes. So the engine first finishes what it runs, on the weights it
started with, and takes no new work (pause_generation, mode "wait") while the weights change; a
push counts as served only once the reset has succeeded, and a reset that fails is a refused push:
the previous weights are reloaded, as for any other failure (an error the engine raises, or a
cancellation). A reset to the model directory (version 0) goes the same way: the served version
changes only once the engine holds its weights with no KV of the others.

Every load also labels the engine's weights with their version (vLLM's `update_weight_version`,
while generation is paused), so each completion says which version sampled which of its tokens
(`CompletionOutput.weight_versions`, the /grpo/generate reply's `version_spans`).

In-flight updates (a push with keep_requests, rollout.inflight_updates): the requests in flight
are not finished first but frozen and preempted (vLLM's pause mode "keep" with clear_cache): their
KV blocks are freed with the whole prefix cache, so the reset that follows the reload succeeds as
always, and on resume each one computes its prompt and the tokens it has so far again, with the new
weights, and samples on from there. Every token is then exactly the log-prob of the version that
sampled it (its prefix all computed by that version), and a completion spans the versions it lived
through; the cost is one prefill of what was in flight. Requests of the version gate (a plain
generate, a score, vLLM's own routes) are still waited for: only /grpo/generate's in-flight batches
ride through a push."""
import asyncio
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from grpo.cpu.serving import EngineControl
from grpo.models import LM_HEAD_KEY, ties_word_embeddings
from grpo.serving.gate import VersionGate
from grpo.serving.weights_check import check_finite, check_hashes
from grpo.serving.weights_dir import SERVING_MARKER, ST_DTYPES, ST_ITEMSIZE, WeightPushError, read_safetensors_header


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _expected_tensors(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from the served model's safetensors headers (empty if it has none)."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, info in read_safetensors_header(f).items():
            out[name] = (info["dtype"], list(info["shape"]))
    return out


@contextlib.asynccontextmanager
async def engine_paused(engine, keep: bool = False):
    """The engine's scheduler paused for the block: what it runs finishes first, on the weights it
    started with (mode "wait"), and nothing new starts until the block ends. keep: what it runs is
    frozen instead (mode "keep") and preempted with the prefix cache cleared (clear_cache): it holds
    no KV, and on resume computes its prompt and tokens so far again with the weights then served
    (in-flight updates: module docstring). Resumed however the block ends, the pause's own wait
    included: a handler cancelled while the pause waited (its client hung up) would otherwise leave
    the scheduler paused, and every later request queued. The resume is shielded, so a second
    cancellation cannot skip it."""
    try:
        if keep:
            await engine.pause_generation(mode="keep", clear_cache=True)
        else:
            await engine.pause_generation(mode="wait", clear_cache=False)
        yield
    finally:
        await asyncio.shield(engine.resume_generation())


def serving_dtype_name(dtype) -> str:
    """The safetensors name ("F32", "BF16", ...) of the torch dtype the engine serves."""
    return ST_DTYPES.get(dtype, "")


def merge_rank_fingerprints(per_rank: list[dict]) -> dict:
    """The fingerprint replies of every worker (one per tensor-parallel rank) as one: each parameter's
    moments as a list over ranks (grpo/serving/fingerprint.py folds slices and replicas)."""
    if len(per_rank) == 1:
        return per_rank[0]
    params = {name: [rank["params"].get(name, (0, 0.0, 0.0)) for rank in per_rank] for name in per_rank[0]["params"]}
    return {"params": params, "packed": per_rank[0]["packed"], "ranks": len(per_rank)}


class WeightsState:
    """What the engine serves now, and the one place that changes it."""

    def __init__(self, engine, model_dir: Path, weights_root: Path, keep_last: int, dtype: str = "",
                 control: Optional[EngineControl] = None) -> None:
        self.engine = engine
        self.control = control or EngineControl(engine)  # a CPU engine's threads (grpo/cpu/serving.py)
        self.dtype = dtype  # safetensors name of the dtype the engine serves ("F32", "BF16"): pushes must match
        self.model_dir = model_dir
        self.root = weights_root
        self.keep_last = keep_last
        self.gate = VersionGate()
        self.version, self.step, self.serving_dir = 0, 0, model_dir
        self.broken: Optional[str] = None  # set if a rollback failed; health then says 503
        self.served_digest: Optional[str] = None  # lets a retried upload of the served version succeed
        self.expected = _expected_tensors(model_dir)
        # A tied lm_head may be pushed or not (vLLM rebuilds it from the embedding).
        tied = ties_word_embeddings(json.loads((model_dir / "config.json").read_text()))
        self.optional = {LM_HEAD_KEY} if tied else set()

    def max_upload_bytes(self) -> Optional[int]:
        """A bound on an upload's size: the served tensors at the serving dtype plus header room."""
        if not self.expected or self.dtype not in ST_ITEMSIZE:
            return None
        numel = sum(math.prod(shape) for _, shape in self.expected.values())
        return numel * ST_ITEMSIZE[self.dtype] + (1 << 20) + 512 * len(self.expected)

    def check_tensors(self, manifest: dict[str, Any]) -> None:
        """Pushed tensors must be exactly the served model's (names, shapes) in the served dtype: no
        partial, foreign or silently converted push."""
        if not self.expected:
            return
        pushed = {}
        for entry in manifest["files"]:
            if not entry["name"].endswith(".safetensors"):
                continue
            for name, info in read_safetensors_header(Path(manifest["path"]) / entry["name"]).items():
                if self.dtype and info["dtype"] != self.dtype:
                    raise WeightPushError(f"tensor {name}: dtype {info['dtype']}, the server serves {self.dtype} "
                                          f"(cast on the trainer; the server does not convert)")
                pushed[name] = list(info["shape"])
        missing = sorted(set(self.expected) - set(pushed) - self.optional)
        unknown = sorted(set(pushed) - set(self.expected) - self.optional)
        if missing or unknown:
            raise WeightPushError(f"tensor names differ from the served model: missing {missing[:3]}, unknown {unknown[:3]}")
        for name, shape in pushed.items():
            if name in self.expected and self.expected[name][1] != shape:
                raise WeightPushError(f"tensor {name}: shape {shape}, the served model has {self.expected[name][1]}")

    async def _reload(self, path: Path) -> None:
        await self.control.for_reload()
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})

    async def label_version(self) -> None:
        """Label the engine's weights with the served version (vLLM's weight version, which stamps
        every token it samples): at start-up, and by every load while generation is paused."""
        await self.engine.update_weight_version(str(self.version))

    async def _forget_cached_kv(self) -> None:
        """Reset the engine's prefix cache; WeightPushError if it refused (a request holds blocks)."""
        if not await self.engine.reset_prefix_cache():
            raise WeightPushError("the engine could not reset its prefix cache (a request still holds KV blocks): "
                                  "equal prefixes would reuse KV computed with the previous weights")

    async def load(self, manifest: dict[str, Any], hashes_checked: bool, keep_requests: bool = False
                   ) -> dict[str, Any]:
        """Load a checked directory; on any failure restore the previous weights and raise.
        keep_requests: swap the weights under the requests in flight outside the version gate
        (in-flight updates, module docstring) instead of letting them finish first."""
        path, version = Path(manifest["path"]), manifest["version"]
        async with self.gate.writing():
            if version == self.version and path == self.serving_dir:
                return {"version": version, "seconds": 0.0, "bytes": 0, "unchanged": True}
            if version <= self.version:
                raise WeightPushError(f"version {version} is not newer than the served version {self.version}")
            t0 = time.perf_counter()
            # What the engine runs now (none of the gate's: it waited for them) ends on the old weights,
            # or with keep_requests goes on with the new ones.
            async with engine_paused(self.engine, keep=keep_requests):
                return await self._swap(manifest, hashes_checked, t0)

    async def reset(self) -> dict[str, Any]:
        """Serve the model directory again, as version 0: a run that attaches to this server starts
        its own sequence of versions (a new run, or a resumed one whose checkpoint is older than the
        pushes served since). The one way versions go down; directories pushed before stay until
        pruned, and an upload of a version whose old directory is left replaces it. A reset that
        fails leaves the served version as it was (_replace)."""
        async with self.gate.writing():
            if self.version == 0 and self.serving_dir == self.model_dir and not self.broken:
                return {"version": 0, "seconds": 0.0, "unchanged": True}
            t0 = time.perf_counter()
            async with engine_paused(self.engine):
                await self._replace(self.model_dir, "0")
                self.version, self.step, self.serving_dir, self.served_digest = 0, 0, self.model_dir, None
                self.broken = None
                (self.root / SERVING_MARKER).unlink(missing_ok=True)
            fingerprint = merge_rank_fingerprints(await self.engine.collective_rpc("grpo_weights_fingerprint"))
        return {"version": 0, "seconds": time.perf_counter() - t0, "fingerprint": fingerprint}

    async def _swap(self, manifest: dict[str, Any], hashes_checked: bool, t0: float) -> dict[str, Any]:
        """With the engine idle: load and verify (_replace), then serve it as its version and
        fingerprint what the engine holds."""
        path, version = Path(manifest["path"]), manifest["version"]

        def verify() -> None:
            try:
                if not hashes_checked:
                    check_hashes(manifest)
                check_finite(manifest)
            except WeightPushError:
                raise
            except Exception as e:  # the file vanished or became unreadable
                raise WeightPushError(f"{path}: could not hash: {type(e).__name__}: {e}") from None

        reload_seconds, hash_seconds = await self._replace(path, str(version), verify)
        seconds = time.perf_counter() - t0
        self.version, self.step, self.serving_dir = version, manifest.get("step", 0), path
        self.served_digest = manifest["files"][0][manifest["hash"]]
        self.broken = None  # a good push repairs a failed rollback
        if path.parent == Path(os.path.realpath(self.root)):
            (self.root / SERVING_MARKER).write_text(path.name + "\n")
        # What the engine holds now, from its own parameters: the trainer checks it against
        # what it pushed (a load that silently skipped or altered a tensor is caught there).
        t1 = time.perf_counter()
        fingerprint = merge_rank_fingerprints(await self.engine.collective_rpc("grpo_weights_fingerprint"))
        fingerprint_seconds = time.perf_counter() - t1
        return {"version": version, "seconds": seconds, "bytes": sum(f["bytes"] for f in manifest["files"]),
                "reload_seconds": reload_seconds, "hash_seconds": hash_seconds, "fingerprint": fingerprint,
                "fingerprint_seconds": fingerprint_seconds}

    async def _replace(self, path: Path, label: str, verify: Optional[Callable[[], None]] = None
                       ) -> tuple[float, float]:
        """With the engine paused: load `path`, forget the KV cached under the weights it replaces and
        label the weights `label` (their version); (reload seconds, verify seconds). `verify` (a check of the files that raises WeightPushError)
        runs in a thread while the engine loads: they overlap. The caller changes the served version
        only after this returns. On any failure, a cancellation included, the weights of the served
        version are loaded again before anything is raised (_restore), so the version the server
        reports always names the weights the engine holds."""
        t0 = time.perf_counter()
        job = asyncio.get_running_loop().run_in_executor(None, _timed, verify) if verify else None
        try:
            try:
                await self._reload(path)
            except Exception as e:  # the engine reports its own errors; keep them for the message
                raise WeightPushError(f"engine failed to load it: {e}") from None
            finally:
                reload_seconds = time.perf_counter() - t0
                verify_seconds = await job if job is not None else 0.0  # a failed check is the reason given
            # KV cached under the old weights would be reused for equal prefixes otherwise
            await self._forget_cached_kv()
            await self.engine.update_weight_version(label)  # the tokens sampled from now on are this version's
        except BaseException as failure:
            await self._restore(failure)
        return reload_seconds, verify_seconds

    async def _restore(self, failure: BaseException) -> NoReturn:
        """After a failed load: the served version's weights loaded again, then `failure` raised (a
        cancellation as it is, anything else as a refused load, WeightPushError). The engine ran
        nothing meanwhile (paused), so what it caches was computed with the weights restored here.
        If the restore fails too, the server is broken (health answers 503) until a load succeeds."""
        if isinstance(failure, WeightPushError):
            reason = str(failure)
        elif isinstance(failure, asyncio.CancelledError):
            reason = "the load was cancelled"
        else:
            reason = f"{type(failure).__name__}: {failure}"
        try:
            await self._reload(self.serving_dir)
            await self.label_version()  # in case the failure came after the new label
        except BaseException as e:
            self.broken = f"restoring version {self.version} failed after a rejected load: {e}"
            if not isinstance(failure, Exception):
                raise failure from None
            raise WeightPushError(f"{reason}; {self.broken}") from None
        if not isinstance(failure, Exception):
            raise failure
        raise WeightPushError(f"{reason}; still serving version {self.version}") from None
