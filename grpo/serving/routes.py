"""The server's own routes, beside vLLM's OpenAI app:

  GET  /grpo/health          open; 200 {"ok", "weights_version", "sampler", "dtype", "head_dtype"} or 503 with the reason
  GET  /grpo/weights_version open; {"weights_version", "step", "dir"}
  GET  /grpo/load            {"requests", "queued_tokens", "weights_version"}: the engine's unfinished
                             requests and prompt tokens waiting for prefill (a fleet routes by them)
  POST /grpo/generate        B prompts (token ids) x n samples -> token ids, log-probs, finish reasons,
                             and each completion's version spans ([[version, start, end], ...])
  POST /grpo/score           (prompt, completion) token ids -> each completion token's log-prob, as sampled
                             (at most SCORE_MAX_TOKENS completion tokens a request: 413 beyond)
  POST /grpo/weights         {"path", "version", "keep_requests"}: load a directory written by the trainer's writer
  POST /grpo/weights/upload  ?version=&step=&hash=&digest=&keep_requests=, body = the safetensors bytes (no shared fs)

Each route is one method of `Routes`; what they share is the engine's weights state
(grpo/serving/engine_weights.py). A generate or score request whose client hangs up is cancelled
(its engine requests aborted), so it holds neither the engine nor the version gate a push waits on.

Which requests wait for which (readers/writer locks): a push waits for the requests of the version
gate (a plain generate, a score, vLLM's own routes) and holds new ones back; a generate with
inflight_updates is outside that gate (a push that keeps requests swaps the weights under it, its
completions' version spans say where), and a score at T != 1 needs the engine alone (it divides the
engine's logits by T): it is a writer of the gate and of `alone`, which in-flight generates read.
"""
import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import uuid
from pathlib import Path
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from grpo.fsutil import HashError, new_hasher
from grpo.serving.client import SCORE_MAX_TOKENS
from grpo.serving.engine_weights import WeightsState, engine_paused
from grpo.serving.gate import VersionGate
from grpo.serving.weights_check import check_weights_dir
from grpo.serving.weights_dir import (MANIFEST_FORMAT, MANIFEST_NAME, WEIGHTS_FILE, WeightPushError, prune_weights,
                                      weights_dir_name)


# How often a running request looks whether its client is still there.
DISCONNECT_POLL_S = 0.2


class GenerateRequest(BaseModel):
    prompt_token_ids: list[list[int]] = Field(min_length=1)
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None  # reseed the sampler and run this batch alone: reproducible samples
    threads: Optional[int] = Field(None, ge=1)  # a CPU engine's threads for this batch (None: all bound cores)
    # outside the version gate: a push that keeps requests swaps the weights under this batch, whose
    # completions then span versions (their version_spans); no seed (the swap point is timing)
    inflight_updates: bool = False


class ScoreSequence(BaseModel):
    prompt_token_ids: list[int]
    completion_token_ids: list[int]


class ScoreRequest(BaseModel):
    sequences: list[ScoreSequence] = Field(min_length=1)
    temperature: float = Field(ge=0.0)  # no default: a score at an unintended temperature looks just as plausible
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1


class PushRequest(BaseModel):
    path: str
    version: int = Field(ge=0)
    keep_requests: bool = False  # swap the weights under in-flight generates (in-flight updates) instead of after them


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def push_error(e: WeightPushError) -> JSONResponse:
    """A refused push: 409 when it is not newer than what is served, 400 otherwise."""
    return error(409 if "not newer" in str(e) else 400, str(e))


def version_spans(completion) -> Optional[list[list[int]]]:
    """[[version, start, end], ...]: which weights version sampled which of a finished completion's
    tokens, from the engine's own stamps (vLLM's CompletionOutput.weight_versions: every step's
    tokens carry the label of the weights that ran it, set by every load while generation is paused).
    None where the engine reported no label of ours (a label that is not a version number)."""
    spans = completion.weight_versions
    if spans is None or not all(s.version.isdigit() for s in spans):
        return None
    return [[int(s.version), s.start, s.end] for s in spans]


def to_samples(final) -> list[dict]:
    """One request's finished output as the samples the trainer reads."""
    samples = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        lp = c.logprobs  # FlatLogprobs; with logprobs=0 each position holds the sampled token only
        logprobs = [lp.logprobs[lp.start_indices[t]] for t in range(len(c.token_ids))]
        samples.append({"token_ids": list(c.token_ids), "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "text": c.text, "version_spans": version_spans(c)})
    return samples


def scored_logprob(final, token: int) -> Optional[float]:
    """The log-prob of `token` in a finished max_tokens=1 request that asked for logprob_token_ids=[token]:
    the processed log-prob (log softmax(logits / T) after top-k/top-p) at the position after its
    prompt. None for -inf (outside the kept top-k/top-p set: JSON has no -inf)."""
    lp = final.outputs[0].logprobs  # FlatLogprobs, one position: the sampled token first, then the asked ids
    start, end = lp.start_indices[0], lp.end_indices[0]
    for i in range(start + 1, end):
        if lp.token_ids[i] == token:
            value = lp.logprobs[i]
            return None if value == float("-inf") else value
    raise RuntimeError(f"the engine returned no log-prob for token {token} (got ids {lp.token_ids[start:end]})")


def prompt_logprobs(final, start: int, tokens: list[int]) -> list[float]:
    """The log-probs of `tokens`, the prompt's positions start, start + 1, ..., in a finished request
    that asked for prompt_logprobs=0 (each position holds the prompt's own token first)."""
    lp = final.prompt_logprobs  # FlatLogprobs; position 0 (no context) is empty
    out = []
    for p, token in enumerate(tokens, start):
        i = lp.start_indices[p]
        if lp.token_ids[i] != token:
            raise RuntimeError(f"the engine's prompt log-prob at position {p} is for token {lp.token_ids[i]}, not {token}")
        out.append(lp.logprobs[i])
    return out


async def drain(queue):
    """The final output of a request added with engine.add_request."""
    from vllm.outputs import STREAM_FINISHED

    final = None
    while True:
        out = queue.get_nowait() or await queue.get()
        if out is not STREAM_FINISHED:
            final = out
        if out.finished:
            return final


async def at_most(width: int, calls: list) -> list:
    """[await call() for call in calls], with at most `width` of them running at a time. If one
    raises, or this is cancelled, the others are cancelled (and have ended) before it propagates."""
    results: list = [None] * len(calls)
    indices = iter(range(len(calls)))

    async def worker():
        for i in indices:  # shared: each index is taken by one worker
            results[i] = await calls[i]()

    workers = [asyncio.ensure_future(worker()) for _ in range(min(width, len(calls)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return results


async def to_the_end(coro) -> None:
    """await coro, which runs to its end even if this is cancelled (then CancelledError after it):
    what must be undone before a lock is let go."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class ClientGone(Exception):
    """The client of a request hung up before its answer was ready."""


async def unless_client_gone(request: Optional[Request], work):
    """await work, cancelled as soon as the client that asked for it has hung up (an abandoned
    request must not keep the engine, and the version gate, busy). ClientGone then."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():  # the client went, or this handler itself was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class UploadTimeout(Exception):
    def __init__(self, received: int):
        super().__init__(received)
        self.received = received


class Routes:
    def __init__(self, state: WeightsState, vocab_size: int, max_model_len: int, upload_timeout_s: float = 600.0):
        self.state = state
        self.engine = state.engine
        self.control = state.control  # a CPU engine's threads and sampler (grpo/cpu/serving.py)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.upload_timeout_s = upload_timeout_s
        self.seeded_lock = asyncio.Lock()  # one seeded batch at a time: reseeding is engine-global
        # in-flight generates read it (they are outside the version gate); a score that scales the
        # engine's logits writes it: nothing else may run on the engine meanwhile
        self.alone = VersionGate()
        # a score's engine requests in flight at once: twice what the scheduler batches, so it never waits for one
        self.score_window = 2 * state.engine.vllm_config.scheduler_config.max_num_seqs
        self.uploading: set[int] = set()  # versions whose upload is in flight

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/grpo/health", self.health, methods=["GET"])
        router.add_api_route("/grpo/weights_version", self.weights_version, methods=["GET"])
        router.add_api_route("/grpo/load", self.load, methods=["GET"])
        router.add_api_route("/grpo/generate", self.generate, methods=["POST"])
        router.add_api_route("/grpo/score", self.score, methods=["POST"])
        router.add_api_route("/grpo/weights", self.push_path, methods=["POST"])
        router.add_api_route("/grpo/weights/upload", self.push_bytes, methods=["POST"])
        router.add_api_route("/grpo/weights/reset", self.reset, methods=["POST"])
        return router

    async def health(self):
        if self.state.broken:
            return error(503, self.state.broken)
        if self.engine.errored:
            return error(503, "the vLLM engine is dead")
        config = self.engine.model_config
        return {"ok": True, "weights_version": self.state.version, "sampler": self.control.sampler,
                "dtype": str(config.dtype).removeprefix("torch."),
                "head_dtype": str(config.head_dtype).removeprefix("torch.")}

    async def weights_version(self):
        return {"weights_version": self.state.version, "step": self.state.step, "dir": self.state.serving_dir.name}

    async def load(self):
        """What the engine has to do now, from its own counts (cheap: no engine call): requests not
        finished (each sample of an n > 1 request counts) and the prompt tokens of those still in
        prefill. A fleet sends the next call to the least loaded server (grpo/serving/fleet.py)."""
        return {"requests": self.engine.get_num_unfinished_requests(),
                "queued_tokens": self.engine.get_num_queued_tokens(), "weights_version": self.state.version}

    # -- generation
    def refuse_ids(self, where: str, ids: list[int], empty: str = "is empty") -> Optional[str]:
        """Why `ids` (named `where` in the reply) cannot go to the engine: none, or one outside the
        vocabulary (None: they can)."""
        if not ids:
            return f"{where} {empty}"
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        return f"{where} has token id {bad[0]} outside [0, {self.vocab_size})" if bad else None

    def refuse_prompts(self, req: GenerateRequest) -> Optional[str]:
        """Why the server cannot take these prompts (None: it can)."""
        for i, ids in enumerate(req.prompt_token_ids):
            refused = self.refuse_ids(f"prompt_token_ids[{i}]", ids)
            if refused:
                return refused
            if len(ids) + req.max_tokens > self.max_model_len:
                return (f"prompt_token_ids[{i}]: {len(ids)} prompt + {req.max_tokens} new tokens "
                        f"exceed max_model_len {self.max_model_len}")
        return None

    async def generate(self, req: GenerateRequest, request: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        refused = self.refuse_prompts(req)
        if refused:
            return error(400, refused)
        try:
            params = SamplingParams(
                n=req.n, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, stop_token_ids=req.stop_token_ids or None, logprobs=0, flat_logprobs=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:  # e.g. n > 1 with temperature 0
            return error(400, str(e))
        if req.inflight_updates:
            if req.seed is not None:
                return error(400, "seed: a batch with inflight_updates is not reproducible (where a push swaps the "
                                  "weights under it is timing); send no seed")
            version, completions = await self.beside_pushes(lambda: self.batch(req, params), request)
        else:
            version, completions = await self.on_one_version(
                lambda: self.seeded_batch(req, params) if req.seed is not None else self.batch(req, params), request)
        if isinstance(completions, JSONResponse):
            return completions
        return {"completions": completions, "weights_version": version, "engine": self.control.batch_figures()}

    async def on_one_version(self, work, request: Optional[Request] = None) -> tuple[int, object]:
        """(the weights version, await work()) with every engine call of `work` on that version: the
        read side of the push gate is held, so a push waits for it. A request the engine refuses
        gives (version, a 400 reply), a client that hung up (version, a 499 reply nobody reads: its
        work was cancelled, the gate let go); an engine that died under it raises (a 503 reply,
        gate.EngineDeathIs503)."""
        async with self.state.gate.reading():
            version = self.state.version  # fixed while we read: a push waits for us
            return version, await self.answered(work(), request)

    async def beside_pushes(self, work, request: Optional[Request] = None) -> tuple[int, object]:
        """(the weights version when it started, await work()) outside the push gate: a push that
        keeps requests swaps the weights under `work` (one that does not waits for it in the engine:
        engine_weights.py); only a score that scales the engine's logits waits for it (`alone`).
        Errors as on_one_version."""
        async with self.alone.reading():
            return self.state.version, await self.answered(work(), request)

    async def with_logits_divided(self, temperature: float, work, request: Optional[Request] = None
                                  ) -> tuple[int, object]:
        """(the weights version, await work()) with the engine's logits divided by `temperature`
        (worker_ext.grpo_score_temperature) and nothing else on the engine: the gate's write side (no
        push, plain generate, score or vLLM route runs) and `alone`'s (no in-flight generate), then
        the engine drained of anything else it still runs (mode "wait"; a request whose handler is
        gone) before the scale is set. The scale is set back to 1 before either lock is let go,
        however `work` ends: a client that hangs up while it waits for the locks, or while it runs,
        leaves the engine as it was. Errors as on_one_version."""
        async def alone():
            async with self.state.gate.writing(), self.alone.writing():
                async with engine_paused(self.engine):
                    await self.engine.collective_rpc("grpo_score_temperature", args=(temperature,))
                try:
                    return self.state.version, await work()
                finally:
                    await to_the_end(self.engine.collective_rpc("grpo_score_temperature", args=(1.0,)))

        answer = await self.answered(alone(), request)
        return answer if isinstance(answer, tuple) else (self.state.version, answer)

    async def answered(self, work, request: Optional[Request]):
        """await work, cancelled when the client hangs up; what the engine or the client did wrong
        as a reply (400 refused, 499 the client left; any failure of a dead engine's is a 503:
        gate.EngineDeathIs503)."""
        try:
            return await unless_client_gone(request, work)
        except ClientGone:
            return error(499, "the client closed the connection; its request was stopped")
        except ValueError as e:
            return error(400, str(e))  # under a dead engine, a 503 (gate.EngineDeathIs503)

    async def batch(self, req: GenerateRequest, params) -> list[list[dict]]:
        """The prompts as independent requests, interleaved with any others."""
        await self.control.use(req.threads)
        base = uuid.uuid4().hex

        async def one(i: int, ids: list[int]):
            final = None
            async for out in self.engine.generate({"prompt_token_ids": ids}, params, f"grpo-{base}-{i}"):
                final = out
            return to_samples(final)

        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(req.prompt_token_ids)))

    async def seeded_batch(self, req: GenerateRequest, params) -> list[list[dict]]:
        """The whole batch scheduled at once after a reseed, so its samples depend only on
        (weights, prompts, seed): pause the scheduler (in-flight requests finish), reseed the
        workers, queue every request, resume."""
        base = uuid.uuid4().hex
        async with self.seeded_lock:
            async with engine_paused(self.engine):
                await self.control.use(req.threads)
                await self.engine.collective_rpc("grpo_reseed", args=(req.seed,))
                queues = [await self.engine.add_request(f"grpo-{base}-{i}", {"prompt_token_ids": ids}, params)
                          for i, ids in enumerate(req.prompt_token_ids)]
            try:
                finals = await asyncio.gather(*(drain(q) for q in queues))
            except asyncio.CancelledError:  # requests added this way are not aborted by the engine itself
                await self.engine.abort([f"grpo-{base}-{i}" for i in range(len(queues))])
                raise
        return [to_samples(final) for final in finals]

    # -- scoring
    def refuse_sequences(self, req: ScoreRequest) -> Optional[str]:
        """Why the server cannot score these sequences (None: it can)."""
        for i, seq in enumerate(req.sequences):
            refused = (self.refuse_ids(f"sequences[{i}].prompt_token_ids", seq.prompt_token_ids)
                       or self.refuse_ids(f"sequences[{i}].completion_token_ids", seq.completion_token_ids,
                                          empty="is empty: nothing to score"))
            if refused:
                return refused
            total = len(seq.prompt_token_ids) + len(seq.completion_token_ids)
            if total > self.max_model_len:
                return (f"sequences[{i}]: {len(seq.prompt_token_ids)} prompt + {len(seq.completion_token_ids)} "
                        f"completion tokens exceed max_model_len {self.max_model_len}")
        return None

    async def score(self, req: ScoreRequest, request: Request):
        """log alpha(c_t | prompt, c_<t) for every completion token c_t, as the engine's sampler
        computes it for a token it samples: log softmax(logits / T) after top-k/top-p (-inf, sent
        as null, outside the kept set; T = 0: the plain log-softmax). The reply's engine_requests
        says how many requests the engine ran for it.

        At T = 1 without top-k/top-p the sampler's processing is the identity (a division by 1 is
        exact, nothing is filtered), so its log-probs are the model's log-softmax, which the engine
        gives for every prompt position of one request: a sequence per request (`whole_sequence`).
        At another T > 0 without top-k/top-p the same requests run at T = 1 with the engine's logits
        divided by T as the sampler divides them (`with_logits_divided`: the engine runs nothing
        else meanwhile), so every position is log softmax(logits / T), the sampler's number: still
        a sequence per request. With top-k or top-p (or T = 0) the sampler is the only place that
        applies them (prompt_logprobs are raw log-softmax), so each position is one request
        (`one_position`).

        The requests go to the engine score_window at a time, and a score that stops (its client
        hung up, or a request failed) aborts those in the engine in one call: the engine is free
        within a poll and a step, whatever the temperature."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        tokens = sum(len(seq.completion_token_ids) for seq in req.sequences)
        if tokens > SCORE_MAX_TOKENS:
            return error(413, f"score request of {tokens} completion tokens is larger than the server takes "
                              f"({SCORE_MAX_TOKENS} per request, one engine request each): split it")
        refused = self.refuse_sequences(req)
        if refused:
            return error(400, refused)
        # below vLLM's _SAMPLING_EPS (1e-5) the sampler is greedy and its log-probs unscaled: per token, as sampled
        per_sequence = req.temperature >= 1e-5 and req.top_p == 1.0 and req.top_k <= 0
        scaled = per_sequence and req.temperature != 1.0  # the engine's logits divided by T, requests at T = 1
        common = dict(max_tokens=1, temperature=1.0 if scaled else req.temperature, top_p=req.top_p,
                      top_k=req.top_k, flat_logprobs=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            SamplingParams(**common, logprob_token_ids=[0])  # a bad top_k etc. is the client's error, once
        except ValueError as e:
            return error(400, str(e))
        base = uuid.uuid4().hex
        outstanding = set()  # this score's requests added and not finished: aborted in one call if it stops

        async def finished(key: str, prompt: list[int], params):
            request_id = f"grpo-score-{base}-{key}"
            outstanding.add(request_id)  # before it is added: a cancel inside add_request may leave it there
            final = await drain(await self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params))
            outstanding.discard(request_id)
            return final

        async def one_position(i: int, t: int) -> Optional[float]:
            """prompt + c_<t with max_tokens=1, asking for c_t's log-prob by logprob_token_ids (the
            token it samples is thrown away; prefix caching shares the sequence's prefix)."""
            seq = req.sequences[i]
            token = seq.completion_token_ids[t]
            final = await finished(f"{i}-{t}", seq.prompt_token_ids + seq.completion_token_ids[:t],
                                   SamplingParams(**common, logprob_token_ids=[token]))
            return scored_logprob(final, token)

        async def whole_sequence(i: int) -> list[Optional[float]]:
            """prompt + c_<last> as the prompt: c_1..c_<last> from its prompt log-probs, the last
            token from the sampler's position after it (so a sequence that fills max_model_len fits)."""
            seq = req.sequences[i]
            *head, last = seq.completion_token_ids
            final = await finished(str(i), seq.prompt_token_ids + head,
                                   SamplingParams(**common, logprob_token_ids=[last], prompt_logprobs=0))
            return prompt_logprobs(final, len(seq.prompt_token_ids), head) + [scored_logprob(final, last)]

        async def every_position():
            await self.control.use(None)  # all of a CPU engine's threads, as an unsplit generate batch
            calls = ([functools.partial(whole_sequence, i) for i in range(len(req.sequences))] if per_sequence else
                     [functools.partial(one_position, i, t) for i, seq in enumerate(req.sequences)
                      for t in range(len(seq.completion_token_ids))])
            try:
                # score_window requests in the engine at a time, enough for the scheduler's batches: a
                # client that hangs up leaves that many to abort, not one per completion token
                results = await at_most(self.score_window, calls)
            except BaseException:  # requests added with add_request are not aborted by the engine itself
                # one call for all: one by one, each abort is a message of its own and a scan of the
                # engine's waiting queue (thousands of them held the engine for seconds)
                await asyncio.shield(self.engine.abort(list(outstanding)))
                raise
            if per_sequence:
                return results
            flat, out, k = results, [], 0
            for seq in req.sequences:
                out.append(flat[k:k + len(seq.completion_token_ids)])
                k += len(seq.completion_token_ids)
            return out

        if scaled:
            version, logprobs = await self.with_logits_divided(req.temperature, every_position, request)
        else:
            version, logprobs = await self.on_one_version(every_position, request)
        if isinstance(logprobs, JSONResponse):
            return logprobs
        requests = len(req.sequences) if per_sequence else sum(len(s.completion_token_ids) for s in req.sequences)
        return {"logprobs": logprobs, "weights_version": version, "engine_requests": requests}

    # -- weight pushes
    async def push_path(self, req: PushRequest):
        try:
            manifest = check_weights_dir(req.path, self.state.root)
            if manifest["version"] != req.version:
                raise WeightPushError(f"{req.path}: manifest says version {manifest['version']}, push says {req.version}")
            self.state.check_tensors(manifest)
            return await self.state.load(manifest, hashes_checked=False, keep_requests=req.keep_requests)
        except WeightPushError as e:
            return push_error(e)

    async def push_bytes(self, request: Request, version: int, digest: str, step: int = 0, hash: str = "sha256",
                         keep_requests: bool = False):
        """The safetensors file in the body; written under the root (hashed as it arrives), then loaded."""
        state = self.state
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
        if version in self.uploading:
            return error(409, f"another upload of version {version} is in progress")
        if final.exists():  # left from before a reset: that version is being pushed again
            shutil.rmtree(final)
        # Per-request names: a failing request removes only what it created itself.
        tmp = state.root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700, parents=True)
        renamed = False
        self.uploading.add(version)
        try:
            try:
                received = await self.receive(request, tmp / WEIGHTS_FILE, int(length), hasher)
            except UploadTimeout as late:
                return error(408, f"upload of version {version} did not arrive within {self.upload_timeout_s:g} s "
                                  f"({late.received} of {length} bytes)")
            if hasher.hexdigest() != digest:
                raise WeightPushError(f"{hash} mismatch: the upload hashes to {hasher.hexdigest()[:16]}..., "
                                      f"the client sent {digest[:16]}...")
            self.complete_upload(tmp, version, step, hash, digest, received)
            try:
                os.rename(tmp, final)  # atomic; fails if a concurrent upload of this version got there first
            except OSError:
                return error(409, f"{final} exists already (a concurrent upload of version {version})")
            renamed = True
            manifest = check_weights_dir(final, state.root)
            state.check_tensors(manifest)
            result = await state.load(manifest, hashes_checked=True, keep_requests=keep_requests)
            prune_weights(state.root, state.keep_last)  # this server owns uploaded directories
            return result
        except WeightPushError as e:
            if renamed and state.serving_dir != final:
                shutil.rmtree(final, ignore_errors=True)
            return push_error(e)
        finally:
            self.uploading.discard(version)
            shutil.rmtree(tmp, ignore_errors=True)

    async def reset(self):
        """The model directory served again as version 0 (WeightsState.reset): a run attaching to
        this server starts its own versions."""
        try:
            return await self.state.reset()
        except WeightPushError as e:
            return error(500, str(e))

    async def receive(self, request: Request, path: Path, length: int, hasher) -> int:
        """The request's body into `path`, hashed as it arrives; its byte count. UploadTimeout when it
        did not arrive within the upload time-out; a body longer or shorter than `length` is refused."""
        received = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            async with asyncio.timeout(self.upload_timeout_s):
                async for chunk in request.stream():
                    hasher.update(chunk)
                    os.write(fd, chunk)
                    received += len(chunk)
                    if received > length:
                        raise WeightPushError(f"upload is longer than its Content-Length ({length} bytes)")
        except TimeoutError:
            raise UploadTimeout(received) from None
        finally:
            os.close(fd)
        if received != length:
            raise WeightPushError(f"upload truncated: received {received} of {length} bytes")
        return received

    def complete_upload(self, tmp: Path, version: int, step: int, hash: str, digest: str, received: int) -> None:
        """The served model's config files and a manifest beside an uploaded weights file."""
        for name in ("config.json", "generation_config.json"):
            if (self.state.model_dir / name).is_file():
                shutil.copyfile(self.state.model_dir / name, tmp / name)
        manifest = {"format": MANIFEST_FORMAT, "version": version, "step": step, "hash": hash,
                    "files": [{"name": WEIGHTS_FILE, "bytes": received, hash: digest}]}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest) + "\n")
