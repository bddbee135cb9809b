"""The trainer's view of the inference server: it samples from pi_old and takes weight pushes.

    server = InferenceServer.launch(model_dir, cfg.server, run_dir, gpu="0")   # or attaches: server.url
    result = server.generate(prompt_ids, n=G, max_tokens=200, temperature=0.1, seed=batch_seed)
    scores = server.score([(prompt_ids[0], result.completions[0][0].token_ids)], temperature=0.1)
    server.push(full_state_dict, version=3, step=120)        # every v iterations (rank 0)
    server.stop()

The object owns both things the loop asks of the server: a push is write (weights_writer, atomic,
hashed with server.weights_hash) -> load -> check the engine's fingerprint -> prune in one call, and generation survives a
dead server: a launched child that died is restarted, the weights it served re-pushed (none
before the first push: a fresh server serves the model directory as version 0, which is what it
served), and the request retried (through RESTARTS deaths); a child that dies while it starts is
started again (through RESTARTS deaths too). A request the server refuses (4xx) is raised as it
is, and a stopped server is never started again. Calls may come from several threads at once (the
asynchronous sampler's beside the trainer's pushes): a death seen by two of them restarts the child
once.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from grpo.config import ConfigError
from grpo.cpu import CPUConfig
from grpo.cpu.bf16 import multiplies_bf16
from grpo.fsutil import owned_dir
from grpo.serving.client import (TOKEN_ENV, GenerationResult, InferenceClient, InferenceServerError, ScoreResult,
                                 ServerUnavailableError, attach)
from grpo.serving.fingerprint import fingerprint_mismatches, pushed_moments, unseen_by_fingerprint
from grpo.serving.supervisor import ServerProcess, StartupRefused, StartupTimeout
from grpo.serving.weights_dir import prune_weights
from grpo.serving.weights_writer import write_weights

_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: the launched child imports grpo from here
_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
HEAD_DTYPES = ("float32", "model")


@dataclass
class ServerConfig:
    """The `server:` section: where pi_old is served and how weights get there."""

    url: Optional[str] = None  # attach to a running server (http://host:port) instead of launching one
    urls: Optional[list[str]] = None  # attach to several running servers (a fleet; bytes pushes); url is its one-server case
    replicas: int = 1  # local servers launched (a fleet), each on server.tensor_parallel_size GPUs of its own (grpo.layout)
    token_file: Optional[str] = None  # attach only: file with the server's token (else $GRPO_SERVER_TOKEN)
    host: str = "127.0.0.1"  # interface the launched server binds; keep loopback unless it must be remote
    port: int = 0  # port of the launched server; 0 = pick a free one
    device: str = "auto"  # the server's GPU as an index into the visible GPUs ("auto": the first), or "cpu"
    dtype: str = "auto"  # serving dtype (vLLM --dtype); float32 makes greedy outputs match HF exactly
    weights_root: Optional[str] = None  # launch: where its private weights roots are made (default /dev/shm if
    #                                     it holds every replica's pushes, else the run dir); attach with push_mode
    #                                     path: the server's own root
    keep_last: int = 2  # weight directories kept after each push (>= 1; the served one is always kept)
    push_mode: Literal["path", "bytes"] = "path"  # path: shared filesystem; bytes: file in the request body
    weights_hash: Literal["sha256", "blake3"] = "blake3"  # manifest checksum: blake3 is faster than sha256 (docs/benchmarks)
    startup_timeout_s: float = 600.0  # launch/restart waits this long for health, then shows the log
    request_timeout_s: float = 600.0  # one HTTP request (a whole generation batch) may take this long
    upload_timeout_s: float = 600.0  # launched server: a bytes-mode upload's body must arrive within this
    retry_deadline_s: float = 60.0  # transient failures are retried with backoff for this long
    max_model_len: int = 2048  # prompt + completion tokens per sequence
    gpu_memory_utilization: Optional[float] = None  # vLLM's share of its GPU; None: 0.85 on its own GPU, 0.3 shared
    tensor_parallel_size: int = 1  # GPUs of the one launched engine (grpo.layout reserves them; e.g. 2 for a 7B model)
    seed: int = 0  # engine seed (set once; per-request seeds kill the CPU engine)
    trust_remote_code: bool = False  # let the model directory run its own Python code
    enforce_eager: bool = False  # no CUDA graphs / compilation: faster start, slower decoding
    head_dtype: Literal["float32", "model"] = "float32"  # the engine's LM head: fp32 logits as the trainer's (alpha's
    #                                                  log-probs in every ratio); "model": the serving dtype, faster

    def __post_init__(self) -> None:
        if self.url is not None and urllib.parse.urlparse(self.url).scheme not in ("http", "https"):
            raise ValueError(f"url: must start with http:// or https://, got {self.url!r}")
        if self.urls is not None:
            if self.url is not None:
                raise ValueError(f"urls: set url or urls, not both (url is the one-server case of urls), got "
                                 f"url={self.url!r} and urls={self.urls!r}")
            if not self.urls:
                raise ValueError("urls: an empty list attaches to no server; leave it unset to launch one")
            for i, u in enumerate(self.urls):
                if not isinstance(u, str) or urllib.parse.urlparse(u).scheme not in ("http", "https"):
                    raise ValueError(f"urls[{i}]: must start with http:// or https://, got {u!r}")
            if len(set(self.urls)) != len(self.urls):
                raise ValueError(f"urls: lists a server twice: {self.urls!r}")
            if self.push_mode != "bytes":
                raise ValueError("push_mode: servers attached by urls take bytes pushes (each has its own weights "
                                 "root); set push_mode: bytes")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        if self.replicas > 1 and self.attached:
            key = "urls" if self.urls else "url"
            raise ValueError(f"replicas: {self.replicas} launches local servers, but {key} attaches to servers "
                             f"elsewhere: set one of replicas and {key}")
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
        for name in ("startup_timeout_s", "request_timeout_s", "retry_deadline_s", "upload_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len: must be >= 16, got {self.max_model_len}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype: must be one of {list(HEAD_DTYPES)}, got {self.head_dtype!r}")

    @property
    def attached(self) -> bool:
        """The servers run elsewhere (url or urls): nothing is launched here."""
        return self.url is not None or bool(self.urls)

    @property
    def attached_urls(self) -> list[str]:
        """The attached servers' URLs (url as a list of one; [] when launched here)."""
        return list(self.urls) if self.urls else [self.url] if self.url is not None else []


def check_context_fits(cfg: ServerConfig, longest_prompt: int, budgets: dict[str, int]) -> None:
    """Refuse at start-up what the server would refuse per request hours later: every prompt plus
    each completion budget (by its config key) must fit in server.max_model_len."""
    for key, max_new_tokens in budgets.items():
        if longest_prompt + max_new_tokens > cfg.max_model_len:
            raise ValueError(f"server.max_model_len: {cfg.max_model_len} is shorter than the longest prompt "
                             f"({longest_prompt} tokens) plus {key} ({max_new_tokens}); raise server.max_model_len "
                             f"to >= {longest_prompt + max_new_tokens} or shorten {key}")


def serving_dtype(cfg: ServerConfig, model_dir: str | os.PathLike, on_cpu: bool = False,
                  native_bf16: Optional[bool] = None) -> torch.dtype:
    """The dtype vLLM serves in, so a push is cast once on the trainer and needs no conversion on
    the server. server.dtype "auto" = the model directory's own dtype (else bf16), except that a
    server on a CPU without native bf16 (on_cpu; native_bf16: grpo.cpu.bf16.multiplies_bf16,
    detected when None) serves a 16-bit model in fp32: emulated 16-bit matmuls are many times
    slower there. A launched server is given this dtype explicitly (never vLLM's own "auto" rule),
    and refuses pushes in any other."""
    names = {"float": "float32", "half": "float16"}
    if cfg.dtype != "auto":
        return getattr(torch, names.get(cfg.dtype, cfg.dtype))
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) \
        else torch.bfloat16
    if on_cpu and dtype in (torch.bfloat16, torch.float16) and not (
            multiplies_bf16() if native_bf16 is None else native_bf16):
        return torch.float32
    return dtype


def _private_root(parent: Path, name: str) -> Path:
    """A fresh directory only this user can read, with an unpredictable name: another local user
    can neither plant weights in it nor swap it for a symlink before the server loads from it.
    Its name holds its owner (this process and when it started): the roots of owners that are gone
    (a SIGKILLed run: gigabytes of RAM each in /dev/shm) are reclaimed here, before a new one is made."""
    return owned_dir(parent, "weights", name)


def weights_parent(cfg: ServerConfig, model_dir: Path, run_dir: Path, roots: int = 1) -> Path:
    """Where launched servers make their private weights roots: server.weights_root if set, else
    /dev/shm when tmpfs has room for keep_last + 2 pushes in each of `roots` roots (the server then
    reads the trainer's writes from memory, no disk), else the run directory. A fleet's launched
    servers have a root each, and a push writes a copy into every one (grpo/serving/fleet.py): the
    fleet asks for all its roots at once."""
    if cfg.weights_root:
        return Path(cfg.weights_root)
    model_bytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    need = roots * model_bytes * (cfg.keep_last + 2) + (1 << 30)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return shm
    return Path(run_dir)


def server_command(cfg: ServerConfig, model_dir: Path, root: Path, server_dir: Path, dtype: torch.dtype,
                   memory_fraction: float) -> list[str]:
    """The launched server's command line (each start adds --port; a CPU engine its own flags): the
    served model at `dtype`, its LM head at server.head_dtype, the private weights root and token file."""
    cmd = [sys.executable, "-m", "grpo.serving.server", "--model", str(model_dir), "--weights-root", str(root),
           "--token-file", str(server_dir / "token"), "--port-file", str(server_dir / "port"), "--host", cfg.host,
           "--dtype", str(dtype).removeprefix("torch."), "--head-dtype", cfg.head_dtype,
           "--max-model-len", str(cfg.max_model_len), "--seed", str(cfg.seed),
           "--gpu-memory-utilization", str(memory_fraction), "--keep-last", str(cfg.keep_last),
           "--tensor-parallel-size", str(cfg.tensor_parallel_size),
           "--parent-pid", str(os.getpid()), "--upload-timeout-s", str(cfg.upload_timeout_s)]
    cmd += ["--trust-remote-code"] if cfg.trust_remote_code else []
    cmd += ["--enforce-eager"] if cfg.enforce_eager else []
    return cmd


class WeightsMismatchError(InferenceServerError):
    """The weights the engine reports holding are not those the trainer pushed: stop the run."""


class InferenceServer:
    """A grpo.serving.server child process (or an attached URL), its client, and the weights it serves."""

    RESTARTS = 3  # deaths one request survives: a server that dies at every try is not restarted forever

    def __init__(self, cfg: ServerConfig, client: InferenceClient, model_dir: Path, run_dir: Path,
                 weights_root: Optional[Path], process: Optional[ServerProcess] = None,
                 token: Optional[str] = None, serve_dtype: Optional[torch.dtype] = None) -> None:
        self.cfg = cfg
        self.client = client
        self.model_dir = model_dir
        self.run_dir = run_dir
        self._root = weights_root  # the server's root (path pushes are written here); None: attached, bytes
        self._process = process
        self._token = token  # a launched child's token (a restart checks its health with it)
        self._served: Optional[tuple[Path, int, str]] = None  # (dir, version, mode): what a restart re-serves
        self._stopped = False
        self.serve_dtype = serve_dtype or serving_dtype(cfg, model_dir)
        self.cpu_cores: Optional[list[int]] = None  # a launched CPU engine: the cores its threads are bound to
        self._unseen = None  # pushed tensors the engine's fingerprint cannot show (known after the first push)
        self._server_dir = run_dir / "server"  # a launched child's token, port file and log
        # pushes swap the weights under the generates that asked for inflight_updates instead of
        # waiting for them (rollout.inflight_updates; set by grpo.batch_source's asynchronous sampler)
        self.inflight_updates = False
        self._restarting = threading.RLock()  # one restart at a time, whichever thread saw the death
        self._starts = 0  # children started so far: a thread that saw a death restarts only the child it saw

    @property
    def url(self) -> str:
        return self.client.url

    def __repr__(self) -> str:
        return f"InferenceServer({self.url!r}, pid={self.pid})"

    # -- construction
    @classmethod
    def launch(cls, model_dir: str | Path, cfg: ServerConfig, run_dir: str | Path, gpu: Optional[str] = None,
               gpu_memory_utilization: Optional[float] = None, cpu: Optional[CPUConfig] = None,
               name: str = "server") -> "InferenceServer":
        """Start `python -m grpo.serving.server` as a child and wait for its health (or attach if cfg.url).
        gpu: the CUDA_VISIBLE_DEVICES entry of the server's GPU (grpo.layout decides), None: CPU, where
        `cpu` (the config's `cpu:` section, defaults when None) sets up the engine. name: the run
        directory's subdirectory for its token, port file and log (one per server of a fleet)."""
        model_dir, run_dir = Path(model_dir).resolve(), Path(run_dir).resolve()
        if cfg.url:  # answers and takes the token, or AttachError (nothing on the server changed)
            client = attach(cfg.url, cfg.token_file, cfg.request_timeout_s, cfg.retry_deadline_s)
            root = Path(cfg.weights_root) if cfg.push_mode == "path" else None
            server = cls(cfg, client, model_dir, run_dir, root)
            server.check_head_dtype()  # started by someone else, with its own --head-dtype
            return server
        server_dir = run_dir / name
        server_dir.mkdir(parents=True, exist_ok=True)
        root = _private_root(weights_parent(cfg, model_dir, run_dir), run_dir.name)
        token = secrets.token_urlsafe(32)
        token_file = server_dir / "token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, token.encode())
        os.close(fd)
        fraction = gpu_memory_utilization or cfg.gpu_memory_utilization or 0.85
        dtype = serving_dtype(cfg, model_dir, on_cpu=gpu is None)
        cmd = server_command(cfg, model_dir, root, server_dir, dtype, fraction)
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        else:  # on this machine's CPU: the fence sets up the engine
            from grpo.cpu.serving import BIND_ENV, engine_env

            cpu = cpu or CPUConfig()
            env.update(engine_env(cpu))
            cmd += ["--cpu-sampler", cpu.engine_sampler, "--cpu-executor", cpu.engine_executor]
        process = ServerProcess(cmd, env, server_dir, cfg.host)
        client = InferenceClient("http://unset", token, cfg.request_timeout_s, cfg.retry_deadline_s,
                                 death_check=process.death_reason)
        server = cls(cfg, client, model_dir, run_dir, root, process, token, serve_dtype=dtype)
        server._server_dir = server_dir
        if gpu is None:
            from grpo.cpu.cores import parse_cpu_list

            server.cpu_cores = parse_cpu_list(env[BIND_ENV])
        try:
            server._start(cfg.port)
        except BaseException:
            process.stop()  # the token file stays: the log next to it names what went wrong
            shutil.rmtree(root, ignore_errors=True)
            raise
        return server

    # -- what the loop asks
    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, stop_token_ids: Optional[list[int]] = None,
                 seed: Optional[int] = None, engine_threads: Optional[int] = None,
                 inflight_updates: bool = False) -> GenerationResult:
        """client.generate, surviving the death of a launched server (restart, re-serve, retry once)."""
        return self._surviving(lambda: self.client.generate(prompt_token_ids, n, max_tokens, temperature, top_p,
                                                            stop_token_ids, seed, engine_threads, inflight_updates))

    def load(self) -> dict:
        """The server's load now (client.load): what its engine has to do."""
        return self.client.load()

    def score(self, sequences: list[tuple[list[int], list[int]]], temperature: float, top_p: float = 1.0,
              top_k: int = -1) -> ScoreResult:
        """client.score (the served weights' log-prob of each given completion token, as sampled at
        this temperature), surviving the death of a launched server like generate."""
        return self._surviving(lambda: self.client.score(sequences, temperature, top_p, top_k))

    def _surviving(self, call):
        """call(); if a launched server died under it (before, during or after a push), restart it,
        re-serve what it served, and call again, through up to RESTARTS deaths (one may come during
        the retry itself). A refusal (4xx) is raised as it is. Where another thread restarted the
        child since this call failed, it is not restarted again: the call is retried on that one."""
        died = None  # which child this call saw die (its start count)
        for restarts in range(self.RESTARTS + 1):
            called_on = None
            try:
                if died is not None:
                    with self._restarting:
                        if self._starts == died:  # else another thread restarted it already
                            self.restart()  # a death while it re-serves counts as one more
                called_on = self._starts
                return call()
            except StartupTimeout:
                raise  # a restart that never became healthy: restarting again would wait as long
            except ServerUnavailableError as e:
                if self._process is None or self._stopped or restarts == self.RESTARTS:
                    raise  # attached: not ours to restart; stopped: the run is ending (a batch sampled ahead)
                died = self._starts if called_on is None else called_on
                self._report_restart(e)

    def push(self, state_dict: dict[str, torch.Tensor], version: int, step: int) -> dict:
        """alpha <- these weights (rank 0's full state dict): write, load, check, prune. Returns the
        server's reply with bytes, seconds, weights_dir and the trainer-side stage times
        (write_seconds, load_seconds: the request round trip, check_seconds: the fingerprint)."""
        t0 = time.perf_counter()
        weights_dir = self.write(state_dict, version, step)
        t1 = time.perf_counter()
        # What the engine should hold, from the state dict itself (not from the file: a writer bug
        # is caught too), computed in a thread while the server loads.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push-moments") as pool:
            reply = self.load_checked(weights_dir, version, pool.submit(self._moments, state_dict))
        self.prune()
        return {**reply, "seconds": time.perf_counter() - t0, "write_seconds": t1 - t0}

    @property
    def push_root(self) -> Path:
        """Where a push is written: the server's root (path mode) or the run's staging directory (bytes)."""
        return self._root if self.cfg.push_mode == "path" else self.run_dir / "weights"

    def write(self, state_dict: dict[str, torch.Tensor], version: int, step: int) -> Path:
        """The push's first half: the weights directory of `version` under push_root, in the serving dtype."""
        # the pruned push's file is overwritten in place (its pages are there already)
        return write_weights(state_dict, self.model_dir, self.push_root, version=version, step=step,
                             dtype=self.serve_dtype, hash_algo=self.cfg.weights_hash, reuse_spare=True)

    def load_checked(self, weights_dir: Path, version: int, expected: concurrent.futures.Future) -> dict:
        """The push's second half: the server loads `weights_dir` as `version` (surviving a death),
        and the engine's fingerprint is checked against `expected` (pushed_moments of the state
        dict, a future: computed while the server loads). WeightsMismatchError when they differ."""
        t1 = time.perf_counter()
        reply = self._surviving(lambda: self._load(weights_dir, version, self.cfg.push_mode))
        t2 = time.perf_counter()
        expected = expected.result()
        if "fingerprint" in reply:
            fingerprint = reply.pop("fingerprint")
            self._unseen = unseen_by_fingerprint(fingerprint)  # what the next push need not compute
            bad = fingerprint_mismatches(expected, fingerprint)
            if bad:
                raise WeightsMismatchError(f"push of version {version}: the engine holds other values than were "
                                           f"pushed for {', '.join(bad)}")
        t3 = time.perf_counter()
        return {**reply, "server_seconds": reply.get("seconds", 0.0), "weights_dir": str(weights_dir),
                "load_seconds": t2 - t1, "check_seconds": t3 - t2}

    def prune(self) -> None:
        """After a push: keep the last server.keep_last weights directories (and a spare file) under push_root."""
        prune_weights(self.push_root, self.cfg.keep_last, keep_spare=True)

    def _moments(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """pushed_moments of this push; on one thread where a CPU engine's threads run on this
        trainer's cores (its reload leaves one core to its own hash check, and a second team of
        threads there would stall both)."""
        moments = lambda: pushed_moments(state_dict, self.serve_dtype, self.model_dir, self._unseen)  # noqa: E731
        if self.cpu_cores:
            from grpo.cpu.cores import on_threads, shares_cores

            if shares_cores(self.cpu_cores):
                return on_threads(1, moments)
        return moments()

    @property
    def weights_root(self) -> Optional[Path]:
        """The server's weights root (path pushes are written there); for tools and tests."""
        return self._root

    @property
    def pid(self) -> Optional[int]:
        """The launched child's pid (None when attached)."""
        return self._process.process.pid if self._process and self._process.process else None

    def serve(self, weights_dir: str | Path, version: int) -> dict:
        """Serve an existing directory written by write_weights as `version` (a resumed run re-serves
        alpha), uploaded so that where it lies does not matter."""
        return self._surviving(lambda: self._load(Path(weights_dir), version, "bytes"))

    def weights_version(self) -> int:
        return self.client.weights_version()

    def _load(self, weights_dir: Path, version: int, mode: str) -> dict:
        reply = self.client.push_weights(weights_dir, version, mode=mode, keep_requests=self.inflight_updates)
        self._served = (weights_dir, version, mode)
        return reply

    @property
    def served(self) -> Optional[tuple[Path, int, str]]:
        """(dir, version, mode) of the last load (None before the first push): what a restart re-serves."""
        return self._served

    def revert(self, served: Optional[tuple[Path, int, str]]) -> None:
        """Back to an earlier load (a fleet's push that another server refused): serving `served`
        again (None: the model directory, version 0). Versions only grow on a running server except
        through a reset: a launched one is restarted onto it, an attached one reset and re-pushed."""
        self._served = served
        if self._process is None:
            print(f"[grpo] inference server {self.url}: resetting it to take back a push its fleet refused",
                  file=sys.stderr)
            self.reset()
            if served is not None:
                self._load(*served)
            return
        print(f"[grpo] inference server {self.url}: restarting it to take back a push its fleet refused", file=sys.stderr)
        self.restart()

    def reset(self) -> dict:
        """The server serves its model directory as version 0 again (POST /grpo/weights/reset)."""
        reply = self.client.reset_weights()
        self._served = None
        return reply

    def start_versions(self) -> None:
        """A run's versions start at 0, the model directory. An attached server may serve another
        run's push, or this run's from past its checkpoint (a resume after a crash): it is reset, or
        the run's pushes would be refused as not newer, and its samples would come from weights the
        run never pushed. A launched server is fresh."""
        version = self.weights_version()
        if version != 0:
            print(f"[grpo] inference server {self.url} served version {version} (another run's, or this run's "
                  f"past its checkpoint); reset to its model directory, version 0", file=sys.stderr)
            self.reset()

    def check_head_dtype(self) -> None:
        """The server's LM head runs in the dtype server.head_dtype asks: float32 (alpha's log-probs
        from fp32 logits, as the trainer's) or "model" (the serving dtype). An attached server was
        started by someone else with its own --head-dtype: checked as it is attached, ConfigError
        naming the URL and both dtypes when it differs, before anything on the server changes."""
        health = self.client.request("GET", "/grpo/health")
        head = health.get("head_dtype")
        served = health.get("dtype") or str(self.serve_dtype).removeprefix("torch.")
        wanted = "float32" if self.cfg.head_dtype == "float32" else served
        if head is not None and head != wanted:
            other = "float32" if head == "float32" else "model"
            raise ConfigError(f"server.head_dtype: {self.url} runs its LM head in {head}, the config's "
                              f"server.head_dtype is {self.cfg.head_dtype}"
                              f"{'' if self.cfg.head_dtype == wanted else f' ({wanted} there)'}; start the server "
                              f"with --head-dtype {self.cfg.head_dtype}, or set server.head_dtype: {other}")

    # -- lifecycle
    def _report_restart(self, error: Exception) -> None:
        what = f"re-serving version {self._served[1]}" if self._served else "nothing pushed yet, so no re-push"
        print(f"[grpo] inference server failed ({str(error).splitlines()[0]}); restarting it, {what}", file=sys.stderr)

    def restart(self) -> None:
        """Start the child again on the same port and re-serve what it served (nothing before a push)."""
        if self._process is None:
            raise InferenceServerError("restart: this server was attached by URL, not launched here")
        with self._restarting:
            self._process.kill()
            self._start(urllib.parse.urlparse(self.client.url).port or self.cfg.port)
            if self._served is not None:
                self._load(*self._served)

    def _start(self, port: int) -> None:
        """Start the child and wait for its health. A child that dies while it starts (killed by the
        OOM killer or an operator, its engine killed, at launch or in a restart) is started again,
        through RESTARTS deaths: faults come close together (the chaos soak killed a resumed run's
        server as it started, then its engine as the next start came up, and a single retry ended
        the run). A child that exits 2 refused its arguments or files, and would again: not retried."""
        healthy = lambda url: InferenceClient(url, self._token, retry_deadline_s=1).health()  # noqa: E731
        for deaths in range(self.RESTARTS + 1):
            self._starts += 1
            try:
                self.client.url = self._process.start(port, healthy, self.cfg.startup_timeout_s)
                return
            except (StartupTimeout, StartupRefused):
                raise
            except ServerUnavailableError as e:  # it died while starting
                if deaths == self.RESTARTS:
                    raise
                self._report_restart(e)

    def is_alive(self) -> bool:
        if self._process is not None and self._process.death_reason():
            return False
        return self.client.health()

    def stop(self) -> None:
        """Stop the child and everything it started; remove the token file and the private weights root."""
        if self._stopped:
            return
        self._stopped = True
        if self._process is not None:
            self._process.stop()
            (self._server_dir / "token").unlink(missing_ok=True)
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> "InferenceServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
