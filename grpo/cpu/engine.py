"""Inside a CPU vLLM engine: the model in the engine-core process, bound to its cores, with the
methods a CPU engine adds to vLLM's worker.

vLLM forces its multiprocess executor on CPU ("uni" is rewritten to "mp": OpenMP binding is set
through the worker's environment). There every decode step goes engine core -> shared-memory queue
-> worker process -> queue -> engine core, both readers poll, and the polling takes a core the
trainer was meant to have. `InProcessExecutor` (vLLM's single-process executor, passed by class
name so the platform keeps it; `cpu.engine_executor: in_process`, the default) runs the worker in
the engine core and does directly what the multiprocess executor did through the environment: the
process is restricted to the cores of VLLM_CPU_OMP_THREADS_BIND and torch runs one OpenMP thread
per core. GPU engines keep the executor vLLM chooses.

The engine core is forked from the server, as vLLM starts it on a GPU (`fork_engine_core`).

The methods a CPU engine adds to vLLM's worker are in grpo/cpu/worker.py.
"""
import multiprocessing
import os

from vllm.platforms import current_platform
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from grpo.cpu.cores import bind_cores

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# what grpo.serving.server passes as --distributed-executor-backend to a CPU engine
EXECUTOR = "grpo.cpu.engine.InProcessExecutor"


def restrict_process(cores: list[int]) -> None:
    """Every thread of this process (those already started: the engine's socket threads) and all it
    starts later (the OpenMP team) run on `cores`, with one OpenMP thread per core."""
    import torch

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(cores))  # before the CPU worker makes set_num_threads a no-op


def locks_leave_no_file() -> None:
    """A lock made with multiprocessing's default context (vLLM's executor lock, tqdm's write lock
    when the weights load) is a named POSIX semaphore, a file in /dev/shm, when that context spawns,
    as it does in the spawned engine core: the file goes when the process or its resource tracker
    unlinks it, and a SIGKILL of the whole tree takes both (the chaos soak found 14). Under the fork
    context a lock's name is unlinked as soon as it is made. Nothing in this process hands a
    default-context lock to a spawned one: vLLM starts its processes from get_mp_context's own."""
    multiprocessing.set_start_method("fork", force=True)


def fork_engine_core() -> None:
    """Start the engine-core process by fork, not spawn. vLLM's CPU platform makes every engine
    process spawn (it sets VLLM_WORKER_MULTIPROC_METHOD as the engine's config is made) because its
    multiprocess executor binds OpenMP through the environment a fresh process reads at start-up.
    The in-process executor binds its cores itself, in the running process (restrict_process), so the
    engine core can be forked from the server as on a GPU, where vLLM forks it too. A spawned one
    imported vLLM and torch again: ~10 s of CPU and ~13 s of every server start on two cores.
    The server runs no torch computation before the fork: an OpenMP team does not survive one."""
    from vllm.platforms.cpu import CpuPlatform

    made = CpuPlatform.check_and_update_config.__func__
    if getattr(made, "forks_engine_core", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        made(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config.forks_engine_core = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


class InProcessExecutor(UniProcExecutor):
    def _init_executor(self) -> None:
        locks_leave_no_file()  # before vLLM's executor makes its lock
        cores = bind_cores(os.environ.get(BIND_ENV)) if current_platform.is_cpu() else None
        if cores:
            restrict_process(cores)
        super()._init_executor()

