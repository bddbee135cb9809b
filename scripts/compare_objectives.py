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
no optimizer: the parameters never move, so every difference is the objective's.

With --follow the parameters move between batches along the recorded run's own updates (its
config: the objective with beta and pi_ref, i, the learning rate), so batch k is compared where the
run trained on it: its rows hold alpha_lag_steps (optimizer steps since the push that sampled the
batch) and run_grad_norms (the run objective's gradient norm per SGD iteration: the run's grad_norm).

Writes <out>/compare.jsonl (a row per batch and objective), <out>/compare.md (the table, printed
too) and <out>/compare.png (gradient norm and cosine per batch); the last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo.batching import collate  # noqa: E402
from grpo.config import ConfigError, load_config  # noqa: E402
from grpo.models import load_model, load_tokenizer  # noqa: E402
from grpo.objective import finalize_stats, local_denominators, token_weights  # noqa: E402
from grpo.optim import build_optimizer, build_scheduler  # noqa: E402
from grpo.policy import ObjectiveInputs, Policy  # noqa: E402
from grpo.recording import RecordedStream, ReplayError, model_and_tokenizer  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402


def parse_objective(spec: str) -> tuple[str, list[str]]:
    """'name: key=value key=value' (or just 'name') -> (name, overrides)."""
    name, _, rest = spec.partition(":")
    return name.strip(), rest.split()


def gradient(policy: Policy, rollout, cfg: TrainConfig, ref_policy: Optional[Policy] = None,
             logp_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The flat gradient of cfg's objective on the whole batch at the policy's parameters, the
    objective's finalized statistics and pi's log-probs. ref_policy: pi_ref of the KL term (beta > 0);
    logp_k: pi_k's log-probs after the first SGD iteration on the batch (None: pi is pi_k)."""
    mb = collate(rollout.samples, 0, torch.device("cpu"))
    logp_ref = None
    if ref_policy is not None and cfg.objective.beta > 0:
        with torch.no_grad():
            logp_ref, _ = ref_policy(mb.input_ids, mb.completion_index, mb.completion_tokens)
    num_seqs, num_tokens = local_denominators(mb.completion_mask, mb.seq_weight, cfg.objective, mb.truncated)
    weights = token_weights(mb.completion_mask, mb.seq_weight, cfg.objective, num_seqs=max(num_seqs, 1),
                            num_tokens=max(num_tokens, 1), max_len=cfg.grpo.max_new_tokens,
                            truncated=mb.truncated)[mb.completion_mask.bool()]
    policy.zero_grad(set_to_none=True)
    policy.temperature = cfg.grpo.temperature
    out = policy(mb.input_ids, mb.completion_index, mb.completion_tokens,
                 objective=ObjectiveInputs(mb.logp_alpha, logp_k, logp_ref, mb.adv[mb.seq_of_token], weights,
                                           cfg.objective, seq_index=mb.seq_of_token))
    out.loss.backward()
    grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in policy.parameters()]
    return torch.cat(grads).double(), finalize_stats(out.stats), out.logp


class Follower:
    """--follow: the parameters move along the recorded run's own updates, batch after batch (its
    config's objective with beta and pi_ref, pi_ref <- pi_theta at each new stage, i SGD iterations,
    the gradient clipped as train.py clips it, AdamW at its learning rate and schedule), so each
    batch is compared at the parameters the run had when it trained on it, up to the order of float
    sums: pi_k then lags alpha by the batch's place in its v-window, as it did live. `step` returns
    the run objective's gradient norm before clipping, per SGD iteration (the run logged grad_norm)."""

    def __init__(self, policy: Policy, run_cfg: TrainConfig, model_path: str):
        self.policy, self.cfg, self.stage = policy, run_cfg, 0
        self.ref = None
        if run_cfg.objective.beta > 0:
            self.ref = Policy(load_model(model_path, dtype=torch.float32).requires_grad_(False),
                              run_cfg.grpo.temperature, run_cfg.kernels)
        self.optimizer = build_optimizer(policy, run_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, run_cfg.grpo.S * run_cfg.grpo.M * run_cfg.grpo.i,
                                         run_cfg.optim)

    def step(self, stream: RecordedStream, stage: int, k: int) -> list[float]:
        if stage != self.stage and self.ref is not None:  # the end of a stage: pi_ref <- pi_theta
            self.ref.load_state_dict(self.policy.state_dict())
        self.stage = stage
        rollout = stream.rollout(stage, k, self.cfg)
        logp_k, norms = None, []
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        for _ in range(self.cfg.grpo.i):
            self.policy.zero_grad(set_to_none=True)
            _, _, logp = gradient(self.policy, rollout, self.cfg, self.ref, logp_k)
            logp_k = logp if logp_k is None else logp_k  # pi_k: the parameters before the first iteration
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm=max_norm)))
            self.optimizer.step()
            self.scheduler.step()
        self.policy.zero_grad(set_to_none=True)
        return norms


def compare(run_dir: Path, base: TrainConfig, objectives: list[tuple[str, TrainConfig]], model_path: str,
            follow: Optional[TrainConfig] = None) -> list[dict]:
    """A row per batch and objective; with `follow` (the recorded run's config) the parameters move
    along that run's updates (Follower) and each row holds the batch's alpha_lag_steps."""
    stream = RecordedStream(run_dir)
    stream.check_batches(sorted(stream.files), base, model_and_tokenizer(model_path, load_tokenizer(model_path)))
    lm = load_model(model_path, dtype=torch.float32)
    policy = Policy(lm, base.grpo.temperature, base.kernels)
    follower = Follower(policy, follow, model_path) if follow is not None else None
    rows = []
    for stage, k in sorted(stream.files):
        reference, first = None, len(rows)
        for name, cfg in objectives:
            rollout = stream.rollout(stage, k, cfg)
            grad, stats, _ = gradient(policy, rollout, cfg)
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
        rows = compare(run_dir, base, objectives, args.model or base.model.path, follow)
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
