"""vLLM's engine with the model in the engine-core process, tied to the server that started it.

    python -m grpo.server ...     (the server always runs its engine this way, on CPU and GPU)

vLLM forces its multiprocess executor on CPU ("uni" is rewritten to "mp": OpenMP binding is set
through the worker's environment). There every decode step goes engine core -> shared-memory
queue -> worker process -> queue -> engine core, and both readers poll: on the 2-core AMX machine
the hop cost 8-18% of a decode step (SmolLM2 bf16, 128 fixed steps through the server, inverse-CDF
sampler: 64 sequences 71 -> 65 ms, 16 sequences 37.9 -> 31.1 ms), and the polling took a core the
trainer was meant to have (the engine core used 11.2 CPU-s of a 13.4 s one-thread batch) unless
the readers were made to nap, which lost wake-ups (the napping executor this replaces).
Running the worker inside the engine core (vLLM's single-process executor, named by class so the
platform keeps it) removes the hop and the queues with it. What the multiprocess executor did
through the environment is done here directly: the process is restricted to the cores of
VLLM_CPU_OMP_THREADS_BIND and torch runs one OpenMP thread per core.

It also ties the engine-core process to the server that started it (on GPU too, where the model
already ran in the engine core): vLLM's engine core outlived a server killed during the engine's
start-up, holding its cores and memory, and only the supervisor's process-group kill caught it.

Loaded by name (vLLM's --distributed-executor-backend), in the engine-core process.
"""
import os
from typing import Optional

from vllm.platforms import current_platform
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from grpo.layout import parse_cpu_list
from grpo.supervisor import SERVER_PID_ENV, die_with_parent

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# what grpo.server passes as --distributed-executor-backend, on CPU and on its one GPU alike
EXECUTOR = "grpo.vllm_executor.InProcessExecutor"


def bind_cores(text: Optional[str]) -> Optional[list[int]]:
    """The cores a bind value names ('0-1', '2,3'), or None for vLLM's other forms ('auto', 'nobind',
    several ranks joined by '|'): those are left to the platform as they are."""
    if not text or not all(part.replace("-", "").isdigit() for part in text.split(",")):
        return None
    return parse_cpu_list(text)


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


class InProcessExecutor(UniProcExecutor):
    def _init_executor(self) -> None:
        if os.environ.get(SERVER_PID_ENV):  # first: the model load that follows takes the longest
            die_with_parent(int(os.environ[SERVER_PID_ENV]))
        cores = bind_cores(os.environ.get(BIND_ENV)) if current_platform.is_cpu() else None
        if cores:
            restrict_process(cores)
        super()._init_executor()
