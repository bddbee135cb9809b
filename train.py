"""Iterative GRPO with verifiable rewards, on- and off-policy: Algorithm 1 of Mroueh et al. (2505.22257).

    torchrun --nproc_per_node=N train.py --config configs/cpu_demo.yaml [grpo.v=10 optim.lr=1e-6 ...] [--resume]

for stage s < S:                                   (the reference policy is refreshed after each)
  for iteration k < M:
    if k mod v == 0: push pi_theta to the inference server     (alpha <- pi_theta; v > 1 is off-policy)
    sample a batch of prompts, G completions per prompt from alpha, with alpha's log-probs
    rewards, group advantages (eq. 2), zero-variance mask (eq. 8)
    for i SGD iterations: forward, objective (eq. 6/7), backward, optimizer step
  pi_ref <- pi_theta

Rank 0 talks to the server and scores; the batch is broadcast and every rank trains on its share
(FSDP2). `main` at the bottom is the loop; the functions above it are its steps, and `setup`
builds everything they use. The instruments (the registered per-pass and per-batch statistics, the
staleness split and parity probe among them, and recording: grpo/instruments.py) are called at the
loop's points, as the checkpointer is; they measure, never steer. One SGD step reads a `Trainer`
(the state it needs); `Run` is one with the loop's services around it, and the scripts and tests
that take the trainer's step make theirs with the same class.
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from grpo import metrics, preflight, provenance
from grpo.batch_source import AsyncBatches, batch_index, make_batch_source
from grpo.batching import (MicroBatch, collate, collate_groups, equalize_micro_batches, group_row_length,
                           group_rows, plan_micro_batches)
from grpo.checkpoint import CheckpointError, Checkpointer, check_shared_directory, export_hf
from grpo.config import ConfigError, load_config, save_config, to_dict
from grpo.cpu import tune_trainer
from grpo.cpu.bf16 import multiplies_bf16
from grpo.data import DataError, PromptSampler, build_prompt, load_problems, make_sampler
from grpo.evaluation import evaluate
from grpo.fsutil import NoSpaceError, own_temp_dir
from grpo.instruments import Instruments
from grpo.kernel_dispatch import check_objective_path
from grpo.layout import LayoutError, overlap_is_free, plan_layout, training_dtype, visible_gpus
from grpo.metrics import MetricsLogger
from grpo.models import ModelPathError, load_model, load_tokenizer, resolve_model_path
from grpo.objective import (all_reduce_stats, contributing, finalize_stats, local_denominators, logged_stats,
                            merge_stats, token_weights)
from grpo.optim import build_optimizer, build_scheduler
from grpo.parallel import (EXIT_LOST_RANK, DistInfo, HostStaging, all_reduce_max, all_reduce_sum, broadcast_json,
                           close_distributed, device_memory_bytes, gather_full_state_dict, gradient_sync_plan,
                           init_distributed, launch_env, lost_rank, on_lost_rank, on_main_rank, say, shard_model,
                           stop_watchdog)
from grpo.policy import ObjectiveInputs, Policy, copy_policy
from grpo.progress import Progress
from grpo.push_policy import PushSchedule
from grpo.recording import RecordedStream, ReplayError, model_and_tokenizer, weights_fingerprint
from grpo.rewards import RewardError, RewardScorer
from grpo.rollout import Rollout, shard_samples
from grpo.serving.client import AttachError
from grpo.serving.fleet import ServerFleet
from grpo.serving.inference import check_context_fits, serving_dtype
from grpo.shared_prompt import use_shared_prompt_attention
from grpo.train_config import TrainConfig, eval_reads_training_data

# ------------------------------------------------------------------------------------------------
# Set-up
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[TrainConfig, bool]:
    ap = argparse.ArgumentParser(description="GRPO (Algorithm 1 of 2505.22257) with an FSDP2 trainer and a vLLM server")
    ap.add_argument("--config", help="YAML config (configs/*.yaml)")
    ap.add_argument("--resume", action="store_true", help="continue the run from its latest complete checkpoint")
    ap.add_argument("--replay", metavar="RUN_DIR", help="train on the batches RUN_DIR recorded (log.save_rollouts) "
                                                        "instead of sampling: no inference server (docs/offpolicy.md)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.v=10 optim.lr=1e-6")
    preflight.add_arguments(ap, trainer=True)
    args = ap.parse_intermixed_args(argv)  # --resume may stand anywhere, also after overrides
    if args.check:  # the dry run: every start-up decision, one line each, nothing started (grpo/preflight.py)
        sys.exit(preflight.check_training(args, prompts_fit=check_prompts_fit))
    cfg = load_config(TrainConfig, args.config, args.overrides)
    cfg.model.path = resolve_model_path(cfg.model.path)  # a hub id becomes its local snapshot, once
    if args.replay:
        cfg.replay = str(Path(args.replay).resolve())
    if cfg.replay:  # the recorded sampler alpha is fixed: nothing to serve, nothing to evaluate with
        cfg.eval_data, cfg.eval_every, cfg.grpo.sample_ahead = None, 0, False
    if not cfg.log.run_name:
        # A fresh directory per run: an existing run is only ever continued with --resume.
        cfg.log.run_name = (Path(args.config).stem if args.config else "run") + time.strftime("-%Y%m%d-%H%M%S")
    return cfg, args.resume


def build_policy(cfg: TrainConfig, device: torch.device, trainable: bool) -> Policy:
    """The HF model wrapped for per-token log-probs and sharded with FSDP2 (per layer + root)."""
    on_gpu = device.type == "cuda"
    lm = load_model(cfg.model.path, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
    if not trainable:
        lm.requires_grad_(False)
    lm.to(device)
    native_bf16 = on_gpu or multiplies_bf16()
    if cfg.model.dtype == "bfloat16" and not native_bf16 and trainable:
        warnings.warn("model.dtype=bfloat16 on a CPU without native bf16 (no AMX / AVX512-BF16): PyTorch emulates "
                      "it, many times slower than float32; model.dtype=auto chooses for the machine")
    compute = training_dtype(cfg.model.dtype, on_gpu, native_bf16)
    param_dtype = getattr(torch, compute) if compute else None
    if cfg.optim.share_prompts:
        use_shared_prompt_attention(lm)  # every forward then takes grpo.batching.collate_groups' rows
    policy = Policy(lm, cfg.grpo.temperature, cfg.kernels)
    return shard_model(policy, lm, param_dtype, cfg.model.activation_checkpointing and trainable, cfg.model.compile)


ALPHA_DIR = "alpha"  # in a checkpoint saved inside a v-window: the weights the server sampled from


class StopFlag:
    """Ctrl-C / SIGTERM: finish the current iteration, checkpoint, exit (agreed by all ranks)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, *_) -> None:
        self.requested = True

    def agreed(self) -> bool:
        return all_reduce_max(float(self.requested)) > 0


@dataclass(kw_only=True)
class Trainer:
    """What one SGD step reads and changes (plan_batch, sgd_iteration, optimizer_step): the config,
    this rank, the policies, the optimizer and the instruments. `Run` is one, with the loop's services
    around it; scripts/compare_objectives.py and tests/fsdp_step_worker.py make theirs with this class
    (one process, no server), so the step they take is the trainer's own, instruments included."""

    cfg: TrainConfig
    dist: DistInfo
    policy: Policy
    pad_token_id: int
    ref_policy: Optional[Policy] = None  # None when beta = 0
    optimizer: Optional[torch.optim.Optimizer] = None  # None: gradients only, never a step (compare_objectives)
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    # reduce-scatter gradients after every micro-batch (optim.grad_sync); None: planned here for this device
    sync_every_micro_batch: Optional[bool] = None
    # the registered instruments, and (in a run) pi_push, the parity probe, recording: grpo/instruments.py;
    # None: the registered ones alone
    instruments: Optional[Instruments] = None

    def __post_init__(self):
        if self.sync_every_micro_batch is None:
            self.sync_every_micro_batch, _ = gradient_sync_plan(self.cfg.optim.grad_sync, self.policy,
                                                                device_memory_bytes(self.dist.device))
        if self.instruments is None:
            self.instruments = Instruments(self.cfg, self.dist, self.policy)


@dataclass(kw_only=True)
class Run(Trainer):
    """Everything the loop uses. server, scorer, sampler and eval_problems live on rank 0 only."""

    run_dir: Path
    tokenizer: object
    checkpointer: Checkpointer
    logger: MetricsLogger
    stop: StopFlag
    serve_dtype: torch.dtype  # what pushes and the final export are cast to (the server's dtype)
    shares_gpu_with_server: bool = False  # one GPU for this trainer and the server (grpo.layout)
    server: Optional[ServerFleet] = None  # one inference server or several (server.replicas, server.urls)
    scorer: Optional[RewardScorer] = None
    sampler: Optional[PromptSampler] = None
    eval_problems: Optional[list] = None
    batches: object = None  # where batches come from (grpo.batch_source: windows, a fixed lag, or asynchronous)
    push_schedule: Optional[PushSchedule] = None  # when alpha <- pi_theta (grpo.push_policy)
    push_staging: HostStaging = field(default_factory=HostStaging)  # the push gather's reused host buffer (rank 0)
    recorded: Optional[RecordedStream] = None  # --replay: the batches a run recorded, in place of the server (rank 0)

    def close(self) -> None:
        stop_watchdog()  # ranks that end with this one are not lost
        if self.server is not None:  # first: the launcher kills a rank that takes long to end (torchrun: 30 s)
            self.server.stop()
        if self.batches is not None:
            self.batches.close()  # a batch sampled ahead fails at once with the server stopped
        self.logger.close()
        if self.scorer is not None:
            self.scorer.close()
        # The sharded models hold the process group: release them so that it is freed here.
        self.instruments.close()
        self.policy = self.ref_policy = self.optimizer = self.scheduler = self.checkpointer = None
        close_distributed()


def setup(cfg: TrainConfig, resume: bool) -> tuple[Run, Progress]:
    """Process group, models, optimizer, logger, and on rank 0 the server, scorer, sampler; with
    `resume`, the state of the newest complete checkpoint (and alpha served again)."""
    env = launch_env()
    layout = plan_layout(visible_gpus(), server_device=cfg.server.device, attached=cfg.server.attached,
                         rank=env.rank, local_rank=env.local_rank, local_world_size=env.local_world_size,
                         node_rank=env.node_rank, memory_fraction=cfg.server.gpu_memory_utilization,
                         server_gpus=cfg.server.tensor_parallel_size, replicas=cfg.server.replicas)
    info = init_distributed(layout.trainer_device, cfg.parallel.timeout_s, cfg.parallel.heartbeat_timeout_s)
    cfg.log.run_name = shared_run_name(cfg)
    preflight.check_batch_split(cfg.grpo.batch_prompts, info.world_size)
    torch.manual_seed(cfg.seed + info.rank)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    sampler = eval_problems = attached = None
    recorded = made_with = None
    run_dir = Path(cfg.log.out_dir) / cfg.log.run_name
    if info.is_main:  # bad data, and a server that does not answer or refuses the token, before anything slow starts
        if cfg.replay or cfg.log.save_rollouts:
            made_with = model_and_tokenizer(cfg.model.path, tokenizer)
        if cfg.replay:  # every batch checked; those sampled by version 0 were sampled by model.path's weights
            recorded = RecordedStream(cfg.replay)
            recorded.check(cfg, made_with, None if cfg.replay_other_weights else
                           weights_fingerprint(cfg.model.path))
        sampler = named_input("data", lambda: make_sampler(cfg.data, cfg.grpo.batch_prompts, seed=cfg.seed))
        if cfg.eval_data is not None:
            eval_problems = named_input("eval_data", lambda: load_problems(cfg.eval_data))
        check_prompts_fit(cfg, tokenizer, sampler, eval_problems)
        if cfg.server.attached and not cfg.replay:
            attached = ServerFleet.attach(cfg.model.path, cfg.server, run_dir)
        # a note, once every input is accepted: a refused input stays one line
        if eval_reads_training_data(cfg):
            print(f"[train] {eval_reads_training_data(cfg)}", file=sys.stderr)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        provenance.record(run_dir)  # this start's code commit (and changes), machine and command line
    checkpointer = Checkpointer(cfg.checkpoint, run_dir)
    try:  # several nodes: every rank writes into the checkpoint directory rank 0 creates
        check_shared_directory(checkpointer.dir)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    policy = build_policy(cfg, info.device, trainable=True)
    sync_every, why = gradient_sync_plan(cfg.optim.grad_sync, policy, device_memory_bytes(info.device, env.local_world_size))
    if info.is_main:
        print(f"[train] gradients reduce-scattered after {'every' if sync_every else 'the last'} micro-batch ({why})",
              file=sys.stderr)
    # which path the objective takes here (fused kernel, torch inside the fused head, or whole
    # sequences through autograd); on CUDA, a kernel that leaves a statistic unwritten stops here
    objective_path = check_objective_path(cfg.objective, info.device, cfg.kernels)
    if info.is_main:
        print(f"[train] objective {cfg.objective.loss} (is_correction {cfg.objective.correction}): "
              f"{objective_path} path", file=sys.stderr)
    ref_policy = build_policy(cfg, info.device, trainable=False) if cfg.objective.beta > 0 else None
    # pi_push, frozen between pushes, for the staleness split of batches sampled before steps were taken
    # pi_push: frozen copies of the pushed weights a batch may still be sampled by (the staleness split)
    frozen = tuple(build_policy(cfg, info.device, trainable=False) for _ in range(Instruments.push_copies(cfg)))
    optimizer = build_optimizer(policy, cfg.optim)
    run = Run(cfg=cfg, dist=info, run_dir=run_dir, tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id,
              policy=policy, ref_policy=ref_policy, optimizer=optimizer,
              scheduler=build_scheduler(optimizer, cfg.grpo.S * cfg.grpo.M * cfg.grpo.i, cfg.optim),
              checkpointer=checkpointer, logger=MetricsLogger(cfg.log, run_dir, to_dict(cfg), info.rank, resume),
              stop=StopFlag(), serve_dtype=serving_dtype(cfg.server, cfg.model.path, on_cpu=layout.server_on_cpu),
              sampler=sampler, eval_problems=eval_problems, batches=make_batch_source(cfg, sample_ahead(cfg, layout)),
              push_schedule=PushSchedule(cfg.push, cfg.grpo.v),
              shares_gpu_with_server=layout.shares_gpu, recorded=recorded, sync_every_micro_batch=sync_every,
              instruments=Instruments(cfg, info, policy, frozen, run_dir, tokenizer, made_with))
    room = checkpointer.room_warning(checkpoint_size(run)) if info.is_main else None
    if room:  # a save writes the new checkpoint before it prunes the oldest
        print(f"[train] warning: {room}", file=sys.stderr)
    progress = Progress()
    latest = run.checkpointer.latest() if resume else None
    if resume and latest is None:  # stopped before its first checkpoint: the run starts again, its rows dropped
        if info.is_main:
            print(f"[train] --resume: no complete checkpoint under {run.checkpointer.dir}; starting from step 0",
                  file=sys.stderr)
        run.logger.truncate_after(0)
    pending = []  # batches a checkpoint had started (grpo.lag): sampled again on the same weights
    if latest is None:
        run.instruments.start()
    else:
        saved = run.checkpointer.load(latest, policy, optimizer, ref_policy, push_model=run.instruments.model_to_load())
        run.scheduler.load_state_dict(saved["scheduler"])
        progress = Progress.from_json(saved["progress"])
        if (latest / ALPHA_DIR).is_dir():  # saved while alpha was not pi_theta: alpha's weights travel with it
            progress = replace(progress, weights_dir=str(latest / ALPHA_DIR))
        # saved with its copy of the newest push's weights (else the next push makes one); the run's probe
        run.instruments.resumed(Checkpointer.holds_push_model(latest), progress.weights_version)
        run.push_schedule.load_state_dict(saved.get("push_schedule", {}))
        if info.is_main:
            run.sampler.load_state_dict(saved["sampler"])
            pending = [{**item, "weights_dir": str(latest / alpha_name(item["version"]))
                        if (latest / alpha_name(item["version"])).is_dir() else item["weights_dir"]}
                       for item in saved.get("batches", {}).get("pending", [])]
            if isinstance(run.batches, AsyncBatches):
                run.batches.load_counts(saved.get("batches", {}))
        run.logger.truncate_after(progress.step)
    if info.is_main and not cfg.replay:
        run.scorer = RewardScorer(cfg.reward)
        run.server = run.instruments.server = attached or ServerFleet.launch(
            cfg.model.path, cfg.server, run_dir, gpus=layout.replica_gpus or (layout.server_gpu,),
            gpu_memory_utilization=layout.server_memory_fraction, cpu=cfg.cpu)
        on_lost_rank(run.server.stop)  # a rank ending for a lost peer leaves no server behind
        run.server.start_versions()  # an attached server may still serve another run's push, or a crashed attempt's
    # the CPU fence's one hook (nothing off CPU): malloc, the LM head's GEMMs, cores shared with the engine
    tune_trainer(cfg.cpu, layout, info.world_size, [policy, ref_policy, *frozen], run.batches, run.server)
    if not cfg.replay and latest is not None:
        progress = resume_sampling(run, progress, pending)
    if info.is_main and isinstance(run.batches, AsyncBatches):
        run.batches.start(run, progress)
    return run, progress


def sample_ahead(cfg: TrainConfig, layout) -> Callable[[int], bool]:
    """Whether batch j (the loop's index) is sampled one batch early at lag 0: only where no push
    comes before it (every v iterations: not the first of a window; drift-driven pushes could come
    anywhere). grpo.sample_ahead null: on for v > 1 where sampling has its own hardware."""
    on = cfg.grpo.sample_ahead if cfg.grpo.sample_ahead is not None else cfg.grpo.v > 1 and overlap_is_free(layout)
    return lambda j: bool(on) and cfg.push.policy == "every_v" and (j % cfg.grpo.M) % cfg.grpo.v != 0


def alpha_name(version: int) -> str:
    """A checkpoint's copy of the weights of `version` (grpo.lag: a batch still to train was sampled by it)."""
    return f"{ALPHA_DIR}-v{version}"


def resume_sampling(run: Run, progress: Progress, pending: list[dict]) -> Progress:
    """The server as the run had it at its checkpoint. With grpo.lag, the batches it had started
    are sampled again, each from the weights it was sampled from, in order; then alpha is served
    again where it is not pi_theta (steps were taken since its push). The asynchronous sampler
    starts from a push of pi_theta: which weights sampled its queue was a matter of timing."""
    if run.cfg.rollout.mode == "async":
        return push_policy(run, progress, reason="resume")[0]
    served = 0  # a launched (or reset attached) server starts at version 0

    def serve(weights_dir: str, version: int) -> None:
        run.server.serve(weights_dir, version)
        run.instruments.served(version, weights_dir)

    if run.dist.is_main and pending:
        served = run.batches.resume(run, pending, served, serve)
    served = broadcast_json(served)
    if served != progress.weights_version and progress.weights_dir and alpha_needed(run.cfg, progress):
        return reserve_alpha(run, progress)
    return progress


def alpha_needed(cfg: TrainConfig, progress: Progress) -> bool:
    """Whether the weights the server serves may sample a batch after this point before any push:
    inside a v-window (the next batch is not the first of one); with drift-driven pushes always (the
    next push is not known). A checkpoint then keeps them, and a resume serves them again. The
    asynchronous sampler resumes from a push of pi_theta."""
    if cfg.rollout.mode == "async":
        return False
    if cfg.push.policy == "drift":
        return progress.weights_version > 0
    return progress.iteration % cfg.grpo.v != 0


def checkpoint_size(run: Run) -> int:
    """The bytes of one checkpoint of this run: pi_theta and AdamW's two moments of each parameter,
    pi_ref and the newest push's copy where kept, and the served weights it may keep: alpha inside a
    window (v > 1, drift-driven pushes), and with grpo.lag those of every batch still to train."""
    cfg = run.cfg
    numel = sum(p.numel() for p in run.policy.parameters())  # a DTensor counts its global shape
    theta = sum(p.numel() * p.element_size() for p in run.policy.parameters())
    kept_copy = (run.instruments.spare or list(run.instruments.copies.values()))[:1]
    frozen = [m for m in (run.ref_policy, *kept_copy) if m is not None]
    every = cfg.push.min_interval if cfg.push.policy == "drift" else cfg.grpo.v
    alphas = 0 if cfg.replay or cfg.rollout.mode == "async" else \
        int(cfg.grpo.v > 1 or cfg.push.policy == "drift") + (cfg.grpo.lag // every + 1 if cfg.grpo.lag else 0)
    return 3 * theta + sum(p.numel() * p.element_size() for m in frozen for p in m.parameters()) + \
        alphas * numel * run.serve_dtype.itemsize


def shared_run_name(cfg: TrainConfig) -> str:
    """Rank 0's run name on every rank (collective). A default name holds its rank's start time:
    ranks that started on either side of a second, or nodes started apart, would otherwise write
    into different run directories."""
    return broadcast_json(cfg.log.run_name)


def named_input(key: str, load):
    """load(), with a data error's one line prefixed by the config section it came from."""
    try:
        return load()
    except DataError as e:
        raise DataError(f"{key}: {e}") from None


def check_prompts_fit(cfg: TrainConfig, tokenizer, sampler: PromptSampler, eval_problems: Optional[list]) -> None:
    """server.max_model_len holds the longest prompt plus its completion budget (file datasets: every
    prompt; the arithmetic stream: its held-out problems, drawn from the same generator)."""
    source = sampler.source if isinstance(sampler.source, list) else sampler.source.eval_problems()
    prompts = [build_prompt(tokenizer, p, cfg.data) for p in source]
    budgets = {"grpo.max_new_tokens": cfg.grpo.max_new_tokens}
    if eval_problems:
        prompts += [build_prompt(tokenizer, p, cfg.eval_data) for p in eval_problems]
        budgets["eval.max_tokens"] = cfg.eval.max_tokens
    longest = max((len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]), default=0)
    try:
        check_context_fits(cfg.server, longest, budgets)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def reserve_alpha(run: Run, progress: Progress) -> Progress:
    """Resumed inside a v-window: alpha is the policy of the last push, not pi_theta. Serve that
    exact directory again; if it is gone, say so and push pi_theta instead. (Resumed before any
    push, the fresh server's version 0 already is alpha.)"""
    old_dir = Path(progress.weights_dir)
    if broadcast_json(run.dist.is_main and (old_dir / "manifest.json").is_file()):
        if run.dist.is_main:
            run.server.serve(old_dir, progress.weights_version)
        return progress
    if run.dist.is_main:
        print(f"[train] resume: the last pushed weights ({old_dir}) are gone; serving the current policy, "
              "so this v-window is not an exact repeat", file=sys.stderr)
    return push_policy(run, progress)[0]


# ------------------------------------------------------------------------------------------------
# The steps of one iteration
# ------------------------------------------------------------------------------------------------


def push_policy(run: Run, progress: Progress, reason: str = "every v", batch: Optional[int] = None
                ) -> tuple[Progress, dict]:
    """alpha <- pi_theta: gather the full state dict on rank 0, which the server writes and loads.
    Collective (every rank gathers its shards). Returns the new progress and {bytes, seconds}.
    reason: why (grpo.push_policy), logged; batch: the loop's batch index it comes before.
    Replaying a recorded run there is no server: the version is counted as a push would count it."""
    t0 = time.time()
    if run.cfg.replay:
        return (progress.after_push(progress.weights_version + 1, progress.weights_dir, reason, batch),
                {"bytes": 0.0, "seconds": 0.0})
    full_state = gather_full_state_dict(run.policy.lm, dtype=run.serve_dtype, staging=run.push_staging)  # {} on ranks > 0
    if run.shares_gpu_with_server:
        # vLLM's layer-wise reload allocates on the GPU this trainer shares: hand back cached blocks
        torch.cuda.empty_cache()
    version = progress.weights_version + 1

    def push() -> dict:  # rank 0 writes, the server loads
        reply = run.server.push(full_state, version, step=progress.step)
        return {"bytes": float(reply["bytes"]), "weights_dir": str(reply["weights_dir"])}

    pushed = on_main_rank(run.dist.is_main, push)
    progress = progress.after_push(version, pushed["weights_dir"], reason, batch)
    run.instruments.after_push(version, pushed["weights_dir"])  # pi_push for the staleness split of its batches
    if run.dist.is_main and isinstance(run.batches, AsyncBatches):
        run.batches.pushed(progress)
    return progress, {"bytes": pushed["bytes"], "seconds": time.time() - t0, "reason": reason}


def batch_seed(cfg: TrainConfig, stage: int, k: int) -> int:
    """The seed of iteration k's batch: sampling and RED-Drop repeat exactly on resume."""
    return (cfg.seed * 1_000_003 + stage * cfg.grpo.M + k) % 2**31


def sample_batch(run: Run, progress: Progress, stage: int, k: int, seed: int) -> Rollout:
    """Rank 0 gets batch (stage, k) from the run's batch source (grpo.batch_source: it starts what
    the weights now served sample, then waits for this batch) or, replaying, from the recording;
    every rank gets the rollout."""
    def sample() -> dict:
        if run.recorded is not None:  # --replay: the batch as the recorded run trained on it
            rollout = run.recorded.rollout(progress.stage, k, run.cfg)
            rollout.stats["time_wait_generate"] = 0.0
            return rollout.to_json()
        return run.batches.take(run, progress, batch_index(run.cfg, stage, k), seed).to_json()

    return Rollout.from_json(on_main_rank_or_stop(run, sample))


def sample_ahead_batches(run: Run, progress: Progress, stage: int, k: int) -> None:
    """Rank 0 starts the batches the weights now served sample ahead of batch (stage, k): the next L
    with grpo.lag, the next one with sample-ahead (grpo.batch_source); they generate while k trains."""
    if run.dist.is_main and run.recorded is None:
        last = batch_index(run.cfg, run.cfg.grpo.S - 1, run.cfg.grpo.M - 1)
        run.batches.start_ahead(run, progress, batch_index(run.cfg, stage, k),
                                lambda j: batch_seed(run.cfg, *divmod(j, run.cfg.grpo.M)), last)


def on_main_rank_or_stop(run: Run, work):
    """work() on rank 0, its JSON result on every rank (collective). A reward term the run cannot
    trust there (grpo.rewards.RewardError: failures past reward.max_failed_frac, a value outside
    its range) stops every rank alike, with its one line (RunStopped), as a full disk does."""
    return on_main_rank(run.dist.is_main, work, stops={RewardError: RunStopped})


def plan_batch(run: Trainer, rollout: Rollout) -> tuple[list[MicroBatch], tuple[int, int], dict]:
    """This rank's share in micro-batches of <= optim.token_budget padded tokens, as many on every
    rank (at least one), the whole batch's (num_seqs, num_tokens) denominators and the tokens the
    train part runs, real and padded (all summed over ranks).

    Sequences that contribute nothing (eq. 8 masked groups, RED-dropped, truncated-masked) are
    counted in the denominators as objective.count_masked says, but never run forward or backward:
    their loss and gradient are exactly zero, so the update is the same (SmolLM2 on GSM8K has
    87-100% of its groups masked)."""
    cfg = run.cfg
    samples = shard_samples(rollout.samples, run.dist.rank, run.dist.world_size)
    local_batch = collate(samples, run.pad_token_id, torch.device("cpu"))
    seqs, tokens = local_denominators(local_batch.completion_mask, local_batch.seq_weight, cfg.objective,
                                      local_batch.truncated)
    keep = contributing(local_batch.completion_mask, local_batch.seq_weight, cfg.objective, local_batch.truncated)
    contributing_samples = [s for s, k in zip(samples, keep.tolist()) if k]
    pad, device = run.pad_token_id, run.dist.device
    if cfg.optim.share_prompts:  # a row per group: its prompt once, its contributing completions as slots
        rows = group_rows(contributing_samples, cfg.optim.token_budget)
        lengths = [group_row_length(r) for r in rows]
        real_tokens = sum(len(r[0].prompt_ids) + sum(len(s.completion_ids) for s in r) for r in rows)
        build = lambda idx: collate_groups([rows[j] for j in idx], pad, device)  # noqa: E731
    else:  # a row per sequence
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in contributing_samples]
        real_tokens = sum(lengths)
        build = lambda idx: collate([contributing_samples[j] for j in idx], pad, device)  # noqa: E731
    plan = plan_micro_batches(lengths, cfg.optim.token_budget)
    # one (possibly empty) micro-batch at least: every parameter then gets a gradient (zero when all
    # is masked), so the optimizer step is the one the full forward would give
    plan = equalize_micro_batches(plan, max(int(all_reduce_max(len(plan))), 1))
    micro_batches = [build(idx) for idx in plan]
    totals = all_reduce_sum({"seqs": seqs, "tokens": tokens, "train_tokens": real_tokens,
                             "train_padded_tokens": sum(mb.input_ids.numel() for mb in micro_batches)})
    shape = {"train_tokens": totals["train_tokens"], "train_padded_tokens": totals["train_padded_tokens"]}
    return micro_batches, (max(int(totals["seqs"]), 1), max(int(totals["tokens"]), 1)), shape


@dataclass
class BatchCache:
    """What the first SGD iteration on a batch computes, for the next i-1 (parameters still pi_k)."""

    logp_k: list = field(default_factory=list)  # per micro-batch: pi_k's log-probs (the forward's own)
    logp_ref: list = field(default_factory=list)  # per micro-batch: pi_ref's log-probs (None at beta = 0)
    entropy_sum: Optional[float] = None  # pi_k's entropy summed over the batch's tokens (all ranks)
    passes: int = 0  # SGD iterations taken on the batch


def sgd_iteration(run: Trainer, micro_batches: list[MicroBatch], cache: BatchCache,
                  denominators: tuple[int, int]) -> tuple[dict[str, torch.Tensor], float]:
    """One pass over this rank's micro-batches: forward, objective, backward (gradients accumulate).
    Returns the objective's statistics summed over micro-batches and ranks, and pi_k's entropy sum.

    On the first SGD iteration on a batch (an empty `cache`) the parameters are still pi_k, so pi_k's
    log-probs are the forward's own (detached) and are cached for the next i-1 iterations
    (ratio_anchor=exact needs them; approx uses them as PPO's pi_old); pi_ref's log-probs and pi_k's
    entropy are computed once here too. The registered instruments measure every pass (and the
    batch's first: the staleness split) from the same tensors (run.instruments).
    """
    cfg, first = run.cfg, cache.entropy_sum is None
    num_seqs, num_tokens = denominators
    measured = run.instruments.sgd_pass(cache.passes, first)
    totals, entropy_sum = None, torch.zeros((), device=run.dist.device)
    for j, mb in enumerate(micro_batches):
        # FSDP2 reduce-scatters after every backward unless told to wait for the last micro-batch, which
        # keeps full unsharded fp32 gradients on every rank meanwhile (optim.grad_sync)
        run.policy.set_requires_gradient_sync(run.sync_every_micro_batch or j == len(micro_batches) - 1)
        if first:
            logp_ref = None
            if run.ref_policy is not None:
                with torch.no_grad():
                    logp_ref, _ = run.ref_policy(mb.input_ids, mb.completion_index, mb.completion_tokens,
                                                 position_ids=mb.position_ids, segments=mb.segments)
            cache.logp_ref.append(logp_ref)
        measured.before(mb)  # steps were taken since the push that sampled this batch: its weights score it
        mask = mb.completion_mask.bool()
        weights = token_weights(mb.completion_mask, mb.seq_weight, cfg.objective, num_seqs=num_seqs,
                                num_tokens=num_tokens, max_len=cfg.grpo.max_new_tokens, truncated=mb.truncated)[mask]
        inputs = ObjectiveInputs(mb.logp_alpha, None if first else cache.logp_k[j], cache.logp_ref[j],
                                 mb.adv[mb.seq_of_token], weights, cfg.objective, seq_index=mb.seq_of_token)
        out = run.policy(mb.input_ids, mb.completion_index, mb.completion_tokens, objective=inputs, with_entropy=first,
                         position_ids=mb.position_ids, segments=mb.segments)
        # FSDP2 averages gradients over ranks; the weights already hold global denominators, so
        # scale back up to get the gradient of the whole batch's loss.
        (out.loss * run.dist.world_size).backward()
        if first:
            cache.logp_k.append(out.logp)
            # over active tokens, like every statistic of the objective (it is divided by their count)
            entropy_sum = entropy_sum + (out.entropy * (weights != 0)).sum()
        measured.after(mb, out.logp, logp_old=cache.logp_k[j], active=weights != 0)
        totals = out.stats if totals is None else merge_stats(totals, out.stats)
    if first:
        # pi_ref's no-grad forwards left FSDP2's root gathered (a root does not reshard after forward):
        # free it until the next batch (the staleness split does the same for pi_push)
        if run.ref_policy is not None:
            run.ref_policy.reshard()
        cache.entropy_sum = all_reduce_sum({"entropy": entropy_sum})["entropy"]
    run.instruments.finished(measured)
    cache.passes += 1
    return all_reduce_stats(totals), cache.entropy_sum


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why in one line. Its last checkpoint is where --resume starts."""


def optimizer_step(run: Trainer) -> tuple[float, bool]:
    """Clip, then step unless the gradient is not finite (then the step is skipped and counted:
    Progress.nan_skips, nan_streak; the LR schedule still advances)."""
    params = [p for p in run.policy.parameters() if p.grad is not None]
    max_norm = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=True)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    finite = math.isfinite(grad_norm)
    if finite:
        run.optimizer.step()
    elif run.dist.is_main:
        print("[train] non-finite gradient, optimizer step skipped", file=sys.stderr)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()  # the schedule follows optimizer steps attempted, so a skip does not shift it
    return grad_norm, finite


def check_nan_streak(cfg: TrainConfig, progress: Progress) -> None:
    """More than optim.max_consecutive_skips steps in a row without a finite gradient: the run is
    not training any more (a batch, a learning rate or the numerics broke it): stop, naming the key."""
    if progress.nan_streak > cfg.optim.max_consecutive_skips:
        first = progress.step - progress.nan_streak + 1
        raise RunStopped(f"{progress.nan_streak} optimizer steps in a row (steps {first}-{progress.step}) had a "
                         f"non-finite gradient, more than optim.max_consecutive_skips={cfg.optim.max_consecutive_skips}"
                         f"; stopped (--resume continues from the last checkpoint)")


def eval_due(cfg: TrainConfig, progress: Progress, g: int, pushed_after: Optional[int]) -> bool:
    """Held-out eval right after a push only (the server then holds pi_theta): before training,
    then every eval_every iterations (a multiple of v). With drift-driven pushes, at the first push
    at or after each multiple of eval_every. pushed_after: the batch index of the push before the
    one just made (None: no push now)."""
    if progress.step == 0:
        return True
    if pushed_after is None or not cfg.eval_every:
        return False
    return g // cfg.eval_every > pushed_after // cfg.eval_every or g % cfg.eval_every == 0


def evaluate_policy(run: Run, progress: Progress) -> None:
    """The held-out evaluation on rank 0 (collective: every rank stops alike if a reward term fails it)."""
    def evaluate_and_log() -> None:
        if run.eval_problems is not None:
            summary, _ = evaluate(run.server, run.tokenizer, run.eval_problems, run.cfg.eval_data, run.cfg.eval,
                                  run.scorer)
            run.logger.log(metrics.eval_row(progress.step, summary))

    on_main_rank_or_stop(run, evaluate_and_log)


def save_checkpoint(run: Run, progress: Progress) -> None:
    """Collective: model, optimizer, pi_ref, RNG, progress, the data cursor (from before the batches
    sampled but not yet trained on, which a resume samples again: grpo.batch_source), the push
    schedule and the LR schedule."""
    sources = broadcast_json(run.batches.state_dict(run.sampler) if run.dist.is_main else None)
    state = {"progress": progress.to_json(), "sampler": sources.pop("sampler"), "batches": sources,
             "push_schedule": run.push_schedule.state_dict(), "scheduler": run.scheduler.state_dict()}
    # Where alpha may sample again before a push, and for every batch still to train, keep the exact
    # weights with the checkpoint (the server's copies die with it) so a resume samples from them again.
    extra = {alpha_name(item["version"]): item["weights_dir"] for item in sources.get("pending", [])
             if item["weights_dir"]}
    if alpha_needed(run.cfg, progress) and progress.weights_dir:
        extra[ALPHA_DIR] = progress.weights_dir
    run.checkpointer.save(progress.step, run.policy, run.optimizer, run.ref_policy, trainer_state=state,
                          extra_dirs=extra or None, push_model=run.instruments.push_model_to_save(progress))


def finish(run: Run, progress: Progress) -> None:
    """Checkpoint, evaluate the final policy (pushed, so the server holds it), export it as HF."""
    save_checkpoint(run, progress)
    if run.cfg.eval_data is not None:
        progress, _ = push_policy(run, progress)
        evaluate_policy(run, progress)
    export_hf(run.policy.lm, run.tokenizer, run.cfg.model.path, run.run_dir / "final", dtype=run.serve_dtype)


def log_step(run: Run, bar, *, progress: Progress, stage: int, iteration: int, sgd_iteration: int, rollout: Rollout,
             stats: dict, entropy_sum, grad_norm: float, started: float, iteration_started: float,
             push: Optional[dict], shape: dict) -> dict:
    """The step's row (grpo/metrics.py) to metrics.jsonl, W&B and the progress bar, returned. push:
    the push before this iteration, on its first step (None after)."""
    train_stats = logged_stats(finalize_stats(stats))
    push = push or {"bytes": 0.0, "seconds": 0.0}
    row = metrics.train_row(
        progress=progress, stage=stage, iteration=iteration, sgd_iteration=sgd_iteration, rollout_stats=rollout.stats,
        train_stats=train_stats, sampled_version=rollout.weights_version,
        entropy=metrics.per_token(entropy_sum, train_stats["num_tokens"]), grad_norm=grad_norm,
        lr=run.scheduler.get_last_lr()[0], time_train=time.time() - started, shape=shape, time_sync=push["seconds"],
        sync_bytes=push["bytes"], iteration_seconds=time.time() - iteration_started,
        instruments=run.instruments.row(sgd_iteration))
    if "reason" in push:  # why this iteration began with a push (grpo.push_policy)
        row["push_reason"] = push["reason"]
    run.logger.log(row)
    bar.update(1)
    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row.get('kl', math.nan):.4f}",
                    clip=f"{row.get('clip_frac', math.nan):.3f}", ver=row["weights_version"])
    return row


def checkpoint_or_stop(run: Run, progress: Progress) -> bool:
    """After an iteration: a checkpoint when due, or when Ctrl-C / SIGTERM asked to stop (agreed by
    all ranks); True to stop."""
    stopping = run.stop.agreed()
    if stopping or run.checkpointer.due(progress.step, steps_taken=run.cfg.grpo.i):
        save_checkpoint(run, progress)
    if stopping and run.dist.is_main:
        print(f"[train] stopped at step {progress.step}; resume with --resume", file=sys.stderr)
    return stopping


# ------------------------------------------------------------------------------------------------
# Algorithm 1
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    try:
        cfg, resume = parse_args(argv)
        run, progress = setup(cfg, resume)
    except (ConfigError, DataError, ModelPathError, LayoutError, ReplayError, AttachError) as e:  # bad input: one line, exit 2
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        return stopped_by_lost_rank(e)
    try:
        bar = run.logger.progress(cfg.grpo.S * cfg.grpo.M * cfg.grpo.i, initial=progress.step)
        for stage in range(progress.stage, cfg.grpo.S):
            for k in range(progress.iteration, cfg.grpo.M):
                t_iter = time.time()
                g = batch_index(cfg, stage, k)
                # alpha <- pi_theta every v iterations (or by the measured drift, push.policy); at step 0
                # the server already holds pi_theta_0
                push = {"bytes": 0.0, "seconds": 0.0}
                decision = run.push_schedule.due(k, since=g - progress.pushed_at_batch)
                pushed_after = None
                if decision.push and progress.step > 0:
                    if run.dist.is_main:
                        run.batches.before_push()  # batches started on alpha finish on alpha
                    pushed_after = progress.pushed_at_batch
                    progress, push = push_policy(run, progress, decision.reason, batch=g)
                if eval_due(cfg, progress, g, pushed_after):
                    evaluate_policy(run, progress)

                # B prompts x G completions from alpha; rewards, advantages (eq. 2), mask (eq. 8)
                seed = batch_seed(cfg, stage, k)
                rollout = sample_batch(run, progress, stage, k, seed)
                # recorded; the parity probe right after a push (or at the start)
                run.instruments.after_sampling(progress, stage, k, seed, rollout, pushed=progress.pushed_at_batch == g)
                sample_ahead_batches(run, progress, stage, k)  # the next batches generate while this one trains
                micro_batches, denominators, shape = plan_batch(run, rollout)

                # i SGD iterations on this batch (pi_k = the policy before the first of them)
                cache = BatchCache()
                for it in range(cfg.grpo.i):
                    t0 = time.time()
                    stats, entropy_sum = sgd_iteration(run, micro_batches, cache, denominators)
                    grad_norm, finite = optimizer_step(run)
                    progress = progress.after_step(finite)
                    row = log_step(run, bar, progress=progress, stage=stage, iteration=k, sgd_iteration=it,
                                   rollout=rollout, stats=stats, entropy_sum=entropy_sum, grad_norm=grad_norm,
                                   started=t0, iteration_started=t_iter, push=push if it == 0 else None, shape=shape)
                    if it == 0:
                        run.push_schedule.measured(row)  # the drift this batch shows: the next push decision
                    check_nan_streak(cfg, progress)
                if cfg.log.sample_table_every and k % cfg.log.sample_table_every == 0:
                    run.logger.log_samples(progress.step, rollout.table)

                progress = replace(progress, iteration=k + 1)
                if checkpoint_or_stop(run, progress):
                    return 130
            # end of stage: pi_ref <- pi_theta
            if run.ref_policy is not None:
                copy_policy(run.ref_policy, run.policy)
            progress = replace(progress, stage=stage + 1, iteration=0)
        finish(run, progress)
        return 0
    except (RunStopped, NoSpaceError, CheckpointError) as e:  # every rank stops; one line
        bar.close()  # ends the progress bar's line first
        if run.dist.is_main:
            then = "; free space there, then --resume" if isinstance(e, NoSpaceError) else ""
            print(f"[train] error: {e}{then}", file=sys.stderr)
        return 1
    except Exception as e:
        return stopped_by_lost_rank(e)
    finally:
        run.close()


def stopped_by_lost_rank(error: Exception) -> int:
    """A collective failed because another rank is gone: one line naming it (grpo.parallel.RankWatchdog)
    instead of a traceback, and EXIT_LOST_RANK. Any other error is raised as it is."""
    line = lost_rank(error)
    if line is None:
        raise error
    say(line)
    return EXIT_LOST_RANK


if __name__ == "__main__":
    with own_temp_dir():  # this rank's temporary files and its children's (server, W&B): reclaimed after a kill
        code = main()
    sys.exit(code)
