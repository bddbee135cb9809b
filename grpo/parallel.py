"""Distributed set-up and FSDP2 sharding, applied to a plain HF model from outside.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR; a plain `python train.py` runs as a world of
one. Which device a rank trains on is grpo.layout's decision; this module makes the process group
for it. Multi-node: the same code under torchrun's rendezvous, e.g.
`torchrun --nnodes=2 --nproc_per_node=7 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py ...`.

Collectives. On GPU the process group is "cpu:gloo,cuda:nccl": NCCL moves the model's CUDA
tensors (FSDP2's all-gathers and reduce-scatters), gloo the small CPU tensors of the loop's own
collectives (rollout broadcast, denominators, flags), so no helper has to know the group's device.
The helpers run their collective whenever a group exists, even with one rank, so a 1-rank run
takes the same path as 8 ranks (NCCL refuses a CPU tensor on 1 rank as on 8).

Time-outs. Ranks 1..n wait in a collective while rank 0 starts vLLM (minutes of compilation and
CUDA graphs), evaluates (GSM8K test x K=50) and samples; NCCL's default of 10 minutes would abort
the run, so the group's time-out is `parallel.timeout_s` (default 4 hours).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ParallelConfig:
    """The `parallel:` section."""

    timeout_s: float = 4 * 3600.0  # a collective may wait this long (rank 0 starting vLLM, evaluating, sampling)

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun tells this process (defaults: a world of one)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


def launch_env(env: dict | None = None) -> LaunchEnv:
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    return LaunchEnv(rank=int(env.get("RANK", "0")), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                     node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))))


def process_group_backend(device_type: str) -> str:
    """The one decision of which backend carries which tensors: gloo for CPU tensors always (the
    loop's small collectives), NCCL for CUDA tensors on GPU (the model's)."""
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"device: no process group backend for device type {device_type!r}")


def init_distributed(device: torch.device | str = "cpu", timeout_s: float = ParallelConfig.timeout_s) -> DistInfo:
    """The default process group for `device` (this rank's, from grpo.layout) with the time-out."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend(device.type),
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), device)


# The one mesh per device type that FSDP2 shards on, made here so that close_distributed can free it.
_meshes: dict[str, DeviceMesh] = {}


def training_mesh(device_type: str) -> DeviceMesh:
    """The 1-D mesh over every rank on this rank's device type (grpo.layout's decision: fully_shard's
    own default mesh takes whichever accelerator the machine has, even for a CPU trainer)."""
    if device_type not in _meshes:
        _meshes[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _meshes[device_type]


GROUP_STILL_REFERENCED = ("the process group is still referenced after destroy_process_group (a sharded "
                          "model still alive?): its threads are torn down at interpreter exit")


def close_distributed() -> bool:
    """Destroy the process group and free it now, while Python still runs; True if it was freed.

    Call it after the sharded models and their optimizer are released: FSDP2 keeps the group in
    each model's state, and the mesh keeps it in its `_pg_registry` for the life of the process
    (DTensor's sharding caches hold the mesh). destroy_process_group alone left gloo's threads
    running until exit, where tearing them down aborted ~1 in 25 finished 2-rank runs ("terminate
    called without an active exception", exit -6)."""
    if not dist.is_initialized():
        return True
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    for mesh in _meshes.values():
        getattr(mesh, "_pg_registry", {}).clear()
    _meshes.clear()
    gc.collect()  # models live in reference cycles (module hooks): collect them now, not at exit
    if group() is not None:
        warnings.warn(GROUP_STILL_REFERENCED)
        return False
    return True


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (Llama/Qwen2/Mistral style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model: cannot find decoder layers (model.model.layers) in {type(model).__name__}")
    return list(layers)


def shard_model(wrapper: torch.nn.Module, lm: torch.nn.Module, param_dtype: torch.dtype | None,
                activation_checkpointing: bool = False, compile_layers: bool = False) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head).

    compile_layers: torch.compile each decoder layer before sharding it (torchtitan's order), with
    dynamic shapes, since every micro-batch has its own rows and length: one compiled graph serves
    every layer and every shape. What it fuses is the elementwise work between the matmuls (RMSNorm
    with its fp32 round trip, rotary, SiLU * up, residual adds); the first step pays the
    compilation (docs/benchmarks has the figures).

    param_dtype=bf16 gives the usual mixed precision (bf16 compute, fp32 master weights and fp32
    gradient reduction); None keeps fp32 compute (CPUs without native bf16).

    The root does not cast its forward's inputs to param_dtype (FSDP2's default does): they
    include the objective's per-token fp32 tensors (the log-probs of alpha, pi_k and pi_ref, the
    advantages and weights; grpo.policy.ObjectiveInputs), which bf16 rounds by up to 0.03 nat at
    log-probs of -4 to -8: every ratio, IS weight and KL estimate was off by that much, and KL at
    pi = pi_ref was 5e-5 instead of 0. The decoder layers still cast theirs (hidden states)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    mesh = training_mesh(next(lm.parameters()).device.type)
    for layer in decoder_layers(lm):
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(layer)
        if compile_layers:
            layer.compile(dynamic=True)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(wrapper, mesh=mesh, mp_policy=dataclasses.replace(mp, cast_forward_inputs=False))
    return wrapper


def all_reduce_sum(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum a dict of scalars over ranks in one collective."""
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: int | float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def broadcast_json(obj, src: int = 0):
    """Send a JSON-able object from `src` to every rank (rollouts, decisions).

    JSON bytes in a uint8 tensor rather than broadcast_object_list: no pickle crosses process
    borders. Decoded from the tensor's memory (numpy view), never through a Python list of ints,
    which costs seconds and gigabytes for a DeepScaleR batch of tens of MB."""
    if not dist.is_initialized():
        return obj
    payload = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    if dist.get_rank() == src:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=src)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=src)
        payload = buf.numpy().tobytes()
    return json.loads(payload)  # the source decodes too: every rank holds the same plain object


def gather_full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model for rank 0 (other ranks get {}), for weight pushes.

    Collective. One tensor at a time: a shard that has to move (all-gathered across ranks, or
    copied off an accelerator) is cast to `dtype` ON ITS DEVICE first, so a bf16 push moves half
    the bytes of the fp32 master weights, and rank 0 gets the full tensor on CPU. A tensor that
    does not move (one CPU rank) is returned as it is, a view of the parameter: casting it here
    would only fill a fresh buffer (page faults cost more than the cast) that the writer copies
    again, so write_weights casts it while writing. Tied parameters (lm_head = embed_tokens) are
    gathered once and appear under both names."""
    from torch.distributed.tensor import DTensor

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}  # every rank skips the same tied duplicates (a skipped gather would hang)
    for name, param in model.state_dict(keep_vars=True).items():
        if id(param) in first_name:
            if is_main:
                out[name] = out[first_name[id(param)]]
            continue
        first_name[id(param)] = name
        local = param.detach()
        moves = local.device.type != "cpu" or (isinstance(local, DTensor) and local.device_mesh.size() > 1)
        if moves and dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        full = local.full_tensor() if isinstance(local, DTensor) else local
        if is_main:
            out[name] = full.cpu()
        del full
    return out


def on_main_rank(is_main: bool, work):
    """work() on rank 0 and its (JSON) result on every rank (collective); a full disk there stops
    every rank alike, rather than leaving the others waiting for rank 0."""
    from grpo.fsutil import NoSpaceError

    outcome = None
    if is_main:
        try:
            outcome = {"result": work()}
        except NoSpaceError as e:
            outcome = {"no_space": str(e)}
    outcome = broadcast_json(outcome)
    if "no_space" in outcome:
        raise NoSpaceError(outcome["no_space"])
    return outcome["result"]
