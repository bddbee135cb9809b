"""The trainer's side of the inference server: config, HTTP client, and the child process.

    with InferenceServer.launch(model_dir, cfg.server, run_dir) as server:     # waits for health
        result = server.client.generate(prompt_ids, n=G, max_tokens=..., temperature=1.0)
        ...                                                                     # every v iterations:
        d = write_weights(full_state_dict, model_dir, server.weights_root, version, step, dtype)
        server.client.push_weights(d, version, mode=cfg.server.push_mode)
        prune_weights(server.weights_root, cfg.server.keep_last)

The client retries transient failures (connection refused/reset, 502/503/504) with exponential
backoff until `retry_deadline_s`, then raises ServerUnavailableError saying what it last saw; an
answer that is an error (400, 401, 409, ...) raises InferenceServerError with the server's
reason at once. When the server is a child process, its death is noticed at the first failed
request and reported with the tail of its log; `restart()` starts it again on the same port
and re-pushes the last weights the client pushed.

No orphans: the child runs in its own process group (stop() signals the whole group, so vLLM's
engine and worker processes go too), stop() is registered with atexit, and the child kills
itself when this process dies (PR_SET_PDEATHSIG plus a parent-pid watchdog, see grpo.server).
"""
from __future__ import annotations

import atexit
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

from grpo.weight_sync import MANIFEST_NAME, default_weights_root

TOKEN_ENV = "GRPO_SERVER_TOKEN"
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


@dataclass
class ServerConfig:
    """The `server:` section: where pi_old is served and how weights get there."""

    url: Optional[str] = None  # attach to a running server (http://host:port) instead of launching one
    token_file: Optional[str] = None  # attach only: file with the server's token (else $GRPO_SERVER_TOKEN)
    host: str = "127.0.0.1"  # interface the launched server binds; keep loopback unless it must be remote
    port: int = 0  # port of the launched server; 0 = pick a free one
    device: str = "auto"  # "auto" (GPU 0 if there is one, else CPU), a GPU index like "0", or "cpu"
    dtype: str = "auto"  # serving dtype (vLLM --dtype); float32 makes greedy outputs match HF exactly
    weights_root: Optional[str] = None  # where pushed weights go; default /dev/shm if roomy, else <run>/weights
    keep_last: int = 2  # weight directories kept after each push (>= 1; the served one is always kept)
    push_mode: Literal["path", "bytes"] = "path"  # path: shared filesystem; bytes: file in the request body
    weights_hash: Literal["sha256", "blake3"] = "sha256"  # manifest checksum; blake3 is ~2.3x faster here
    startup_timeout_s: float = 600.0  # launch/restart waits this long for health, then shows the log
    request_timeout_s: float = 600.0  # one HTTP request (a whole generation batch) may take this long
    retry_deadline_s: float = 60.0  # transient failures are retried with backoff for this long
    max_model_len: int = 2048  # prompt + completion tokens per sequence
    gpu_memory_utilization: float = 0.85  # GPU only: fraction of the server's GPU vLLM may use
    kv_cache_gb: float = 1.0  # CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)
    cpu_threads: Optional[str] = None  # CPU only: cores for vLLM's threads, e.g. "0-1"; None = see docs
    seed: int = 0  # engine seed (set once; per-request seeds kill the CPU engine)
    trust_remote_code: bool = False  # let the model directory run its own Python code
    enforce_eager: bool = False  # no CUDA graphs / compilation: faster start, slower decoding

    def __post_init__(self) -> None:
        if self.url is not None and urllib.parse.urlparse(self.url).scheme not in ("http", "https"):
            raise ValueError(f"url: must start with http:// or https://, got {self.url!r}")
        if self.url is not None and self.push_mode == "path" and self.weights_root is None:
            raise ValueError("weights_root: attaching with push_mode 'path' needs the server's weights root "
                             "(a shared filesystem), got None; or use push_mode 'bytes'")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.device not in ("auto", "cpu") and not self.device.isdigit():
            raise ValueError(f"device: must be 'auto', 'cpu' or a GPU index, got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last: must be >= 1 (the served weights are kept), got {self.keep_last}")
        for name in ("startup_timeout_s", "request_timeout_s", "retry_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len: must be >= 16, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gb < 1 or self.kv_cache_gb != int(self.kv_cache_gb):
            raise ValueError(f"kv_cache_gb: must be a whole number of GiB >= 1 (vLLM reads an integer), got {self.kv_cache_gb}")
        if self.cpu_threads is not None and not all(p.replace("-", "").isdigit() for p in self.cpu_threads.split(",")):
            raise ValueError(f"cpu_threads: must be a CPU list like '0-1' or '2,3', got {self.cpu_threads!r}")


@dataclass
class Completion:
    token_ids: list[int]  # the sampled completion o_i
    logprobs: list[float]  # log alpha(o_i,t | q, o_i,<t): sampled tokens' log-probs, temperature-scaled
    finish_reason: str  # "stop" (eos / stop token) or "length"
    text: str


@dataclass
class GenerationResult:
    completions: list[list[Completion]]  # [prompt][sample]
    weights_version: int  # the pushed version that produced every completion here


class InferenceServerError(RuntimeError):
    """The server answered with an error (bad request, bad token, rejected push, ...)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(InferenceServerError):
    """No answer from the server within the retry deadline (or its process has died)."""


class InferenceClient:
    """HTTP client for grpo.server (stdlib only, one connection per request)."""

    def __init__(self, url: str, token: Optional[str], timeout_s: float = 600.0, retry_deadline_s: float = 60.0,
                 death_check: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self._token = token
        self._death_check = death_check  # returns a reason when the server process is known dead
        self.last_push: Optional[tuple[Path, int, str]] = None  # re-pushed by InferenceServer.restart

    def __repr__(self) -> str:  # never show the token
        return f"InferenceClient({self.url!r})"

    # -- transport
    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        u = urllib.parse.urlparse(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname, u.port, timeout=timeout, blocksize=1 << 20)

    def _request(self, method: str, path: str, body=None, headers: Optional[dict] = None,
                 timeout: Optional[float] = None, retry: bool = True) -> dict:
        hdrs = {"Accept": "application/json", **(headers or {})}
        if self._token:
            hdrs["Authorization"] = f"Bearer {self._token}"
        deadline = time.monotonic() + self.retry_deadline_s
        delay = 0.25
        while True:
            payload = body() if callable(body) else body  # a file body is reopened per attempt
            try:
                conn = self._connection(timeout or self.timeout_s)
                try:
                    conn.request(method, path, body=payload, headers=hdrs)
                    resp = conn.getresponse()
                    status, data = resp.status, resp.read()
                finally:
                    conn.close()
                    if hasattr(payload, "close"):
                        payload.close()
            except TimeoutError as e:
                raise ServerUnavailableError(f"{method} {self.url}{path}: no answer within {timeout or self.timeout_s:.0f} s "
                                             f"({e}); raise server.request_timeout_s if batches are this slow") from None
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if status == 200:
                    return json.loads(data)
                try:
                    reason = json.loads(data).get("error", data.decode(errors="replace"))
                except (ValueError, AttributeError):
                    reason = data.decode(errors="replace")[:500]
                if isinstance(reason, dict):
                    reason = reason.get("message", reason)
                if status not in (502, 503, 504):
                    raise InferenceServerError(f"{method} {self.url}{path}: HTTP {status}: {reason}", status)
                last = f"HTTP {status}: {reason}"
            if self._death_check is not None and (dead := self._death_check()):
                raise ServerUnavailableError(f"{method} {self.url}{path} failed ({last}): {dead}")
            if not retry or time.monotonic() + delay > deadline:
                raise ServerUnavailableError(f"{method} {self.url}{path}: server unavailable for "
                                             f"{self.retry_deadline_s:.0f} s; last error: {last}")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _post_json(self, path: str, obj: dict, **kw) -> dict:
        return self._request("POST", path, json.dumps(obj).encode(), {"Content-Type": "application/json"}, **kw)

    # -- API
    def health(self) -> bool:
        """True when the server answers and its engine is alive (one attempt, no retries)."""
        try:
            return bool(self._request("GET", "/grpo/health", timeout=10.0, retry=False).get("ok"))
        except InferenceServerError:
            return False

    def weights_version(self) -> int:
        return int(self._request("GET", "/grpo/weights_version")["weights_version"])

    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, stop_token_ids: Optional[list[int]] = None,
                 seed: Optional[int] = None) -> GenerationResult:
        """n samples for each prompt (token ids), with the sampled tokens' log-probs. With `seed`,
        the server reseeds its sampler and schedules this batch alone: the same weights, prompts
        and seed give the same samples (how a resumed run repeats the uninterrupted one)."""
        out = self._post_json("/grpo/generate", {
            "prompt_token_ids": [list(map(int, p)) for p in prompt_token_ids], "n": n, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "stop_token_ids": stop_token_ids, "seed": seed})
        return GenerationResult(
            completions=[[Completion(**c) for c in per_prompt] for per_prompt in out["completions"]],
            weights_version=int(out["weights_version"]))

    def push_weights(self, weights_dir: Path, version: int, mode: str = "path") -> dict:
        """Make the server serve `weights_dir` (from write_weights) as `version`: {version, seconds, bytes}."""
        weights_dir = Path(weights_dir).resolve()
        t0 = time.perf_counter()
        if mode == "path":
            out = self._post_json("/grpo/weights", {"path": str(weights_dir), "version": version})
        elif mode == "bytes":
            manifest = json.loads((weights_dir / MANIFEST_NAME).read_text())
            (entry,) = manifest["files"]  # write_weights writes exactly one file
            algo = manifest["hash"]
            query = urllib.parse.urlencode({"version": version, "step": manifest.get("step", 0), "hash": algo,
                                            "digest": entry[algo]})
            out = self._request("POST", f"/grpo/weights/upload?{query}",
                                body=lambda: open(weights_dir / entry["name"], "rb"),
                                headers={"Content-Type": "application/octet-stream",
                                         "Content-Length": str(entry["bytes"])})
        else:
            raise ValueError(f"mode: must be 'path' or 'bytes', got {mode!r}")
        out["client_seconds"] = time.perf_counter() - t0
        self.last_push = (weights_dir, version, mode)
        return out


# ----------------------------------------------------------------------------- the child process

def _cpu_bind_list(cpu_threads: Optional[str]) -> str:
    """Cores for vLLM's OpenMP threads. With >= 4 usable cores the server takes the upper half
    (give the trainer the lower half); with fewer it shares them all, since GRPO alternates
    sampling and training rather than running both at once."""
    if cpu_threads:
        return cpu_threads
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    chosen = cpus[len(cpus) // 2:] if len(cpus) >= 4 else cpus
    return ",".join(map(str, chosen))


def _uses_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device.isdigit():
        return True
    import torch

    return torch.cuda.is_available()


class InferenceServer:
    """A grpo.server child process (or an attached URL) and the client that talks to it."""

    def __init__(self, cfg: ServerConfig, client: InferenceClient, weights_root: Optional[Path],
                 cmd: Optional[list[str]] = None, env: Optional[dict] = None, run_dir: Optional[Path] = None,
                 owns_root: bool = False) -> None:
        self.cfg = cfg
        self.client = client
        self.weights_root = weights_root
        self._cmd, self._env, self._run_dir, self._owns_root = cmd, env, run_dir, owns_root
        self.process: Optional[subprocess.Popen] = None
        self._log_path = run_dir / "server" / "server.log" if run_dir else None
        self._stopped = False

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def token(self) -> Optional[str]:
        return self.client._token

    def __repr__(self) -> str:
        return f"InferenceServer({self.url!r}, pid={self.process.pid if self.process else None})"

    # -- construction
    @classmethod
    def attach(cls, cfg: ServerConfig) -> "InferenceServer":
        token = Path(cfg.token_file).read_text().strip() if cfg.token_file else os.environ.get(TOKEN_ENV)
        client = InferenceClient(cfg.url, token, cfg.request_timeout_s, cfg.retry_deadline_s)
        if not client.health():
            client._request("GET", "/grpo/health")  # retries until the deadline, then says why
        return cls(cfg, client, Path(cfg.weights_root) if cfg.weights_root else None)

    @classmethod
    def launch(cls, model_dir: str | Path, cfg: ServerConfig, run_dir: str | Path) -> "InferenceServer":
        """Start `python -m grpo.server` as a child and wait for its health (or attach if cfg.url)."""
        if cfg.url:
            return cls.attach(cfg)
        model_dir, run_dir = Path(model_dir).resolve(), Path(run_dir).resolve()
        server_dir = run_dir / "server"
        server_dir.mkdir(parents=True, exist_ok=True)
        model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        owns_root = cfg.weights_root is None
        root = Path(cfg.weights_root) if cfg.weights_root else default_weights_root(run_dir, model_bytes, cfg.keep_last)
        if owns_root:  # leftovers of an earlier run in the same run dir: a new server starts at version 0
            shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_urlsafe(32)
        token_file = server_dir / "token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, token.encode())
        os.close(fd)
        cmd = [sys.executable, "-m", "grpo.server", "--model", str(model_dir), "--weights-root", str(root),
               "--token-file", str(token_file), "--port-file", str(server_dir / "port"), "--host", cfg.host,
               "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--seed", str(cfg.seed),
               "--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--keep-last", str(cfg.keep_last),
               "--parent-pid", str(os.getpid())]
        cmd += ["--trust-remote-code"] if cfg.trust_remote_code else []
        cmd += ["--enforce-eager"] if cfg.enforce_eager else []
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        if _uses_gpu(cfg.device):
            env["CUDA_VISIBLE_DEVICES"] = "0" if cfg.device == "auto" else cfg.device  # paper: GPU 0 samples
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_gb))
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind_list(cfg.cpu_threads)
        client = InferenceClient("http://unset", token, cfg.request_timeout_s, cfg.retry_deadline_s)
        server = cls(cfg, client, root, cmd, env, run_dir, owns_root)
        client._death_check = server._death_reason
        _live_servers.add(server)
        server._start(cfg.port)
        return server

    # -- lifecycle
    def _start(self, port: int) -> None:
        port_file = self._run_dir / "server" / "port"
        port_file.unlink(missing_ok=True)
        cmd = self._cmd + ["--port", str(port)]
        with open(self._log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting grpo.server\n".encode())
            self.process = subprocess.Popen(cmd, env=self._env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._kill_group()
                raise ServerUnavailableError(f"grpo.server exited with code {self.process.returncode} during "
                                             f"start-up; last lines of {self._log_path}:\n{self.log_tail()}")
            if port_file.is_file() and (text := port_file.read_text().strip()):
                self.client.url = f"http://{self.cfg.host}:{int(text)}"
                if self.client.health():
                    return
            time.sleep(0.5)
        self._kill_group()
        raise ServerUnavailableError(f"grpo.server not healthy after {self.cfg.startup_timeout_s:.0f} s "
                                     f"(server.startup_timeout_s); last lines of {self._log_path}:\n{self.log_tail()}")

    def _death_reason(self) -> Optional[str]:
        if self.process is not None and self.process.poll() is not None:
            return (f"the grpo.server process (pid {self.process.pid}) exited with code {self.process.returncode}; "
                    f"InferenceServer.restart() starts it again. Last lines of {self._log_path}:\n{self.log_tail()}")
        return None

    def log_tail(self, lines: int = 40) -> str:
        if not self._log_path or not self._log_path.is_file():
            return "(no log)"
        with open(self._log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def is_alive(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            return False
        return self.client.health()

    def _kill_group(self, grace_s: float = 20.0) -> None:
        """SIGTERM the child's process group (server, engine core, workers), SIGKILL what remains."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the child's pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                if self.process.poll() is not None and not _group_alive(pgid):
                    break
                time.sleep(0.1)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> None:
        """Stop (if needed) and start again on the same port, then re-push the last pushed weights."""
        if self._cmd is None:
            raise InferenceServerError("restart: this server was attached by URL, not launched here")
        port = urllib.parse.urlparse(self.client.url).port or self.cfg.port
        self._kill_group()
        self._start(port)
        if self.client.last_push is not None:
            weights_dir, version, mode = self.client.last_push
            self.client.push_weights(weights_dir, version, mode)

    def stop(self) -> None:
        """Stop the child and everything it started; remove the token file and an own /dev/shm root."""
        if self._stopped:
            return
        self._stopped = True
        _live_servers.discard(self)
        self._kill_group()
        if self._run_dir is not None:
            (self._run_dir / "server" / "token").unlink(missing_ok=True)
        if self._owns_root and self.weights_root is not None and str(self.weights_root).startswith("/dev/shm/"):
            shutil.rmtree(self.weights_root, ignore_errors=True)

    def __enter__(self) -> "InferenceServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


_live_servers: "set[InferenceServer]" = set()  # strong refs: atexit must reach every child


@atexit.register
def _stop_all() -> None:
    for server in list(_live_servers):
        server.stop()
