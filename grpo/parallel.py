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

Lost ranks. A rank that dies, hangs or is stopped must not leave the others waiting for that time-out:
`RankWatchdog` (every rank, a heartbeat through the launcher's store) stops the run within
`parallel.heartbeat_timeout_s` (default 60 s) with one line naming the lost rank (docs/faults.md).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ParallelConfig:
    """The `parallel:` section."""

    timeout_s: float = 4 * 3600.0  # a collective may wait this long (rank 0 starting vLLM, evaluating, sampling)
    # a rank silent this long (stopped, hung, its node gone) is lost: every rank stops (RankWatchdog)
    heartbeat_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


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


def die_with_launcher() -> None:
    """Under torchrun: this rank is SIGKILLed when its torchrun agent dies. The agent starts each
    rank in a session of its own, so killing the job's process group (a sweep or a scheduler
    stopping it, `kill -9` of torchrun) reached the agent alone: the ranks ran on as orphans and
    wrote into a run directory the next attempt was resuming. SIGTERM to the agent is unaffected:
    it forwards that to the ranks, which checkpoint and exit. Linux only (prctl)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # re-parented to init: the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(device: torch.device | str = "cpu", timeout_s: float = ParallelConfig.timeout_s,
                     heartbeat_timeout_s: float = ParallelConfig.heartbeat_timeout_s) -> DistInfo:
    """The default process group for `device` (this rank's, from grpo.layout) with the time-out, and
    with several ranks the watchdog that stops this rank when another is lost (RankWatchdog)."""
    die_with_launcher()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        group = dict(backend=process_group_backend(device.type), timeout=datetime.timedelta(seconds=timeout_s),
                     device_id=device if device.type == "cuda" else None)
        if "WORLD_SIZE" in os.environ:  # torchrun (or another env:// launcher) says where the group meets
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(**group)
        else:
            # A process started without a launcher is a world of one: its store lives in the process.
            # Before, it wrote RANK, WORLD_SIZE and a free MASTER_PORT into os.environ, which every child
            # started afterwards inherited: processes a caller started in parallel then met on that one
            # port (EADDRINUSE) or took it for a launcher's.
            dist.init_process_group(**group, store=dist.HashStore(), rank=0, world_size=1)
    global _watchdog
    if _watchdog is None and dist.get_world_size() > 1:
        _watchdog = RankWatchdog(dist.get_rank(), dist.get_world_size(), heartbeat_timeout_s)
        _watchdog.start()
        if threading.current_thread() is threading.main_thread():
            # torchrun SIGTERMs every rank when one fails. Until the run sets its own handler (train.py's
            # StopFlag, after start-up), that signal would end this rank before the watch names the peer.
            signal.signal(signal.SIGTERM, _watchdog.name_the_lost_rank_then_end)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), device)


EXIT_LOST_RANK = 75  # a rank was lost (os.EX_TEMPFAIL: try again later, with --resume)


class RankWatchdog:
    """Stops this rank, in a bounded time, when another rank of the group is lost.

    Every rank's daemon thread bumps its counter in the launcher's store (torchrun's TCPStore, or
    rank 0's without torchrun: MASTER_ADDR:MASTER_PORT) every `interval_s` and reads the others'.
    Another rank is lost when
      - its process has exited: ranks on this host are looked up by pid at every beat (seconds);
      - its counter has not moved for `timeout_s`: stopped (SIGSTOP), hung, or its node gone
        without closing its sockets. A rank busy outside collectives (rank 0 starting vLLM,
        sampling, evaluating) still beats: the thread runs beside the work;
      - or another rank found it lost first (the verdict is shared through the store);
    and the store is lost when it does not answer for `timeout_s` (the launcher is gone).

    The main thread takes the verdict with `claim` when an exception reaches it (gloo fails a
    collective with a dead peer at once): it prints the line and ends the run normally. If it has
    not claimed it within `grace_s` (it waits in a collective that will never return: a stopped
    peer, or NCCL with a dead one, which waits for parallel.timeout_s), this thread prints the line,
    runs the cleanups given to `on_lost` (rank 0: stop the inference server) and exits the process
    with EXIT_LOST_RANK. torchrun then stops the other ranks of its node: SIGTERM, and SIGKILL 30 s
    later (torch 2.13's agent waits that long for the ranks of a failed group, whatever its
    --shutdown-timeout), which also ends a stopped rank."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, store=None) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = min(max(self.timeout_s / 10, 0.2), 2.0)
        self.grace_s = 2 * self.interval_s
        self._store = store
        self._cleanups: list[Callable[[], None]] = []
        self._verdict: Optional[str] = None
        self._found = threading.Event()  # a verdict was reached
        self._claimed = threading.Event()  # the main thread handles the end (or the run is closing)
        self._stopped = threading.Event()
        self._wake = threading.Event()  # beat now, not at the end of the interval
        self._thread = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)

    def start(self) -> None:
        if self._store is None:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=datetime.timedelta(seconds=max(self.interval_s, 5.0)),
                                        wait_for_workers=False)
        self._store.set(f"{_WATCH_KEY}/who/{self.rank}", json.dumps(_this_process()))
        self._thread.start()

    def on_lost(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` before this thread ends the process for a lost rank (never on a normal end)."""
        self._cleanups.append(cleanup)

    def claim(self, wait_s: float) -> Optional[str]:
        """The main thread takes over the end of the run: the verdict (waiting up to wait_s for one),
        or None when no rank is lost. This thread then never ends the process itself."""
        self._claimed.set()
        self._found.wait(wait_s)
        return self._verdict

    def name_the_lost_rank_then_end(self, signum: int, _frame) -> None:
        """A SIGTERM handler for start-up: when a lost peer is why this rank is stopped (torchrun
        stops the others when one dies), print the line naming it within two beats and end the rank
        with EXIT_LOST_RANK; otherwise end as the signal would have."""
        self._wake.set()
        verdict = self.claim(2 * self.interval_s + 1.0)
        if verdict:
            self._end(verdict)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def stop(self) -> None:
        self._claimed.set()
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.grace_s + 5)
        self._store = None  # closes the connection

    # -- the thread
    def _watch(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        beats = [f"{_WATCH_KEY}/beat/{r}" for r in peers]
        seen = {r: (None, time.monotonic()) for r in peers}  # rank -> (its last count, when it last moved)
        who: dict[int, dict] = {}  # rank -> its host and process (_this_process)
        store_ok = time.monotonic()
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopped.is_set():
                return
            now = time.monotonic()
            try:  # a few round trips a beat, whatever the world size
                self._store.add(f"{_WATCH_KEY}/beat/{self.rank}", 1)
                verdict = self._shared_verdict()
                for r in [r for r in peers if r not in who]:  # the first beats only
                    if self._store.check([f"{_WATCH_KEY}/who/{r}"]):
                        who[r] = json.loads(self._store.get(f"{_WATCH_KEY}/who/{r}"))
                if self._store.check(beats):
                    counts = [int(c) for c in self._store.multi_get(beats)]
                else:  # some rank has not beaten yet: one by one (adding 0 reads without waiting)
                    counts = [self._store.add(key, 0) for key in beats]
                store_ok = now
            except Exception as e:  # noqa: BLE001 - the store's errors (DistNetworkError, time-outs) all mean "no answer"
                if now - store_ok <= self.timeout_s:
                    continue
                verdict = (f"lost the launcher's store {self._store.host}:{self._store.port} "
                           f"(no answer for {now - store_ok:.0f} s: {type(e).__name__})")
                counts = []
            for r, count in zip(peers, counts):
                if verdict:
                    break
                if r in who and _same_host(who[r]) and not _alive(who[r]):
                    verdict = f"lost rank {r} (its process {who[r]['pid']} exited)"
                elif count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.timeout_s:
                    verdict = (f"lost rank {r} (no heartbeat for {now - seen[r][1]:.0f} s: stopped, hung or its node "
                               f"unreachable; parallel.heartbeat_timeout_s={self.timeout_s:g})")
            if verdict:
                self._decide(verdict)
                return

    def _shared_verdict(self) -> Optional[str]:
        key = f"{_WATCH_KEY}/lost"
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()

    def _decide(self, verdict: str) -> None:
        self._verdict = verdict
        try:  # every other rank learns it at its next beat, wherever it runs
            self._store.compare_set(f"{_WATCH_KEY}/lost", "", verdict)
        except Exception:  # noqa: BLE001 - the store may be what was lost
            pass
        self._found.set()
        if self._claimed.wait(self.grace_s):
            return  # the main thread ends the run (or it was closing anyway)
        self._end(verdict)

    def _end(self, verdict: str) -> None:
        say(lost_rank_line(self.rank, verdict))
        for cleanup in self._cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - the process ends either way
                say(f"[grpo] rank {self.rank}: cleanup after a lost rank failed: {e}")
        sys.stdout.flush()
        os._exit(EXIT_LOST_RANK)


_WATCH_KEY = "grpo/watchdog"
_watchdog: Optional[RankWatchdog] = None


def say(line: str) -> None:
    """`line` on stderr on a line of its own. Rank 0's progress bar (grpo.metrics) leaves stderr in
    the middle of a line; tqdm.write takes the bar off that line first and draws it again below."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def lost_rank_line(rank: int, verdict: str) -> str:
    return f"[grpo] rank {rank}: {verdict}; stopping (resume with --resume once every rank can run)"


def stop_watchdog() -> None:
    """The run is ending on its own (finished, stopped, failed): peers leaving now are not lost."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def on_lost_rank(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` (e.g. stop the inference server) if this rank ends the process for a lost rank."""
    if _watchdog is not None:
        _watchdog.on_lost(cleanup)


def lost_rank(error: BaseException) -> Optional[str]:
    """Why `error` reached the loop, if a lost rank is the reason: the line to print, else None.

    A collective with a dead peer fails at once (gloo sees the closed connection) while the dead
    rank is found within a beat (same host) or parallel.heartbeat_timeout_s (elsewhere): an error
    raised inside torch.distributed waits up to that long for the verdict, any other error not at all."""
    if _watchdog is None:
        return None
    wait_s = _watchdog.timeout_s + 2 * _watchdog.interval_s if _from_collective(error) else 0.0
    verdict = _watchdog.claim(wait_s)
    return lost_rank_line(_watchdog.rank, verdict) if verdict else None


def _from_collective(error: BaseException) -> bool:
    """Raised inside torch.distributed (a collective, FSDP's gathers, a checkpoint's planning)."""
    tb = error.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return isinstance(error, dist.DistError)


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid_ns": _pid_namespace(), "pid": os.getpid(),
            "start": _start_time(os.getpid())}


def _pid_namespace() -> Optional[int]:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if gone
    or a zombie: with the pid it names one process, never a later one that reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _same_host(who: dict) -> bool:
    return who.get("host") == socket.gethostname() and who.get("pid_ns") == _pid_namespace() and bool(who.get("start"))


def _alive(who: dict) -> bool:
    return _start_time(int(who["pid"])) == who["start"]


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
    stop_watchdog()
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
                activation_checkpointing: bool = False, compile_layers: bool = False,
                compile_backend: str = "inductor") -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head).

    compile_layers: torch.compile each decoder layer before sharding it (torchtitan's order), with
    dynamic shapes, since every micro-batch has its own rows and length: one compiled graph serves
    every layer and every shape. What it fuses is the elementwise work between the matmuls (RMSNorm
    with its fp32 round trip, rotary, SiLU * up, residual adds); the first step pays the
    compilation (docs/benchmarks has the figures). compile_backend is torch.compile's: "inductor"
    (what a run uses); scripts/gpu_check.py --smoke passes "aot_eager" (dynamo's graphs and AOT
    autograd through the FSDP2 hooks, without inductor's C++ code generation, which costs minutes
    on a 2-core CPU).

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
            layer.compile(dynamic=True, backend=compile_backend)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(wrapper, mesh=mesh, mp_policy=dataclasses.replace(mp, cast_forward_inputs=False))
    return wrapper


# optim.grad_sync "auto": reduce-scatter after every micro-batch once the unsharded fp32 gradients
# would take more than this share of a rank's device memory (docs/layouts.md#memory-per-rank).
UNSHARDED_GRADIENTS_SHARE = 0.05


def device_memory_bytes(device: torch.device, ranks_on_node: int = 1) -> int:
    """A rank's memory: its GPU's, or on a CPU the machine's RAM shared by the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(ranks_on_node, 1)


def gradient_sync_plan(setting: str, model: torch.nn.Module, memory_bytes: int) -> tuple[bool, str]:
    """(reduce-scatter the gradients after every micro-batch, why) for optim.grad_sync.

    FSDP2 told to sync at the last micro-batch only (set_requires_gradient_sync) keeps every rank's
    full, unsharded fp32 gradients between micro-batches: 4 bytes per parameter (6 GB at 1.5B, 28 GB
    at 7B), against one reduce-scatter per optimizer step. Syncing after every micro-batch keeps
    only this rank's shard (4 / world_size bytes per parameter) and pays one reduce-scatter per
    micro-batch. "auto" keeps them unsharded while they take at most UNSHARDED_GRADIENTS_SHARE of
    the rank's memory (`memory_bytes`, this rank's figure).

    Every rank must take the same path: a rank that reduce-scatters after every micro-batch beside
    one that waits for the last pairs their collectives wrongly (a hang, or wrong gradients). So
    "auto" decides from the least `memory_bytes` of any rank (one collective: every rank calls this
    with the same setting), and ranks on unlike nodes (an H100 beside an H200) agree."""
    if setting != "auto":
        return setting == "every_micro_batch", f"optim.grad_sync={setting}"
    memory_bytes = least_over_ranks(memory_bytes)
    unsharded = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # DTensor numel: the full size
    every = unsharded > UNSHARDED_GRADIENTS_SHARE * memory_bytes
    return every, (f"optim.grad_sync=auto: unsharded fp32 gradients {unsharded / 2**30:.2f} GiB "
                   f"{'>' if every else '<='} {UNSHARDED_GRADIENTS_SHARE:.0%} of {memory_bytes / 2**30:.0f} GiB")


def all_reduce_sum(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum a dict of scalars over ranks in one collective."""
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def least_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (collective; the value itself without a process group)."""
    t = torch.tensor([int(value)], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


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


class HostStaging:
    """A host buffer, page-locked where an accelerator is present, that every push's gather copies
    into and that lives as long as the run: each weight leaves the GPU by one asynchronous copy
    into its slice (one synchronisation per push), instead of a synchronous copy into fresh
    pageable memory per tensor. On an H200 the gather of Qwen2.5-0.5B in bf16 took 0.77 s that
    way and 0.02 s into a reused page-locked buffer (docs/benchmarks/gpu-h200.md). Page-locking is
    paid once (about 0.5 s per GB), at the first push, and the buffer grows if a later push needs
    more. The tensors a gather returns are views of the buffer: valid until the next gather."""

    def __init__(self, pin: Optional[bool] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffer: Optional[torch.Tensor] = None  # uint8, reused by every gather

    def reserve(self, nbytes: int) -> None:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old one goes first: two at once would double the host memory
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)


def _aligned(n: int) -> int:
    return -(-n // 64) * 64  # each tensor's slice 64-byte aligned, as the allocators give it


def gather_full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None,
                           staging: Optional[HostStaging] = None) -> dict[str, torch.Tensor]:
    """The whole model for rank 0 (other ranks get {}), for weight pushes.

    Collective. One tensor at a time: a shard that has to move (all-gathered across ranks, or
    copied off an accelerator) is cast to `dtype` ON ITS DEVICE first, so a bf16 push moves half
    the bytes of the fp32 master weights, and rank 0 gets the full tensor on CPU. A tensor that
    does not move (one CPU rank) is returned as it is, a view of the parameter: casting it here
    would only fill a fresh buffer (page faults cost more than the cast) that the writer copies
    again, so write_weights casts it while writing. Tied parameters (lm_head = embed_tokens) are
    gathered once and appear under both names.

    staging: tensors that come off an accelerator land in this reused (page-locked) host buffer
    by asynchronous copies, one synchronisation at the end (HostStaging); they are then views of
    it, valid until the next gather with the same staging."""
    from torch.distributed.tensor import DTensor

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}  # every rank skips the same tied duplicates (a skipped gather would hang)
    params = model.state_dict(keep_vars=True)
    plan = {}  # name -> (moves, cast)
    for name, param in params.items():
        if id(param) not in first_name:
            first_name[id(param)] = name
            moves = param.device.type != "cpu" or (isinstance(param, DTensor) and param.device_mesh.size() > 1)
            plan[name] = (moves, moves and dtype is not None and param.is_floating_point())
    staged = staging is not None and is_main and any(param.device.type != "cpu" for param in params.values())
    if staged:
        staging.reserve(sum(_aligned(params[n].numel() * (dtype if cast else params[n].dtype).itemsize)
                            for n, (moves, cast) in plan.items() if params[n].device.type != "cpu"))
    offset, copied = 0, False
    for name, param in params.items():
        if name not in plan:
            if is_main:
                out[name] = out[first_name[id(param)]]
            continue
        moves, cast = plan[name]
        local = param.detach()
        if cast:
            local = local.to(dtype)
        full = local.full_tensor() if isinstance(local, DTensor) else local
        if is_main:
            if staged and full.device.type != "cpu":
                host = staging.view(offset, full.shape, full.dtype)
                host.copy_(full, non_blocking=True)
                offset += _aligned(host.numel() * host.element_size())
                out[name], copied = host, True
            else:
                out[name] = full.cpu()
        del full
    if copied:
        torch.cuda.synchronize()  # every asynchronous copy has landed before the writer reads
    return out


def on_main_rank(is_main: bool, work, stops: Optional[dict] = None):
    """work() on rank 0 and its (JSON) result on every rank (collective). An error of a kind that
    ends the run where it happens, a full disk and the kinds in `stops` ({raised on rank 0: raised on
    every rank}), stops every rank alike, with its one line, rather than leaving the others waiting
    for rank 0."""
    from grpo.fsutil import NoSpaceError

    kinds = {NoSpaceError: NoSpaceError, **(stops or {})}
    outcome = None
    if is_main:
        try:
            outcome = {"result": work()}
        except tuple(kinds) as e:
            outcome = {"stopped": [next(i for i, kind in enumerate(kinds) if isinstance(e, kind)), str(e)]}
    outcome = broadcast_json(outcome)
    if "stopped" in outcome:
        which, line = outcome["stopped"]
        raise list(kinds.values())[which](line)
    return outcome["result"]
