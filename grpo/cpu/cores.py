"""Cores shared by the trainer and a CPU vLLM engine: which cores the engine binds, and who runs how
many threads while a batch is sampled ahead.

On a GPU node sampling and training run on separate hardware and none of this applies. Here both
run on the same few cores. Taken in turn (generate, then train) each side uses all of them. With
sample-ahead on (`grpo.sample_ahead=true`) the engine samples batch k+1 while the trainer trains on
batch k; then they split the cores (`cpu.split_cores`): the engine runs on half of its cores, the
trainer on the rest, and the trainer takes the freed cores back as soon as the batch is in. Two
OpenMP teams at full width on the same cores would each wait at every barrier for the thread that
lost its core to the other.

The engine's thread count for a batch is a function of the batch index only (half when it is
sampled ahead, all otherwise), never of timing: vLLM's CPU kernels round differently with another
thread count, so a resumed run must give a batch the count the uninterrupted run gave it. The
trainer's count does not change its numbers (fp32 forward and backward are bitwise equal on 1 and
2 threads), so timing may decide it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo.provenance import usable_cores


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the Linux CPU list format VLLM_CPU_OMP_THREADS_BIND takes)."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def bind_cores(text: Optional[str]) -> Optional[list[int]]:
    """The cores a bind value names ('0-1', '2,3'), or None for vLLM's other forms ('auto', 'nobind',
    several ranks joined by '|'): those are left to the platform as they are."""
    if not text or not all(part.replace("-", "").isdigit() for part in text.split(",")):
        return None
    return parse_cpu_list(text)


def engine_cores(requested: Optional[str], usable: Optional[list[int]] = None) -> str:
    """The cores a launched CPU engine binds its OpenMP threads to (`cpu.engine_cores`, else chosen):
    with >= 4 usable cores the upper half (the trainer keeps the lower half), with fewer all of them,
    shared with the trainer, since GRPO alternates sampling and training."""
    if requested:
        return requested
    if usable is None:
        usable = usable_cores()
    chosen = usable[len(usable) // 2:] if len(usable) >= 4 else usable
    return ",".join(map(str, chosen))


def shares_cores(engine: Optional[list[int]], trainer: Optional[set[int]] = None) -> bool:
    """Whether a CPU engine bound to `engine` runs on cores this process runs on too."""
    if not engine:
        return False
    trainer = set(os.sched_getaffinity(0)) if trainer is None else trainer
    return bool(set(engine) & trainer)


@dataclass(frozen=True)
class CoreSplit:
    """OpenMP threads of the trainer (this process) and of a CPU engine on the same cores, per phase:
    alone (the other side waits) or overlapped (the engine samples ahead while this trains)."""
    trainer_alone: int
    trainer_overlapped: int
    server_alone: int
    server_overlapped: int


def core_split(layout, world_size: int, trainer_threads: int, trainer_cores: set[int],
               server_cores: Optional[list[int]]) -> Optional[CoreSplit]:
    """How the trainer and a launched CPU engine share cores they both use, or None when they do not
    share any: an engine on a GPU or attached elsewhere (server_cores None), disjoint cores (>= 4
    cores: the engine is bound to the upper half), or several trainer ranks (each rank then holds
    its own threads; there is no single trainer to hand cores back and forth). layout: this rank's
    grpo.layout.DeviceLayout.

    Alone, each side uses all it has; overlapped, the engine gets half of its cores (its first
    threads stay on their bound cores) and the trainer the rest."""
    if not (layout.server_on_cpu and layout.trainer_device == "cpu") or server_cores is None or world_size != 1:
        return None
    if not set(server_cores) & set(trainer_cores) or min(len(server_cores), trainer_threads) < 2:
        return None
    server_overlapped = len(server_cores) // 2
    return CoreSplit(trainer_alone=trainer_threads, trainer_overlapped=max(1, trainer_threads - server_overlapped),
                     server_alone=len(server_cores), server_overlapped=server_overlapped)


class CoreSharing:
    """The split applied: the engine's threads per batch, the trainer's threads per piece of work.

    sampling_ahead(): whether a batch is being sampled ahead right now (train.SampleAhead.busy)."""

    def __init__(self, split: CoreSplit, sampling_ahead: Callable[[], bool]):
        self.split = split
        self.sampling_ahead = sampling_ahead

    def engine_threads(self, sampled_ahead: bool) -> int:
        """The engine's threads for a batch: half when it is sampled ahead, all otherwise."""
        return self.split.server_overlapped if sampled_ahead else self.split.server_alone

    def fit_trainer_threads(self, *_) -> None:
        """This trainer's threads for the next piece of work: what the engine leaves while it samples
        ahead, all once it is done. Called before every forward and right after it (before the
        backward, ~2/3 of the work, so cores freed meanwhile are taken back)."""
        threads = self.split.trainer_overlapped if self.sampling_ahead() else self.split.trainer_alone
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def attach(self, module: torch.nn.Module) -> None:
        """Fit the threads around every forward of `module` (the trainer's loop stays as it is)."""
        module.register_forward_pre_hook(self.fit_trainer_threads)
        module.register_forward_hook(self.fit_trainer_threads)


def on_threads(threads: int, fn, *args):
    """fn(*args) with torch's intra-op threads set to `threads` meanwhile (the caller's other threads
    do no tensor work then: the trainer waits on the push request)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)
