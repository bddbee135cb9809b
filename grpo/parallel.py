"""Distributed set-up and FSDP2 sharding, applied to a plain HF model from outside.

torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; a plain `python train.py` runs as a world of one. gloo
on CPU, NCCL on GPU. Multi-node: the same code under torchrun's rendezvous, e.g.
`torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py ...`,
with the inference server reached over HTTP (server.url).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (Llama/Qwen2/Mistral style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model: cannot find decoder layers (model.model.layers) in {type(model).__name__}")
    return list(layers)


def shard_model(wrapper: torch.nn.Module, lm: torch.nn.Module, param_dtype: torch.dtype | None,
                activation_checkpointing: bool = False) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head).

    param_dtype=bf16 gives the usual mixed precision (bf16 compute, fp32 master weights and fp32
    gradient reduction); None keeps fp32 compute (the CPU default)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    for layer in decoder_layers(lm):
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(layer)
        fully_shard(layer, mp_policy=mp)
    fully_shard(wrapper, mp_policy=mp)
    return wrapper


def all_reduce_sum(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum a dict of scalars over ranks in one collective."""
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: int | float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def broadcast_json(obj, src: int = 0):
    """Send a JSON-able object from `src` to every rank (rollouts, decisions)."""
    # JSON bytes in a tensor rather than broadcast_object_list: no pickle crosses process borders.
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    import json

    payload = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return json.loads(bytes(buf.tolist()) if dist.get_rank() != src else payload)


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU (other ranks get {}), for weight pushes and exports.

    Collective. Tied embeddings come back as separate tensors, so safetensors can save them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
