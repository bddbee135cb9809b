"""The HTTP client of grpo.serving.server: requests with retries for transient failures, errors that say why.

    client = InferenceClient("http://127.0.0.1:8000", token)
    result = client.generate(prompt_ids, n=G, max_tokens=200, temperature=0.1, seed=7)
    scores = client.score([(prompt_ids[0], result.completions[0][0].token_ids)], temperature=0.1)
    client.push_weights(weights_dir, version=3, mode="path")

Transient failures (connection refused or reset, 502/503/504) are retried with exponential backoff
until `retry_deadline_s`, then ServerUnavailableError says what it last saw, in a few words
("connection refused"); an answer that is an error (400, 401, 404, 409, ...), or a TLS handshake
that fails (https to a plain-HTTP server), raises InferenceServerError with the reason at once.

`attach(url, token_file)` is how a run starts on a server it did not launch (server.url,
server.urls): the token is read and the server asked, before anything else starts, whether it
answers (/grpo/health) and takes the token (/version, behind the bearer check); AttachError is the
one line that names the URL and what failed. Nothing on the server changes. `death_check` (given by the process supervisor) turns the first failed request to a server
whose process has died into an immediate ServerUnavailableError with its log tail, instead of a
minute of retries. (urllib3's Retry has neither a deadline nor a hook for that check, so the
loop is ours; requests does the transport: pooled connections, streamed uploads, TLS.) A client
may be called from several threads at once (the asynchronous sampler's calls beside the trainer's
pushes): each thread has a requests session of its own, since a session is not made for sharing.
"""
from __future__ import annotations

import json
import os
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import requests

from grpo.serving.weights_dir import MANIFEST_NAME

TOKEN_ENV = "GRPO_SERVER_TOKEN"  # an attached server's token, when server.token_file is not set
TRANSIENT_STATUS = (502, 503, 504)
# The most completion tokens one score() request may ask for: the server makes one engine request
# of each, and answers 413 beyond it (grpo/serving/routes.py; the parity probe is checked against it).
SCORE_MAX_TOKENS = 16384


@dataclass
class Completion:
    token_ids: list[int]  # the sampled completion o_i
    logprobs: list[float]  # log alpha(o_i,t | q, o_i,<t): sampled tokens' log-probs, temperature-scaled
    finish_reason: str  # "stop" (eos / stop token) or "length"
    text: str
    # [[version, start, end], ...]: the weights version that sampled each range of the tokens, from the
    # engine's stamps (several where an in-flight update swapped the weights under it); None: not reported
    version_spans: Optional[list[list[int]]] = None


@dataclass
class GenerationResult:
    completions: list[list[Completion]]  # [prompt][sample]
    # the pushed version that produced every completion here (with inflight_updates: the version served
    # when the call started; each completion's version_spans say which version sampled which token)
    weights_version: int
    engine: dict = field(default_factory=dict)  # what the engine reports of the batch (a CPU engine: its threads)


@dataclass
class ScoreResult:
    # [sequence][t]: log alpha(c_t | prompt, c_<t) at the asked temperature / top_p / top_k, computed
    # as the engine computes a sampled token's log-prob; -inf where c_t is outside the kept top-k/top-p set
    logprobs: list[list[float]]
    weights_version: int  # the pushed version that produced every number here
    engine_requests: int  # requests the engine ran: one per sequence at T = 1 unfiltered, else one per token


class InferenceServerError(RuntimeError):
    """The server answered with an error (bad request, bad token, rejected push, ...)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(InferenceServerError):
    """No answer from the server within the retry deadline (or its process has died)."""

    def __init__(self, message: str, last: Optional[str] = None) -> None:
        super().__init__(message)
        self.last = last  # the last failure seen, in a few words (transport_failure, or the HTTP status)


class AttachError(InferenceServerError):
    """A running server (server.url, server.urls) this run cannot use: it does not answer, refuses the
    token, speaks another scheme, or there is no token to give it. The message is one line naming the
    URL and what failed."""


def transport_failure(error: BaseException) -> str:
    """Why a request got no answer, in a few words: the innermost cause requests and urllib3 wrap
    ("connection refused", "name or service not known", "TLS handshake failed (WRONG_VERSION_NUMBER)")."""
    seen, todo, innermost = set(), [error], None
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLError):
            return f"TLS handshake failed ({e.reason or e})"
        if isinstance(e, OSError) and e.strerror:
            innermost = e.strerror[0].lower() + e.strerror[1:]
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
    return innermost or f"{type(error).__name__}: {error}"


def _reason(resp: requests.Response) -> str:
    try:
        reason = resp.json().get("error", resp.text)
    except (ValueError, AttributeError):
        reason = resp.text[:500]
    return reason.get("message", reason) if isinstance(reason, dict) else reason


class InferenceClient:
    """HTTP client for grpo.serving.server."""

    def __init__(self, url: str, token: Optional[str], timeout_s: float = 600.0, retry_deadline_s: float = 60.0,
                 death_check: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.death_check = death_check  # returns a reason when the server process is known dead
        self._headers = {"Accept": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._local = threading.local()  # a session per calling thread

    def __repr__(self) -> str:  # never show the token
        return f"InferenceClient({self.url!r})"

    @property
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self._headers)
        return session

    def request(self, method: str, path: str, *, json_body=None, data=None, headers: Optional[dict] = None,
                timeout: Optional[float] = None, retry: bool = True) -> dict:
        """One call, retried while the failure is transient. `data` may be a callable returning a
        fresh body (a file is reopened per attempt)."""
        deadline = time.monotonic() + self.retry_deadline_s
        delay, timeout = 0.25, timeout or self.timeout_s
        while True:
            body = data() if callable(data) else data
            try:
                resp = self._session.request(method, self.url + path, json=json_body, data=body, headers=headers,
                                             timeout=timeout)
            except requests.ReadTimeout as e:
                raise ServerUnavailableError(f"{method} {self.url}{path}: no answer within {timeout:.0f} s ({e}); "
                                             "raise server.request_timeout_s if batches are this slow") from None
            except (requests.exceptions.SSLError, requests.exceptions.InvalidURL) as e:  # never heals by waiting
                raise InferenceServerError(f"{method} {self.url}{path}: {transport_failure(e)}") from None
            except requests.RequestException as e:  # refused, reset, connect timeout: transient
                last = transport_failure(e)
            else:
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code not in TRANSIENT_STATUS:
                    raise InferenceServerError(f"{method} {self.url}{path}: HTTP {resp.status_code}: {_reason(resp)}",
                                               resp.status_code)
                last = f"HTTP {resp.status_code}: {_reason(resp)}"
            finally:
                if hasattr(body, "close"):
                    body.close()
            if self.death_check is not None and (dead := self.death_check()):
                raise ServerUnavailableError(f"{method} {self.url}{path} failed ({last}): {dead}", last)
            if not retry or time.monotonic() + delay > deadline:
                raise ServerUnavailableError(f"{method} {self.url}{path}: server unavailable for "
                                             f"{self.retry_deadline_s:.0f} s; last error: {last}", last)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    # -- API
    def health(self) -> bool:
        """True when the server answers and its engine is alive (one attempt, no retries)."""
        try:
            return bool(self.request("GET", "/grpo/health", timeout=10.0, retry=False).get("ok"))
        except InferenceServerError:
            return False

    def weights_version(self) -> int:
        return int(self.request("GET", "/grpo/weights_version")["weights_version"])

    def load(self) -> dict:
        """What the engine has to do now: {"requests", "queued_tokens", "weights_version"} (one
        attempt, a short time-out: a fleet asks before each call it routes)."""
        return self.request("GET", "/grpo/load", timeout=10.0, retry=False)

    def reset_weights(self) -> dict:
        """The server serves its model directory again, as version 0 (a run's versions start there)."""
        return self.request("POST", "/grpo/weights/reset")

    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, stop_token_ids: Optional[list[int]] = None,
                 seed: Optional[int] = None, engine_threads: Optional[int] = None,
                 inflight_updates: bool = False) -> GenerationResult:
        """n samples for each prompt (token ids), with the sampled tokens' log-probs. With `seed`,
        the server reseeds its sampler and schedules this batch alone: the same weights, prompts
        and seed give the same samples (how a resumed run repeats the uninterrupted one).
        engine_threads: a CPU engine's OpenMP threads for this batch (None: all it is bound to; see
        grpo/cpu/cores.py); its kernels round differently with another count. inflight_updates: a
        push that keeps requests may swap the weights under this batch (no seed then); each
        completion's version_spans say which version sampled which token."""
        out = self.request("POST", "/grpo/generate", json_body={
            "prompt_token_ids": [list(map(int, p)) for p in prompt_token_ids], "n": n, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "stop_token_ids": stop_token_ids, "seed": seed,
            "threads": engine_threads, "inflight_updates": inflight_updates})
        return GenerationResult(
            completions=[[Completion(**c) for c in per_prompt] for per_prompt in out["completions"]],
            weights_version=int(out["weights_version"]), engine=dict(out.get("engine") or {}))

    def score(self, sequences: list[tuple[list[int], list[int]]], temperature: float, top_p: float = 1.0,
              top_k: int = -1) -> ScoreResult:
        """The engine's log-prob of each completion token given its prompt and the completion before
        it, for (prompt token ids, completion token ids) pairs: what /grpo/generate would report for
        that completion had it sampled it at this temperature, top_p and top_k (one weights version)."""
        out = self.request("POST", "/grpo/score", json_body={
            "sequences": [{"prompt_token_ids": list(map(int, prompt)),
                           "completion_token_ids": list(map(int, completion))} for prompt, completion in sequences],
            "temperature": temperature, "top_p": top_p, "top_k": top_k})
        # JSON has no -inf: the server sends null for a token outside the kept top-k/top-p set
        return ScoreResult(logprobs=[[float("-inf") if x is None else float(x) for x in per_sequence]
                                     for per_sequence in out["logprobs"]],
                           weights_version=int(out["weights_version"]),
                           engine_requests=int(out["engine_requests"]))

    def push_weights(self, weights_dir: Path, version: int, mode: str = "path", keep_requests: bool = False) -> dict:
        """Make the server serve `weights_dir` (from write_weights) as `version`: {version, seconds,
        bytes, ...}. path: the server reads the directory (a shared filesystem); bytes: the file goes
        in the request body and the server writes it under its own root. keep_requests: the weights
        are swapped under the in-flight generates that asked for inflight_updates (their later tokens
        are the new version's) instead of after them."""
        weights_dir = Path(weights_dir).resolve()
        t0 = time.perf_counter()
        if mode == "path":
            out = self.request("POST", "/grpo/weights", json_body={"path": str(weights_dir), "version": version,
                                                                   "keep_requests": keep_requests})
        elif mode == "bytes":
            manifest = json.loads((weights_dir / MANIFEST_NAME).read_text())
            (entry,) = manifest["files"]  # write_weights writes exactly one file
            algo = manifest["hash"]
            query = urllib.parse.urlencode({"version": version, "step": manifest.get("step", 0), "hash": algo,
                                            "digest": entry[algo], "keep_requests": str(keep_requests).lower()})
            out = self.request("POST", f"/grpo/weights/upload?{query}",
                               data=lambda: open(weights_dir / entry["name"], "rb"),
                               headers={"Content-Type": "application/octet-stream",
                                        "Content-Length": str(entry["bytes"])})
        else:
            raise ValueError(f"mode: must be 'path' or 'bytes', got {mode!r}")
        out["client_seconds"] = time.perf_counter() - t0
        return out


def attach_token(url: str, token_file: Optional[str]) -> str:
    """The token to attach to `url` with: server.token_file's contents, else $GRPO_SERVER_TOKEN.
    AttachError when there is none (the server refuses every call but its health without one)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise AttachError(f"attaching to {url}: server.token_file {token_file}: {e.strerror or e}") from None
        if not token:
            raise AttachError(f"attaching to {url}: server.token_file {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise AttachError(f"attaching to {url}: no token: set server.token_file to the file the server reads its "
                          f"token from (--token-file), or ${TOKEN_ENV}")
    return token


def attach(url: str, token_file: Optional[str], timeout_s: float = 600.0, retry_deadline_s: float = 60.0
           ) -> InferenceClient:
    """A client of the grpo.serving.server running at `url`, once the server has shown that it
    answers and takes the token (module docstring). Two reads, nothing changed on the server.
    AttachError otherwise: nothing answers within retry_deadline_s (refused, unknown host), a TLS
    handshake fails (https to a plain-HTTP server), it is no grpo server, or it refuses the token."""
    client = InferenceClient(url, attach_token(url, token_file), timeout_s, retry_deadline_s)
    source = f"server.token_file {token_file}" if token_file else f"${TOKEN_ENV}"
    try:
        client.request("GET", "/grpo/health", timeout=min(timeout_s, 30.0))  # open: is it there and healthy
    except ServerUnavailableError as e:
        raise AttachError(f"attaching to {url}: no healthy answer within server.retry_deadline_s="
                          f"{retry_deadline_s:g} s ({e.last})") from None
    except InferenceServerError as e:
        scheme = "; is it a plain-HTTP server (http://)?" if "TLS" in str(e) and url.startswith("https") else ""
        what = "not a grpo.serving.server (GET /grpo/health: HTTP 404)" if e.status == 404 else \
            str(e).removeprefix(f"GET {client.url}/grpo/health: ")
        raise AttachError(f"attaching to {url}: {what}{scheme}") from None
    try:  # behind the bearer check, which answers 401 before any route is looked up
        client.request("GET", "/version", timeout=min(timeout_s, 30.0))
    except InferenceServerError as e:
        if e.status == 401:
            raise AttachError(f"attaching to {url}: the server refuses the token from {source} (HTTP 401); give "
                              f"server.token_file the file the server was started with") from None
        if e.status is None or e.status >= 500:
            raise AttachError(f"attaching to {url}: {e}") from None
    return client
