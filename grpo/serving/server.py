"""The inference server: a real vLLM engine serving alpha, with weight pushes from the trainer.

    python -m grpo.serving.server --model DIR --weights-root DIR --token-file FILE [--port 0 --port-file F]

It is vLLM's own OpenAI app (so /v1/completions, /v1/models, ... behave exactly as in `vllm
serve`, for standard clients and evaluation tools), with our routes (grpo/serving/routes.py) and
two middlewares (grpo/serving/gate.py) added.

Log-probs: the engine runs with logprobs_mode="processed_logprobs", so each sampled token's
log-prob is taken from the distribution it was actually sampled from (logits / temperature,
then top-k/top-p renormalised): log alpha(o_t | q, o_<t) of the objective. With temperature 0
(greedy) it is the plain log-softmax of the logits. The LM head runs in fp32 (`--head-dtype`,
vLLM's hf_overrides head_dtype, ModelConfig.head_dtype): the trainer's logits are fp32, and a bf16
logit's rounding (0.125 at |z| ~ 16-32) becomes ~0.6 nat after the paper's T = 0.1. On a GPU vLLM
accumulates the head's GEMM in fp32 (torch.mm with out_dtype); on a CPU it multiplies fp32 copies.

Security: binds 127.0.0.1 unless told otherwise; every route except the two open GETs and
vLLM's /health needs `Authorization: Bearer <token>` (the token comes from a 0600 file or the
GRPO_SERVER_TOKEN variable, is removed from the environment before the engine starts and is
never logged); vLLM's development routes are never registered (VLLM_SERVER_DEV_MODE is unset);
weights load only from directories under --weights-root that pass grpo/serving/weights_check.py.

Consistency: a push takes a write lock that waits for in-flight requests and holds new ones
back (they wait, they do not fail), so every completion comes from one weights_version
(grpo/serving/engine_weights.py); each completion's version_spans say so, from the engine's own
stamps. A generate that asks for in-flight updates is the exception: a push that keeps requests
swaps the weights under it, and its completions' version_spans say which version sampled which
token.

No orphans: every process vLLM starts for its engine (the engine core, tensor-parallel workers),
by fork or by spawn, whichever executor vLLM picks, dies with this server (`engine_processes_die_with_server`).
"""
import argparse
import asyncio
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from grpo.fsutil import own_temp_dir
from grpo.serving.supervisor import REFUSED_EXIT, SERVER_PID_ENV, die_with_parent

TOKEN_ENV = "GRPO_SERVER_TOKEN"


_forking = [0]  # the pid of the process about to fork, recorded before the fork
_hooks = [False]  # whether this process's at-fork hooks are registered (a forked child inherits them)


def engine_processes_die_with_server() -> None:
    """Tie every process this server's engine starts to this server, whatever executor vLLM picks.

    vLLM starts its engine core (and, with tensor parallelism, one worker per GPU) with
    multiprocessing, by fork or by spawn. A forked child runs the at-fork hooks registered here (and
    inherits them, for its own children); a spawned child imports the server's main module (this
    one, as __mp_main__), where `_in_engine_process` below runs and registers them again. Either way
    the child dies with the process that started it (PR_SET_PDEATHSIG plus a watchdog on that pid,
    or at once if it is already gone): the engine core with the server, a tensor-parallel worker with
    the engine core. The parent's pid is the one the parent recorded itself (before the fork; in
    SERVER_PID_ENV for spawn), never the child's getppid(), which is init's once the parent died."""
    os.environ[SERVER_PID_ENV] = str(os.getpid())  # what a spawned child ties itself to
    if not _hooks[0]:
        _hooks[0] = True
        os.register_at_fork(before=lambda: _forking.__setitem__(0, os.getpid()),
                            after_in_child=lambda: _tie_to(_forking[0]))


# An engine process whose server is gone has nothing to finish; its SIGTERM can go unanswered while it
# still starts (vLLM's handler only asks its busy loop to stop), and it held cores and memory for the
# watchdog's whole grace (30 s) when its server was killed during start-up on a loaded machine.
ENGINE_TERM_GRACE_S = 5.0


def _tie_to(parent_pid: int) -> None:
    try:
        die_with_parent(parent_pid, grace_s=ENGINE_TERM_GRACE_S)
    except SystemExit:  # the parent died before this child got here: leave no orphan
        os._exit(1)
    engine_processes_die_with_server()  # and this process's own children die with it


def _in_engine_process() -> None:
    """Run at import: in a process spawned for this server's engine, tie it to its spawner."""
    pid = os.environ.get(SERVER_PID_ENV)  # set by a server (or an engine process) for its children
    if pid and int(pid) != os.getpid():
        _tie_to(int(pid))


_in_engine_process()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grpo.serving.server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory served at version 0")
    p.add_argument("--weights-root", required=True, help="pushed weights load only from under here")
    p.add_argument("--token-file", help=f"file (mode 0600) holding the bearer token; else ${TOKEN_ENV}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (written to --port-file)")
    p.add_argument("--port-file", help="the bound port is written here once the socket is bound")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--head-dtype", choices=["float32", "model"], default="float32",
                   help="the LM head's dtype: float32 logits as the trainer computes them, or the model's dtype")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds kill the CPU engine)")
    p.add_argument("--served-model-name", help="name for /v1 clients (default: the model path)")
    p.add_argument("--keep-last", type=int, default=2, help="uploaded weight dirs kept (bytes mode)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the trainer) is gone")
    p.add_argument("--upload-timeout-s", type=float, default=600.0, help="an upload's body must arrive within this")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of one tensor-parallel engine")
    p.add_argument("--cpu-sampler", choices=["inverse_cdf", "vllm"], default="inverse_cdf",
                   help="CPU engine: draw tokens by inverse CDF (grpo/cpu/sampler.py) or with vLLM's Gumbel sampler")
    p.add_argument("--cpu-executor", choices=["in_process", "vllm"], default="in_process",
                   help="CPU engine: the model in the engine-core process (grpo/cpu/engine.py) or vLLM's choice")
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


def vllm_args(ns: argparse.Namespace, port: int, on_cpu: bool) -> argparse.Namespace:
    """vLLM's own serve arguments for this server. On GPU vLLM chooses its executor (one GPU: the
    model in the engine core; tensor parallelism: a worker process per GPU); on CPU the fence's
    in-process executor (grpo/cpu/engine.py) unless --cpu-executor vllm."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", ns.model, "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
            "--seed", str(ns.seed), "--gpu-memory-utilization", str(ns.gpu_memory_utilization),
            "--tensor-parallel-size", str(ns.tensor_parallel_size),
            "--logprobs-mode", "processed_logprobs", "--hf-overrides", json.dumps({"head_dtype": ns.head_dtype}),
            "--host", ns.host, "--port", str(port),
            "--worker-extension-cls", "grpo.serving.worker_ext.GRPOWorkerExtension",
            "--disable-uvicorn-access-log"]
    if ns.served_model_name:
        argv += ["--served-model-name", ns.served_model_name]
    if ns.trust_remote_code:
        argv += ["--trust-remote-code"]
    if ns.enforce_eager:
        argv += ["--enforce-eager"]
    argv += engine_executor_args(on_cpu, ns.cpu_executor)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def engine_executor_args(on_cpu: bool, cpu_executor: str = "in_process") -> list[str]:
    """The executor vLLM is told to use: none on GPU (vLLM chooses), the in-process one on CPU."""
    if on_cpu and cpu_executor == "in_process":
        from grpo.cpu.engine import EXECUTOR

        return ["--distributed-executor-backend", EXECUTOR]
    return []


ENGINE_DIED_EXIT = 3  # the server's exit code when its engine died under it
ENGINE_PROCESS_NAME = "VLLM::EngineCore"  # the title vLLM gives its engine-core process


class EngineProcessWatch:
    """From before the engine starts: once an engine-core process of this server exists, its death
    ends the server. vLLM's own death flag (exit_when_the_engine_dies, below) exists only once its
    client is built, and a call that client makes to the engine while it is being built
    (reset_mm_cache) waits for ever on a dead one: vLLM 0.32 resolves no utility call in flight when
    its engine dies. The chaos soak's server, its engine killed right after it came up, hung there
    until the trainer's start-up time-out (300 s), and the run ended. `dead()` is also asked as a
    request fails (gate.EngineDeathIs503): the process's end is known before vLLM's flag says so."""

    def __init__(self, poll_s: float = 0.5) -> None:
        import psutil

        self.poll_s = poll_s
        self._me = psutil.Process()
        self._engines: list = []  # the engine-core processes seen so far
        self._lock = threading.Lock()  # the watch thread and the request handlers both look

    def dead(self) -> Optional[str]:
        """Why the engine is dead ("engine-core process 123 exited"), or None while every one seen runs."""
        import psutil

        with self._lock:
            for child in self._me.children():
                try:
                    if child.name() == ENGINE_PROCESS_NAME and child not in self._engines:
                        self._engines.append(child)
                except psutil.Error:
                    continue
            for p in self._engines:
                try:
                    gone = not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    gone = True
                if gone:
                    return f"engine-core process {p.pid} exited"
        return None

    def start(self) -> "EngineProcessWatch":
        def watch() -> None:
            while not self.dead():
                time.sleep(self.poll_s)
            print("[grpo.server] the vLLM engine died: exiting so that the trainer restarts this server",
                  file=sys.stderr, flush=True)
            os._exit(ENGINE_DIED_EXIT)

        threading.Thread(target=watch, name="engine-process-watch", daemon=True).start()
        return self


async def exit_when_the_engine_dies(engine, poll_s: float = 0.5) -> None:
    """A server whose vLLM engine died (killed, OOM, a crash in a kernel) cannot serve again, but its
    HTTP side would go on answering 503 "engine is dead": its supervisor would wait for health until
    server.startup_timeout_s, or a request would retry until its deadline. End the process instead,
    so the trainer sees a dead server at once and restarts it."""
    while not engine.errored:
        await asyncio.sleep(poll_s)
    print("[grpo.server] the vLLM engine died: exiting so that the trainer restarts this server",
          file=sys.stderr, flush=True)
    os._exit(ENGINE_DIED_EXIT)  # nothing left to shut down gracefully: the engine is gone


async def serve(ns: argparse.Namespace, token: str) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import create_server_socket, serve_http
    from vllm.platforms import current_platform
    from vllm.utils.gc_utils import freeze_gc_heap

    from grpo.cpu.serving import EngineControl
    from grpo.serving.engine_weights import WeightsState, serving_dtype_name
    from grpo.serving.gate import BearerAuth, EngineDeathIs503, GateRequests, Guarded
    from grpo.serving.routes import Routes

    # Bind first: the port is known (and reserved) before the minute-long engine start-up.
    sock = create_server_socket((ns.host, ns.port), reuse_port=False)
    port = sock.getsockname()[1]
    if ns.port_file:
        tmp = ns.port_file + ".tmp"
        Path(tmp).write_text(f"{port}\n")
        os.replace(tmp, ns.port_file)
    on_cpu = current_platform.is_cpu()
    args = vllm_args(ns, port, on_cpu)
    if on_cpu and ns.cpu_executor == "in_process":
        from grpo.cpu.engine import fork_engine_core

        fork_engine_core()
    root = Path(ns.weights_root)  # checked by main()
    processes = EngineProcessWatch().start()
    async with build_async_engine_client(args) as engine:
        # held for the life of serve(): the event loop keeps only weak references to tasks
        watch = asyncio.create_task(exit_when_the_engine_dies(engine))  # noqa: F841
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        # Start-up objects out of the collector's reach, in the workers and here (vLLM freezes only its
        # engine-core process): a full collection would scan them all, mid-push and mid-batch.
        heap = (await engine.collective_rpc("grpo_freeze_heap"))[0]
        freeze_gc_heap()
        print(f"[grpo.server] engine worker started by {heap['started_by']}; heap frozen ({heap['frozen']} objects): "
              f"a full garbage collection took {heap['full_collection_s']:.3f} s, now "
              f"{heap['full_collection_frozen_s']:.3f} s", flush=True)
        control = await EngineControl.start(engine, on_cpu, ns.cpu_sampler)  # the CPU fence's hook (GPU: nothing)
        print(f"[grpo.server] sampler: {control.sampler}; LM head in {engine.model_config.head_dtype}", flush=True)
        state = WeightsState(engine, Path(ns.model).resolve(), root, ns.keep_last,
                             dtype=serving_dtype_name(engine.model_config.dtype), control=control)
        await state.label_version()  # the tokens sampled from the model directory are version 0's
        routes = Routes(state, engine.model_config.get_vocab_size(), engine.model_config.max_model_len,
                        ns.upload_timeout_s)
        app.include_router(routes.router())
        def engine_died() -> Optional[str]:
            return "vLLM reports it dead" if engine.errored else processes.dead()

        guarded = Guarded(app, BearerAuth(GateRequests(EngineDeathIs503(app, engine_died), state.gate), token))
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
    from grpo.serving.weights_check import check_weights_root
    from grpo.serving.weights_dir import WeightPushError

    die_with_parent(ns.parent_pid)
    engine_processes_die_with_server()

    try:  # before the engine starts: a root someone else could write to is refused in one line
        check_weights_root(ns.weights_root)
    except WeightPushError as e:
        print(f"[grpo.server] {e}", file=sys.stderr)
        sys.exit(REFUSED_EXIT)
    import uvloop

    uvloop.run(serve(ns, token))


if __name__ == "__main__":
    with own_temp_dir():  # the engine's sockets and files: reclaimed after a kill (a trainer's server uses the trainer's)
        main()
