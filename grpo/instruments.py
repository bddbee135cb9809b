"""The off-policy instruments as one component, which the loop calls at its points as it calls the
checkpointer (docs/offpolicy.md):

    instruments.after_push()                      pi_push <- pi_theta: the staleness split's reference
    instruments.after_sampling(progress, stage, k, seed, rollout)
                                                  the batch recorded (log.save_rollouts) with the fingerprint of
                                                  the weights that sampled it; right after a push,
                                                  the parity probe; which weights score the batch's split
    split = instruments.split                     on the first SGD pass: split.before(mb), split.after(mb, ...),
                                                  split.finish() (grpo/staleness.py's sums, all-reduced)
    instruments.row(sgd_iteration)                what the step's row gets: the split, the probe (first step)

It owns pi_push (a frozen copy of the pushed weights, kept while log.split_staleness is on and
v > 1) and the parity probe's sequences, and hands both to the checkpointer and back on resume.
Everything here is measurement: no call changes what the trainer computes or samples.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import torch

from grpo import staleness
from grpo.parallel import all_reduce_sum, broadcast_json, on_main_rank
from grpo.parity import ParityProbe, ParityVersionError, engine_parity, trainer_logprobs
from grpo.policy import Policy, copy_policy
from grpo.progress import Progress, alpha_lag
from grpo.recording import batch_path, record_batch, recorded_weights, sampled_by, weights_fingerprint
from grpo.serving.client import InferenceServerError


class StalenessSplit:
    """The split of one batch's first SGD pass (grpo/staleness.py). lagged: None, not logged;
    False, no optimizer step since the push that sampled the batch (pi_push is pi_k: the pass's own
    log-probs); True, the frozen pushed weights score each micro-batch before its forward."""

    def __init__(self, pushed_policy: Optional[Policy], lagged: Optional[bool]):
        self.pushed_policy, self.lagged = pushed_policy, lagged
        self.sums, self.logp_push, self.means = None, None, {}

    def before(self, mb) -> None:
        """pi_push's log-probs of a micro-batch (no grad), when lagged."""
        if self.lagged:
            with torch.no_grad():
                self.logp_push, _ = self.pushed_policy(mb.input_ids, mb.completion_index, mb.completion_tokens,
                                                       position_ids=mb.position_ids, segments=mb.segments)

    def after(self, logp_alpha: torch.Tensor, logp_k: torch.Tensor, active: torch.Tensor) -> None:
        """Add a micro-batch's terms, with pi_k's log-probs from the pass's forward."""
        if self.lagged is not None:
            logp_push = self.logp_push if self.lagged else logp_k
            self.sums = staleness.add_sums(self.sums, staleness.split_sums(logp_alpha, logp_push, logp_k, active))

    def finish(self) -> None:
        """All-reduce the sums into per-token means (collective, on every rank when logged)."""
        if self.lagged:  # its no-grad forwards left FSDP2's root gathered: free it until the next lagged batch
            self.pushed_policy.reshard()
        self.release()
        if self.sums is not None:
            self.means = staleness.split_means(all_reduce_sum(self.sums))

    def release(self) -> None:
        """Let go of pi_push: a sharded model holds the process group, which Run.close frees."""
        self.pushed_policy, self.logp_push = None, None


class OffPolicyInstruments:
    """Staleness split, parity probe and recording for a run (every rank; I/O on rank 0). server
    and tokenizer are the run's (server None on ranks > 0 and in replay); made_with: what recorded
    batches are made with (grpo.recording.model_and_tokenizer, rank 0)."""

    def __init__(self, cfg, dist, run_dir: Path, policy: Policy, pushed_policy: Optional[Policy], tokenizer,
                 made_with: Optional[dict] = None):
        self.cfg, self.dist, self.run_dir = cfg, dist, Path(run_dir)
        self.policy, self.tokenizer = policy, tokenizer
        self.made_with = made_with  # the model and tokenizer recorded batches are made with (rank 0; grpo/recording.py)
        self.pushed_policy = pushed_policy  # pi_push (log.split_staleness, v > 1), frozen between pushes
        self.pushed_known = False  # pushed_policy holds the push that alpha is (False after a resume that lost it)
        self.server = None  # set once launched (rank 0)
        self.probe: Optional[ParityProbe] = None  # the parity probe's sequences, every rank
        self.split = StalenessSplit(None, None)  # the current batch's
        self.parity: dict = {}  # the current batch's probe (after a push), for its first row
        self._sampled_by: Optional[tuple[int, dict]] = None  # (version, its fingerprint) for the recording (rank 0)

    @staticmethod
    def keeps_push(cfg) -> bool:
        """Whether the run keeps pi_push: the staleness split needs it on batches sampled after steps
        were taken since their push (v > 1); replay has no pushes."""
        return cfg.log.split_staleness and cfg.grpo.v > 1 and not cfg.replay

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
        the weights that score the batch's staleness split."""
        if self.cfg.log.save_rollouts:  # a full disk on rank 0 stops every rank (collective)
            on_main_rank(self.dist.is_main, lambda: str(record_batch(
                self.run_dir, stage, k, seed, rollout, {**self.made_with, **self.weights_of_batch(progress, stage, k)})))
        self.parity = self.probe_parity(progress, rollout, stage, k) if k % self.cfg.grpo.v == 0 else {}
        self.split = StalenessSplit(self.pushed_policy, self.split_source(progress, rollout))

    def row(self, sgd_iteration: int) -> dict:
        """The instruments of a step's row: the batch's split (when known), the probe on its first step."""
        return {**self.split.means, **(self.parity if sgd_iteration == 0 else {})}

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
        """Drop the sharded models (the loop's batch cache shares the current split)."""
        self.split.release()
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
        """Where pi_push's log-probs come from for this batch's staleness split (grpo/staleness.py):
        False: no optimizer step since the push that sampled it, so pi_push is pi_k (on policy,
        exactly); True: steps were taken, the frozen copy of the pushed weights scores it; None: not
        known (the split is not logged: replay, log.split_staleness off, a resume that lost the copy)."""
        if not self.cfg.log.split_staleness or self.cfg.replay:
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
