"""The training run's config: Algorithm 1's knobs plus one section per component.

A YAML file under configs/ fills this tree; `train.py --config F a.b=c` overrides single keys. The
sections of other components are defined next to the code that reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from grpo.batch_source import RolloutConfig
from grpo.checkpoint import CheckpointConfig
from grpo.cpu import CPUConfig
from grpo.data import DataConfig
from grpo.evaluation import EvalConfig
from grpo.metrics import LogConfig
from grpo.objective import ObjectiveConfig
from grpo.parallel import ParallelConfig
from grpo.parity import ParityConfig
from grpo.push_policy import PushConfig
from grpo.rewards import RewardConfig, reward_range
from grpo.serving.inference import ServerConfig
from kernels import KernelConfig


@dataclass
class ModelConfig:
    path: str = ".cache/models/smollm2"  # HF model directory (or hub name where the hub is reachable)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # training params: auto = bf16 mixed precision on GPU and on CPUs that multiply bf16 (AMX, AVX512-BF16), else fp32
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (memory for time)
    compile: bool = False  # torch.compile each decoder layer (dynamic shapes): fuses the norms, rotary, SiLU*up and casts; the first step pays the compilation
    trust_remote_code: bool = False  # allow model code from the model directory (off: safety)


@dataclass
class GRPOConfig:
    """Algorithm 1 of Mroueh et al. (2505.22257)."""

    S: int = 1  # stages; after each, pi_ref <- pi_theta
    M: int = 10  # iterations (batches) per stage
    v: int = 1  # push weights to the inference server every v iterations (v > 1: off-policy GRPO)
    i: int = 1  # SGD iterations (optimizer steps) on each batch
    G: int = 8  # completions sampled per prompt
    batch_prompts: int = 8  # prompts per iteration (global, across ranks)
    max_new_tokens: int = 128  # completion budget; longer ones are truncated
    temperature: float = 1.0  # sampling temperature; log-probs of pi, pi_k, pi_ref use the same T
    top_p: float = 1.0  # nucleus sampling (1.0 keeps alpha's log-probs exact)
    lag: int = 0  # batch k is sampled from the policy served `lag` iterations earlier, so the next batches generate while k trains (0: Algorithm 1 as written; grpo/batch_source.py)
    sample_ahead: Optional[bool] = None  # generate batch k+1 while training on k when no push separates them;
    #                                      null: on for v > 1 where sampling has its own hardware (grpo.layout.overlap_is_free);
    #                                      batches are the same either way (on a CPU: see cpu.split_cores)

    def __post_init__(self):
        for name in ("S", "M", "v", "i", "batch_prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.G < 2:
            raise ValueError(f"G: group size must be >= 2 (advantages need a group), got {self.G}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ValueError(f"lag: must be an integer >= 0, got {self.lag!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 (the trainer divides logits by it), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class OptimConfig:
    lr: float = 1e-6  # AdamW peak learning rate
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm (0: off)
    max_consecutive_skips: int = 5  # optimizer steps in a row skipped for a non-finite gradient before the run stops (0: the first stops it)
    warmup_steps: int = 0  # linear warmup (optimizer steps)
    schedule: Literal["constant", "cosine"] = "constant"  # after warmup
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    token_budget: int = 4096  # padded tokens per micro-batch per rank; gradients accumulate over micro-batches
    share_prompts: bool = False  # a group's prompt runs forward once, its completions as slots of one row (grpo/shared_prompt.py); same numbers, fewer tokens
    grad_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"  # when FSDP2 reduce-scatters gradients:
    #   last_micro_batch keeps full unsharded fp32 gradients on every rank in between (4 B/param), every_micro_batch
    #   one reduce-scatter per micro-batch; auto: by the model's size and the device's memory (grpo/parallel.py)

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip: must be >= 0, got {self.grad_clip}")
        if isinstance(self.max_consecutive_skips, bool) or self.max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips: must be an integer >= 0, got {self.max_consecutive_skips!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget: must be >= 1, got {self.token_budget}")


@dataclass
class TrainConfig:
    # the user's own modules (a .py path or a dotted name), imported before the rest of the config is
    # read: losses, advantages, reward terms and metrics registered there, with their knobs (docs/extending.md)
    plugins: list[str] = field(default_factory=list)
    seed: int = 0  # seeds data order, sampling engine and torch
    model: ModelConfig = field(default_factory=ModelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)  # only where the trainer or the server runs on a CPU
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)  # the log-prob parity probe after pushes (docs/offpolicy.md)
    eval: EvalConfig = field(default_factory=EvalConfig)
    eval_every: int = 0  # evaluate on the held-out set every N iterations (0: only before and after)
    eval_data: Optional[DataConfig] = None  # held-out problems for periodic eval (None: no periodic eval)
    replay: Optional[str] = None  # a run recorded with log.save_rollouts: train on its batches, no server (--replay)
    # replay a recording sampled by other weights than model.path's (a deliberate cross-model experiment:
    # alpha is then another model), or one too old to record them (docs/offpolicy.md)
    replay_other_weights: bool = False
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # how batches are sampled: windows and grpo.lag, or asynchronously (grpo/batch_source.py)
    push: PushConfig = field(default_factory=PushConfig)  # when alpha <- pi_theta: every grpo.v iterations, or by the measured drift (grpo/push_policy.py)

    def __post_init__(self):
        self._check_regime()
        if self.eval_every < 0 or (self.eval_every and self.eval_every % self.grpo.v):
            # Eval samples from the server, which holds pi_theta only right after a push.
            raise ValueError(f"eval_every: must be 0 or a multiple of grpo.v={self.grpo.v}, got {self.eval_every}")
        if self.grpo.batch_prompts * self.grpo.G < 1:
            raise ValueError("grpo.batch_prompts: empty batch")
        lo, hi = reward_range(self.reward, self.grpo.max_new_tokens)  # what the bound's M scales rewards by
        if not hi > lo:
            raise ValueError(f"reward.terms: the weighted reward has no range ([{lo:g}, {hi:g}]) at grpo.max_new_tokens="
                             f"{self.grpo.max_new_tokens}: give a term that can fire there a nonzero weight")


    def _check_regime(self) -> None:
        """The sampling regime's keys, together: each one read, none contradicting another."""
        g, r, p = self.grpo, self.rollout, self.push
        if r.mode == "async" and g.lag:
            raise ValueError("grpo.lag: the asynchronous sampler has no fixed lag (its bound is rollout.max_staleness); "
                             "drop grpo.lag or set rollout.mode: sync")
        if (r.mode == "async" or g.lag) and g.sample_ahead is not None:
            raise ValueError("grpo.sample_ahead: with grpo.lag or rollout.mode: async the next batches always generate "
                             "while one trains; drop grpo.sample_ahead")
        if p.policy == "drift" and g.v != 1:
            raise ValueError(f"grpo.v: with push.policy: drift the pushes follow the measured drift, not every v "
                             f"iterations; drop grpo.v (it is {g.v}) or set push.policy: every_v")
        if p.policy == "drift" and p.signal == "tv_staleness" and not self.log.split_staleness:
            raise ValueError("push.policy: drift pushes on tv_staleness, which log.split_staleness: false does not "
                             "measure; set log.split_staleness: true or push.signal: is_weight_ess")
        if self.replay and (g.lag or r.mode == "async" or p.policy == "drift"):
            raise ValueError("replay: a replay trains on the recorded batches, with no server and no pushes; drop "
                             "grpo.lag, rollout.mode and push.policy (the recording keeps each sample's version)")
        if g.lag:
            # every batch still to train may need its weights again after a resume: the server keeps them
            versions = g.lag // (p.min_interval if p.policy == "drift" else g.v) + 1
            if self.server.keep_last < versions:
                raise ValueError(f"server.keep_last: must be >= {versions} with grpo.lag: {g.lag} (the weights of "
                                 f"every batch sampled but not yet trained on are kept), got {self.server.keep_last}")


def eval_reads_training_data(cfg: TrainConfig) -> Optional[str]:
    """One start-up line when the held-out evaluation reads the training data's own settings
    (`eval_data` equal to `data`, e.g. written `eval_data: *data`), saying what it then reads; None
    when eval_data is its own (or there is none)."""
    if cfg.eval_data is None or cfg.eval_data != cfg.data:
        return None
    if cfg.data.dataset == "arithmetic":
        return (f"eval_data equals data (dataset arithmetic): the eval reads the task's held-out problems "
                f"(arithmetic.eval_size: {cfg.data.arithmetic.eval_size}), never drawn for training")
    return (f"eval_data equals data (dataset {cfg.data.dataset}): the eval reads the training problems themselves; "
            "give eval_data a dataset of its own for a held-out score")

