"""Instruments: statistics of the training step, each one registered function, and the component
the loop calls at its points (docs/offpolicy.md, docs/extending.md).

An instrument is a function of one micro-batch's tokens that returns per-token values; it is
registered with its name, its logged keys (each with its W&B section and one line of meaning) and
when it runs, like a loss:

    @register_instrument("ratio_tail", section="train", per="pass",
                         ratio_tail_frac="fraction of active tokens with pi_theta / pi_old > 1.2")
    def ratio_tail(x: Tokens) -> dict:
        return {"ratio_tail_frac": (x.logp - x.logp_old).exp() > 1.2}

`Tokens` holds flat tensors over the micro-batch's completion tokens: the policy's log-probs on this
pass, pi_old's (pi_k, the policy before the batch's first step), alpha's (the sampler's), the
active mask (the tokens the objective counts), each token's advantage and sequence, and the
micro-batch itself. The component reduces the values over the active tokens of every micro-batch and
rank (a mean; "max" or "sum" where declared; a NaN value is skipped, so a value that is undefined
for a token is NaN there) and puts them in the step's row; a key with no token is missing.

    per="pass"   every SGD pass (the row of each of the i steps on a batch has its own)
    per="batch"  the batch's first pass (parameters pi_k), repeated in the rows of its i steps
    per="probe"  the parity probe after a push (grpo/parity.py): logp the trainer's, logp_alpha the
                 engine's, on the same weights; cfg is the `parity:` section

Shipped instances: the staleness split (per batch, grpo/staleness.py, needs pi_push's log-probs)
and the parity probe's statistics (grpo/parity.py). A user's instrument is one function in a file
named under `plugins:`.

The component (`Instruments`) owns what the shipped ones need beyond a micro-batch: pi_push (a
frozen copy of the pushed weights, kept while log.split_staleness is on and v > 1) and the parity
probe's sequences, which it hands to the checkpointer and back on resume, and the recording of
batches (log.save_rollouts). The loop calls it as it calls the checkpointer:

    instruments.after_push()                      pi_push <- pi_theta: the staleness split's reference
    instruments.after_sampling(progress, stage, k, seed, rollout)
                                                  the batch recorded (log.save_rollouts) with the fingerprint of
                                                  the weights that sampled it; right after a push, the parity
                                                  probe; which weights give the batch's pi_push
    measured = instruments.sgd_pass(first)        an SGD pass: measured.before(mb), measured.after(mb, ...)
                                                  per micro-batch, measured.finish() (collective)
    instruments.row(sgd_iteration)                what the step's row gets: pass, batch, probe (first step)

Everything here is measurement: no call changes what the trainer computes or samples.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from grpo import metrics, parity, registry, staleness
from grpo.parallel import all_reduce_max, all_reduce_sum, broadcast_json, on_main_rank
from grpo.parity import ParityProbe, ParityVersionError, engine_parity, trainer_logprobs
from grpo.policy import Policy, copy_policy
from grpo.progress import Progress, alpha_lag
from grpo.recording import batch_path, record_batch, recorded_weights, sampled_by, weights_fingerprint
from grpo.serving.client import InferenceServerError

# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tokens:
    """What an instrument sees of one micro-batch: flat tensors, one entry per completion token
    (row-major over the micro-batch's sequences), detached."""

    logp: Tensor  # the policy's log-probs on this pass (pi_theta; on the batch's first pass, pi_k)
    logp_old: Tensor  # pi_old: pi_k, the policy before the batch's first step (PPO's old policy)
    logp_alpha: Tensor  # alpha's: the sampler's, as the engine reported them
    active: Tensor  # bool: the tokens the objective counts (weight != 0); values are reduced over these
    adv: Tensor  # the advantage of each token's sequence
    seq_index: Tensor  # each token's sequence in the micro-batch
    cfg: Any  # the run's TrainConfig (per="probe": the `parity:` section)
    sgd_iteration: int = 0  # which of the i passes over the batch (0: the first, where logp is pi_k)
    mb: Any = None  # the grpo.batching.MicroBatch itself (None for the probe)
    logp_push: Optional[Tensor] = None  # pi_push's (the policy at the push that sampled the batch): needs_push


@dataclass(frozen=True)
class Instrument:
    name: str
    fn: Callable[[Tokens], dict]  # tokens -> {key: per-token values [N]} (bool, float; NaN: undefined there)
    keys: tuple[str, ...]  # the logged keys it returns, declared in its section
    per: str  # "pass" | "batch" | "probe"
    reduce: dict  # key -> "mean" (the default), "max" or "sum", over the active tokens
    enabled: Callable[[Any], bool]  # the TrainConfig -> whether it runs
    needs_push: bool  # it reads logp_push: it runs only on batches whose pi_push is known


INSTRUMENTS: dict[str, Instrument] = {}
REDUCTIONS = ("mean", "max", "sum")


def register_instrument(name: str, *, section: str, per: str = "pass", reduce: Optional[dict] = None,
                        enabled: Callable[[Any], bool] = lambda cfg: True, needs_push: bool = False, **meanings: str):
    """Decorator: register fn(x: Tokens) -> {key: per-token values} as the instrument `name`; its
    keys are declared here (key=one line of meaning, in the W&B `section`) and logged in each
    training row. per: "pass", "batch" or "probe" (module docstring); reduce: key -> "max" or "sum"
    where a key is not a mean over the active tokens."""
    reduce = dict(reduce or {})
    if per not in ("pass", "batch", "probe"):
        raise ValueError(f"instrument {name}: per must be 'pass', 'batch' or 'probe', got {per!r}")
    if not meanings:
        raise ValueError(f"instrument {name}: declare its keys, key='one line of meaning'")
    if set(reduce) - set(meanings) or set(reduce.values()) - set(REDUCTIONS):
        raise ValueError(f"instrument {name}: reduce maps its keys ({sorted(meanings)}) to one of {list(REDUCTIONS)}, "
                         f"got {reduce}")
    if needs_push and per != "batch":
        raise ValueError(f"instrument {name}: needs_push is for per='batch' (pi_push scores the batch's first pass)")

    def register(fn):
        registry.register(INSTRUMENTS, name, Instrument(name, fn, tuple(meanings), per, reduce, enabled, needs_push),
                          "instrument")
        try:
            metrics.declare_many(section, meanings, module=fn.__module__)
        except ValueError:
            del INSTRUMENTS[name]
            raise
        return fn
    return register


def active_instruments(cfg, per: str) -> list[Instrument]:
    return [i for i in INSTRUMENTS.values() if i.per == per and (per == "probe" or i.enabled(cfg))]


class Reduction:
    """The reductions of some instruments' keys: partial sums (or maxima) over micro-batches, then
    over ranks (`result`). Every rank holds every key from the start, so the collectives match."""

    def __init__(self, instruments: list[Instrument]):
        self.instruments = instruments
        # on the tokens' device once added to (no host sync per micro-batch); plain numbers until then
        self.sums: dict[str, Tensor | float] = {}
        self.maxima: dict[str, Tensor | float] = {}
        for instrument in instruments:
            for key in instrument.keys:
                if instrument.reduce.get(key, "mean") == "max":
                    self.maxima[key] = -math.inf
                else:
                    self.sums[key] = self.sums[f"{key}/n"] = 0.0

    def add(self, x: Tokens, instruments: Optional[list[Instrument]] = None) -> None:
        """Every instrument's values on one micro-batch's tokens, added in."""
        for instrument in self.instruments if instruments is None else instruments:
            with registry.blame("instrument", instrument.name, instrument.fn.__module__):
                values = instrument.fn(x)
                if not isinstance(values, dict) or set(values) != set(instrument.keys):
                    raise ValueError(f"instrument {instrument.name}: returned {sorted(values)}, declared "
                                     f"{sorted(instrument.keys)}")
                for key in instrument.keys:
                    value = torch.as_tensor(values[key]).detach().to(device=x.active.device, dtype=torch.float64)
                    if value.shape != x.active.shape:
                        raise ValueError(f"instrument {instrument.name}: {key} must hold a value per token (shape "
                                         f"{tuple(x.active.shape)}), got shape {tuple(value.shape)}")
                    counted = x.active.bool() & ~torch.isnan(value)
                    if key in self.maxima:
                        top = torch.where(counted, value, -math.inf).amax() if value.numel() else -math.inf
                        self.maxima[key] = torch.clamp(torch.as_tensor(top, dtype=torch.float64, device=value.device),
                                                       min=self.maxima[key]) if value.numel() else self.maxima[key]
                    else:
                        self.sums[key] = self.sums[key] + torch.where(counted, value, 0.0).sum()
                        self.sums[f"{key}/n"] = self.sums[f"{key}/n"] + counted.sum().double()

    def result(self, collective: bool = True) -> dict[str, float]:
        """Per key: the mean over every counted token (sum, max where declared); NaN (missing from
        the row) where no token was counted. collective: over every rank (all ranks call it)."""
        sums = all_reduce_sum(self.sums) if collective else {k: float(v) for k, v in self.sums.items()}
        out = {}
        for instrument in self.instruments:
            for key in instrument.keys:
                how = instrument.reduce.get(key, "mean")
                if how == "max":
                    top = all_reduce_max(float(self.maxima[key])) if collective else float(self.maxima[key])
                    out[key] = top if top > -math.inf else math.nan
                elif how == "sum":
                    out[key] = sums[key]
                else:
                    out[key] = sums[key] / sums[f"{key}/n"] if sums[f"{key}/n"] > 0 else math.nan
        return out


def probe_stats(engine: list[list[float]], trainer: list[list[float]], parity_cfg) -> dict[str, float]:
    """Every probe instrument on the probe's tokens (rank 0, no collective): the engine's log-probs
    in alpha's place, the trainer's as the policy's and pi_old's, every token active. Missing keys
    (no token counted) are left out."""
    e = torch.tensor([v for seq in engine for v in seq], dtype=torch.float64)
    t = torch.tensor([v for seq in trainer for v in seq], dtype=torch.float64)
    seq_index = torch.tensor([j for j, seq in enumerate(engine) for _ in seq], dtype=torch.long)
    x = Tokens(logp=t, logp_old=t, logp_alpha=e, active=torch.ones_like(e, dtype=torch.bool),
               adv=torch.zeros_like(e), seq_index=seq_index, cfg=parity_cfg)
    reduction = Reduction(active_instruments(parity_cfg, "probe"))
    reduction.add(x)
    return metrics.defined(reduction.result(collective=False))


# The shipped instances: the staleness split and the parity probe's statistics.
register_instrument("staleness_split", section="bound", per="batch", needs_push=True,
                    enabled=lambda cfg: cfg.log.split_staleness and not cfg.replay,
                    **staleness.MEANINGS)(staleness.split_terms)
register_instrument("parity", section="bound", per="probe", reduce=parity.REDUCE, **parity.MEANINGS)(parity.parity_terms)


# ----------------------------------------------------------------------------------------------
# An SGD pass
# ----------------------------------------------------------------------------------------------


class SGDPass:
    """The instruments of one SGD pass over a batch's micro-batches (every rank): the per-pass ones,
    and on the batch's first pass the per-batch ones, those needing pi_push only where it is known
    (push_source: False, no step since the push, so pi_push is pi_k; True, the frozen copy scores
    each micro-batch first; None, not known)."""

    def __init__(self, cfg, sgd_iteration: int, first: bool, pushed_policy: Optional[Policy],
                 push_source: Optional[bool]):
        self.cfg, self.sgd_iteration, self.first = cfg, sgd_iteration, first
        batch = [i for i in active_instruments(cfg, "batch") if push_source is not None or not i.needs_push] \
            if first else []
        self.instruments = active_instruments(cfg, "pass") + batch
        self.reduction = Reduction(self.instruments)
        self.lagged = first and push_source is True and any(i.needs_push for i in batch)
        self.pushed_policy = pushed_policy if self.lagged else None
        self.logp_push = None

    def before(self, mb) -> None:
        """pi_push's log-probs of a micro-batch (no grad), where a measured instrument needs them and
        steps were taken since the push."""
        if self.lagged:
            with torch.no_grad():
                self.logp_push, _ = self.pushed_policy(mb.input_ids, mb.completion_index, mb.completion_tokens,
                                                       position_ids=mb.position_ids, segments=mb.segments)

    def after(self, mb, logp: Tensor, logp_old: Tensor, active: Tensor) -> None:
        """Add a micro-batch's values: logp, the pass's forward; logp_old, pi_k's (on the first pass
        the same); active, the tokens the objective counts."""
        if not self.instruments:
            return
        logp_old = logp_old.detach()
        x = Tokens(logp=logp.detach(), logp_old=logp_old, logp_alpha=mb.logp_alpha, active=active,
                   adv=mb.adv[mb.seq_of_token], seq_index=mb.seq_of_token, cfg=self.cfg,
                   sgd_iteration=self.sgd_iteration, mb=mb,
                   logp_push=self.logp_push if self.lagged else (logp_old if self.first else None))
        self.reduction.add(x)

    def finish(self) -> tuple[dict[str, float], dict[str, float]]:
        """(per-pass values, per-batch values), reduced over every rank (collective)."""
        if self.lagged:  # its no-grad forwards left FSDP2's root gathered: free it until the next lagged batch
            self.pushed_policy.reshard()
        self.pushed_policy = self.logp_push = None
        values = self.reduction.result() if self.instruments else {}
        per_pass = {key for i in self.instruments if i.per == "pass" for key in i.keys}
        return ({k: v for k, v in values.items() if k in per_pass},
                {k: v for k, v in values.items() if k not in per_pass})


# ----------------------------------------------------------------------------------------------
# The component the loop calls
# ----------------------------------------------------------------------------------------------


class Instruments:
    """The registered instruments of a run, and what the shipped ones need: pi_push, the parity probe
    and recording (every rank; I/O on rank 0). server and tokenizer are the run's (server None on
    ranks > 0 and in replay); made_with: what recorded batches are made with
    (grpo.recording.model_and_tokenizer, rank 0). Made with cfg, dist and policy alone (a trainer
    without a loop: scripts/compare_objectives.py), it measures the passes and batches it is given."""

    def __init__(self, cfg, dist, policy: Policy, pushed_policy: Optional[Policy] = None,
                 run_dir: Optional[Path] = None, tokenizer=None, made_with: Optional[dict] = None):
        self.cfg, self.dist, self.run_dir = cfg, dist, Path(run_dir) if run_dir is not None else None
        self.policy, self.tokenizer = policy, tokenizer
        self.made_with = made_with  # the model and tokenizer recorded batches are made with (rank 0; grpo/recording.py)
        self.pushed_policy = pushed_policy  # pi_push (log.split_staleness, v > 1), frozen between pushes
        self.pushed_known = False  # pushed_policy holds the push that alpha is (False after a resume that lost it)
        self.server = None  # set once launched (rank 0)
        self.probe: Optional[ParityProbe] = None  # the parity probe's sequences, every rank
        self.push_source: Optional[bool] = None  # where the current batch's pi_push comes from (split_source)
        self.batch: dict = {}  # the current batch's per-batch values (its first pass)
        self.passes: dict = {}  # the last pass's per-pass values
        self.parity: dict = {}  # the current batch's probe (after a push), for its first row
        self._sampled_by: Optional[tuple[int, dict]] = None  # (version, its fingerprint) for the recording (rank 0)

    @staticmethod
    def keeps_push(cfg) -> bool:
        """Whether the run keeps pi_push: an instrument that needs it (the staleness split, with
        log.split_staleness) does on batches sampled after steps were taken since their push (v > 1);
        replay has no pushes."""
        return cfg.grpo.v > 1 and not cfg.replay and any(i.needs_push for i in active_instruments(cfg, "batch"))

    # -- the loop's points ---------------------------------------------------------------------

    def start(self) -> None:
        """A fresh run: version 0, served from the model directory, is pi_theta_0."""
        self.after_push()

    def after_push(self) -> None:
        """pi_push <- pi_theta (collective: a local copy of each shard)."""
        if self.pushed_policy is not None:
            copy_policy(self.pushed_policy, self.policy)
            self.pushed_known = True

    def after_sampling(self, progress: Progress, stage: int, k: int, seed: int, rollout) -> None:
        """The batch as trained on to <run>/rollouts/; the parity probe right after a push (collective);
        the weights that give the batch's pi_push."""
        if self.cfg.log.save_rollouts:  # a full disk on rank 0 stops every rank (collective)
            on_main_rank(self.dist.is_main, lambda: str(record_batch(
                self.run_dir, stage, k, seed, rollout, {**self.made_with, **self.weights_of_batch(progress, stage, k)})))
        self.parity = self.probe_parity(progress, rollout, stage, k) if k % self.cfg.grpo.v == 0 else {}
        self.push_source = self.split_source(progress, rollout)
        self.batch = {}

    def sgd_pass(self, sgd_iteration: int, first: bool) -> SGDPass:
        """The instruments of an SGD pass (first: the batch's first, parameters pi_k)."""
        return SGDPass(self.cfg, sgd_iteration, first, self.pushed_policy, self.push_source)

    def finished(self, measured: SGDPass) -> None:
        """An SGD pass's values, reduced over the ranks (collective), kept for the step's row."""
        self.passes, batch = measured.finish()
        if measured.first:
            self.batch = batch

    def row(self, sgd_iteration: int) -> dict:
        """The instruments of a step's row: the pass's, the batch's (when known), the probe on its first step."""
        return {**self.batch, **self.passes, **(self.parity if sgd_iteration == 0 else {})}

    # -- checkpoints -----------------------------------------------------------------------------

    def push_model_to_save(self, inside_window: bool) -> Optional[Policy]:
        """pi_push for a checkpoint saved inside a v-window (a resume then splits exactly as the run)."""
        return self.pushed_policy if inside_window and self.pushed_policy is not None and self.pushed_known else None

    def resumed(self, push_model_saved: bool) -> None:
        """After the checkpointer loaded pi_push (if the checkpoint held it), and the run's probe
        (drawn with the parity settings it has now; else drawn again from the next probed batch)."""
        self.pushed_known = self.pushed_policy is not None and push_model_saved
        probe = None
        if self.dist.is_main:
            probe = ParityProbe.load(self.run_dir)
            if probe is not None and not probe.drawn_with(self.cfg.parity):
                print(f"[train] resume: the parity probe in {self.run_dir} was drawn with other parity settings "
                      f"({probe.settings()}); drawing a new one", file=sys.stderr)
                probe = None
        self.probe = broadcast_probe(probe)

    def close(self) -> None:
        """Drop the sharded models: they hold the process group, which Run.close frees."""
        self.policy = self.pushed_policy = None

    # -- inside ----------------------------------------------------------------------------------

    def weights_of_batch(self, progress: Progress, stage: int, k: int) -> dict[str, str]:
        """The fingerprint of the weights that sampled batch (stage, k), for its recording (rank 0):
        alpha's weights directory (the model directory at version 0), read once per version; a
        replay's, the recording's own."""
        if self.cfg.replay:
            return recorded_weights(batch_path(self.cfg.replay, stage, k))
        version = progress.weights_version
        if self._sampled_by is None or self._sampled_by[0] != version:
            weights_dir = progress.weights_dir or self.cfg.model.path
            self._sampled_by = version, sampled_by(version, weights_fingerprint(weights_dir))
        return self._sampled_by[1]

    def split_source(self, progress: Progress, rollout) -> Optional[bool]:
        """Where pi_push's log-probs come from for this batch (grpo/staleness.py): False: no optimizer
        step since the push that sampled it, so pi_push is pi_k (on policy, exactly); True: steps
        were taken, the frozen copy of the pushed weights scores it; None: not known (replay, a
        resume that lost the copy): the instruments that need it are not run."""
        if self.cfg.replay:
            return None
        pushes, steps = alpha_lag(progress, rollout.weights_version, progress.step)
        if pushes != 0 or steps is None:
            return None
        if steps == 0:
            return False
        return True if self.pushed_policy is not None and self.pushed_known else None

    def probe_parity(self, progress: Progress, rollout, stage: int, k: int) -> dict:
        """Right after a push (and at the start), before any step on the new weights: the engine and
        the trainer score the run's probe with the same weights (grpo/parity.py). The probe is drawn
        from the first batch that reaches here and kept with the run. {} when not due; parity_* and
        time_parity on rank 0. Collective (the trainer's forward)."""
        cfg = self.cfg.parity
        if cfg.sequences == 0 or self.cfg.replay or progress.weights_version % cfg.every != 0:
            return {}
        t0 = time.time()
        if self.probe is None:
            probe = None
            if self.dist.is_main:
                probe = ParityProbe.draw(rollout.samples, cfg, self.cfg.grpo.G,
                                         {"stage": stage, "iteration": k, "weights_version": progress.weights_version})
                probe.save(self.run_dir)
            self.probe = broadcast_probe(probe)
        trainer = trainer_logprobs(self.policy, self.probe, self.tokenizer.pad_token_id, self.dist.device,
                                   self.cfg.optim.share_prompts)
        outcome = None
        if self.dist.is_main:
            try:
                stats = engine_parity(self.server, self.probe, trainer, cfg, progress.weights_version,
                                      self.cfg.grpo.temperature, self.cfg.grpo.top_p)
            except InferenceServerError as e:  # a diagnostic: say it failed, train on
                print(f"[train] parity probe skipped at weights version {progress.weights_version}: {e}",
                      file=sys.stderr)
                outcome = {"stats": {}}
            except ParityVersionError as e:  # every rank stops, none waits for rank 0
                outcome = {"error": str(e)}
            else:
                outcome = {"stats": {**stats, "time_parity": time.time() - t0}}
        outcome = broadcast_json(outcome)
        if "error" in outcome:
            raise RuntimeError(outcome["error"])
        return outcome["stats"] if self.dist.is_main else {}


def broadcast_probe(probe: Optional[ParityProbe]) -> Optional[ParityProbe]:
    """Rank 0's parity probe on every rank (collective)."""
    obj = broadcast_json(probe.to_json() if probe is not None else None)
    return ParityProbe.from_json(obj) if obj is not None else None
