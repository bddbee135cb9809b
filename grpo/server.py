"""The inference server: a real vLLM engine serving pi_old, with weight pushes from the trainer.

    python -m grpo.server --model DIR --weights-root DIR --token-file FILE [--port 0 --port-file F]

It is vLLM's own OpenAI app (so /v1/completions, /v1/models, ... behave exactly as in `vllm
serve`, for standard clients and evaluation tools), with our routes and two middlewares added:

  GET  /grpo/health          open; 200 {"ok", "weights_version", "sampler"} or 503 with the reason
  GET  /grpo/weights_version open; {"weights_version", "step", "dir"}
  POST /grpo/generate        B prompts (token ids) x n samples -> token ids, log-probs, finish reasons
  POST /grpo/weights         {"path", "version"}: load a directory written by write_weights
  POST /grpo/weights/upload  ?version=&step=&hash=&digest=, body = the safetensors bytes (no shared fs)

Log-probs: the engine runs with logprobs_mode="processed_logprobs", so each sampled token's
log-prob is taken from the distribution it was actually sampled from (logits / temperature,
then top-k/top-p renormalised): log alpha(o_t | q, o_<t) of the objective. With temperature 0
(greedy) it is the plain log-softmax of the logits.

Security: binds 127.0.0.1 unless told otherwise; every route except the two open GETs and
vLLM's /health needs `Authorization: Bearer <token>` (the token comes from a 0600 file or the
GRPO_SERVER_TOKEN variable, is removed from the environment before the engine starts and is
never logged); vLLM's development routes are never registered (VLLM_SERVER_DEV_MODE is unset);
weights load only from directories under --weights-root that pass grpo.weight_sync's checks.

Consistency: a push takes a write lock that waits for in-flight requests and holds new ones
back (they wait, they do not fail), so every completion comes from one weights_version. The
hash check runs in a thread while the engine loads; if it (or the load) fails, the previous
weights are reloaded before the lock is released, so no request ever sees rejected weights.
"""
import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import stat
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, Field

TOKEN_ENV = "GRPO_SERVER_TOKEN"
OPEN_PATHS = frozenset({"/health", "/grpo/health", "/grpo/weights_version"})


# ----------------------------------------------------------------------------- process set-up

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grpo.server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory served at version 0")
    p.add_argument("--weights-root", required=True, help="pushed weights load only from under here")
    p.add_argument("--token-file", help=f"file (mode 0600) holding the bearer token; else ${TOKEN_ENV}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (written to --port-file)")
    p.add_argument("--port-file", help="the bound port is written here once the socket is bound")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds kill the CPU engine)")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--cpu-threads", help="CPU only: VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1")
    p.add_argument("--served-model-name", help="name for /v1 clients (default: the model path)")
    p.add_argument("--keep-last", type=int, default=2, help="uploaded weight dirs kept (bytes mode)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the trainer) is gone")
    p.add_argument("--upload-timeout-s", type=float, default=600.0, help="an upload's body must arrive within this")
    p.add_argument("--sampler", choices=["inverse_cdf", "vllm"], default="inverse_cdf",
                   help="CPU engine: draw tokens by inverse CDF (grpo.vllm_sampler) or with vLLM's own Gumbel sampler")
    return p.parse_args(argv)


def read_token(token_file: Optional[str]) -> str:
    """The bearer token, from a private file or the environment (then removed from it)."""
    if token_file:
        st = os.stat(token_file)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise SystemExit(f"--token-file {token_file}: must be owned by you with mode 0600, "
                             f"has mode {oct(stat.S_IMODE(st.st_mode))}")
        token = Path(token_file).read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    os.environ.pop(TOKEN_ENV, None)  # the engine's child processes need not see it
    if len(token) < 16:
        raise SystemExit(f"no usable token: give --token-file or ${TOKEN_ENV} (at least 16 characters)")
    return token


# ----------------------------------------------------------------------------- concurrency

class VersionGate:
    """Readers (requests) share; a writer (a push) waits for them and holds new ones back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reading(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class BearerAuth:
    """ASGI middleware: everything but OPEN_PATHS needs the run's token (constant-time check)."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not (
            scope["path"] in OPEN_PATHS and scope.get("method", "GET") in ("GET", "HEAD")
        ):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").partition(" ")
            ok = scheme.lower() == "bearer" and secrets.compare_digest(
                hashlib.sha256(given.encode()).digest(), self._digest)
            if not ok:
                from starlette.responses import JSONResponse

                resp = JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class GateRequests:
    """ASGI middleware: vLLM's own routes (/v1/...) hold the read side of the gate while they run."""

    def __init__(self, app, gate: VersionGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/grpo/") or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        async with self.gate.reading():
            return await self.app(scope, receive, send)


class Guarded:
    """vLLM's app behind our middlewares, as the outermost ASGI layer.

    vLLM has built the app's middleware stack by the time we get it (add_middleware refuses),
    so the checks wrap the whole app instead; attribute access goes to the app for serve_http.
    """

    def __init__(self, app, asgi) -> None:
        self._app, self._asgi = app, asgi

    async def __call__(self, scope, receive, send):
        await self._asgi(scope, receive, send)

    def __getattr__(self, name):
        return getattr(self._app, name)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- weights state

def _expected_tensors(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from the served model's safetensors headers (empty if it has none)."""
    from grpo.weight_sync import read_safetensors_header

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, info in read_safetensors_header(f).items():
            out[name] = (info["dtype"], list(info["shape"]))
    return out


def serving_dtype_name(dtype) -> str:
    """The safetensors name ("F32", "BF16", ...) of the torch dtype the engine serves."""
    from grpo.weight_sync import _ST_DTYPES

    return _ST_DTYPES.get(dtype, "")


class EngineThreads:
    """A CPU engine's OpenMP thread count, as each generate request and each push asks. vLLM's CPU
    kernels round differently with another count (SmolLM2: log-probs ~3e-5 apart, 1 vs 2 threads),
    so a batch's samples depend on it: each request names its count (None: all bound cores), never
    the previous request. Changed through the worker extension, between engine steps, only when it
    differs. `bound`: the cores the engine's threads are bound to (0: a GPU engine, never changed)."""

    def __init__(self, engine, bound: int) -> None:
        self.engine = engine
        self.bound = bound
        self.asked: Optional[int] = None  # what the last change asked for (None: all bound cores, as started)
        self.now = bound  # the count the worker reported (0: a GPU engine)

    @classmethod
    async def start(cls, engine, on_cpu: bool) -> "EngineThreads":
        bound = (await engine.collective_rpc("grpo_set_threads", args=(0,)))[0] if on_cpu else 0
        return cls(engine, bound)

    async def use(self, threads: Optional[int]) -> None:
        if self.bound and threads != self.asked:
            self.now = (await self.engine.collective_rpc("grpo_set_threads", args=(threads or 0,)))[0]
            self.asked = threads

    async def for_reload(self) -> None:
        """A push: the engine reloads on all its cores but one, which the push's hash and finiteness
        check (a thread of this process, meanwhile) takes. With both at full width on 2 cores, each
        stalled the other (an OpenMP team waits at every barrier for the thread that lost its core):
        SmolLM2 reload 0.45-0.57 s beside the check, 0.31-0.39 s on one thread."""
        await self.use(self.bound - 1 if self.bound >= 2 else None)


class WeightsState:
    """What the engine serves now, and the one place that changes it."""

    def __init__(self, engine, model_dir: Path, weights_root: Path, keep_last: int, dtype: str = "",
                 threads: Optional[EngineThreads] = None) -> None:
        self.engine = engine
        self.threads = threads or EngineThreads(engine, bound=0)
        self.dtype = dtype  # safetensors name of the dtype the engine serves ("F32", "BF16"): pushes must match
        self.model_dir = model_dir
        self.root = weights_root
        self.keep_last = keep_last
        self.gate = VersionGate()
        self.version, self.step, self.serving_dir = 0, 0, model_dir
        self.broken: Optional[str] = None  # set if a rollback failed; health then says 503
        self.served_digest: Optional[str] = None  # lets a retried upload of the served version succeed
        from grpo.models import LM_HEAD_KEY, ties_word_embeddings

        self.expected = _expected_tensors(model_dir)
        # A tied lm_head may be pushed or not (vLLM rebuilds it from the embedding).
        tied = ties_word_embeddings(json.loads((model_dir / "config.json").read_text()))
        self.optional = {LM_HEAD_KEY} if tied else set()

    def max_upload_bytes(self) -> Optional[int]:
        """A bound on an upload's size: the served tensors at the serving dtype plus header room."""
        from grpo.weight_sync import _ST_ITEMSIZE

        if not self.expected or self.dtype not in _ST_ITEMSIZE:
            return None
        numel = sum(math.prod(shape) for _, shape in self.expected.values())
        return numel * _ST_ITEMSIZE[self.dtype] + (1 << 20) + 512 * len(self.expected)

    def check_tensors(self, manifest: dict[str, Any]) -> None:
        """Pushed tensors must be exactly the served model's (names, shapes) in the served dtype: no
        partial, foreign or silently converted push."""
        from grpo.weight_sync import WeightPushError, read_safetensors_header

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
        await self.threads.for_reload()
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})

    async def load(self, manifest: dict[str, Any], hashes_checked: bool) -> dict[str, Any]:
        """Load a checked directory; on any failure restore the previous weights and raise."""
        from grpo.weight_sync import SERVING_MARKER, WeightPushError, check_finite, check_hashes

        path, version = Path(manifest["path"]), manifest["version"]
        async with self.gate.writing():
            if version == self.version and path == self.serving_dir:
                return {"version": version, "seconds": 0.0, "bytes": 0, "unchanged": True}
            if version <= self.version:
                raise WeightPushError(f"version {version} is not newer than the served version {self.version}")
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            # Hash and finiteness are checked in a thread while the engine process loads: they overlap,
            # and a failure rolls the engine back below.
            def verify() -> None:
                if not hashes_checked:
                    check_hashes(manifest)
                check_finite(manifest)

            hash_job = loop.run_in_executor(None, _timed, verify)
            load_error: Optional[BaseException] = None
            try:
                await self._reload(path)
            except Exception as e:  # the engine reports its own errors; keep them for the message
                load_error = e
            reload_seconds = time.perf_counter() - t0
            hash_seconds = 0.0
            hash_error: Optional[BaseException] = None
            if hash_job is not None:
                try:
                    hash_seconds = await hash_job
                except Exception as e:  # a mismatch, or the file vanished or became unreadable
                    hash_error = e if isinstance(e, WeightPushError) else WeightPushError(
                        f"{path}: could not hash: {type(e).__name__}: {e}")
            if load_error or hash_error:
                reason = str(hash_error or f"engine failed to load it: {load_error}")
                try:
                    await self._reload(self.serving_dir)
                    await self.engine.reset_prefix_cache()
                except Exception as e:
                    self.broken = f"restoring version {self.version} failed after a rejected push: {e}"
                    raise WeightPushError(f"{reason}; {self.broken}") from None
                raise WeightPushError(f"{reason}; still serving version {self.version}")
            # KV blocks cached under the old weights would be reused for equal prefixes otherwise.
            await self.engine.reset_prefix_cache()
            seconds = time.perf_counter() - t0
            self.version, self.step, self.serving_dir = version, manifest.get("step", 0), path
            self.served_digest = manifest["files"][0][manifest["hash"]]
            self.broken = None  # a good push repairs a failed rollback
            if path.parent == Path(os.path.realpath(self.root)):
                (self.root / SERVING_MARKER).write_text(path.name + "\n")
            # What the engine holds now, from its own parameters: the trainer checks it against
            # what it pushed (a load that silently skipped or altered a tensor is caught there).
            t1 = time.perf_counter()
            fingerprint = (await self.engine.collective_rpc("grpo_weights_fingerprint"))[0]
            fingerprint_seconds = time.perf_counter() - t1
        return {"version": version, "seconds": seconds, "bytes": sum(f["bytes"] for f in manifest["files"]),
                "reload_seconds": reload_seconds, "hash_seconds": hash_seconds, "fingerprint": fingerprint,
                "fingerprint_seconds": fingerprint_seconds}


# ----------------------------------------------------------------------------- routes

class GenerateRequest(BaseModel):
    prompt_token_ids: list[list[int]] = Field(min_length=1)
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None  # reseed the sampler and run this batch alone: reproducible samples
    threads: Optional[int] = Field(None, ge=1)  # CPU engine: OpenMP threads for this batch (None: all bound cores)


class PushRequest(BaseModel):
    path: str
    version: int = Field(ge=0)


def make_router(state: WeightsState, vocab_size: int, max_model_len: int, upload_timeout_s: float = 600.0,
                sampler: str = "vllm"):
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    from grpo.fsutil import HashError, new_hasher
    from grpo.weight_sync import (MANIFEST_FORMAT, MANIFEST_NAME, WEIGHTS_FILE, WeightPushError, check_weights_dir,
                                  prune_weights, weights_dir_name)

    router = APIRouter()
    seeded_lock = asyncio.Lock()  # one seeded batch at a time: reseeding is engine-global
    threads = state.threads

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @router.get("/grpo/health")
    async def health():
        if state.broken:
            return error(503, state.broken)
        if state.engine.errored:
            return error(503, "the vLLM engine is dead")
        return {"ok": True, "weights_version": state.version, "sampler": sampler}

    @router.get("/grpo/weights_version")
    async def weights_version():
        return {"weights_version": state.version, "step": state.step, "dir": state.serving_dir.name}

    @router.post("/grpo/generate")
    async def generate(req: GenerateRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for i, ids in enumerate(req.prompt_token_ids):
            if not ids:
                return error(400, f"prompt_token_ids[{i}] is empty")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                return error(400, f"prompt_token_ids[{i}] has token id {bad[0]} outside [0, {vocab_size})")
            if len(ids) + req.max_tokens > max_model_len:
                return error(400, f"prompt_token_ids[{i}]: {len(ids)} prompt + {req.max_tokens} new tokens "
                                  f"exceed max_model_len {max_model_len}")
        try:
            params = SamplingParams(
                n=req.n, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, stop_token_ids=req.stop_token_ids or None, logprobs=0, flat_logprobs=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:  # e.g. n > 1 with temperature 0
            return error(400, str(e))
        base = uuid.uuid4().hex

        async def one(i: int, ids: list[int]):
            final = None
            async for out in state.engine.generate({"prompt_token_ids": ids}, params, f"grpo-{base}-{i}"):
                final = out
            return to_samples(final)

        async def seeded_batch():
            """The whole batch scheduled at once after a reseed, so its samples depend only on
            (weights, prompts, seed): pause the scheduler (in-flight requests finish), reseed
            the workers, queue every request, resume."""
            from vllm.outputs import STREAM_FINISHED

            async def drain(q):
                final = None
                while True:
                    out = q.get_nowait() or await q.get()
                    if out is not STREAM_FINISHED:
                        final = out
                    if out.finished:
                        return final

            async with seeded_lock:
                await state.engine.pause_generation(mode="wait", clear_cache=False)
                try:
                    await threads.use(req.threads)
                    await state.engine.collective_rpc("grpo_reseed", args=(req.seed,))
                    queues = [await state.engine.add_request(f"grpo-{base}-{i}", {"prompt_token_ids": ids}, params)
                              for i, ids in enumerate(req.prompt_token_ids)]
                finally:
                    await state.engine.resume_generation()
                finals = await asyncio.gather(*(drain(q) for q in queues))
            return [to_samples(final) for final in finals]

        def to_samples(final):
            samples = []
            for c in sorted(final.outputs, key=lambda c: c.index):
                lp = c.logprobs  # FlatLogprobs; with logprobs=0 each position holds the sampled token only
                logprobs = [lp.logprobs[lp.start_indices[t]] for t in range(len(c.token_ids))]
                samples.append({"token_ids": list(c.token_ids), "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "text": c.text})
            return samples

        async with state.gate.reading():
            version = state.version  # fixed while we read: a push waits for us
            try:
                if req.seed is not None:
                    completions = await seeded_batch()
                else:
                    await threads.use(req.threads)
                    completions = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(req.prompt_token_ids)))
            except ValueError as e:
                return error(400, str(e))
            except Exception as e:
                if state.engine.errored:
                    return error(503, f"the vLLM engine died: {type(e).__name__}: {e}")
                raise
        return {"completions": completions, "weights_version": version, "threads": threads.now}

    @router.post("/grpo/weights")
    async def push_path(req: PushRequest):
        try:
            manifest = check_weights_dir(req.path, state.root)
            if manifest["version"] != req.version:
                raise WeightPushError(f"{req.path}: manifest says version {manifest['version']}, push says {req.version}")
            state.check_tensors(manifest)
            return await state.load(manifest, hashes_checked=False)
        except WeightPushError as e:
            return error(409 if "not newer" in str(e) else 400, str(e))

    @router.post("/grpo/weights/upload")
    async def push_bytes(request: Request, version: int, digest: str, step: int = 0, hash: str = "sha256"):
        """The safetensors file in the body; written under the root (hashed as it arrives), then loaded."""
        try:
            hasher = new_hasher(hash)
        except HashError as e:
            return error(400, str(e))
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            return error(411, "Content-Length is required")
        bound = state.max_upload_bytes()
        if bound is not None and int(length) > bound:
            return error(413, f"upload of {length} bytes is larger than the served model can be ({bound} bytes)")
        final = state.root / weights_dir_name(version)
        if version == state.version and state.serving_dir == final and state.served_digest == digest:
            return {"version": version, "seconds": 0.0, "bytes": 0, "unchanged": True}  # a retried push
        if version <= state.version:
            return error(409, f"version {version} is not newer than the served version {state.version}")
        if final.exists():
            return error(409, f"{final} exists already (another upload of version {version}?)")
        # Per-request names: a failing request removes only what it created itself.
        tmp = state.root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700, parents=True)
        renamed = False
        try:
            received = 0
            fd = os.open(tmp / WEIGHTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                async with asyncio.timeout(upload_timeout_s):
                    async for chunk in request.stream():
                        hasher.update(chunk)
                        os.write(fd, chunk)
                        received += len(chunk)
                        if received > int(length):
                            raise WeightPushError(f"upload is longer than its Content-Length ({length} bytes)")
            except TimeoutError:
                return error(408, f"upload of version {version} did not arrive within {upload_timeout_s:g} s "
                                  f"({received} of {length} bytes)")
            finally:
                os.close(fd)
            if received != int(length):
                raise WeightPushError(f"upload truncated: received {received} of {length} bytes")
            if hasher.hexdigest() != digest:
                raise WeightPushError(f"{hash} mismatch: the upload hashes to {hasher.hexdigest()[:16]}..., "
                                      f"the client sent {digest[:16]}...")
            for name in ("config.json", "generation_config.json"):
                if (state.model_dir / name).is_file():
                    shutil.copyfile(state.model_dir / name, tmp / name)
            manifest = {"format": MANIFEST_FORMAT, "version": version, "step": step, "hash": hash,
                        "files": [{"name": WEIGHTS_FILE, "bytes": received, hash: digest}]}
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest) + "\n")
            try:
                os.rename(tmp, final)  # atomic; fails if a concurrent upload of this version got there first
            except OSError:
                return error(409, f"{final} exists already (a concurrent upload of version {version})")
            renamed = True
            manifest = check_weights_dir(final, state.root)
            state.check_tensors(manifest)
            result = await state.load(manifest, hashes_checked=True)
            prune_weights(state.root, state.keep_last)  # this server owns uploaded directories
            return result
        except WeightPushError as e:
            if renamed and state.serving_dir != final:
                shutil.rmtree(final, ignore_errors=True)
            return error(409 if "not newer" in str(e) else 400, str(e))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return router


# ----------------------------------------------------------------------------- main

def vllm_args(ns: argparse.Namespace, port: int) -> argparse.Namespace:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", ns.model, "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
            "--seed", str(ns.seed), "--gpu-memory-utilization", str(ns.gpu_memory_utilization),
            "--logprobs-mode", "processed_logprobs", "--host", ns.host, "--port", str(port),
            "--worker-extension-cls", "grpo.vllm_worker_ext.GRPOWorkerExtension",
            "--disable-uvicorn-access-log"]
    if ns.served_model_name:
        argv += ["--served-model-name", ns.served_model_name]
    if ns.trust_remote_code:
        argv += ["--trust-remote-code"]
    if ns.enforce_eager:
        argv += ["--enforce-eager"]
    from grpo.vllm_executor import EXECUTOR

    # the model in the engine-core process (no worker process on CPU), which dies with this one
    argv += ["--distributed-executor-backend", EXECUTOR]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


async def serve(ns: argparse.Namespace, token: str) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import create_server_socket, serve_http

    # Bind first: the port is known (and reserved) before the minute-long engine start-up.
    sock = create_server_socket((ns.host, ns.port), reuse_port=False)
    port = sock.getsockname()[1]
    if ns.port_file:
        tmp = ns.port_file + ".tmp"
        Path(tmp).write_text(f"{port}\n")
        os.replace(tmp, ns.port_file)
    args = vllm_args(ns, port)
    root = Path(ns.weights_root)  # checked by main()
    async with build_async_engine_client(args) as engine:
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        # Start-up objects out of the collector's reach, in the workers and here (vLLM freezes only its
        # engine-core process): a full collection scanned them all, ~0.4 s, mid-push and mid-batch.
        from vllm.utils.gc_utils import freeze_gc_heap

        heap = (await engine.collective_rpc("grpo_freeze_heap"))[0]
        freeze_gc_heap()
        print(f"[grpo.server] engine worker heap frozen ({heap['frozen']} objects): a full garbage collection "
              f"took {heap['full_collection_s']:.3f} s, now {heap['full_collection_frozen_s']:.3f} s", flush=True)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # This process's own tensor work (a push's finiteness check) runs beside the engine's
            # threads on the same cores: on one thread it never takes a core from their team.
            import torch

            torch.set_num_threads(1)
        # vLLM's CPU sampler draws a Gumbel number per vocabulary entry; one uniform per row does the same
        # job from the log-probs it computes anyway (grpo.vllm_sampler). Other backends keep their own.
        sampler = "vllm"
        if ns.sampler == "inverse_cdf" and current_platform.is_cpu():
            if all(await engine.collective_rpc("grpo_use_inverse_cdf_sampler")):
                sampler = "inverse_cdf"
        print(f"[grpo.server] sampler: {sampler}", flush=True)
        state = WeightsState(engine, Path(ns.model).resolve(), root, ns.keep_last,
                             dtype=serving_dtype_name(engine.model_config.dtype),
                             threads=await EngineThreads.start(engine, on_cpu=current_platform.is_cpu()))
        vocab = engine.model_config.get_vocab_size()
        app.include_router(make_router(state, vocab, engine.model_config.max_model_len, ns.upload_timeout_s,
                                       sampler))
        guarded = Guarded(app, BearerAuth(GateRequests(app, state.gate), token))
        print(f"[grpo.server] serving {ns.model} on http://{ns.host}:{port} (weights root {root})", flush=True)
        shutdown = await serve_http(guarded, sock=sock, host=ns.host, port=port, log_level="warning",
                                    access_log=False, timeout_keep_alive=5)
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: Optional[list[str]] = None) -> None:
    ns = parse_args(argv)
    token = read_token(ns.token_file)
    os.environ.pop("VLLM_SERVER_DEV_MODE", None)  # never expose /collective_rpc, /sleep, ...
    os.environ.pop("VLLM_API_KEY", None)
    if ns.kv_cache_gb:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ns.kv_cache_gb))
    if ns.cpu_threads:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ns.cpu_threads
    from grpo.supervisor import SERVER_PID_ENV, die_with_parent
    from grpo.weight_sync import WeightPushError, check_weights_root

    die_with_parent(ns.parent_pid)
    os.environ[SERVER_PID_ENV] = str(os.getpid())  # the engine's processes die with this one (grpo.vllm_executor)

    try:  # before the engine starts: a root someone else could write to is refused in one line
        check_weights_root(ns.weights_root)
    except WeightPushError as e:
        print(f"[grpo.server] {e}", file=sys.stderr)
        sys.exit(2)
    import uvloop

    uvloop.run(serve(ns, token))


if __name__ == "__main__":
    main()
