"""Several objectives on the same recorded batches, from the same parameters: how their updates differ.

    python scripts/compare_objectives.py --run runs/<recorded> --config configs/cpu_demo.yaml \
        --objective grpo --objective "cispo: objective.loss=cispo objective.advantage=none" \
        --objective "gspo: objective.loss=gspo" --out runs/<recorded>/compare

A recorded run (log.save_rollouts: true) holds every batch as trained on, with alpha's log-probs.
For each batch and each objective (`NAME: overrides of the config`, the first one the reference),
this computes the gradient of that objective's loss at the same parameters (the config's
`model.path`, or --model), as the first SGD step on the batch would take it (pi_k = the current
policy; advantages and weights recomputed under that objective's section with the batch's own seed),
and reports per batch: the gradient norm, the cosine between each update and the reference's, the
loss, the clip fraction and the fraction of tokens a correction masked. One process, no server,
no optimizer: the parameters never move, so every difference is the objective's. The policy is the
trainer's own (train.build_policy, FSDP2 over this one process): it computes in the precision the
config's model.dtype gives on this machine's CPU (bf16 mixed precision where it multiplies bf16, fp32
elsewhere), as the run computed where it trained on the same kind of CPU.

With --follow the parameters move between batches along the recorded run's own updates, taken by
the trainer's own step (train.plan_batch, sgd_iteration, optimizer_step under the run's config: the
objective with beta and pi_ref, i, micro-batches, clipping, AdamW), so batch k is compared where the
run trained on it: its rows hold alpha_lag_steps (optimizer steps since the push that sampled the
batch) and run_grad_norms (the run objective's gradient norm per SGD iteration: the run's grad_norm).

Writes <out>/compare.jsonl (a row per batch and objective), <out>/compare.md (the table, printed
too) and <out>/compare.png (gradient norm and cosine per batch); the last line printed is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo.config import ConfigError, load_config  # noqa: E402
from grpo.cpu.bf16 import lm_head_bf16_math_installed  # noqa: E402
from grpo.models import load_tokenizer  # noqa: E402
from grpo.objective import finalize_stats  # noqa: E402
from grpo.optim import build_optimizer, build_scheduler  # noqa: E402
from grpo.parallel import DistInfo, close_distributed, init_distributed  # noqa: E402
from grpo.policy import Policy, copy_policy  # noqa: E402
from grpo.recording import RecordedStream, ReplayError, model_and_tokenizer  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402
import train  # noqa: E402  (the trainer's own policy and step)


DEVICE = torch.device("cpu")  # one process on this machine's CPU cores
ONE_PROCESS = DistInfo(0, 1, 0, DEVICE)  # its rank: FSDP2 over this process alone


def parse_objective(spec: str) -> tuple[str, list[str]]:
    """'name: key=value key=value' (or just 'name') -> (name, overrides)."""
    name, _, rest = spec.partition(":")
    return name.strip(), rest.split()


def gradient(policy: Policy, rollout, cfg: TrainConfig, pad_token_id: int) -> tuple[torch.Tensor, dict]:
    """The flat gradient of cfg's objective on the whole batch at the policy's parameters, as the
    trainer's first SGD iteration on it takes it (train.plan_batch, sgd_iteration: micro-batches,
    global denominators, pi = pi_k), and the objective's finalized statistics."""
    policy.zero_grad(set_to_none=True)
    policy.temperature = cfg.grpo.temperature
    trainer = train.Trainer(cfg=cfg, dist=ONE_PROCESS, policy=policy, pad_token_id=pad_token_id)
    micro_batches, denominators, _ = train.plan_batch(trainer, rollout)
    stats, _ = train.sgd_iteration(trainer, micro_batches, train.BatchCache(), denominators)
    grads = [full(p.grad).reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in policy.parameters()]
    policy.zero_grad(set_to_none=True)
    return torch.cat(grads).double().cpu(), finalize_stats(stats)


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's whole tensor (FSDP2 holds DTensor shards: here one, of the whole)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainer_policy(cfg: TrainConfig, model_path: str, trainable: bool) -> Policy:
    """The policy train.py would build from `model_path` under cfg: FSDP2 over this process, in the
    compute dtype model.dtype gives here (the LM head in the trainer's CPU math mode: main). A plain
    fp32 model is not the run's arithmetic where the run trained in bf16: --follow's gradient norms
    left the run's from the first step (1.5e-4 relative) and by 5% after eight."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))
    return train.build_policy(cfg, DEVICE, trainable)


class Follower:
    """--follow: the parameters move along the recorded run's own updates, batch after batch, by the
    trainer's own step under its config (train.plan_batch, sgd_iteration, optimizer_step: micro-batches
    of optim.token_budget, beta with pi_ref, pi_ref <- pi_theta at each new stage, i SGD iterations,
    clipping, AdamW at its learning rate and schedule), so each batch is compared at the parameters
    the run had when it trained on it, up to the order of float sums between its ranks and this one
    process: pi_k then lags alpha by the batch's place in its v-window, as it did live. `step` returns
    the run objective's gradient norm before clipping, per SGD iteration (the run logged grad_norm)."""

    def __init__(self, policy: Policy, run_cfg: TrainConfig, model_path: str, pad_token_id: int):
        self.cfg, self.stage = run_cfg, 0
        ref = trainer_policy(run_cfg, model_path, trainable=False) if run_cfg.objective.beta > 0 else None
        optimizer = build_optimizer(policy, run_cfg.optim)
        scheduler = build_scheduler(optimizer, run_cfg.grpo.S * run_cfg.grpo.M * run_cfg.grpo.i, run_cfg.optim)
        self.run = train.Trainer(cfg=run_cfg, dist=ONE_PROCESS, policy=policy, pad_token_id=pad_token_id,
                                 ref_policy=ref, optimizer=optimizer, scheduler=scheduler)

    def step(self, stream: RecordedStream, stage: int, k: int) -> list[float]:
        run = self.run
        if stage != self.stage and run.ref_policy is not None:  # the end of a stage: pi_ref <- pi_theta
            copy_policy(run.ref_policy, run.policy)
        self.stage = stage
        micro_batches, denominators, _ = train.plan_batch(run, stream.rollout(stage, k, self.cfg))
        cache, norms = train.BatchCache(), []
        for _ in range(self.cfg.grpo.i):
            train.sgd_iteration(run, micro_batches, cache, denominators)
            grad_norm, _ = train.optimizer_step(run)
            norms.append(grad_norm)
        return norms


def compare(run_dir: Path, base: TrainConfig, objectives: list[tuple[str, TrainConfig]], model_path: str,
            follow: Optional[TrainConfig] = None) -> list[dict]:
    """A row per batch and objective; with `follow` (the recorded run's config) the parameters move
    along that run's updates (Follower) and each row holds the batch's alpha_lag_steps."""
    stream = RecordedStream(run_dir)
    tokenizer = load_tokenizer(model_path)
    # at the parameters it is given (--model may be other weights on purpose): the weights are not checked
    stream.check_batches(sorted(stream.files), base, model_and_tokenizer(model_path, tokenizer), None)
    policy = trainer_policy(follow or base, model_path, trainable=True)
    follower = Follower(policy, follow, model_path, tokenizer.pad_token_id) if follow is not None else None
    rows = []
    for stage, k in sorted(stream.files):
        reference, first = None, len(rows)
        for name, cfg in objectives:
            rollout = stream.rollout(stage, k, cfg)
            grad, stats = gradient(policy, rollout, cfg, tokenizer.pad_token_id)
            reference = grad if reference is None else reference
            denom = float(grad.norm() * reference.norm())
            rows.append({"stage": stage, "iteration": k, "objective": name, "grad_norm": float(grad.norm()),
                         "cosine_to_reference": float(grad @ reference) / denom if denom > 0 else math.nan,
                         "loss": stats["loss"], "clip_frac": stats["clip_frac"],
                         "masked_frac": stats.get("is_masked_frac", math.nan),
                         "reward_mean": rollout.stats["reward_mean"],
                         # optimizer steps between the push that sampled the batch and these parameters
                         **({"alpha_lag_steps": (k % follow.grpo.v) * follow.grpo.i} if follower else {})})
        if follower is not None:
            norms = follower.step(stream, stage, k)
            for row in rows[first:]:
                row["run_grad_norms"] = norms
    return rows


def table(rows: list[dict]) -> str:
    keys = ("stage", "iteration", "objective", "grad_norm", "cosine_to_reference", "loss", "clip_frac", "masked_frac")
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["objective"] for r in rows))
    fig, (ax_norm, ax_cos) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in names:
        mine = [r for r in rows if r["objective"] == name]
        x = list(range(len(mine)))
        ax_norm.plot(x, [r["grad_norm"] for r in mine], marker="o", label=name)
        ax_cos.plot(x, [r["cosine_to_reference"] for r in mine], marker="o", label=name)
    ax_norm.set(xlabel="recorded batch", ylabel="gradient norm", title="update size")
    ax_cos.set(xlabel="recorded batch", ylabel=f"cosine to {names[0]}", title="update direction")
    ax_norm.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a run recorded with log.save_rollouts: true")
    ap.add_argument("--config", help="the config the objectives' overrides apply to (default: the run's own)")
    ap.add_argument("--model", help="the parameters (default: the config's model.path)")
    ap.add_argument("--objective", action="append", required=True, help="'NAME: key=value ...'; the first is the reference")
    ap.add_argument("--out", help="output directory (default: <run>/compare)")
    ap.add_argument("--follow", action="store_true",
                    help="move the parameters along the recorded run's own updates (its config), so each batch is "
                         "compared where the run trained on it (from --model, the run's starting parameters)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run)
    config = args.config or str(run_dir / "config.yaml")
    # pi_ref = pi_theta at the compared parameters: the KL term's gradient is 0, so beta is set to 0
    common = ["replay=null", "eval_data=null", "objective.beta=0.0"]
    try:
        base = load_config(TrainConfig, config, common)
        objectives = [(name, load_config(TrainConfig, config, [*common, *over]))
                      for name, over in map(parse_objective, args.objective)]
        follow = load_config(TrainConfig, str(run_dir / "config.yaml"), ["replay=null", "eval_data=null"]) \
            if args.follow else None
        init_distributed(DEVICE)  # FSDP2's process group: this process alone
        try:
            # the LM head's CPU math mode that grpo.cpu.tune_trainer gives a trainer, for this call only
            with lm_head_bf16_math_installed():
                rows = compare(run_dir, base, objectives, args.model or base.model.path, follow)
        finally:
            close_distributed()
    except (ConfigError, ReplayError) as e:
        print(f"compare_objectives: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or run_dir / "compare")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = table(rows)
    (out / "compare.md").write_text(text + "\n")
    plot(rows, out / "compare.png")
    print(text)
    print(json.dumps({"rows": len(rows), "out": str(out), "objectives": [n for n, _ in objectives]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
