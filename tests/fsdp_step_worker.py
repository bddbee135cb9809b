"""One GRPO update on a fixed batch under torchrun, written out for tests/test_train_step.py.

    torchrun --nproc_per_node=N tests/fsdp_step_worker.py MODEL_DIR OUT_JSON [key=value ...]

Runs train.py's own steps (micro-batch plan, global denominators, sgd_iteration, optimizer_step)
on a seeded batch, so the 1-rank and 2-rank results can be compared number for number.
"""
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train  # noqa: E402
from grpo import objective as O  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.optim import build_optimizer, build_scheduler  # noqa: E402
from grpo.parallel import all_reduce_max, all_reduce_sum, gather_full_state_dict, init_distributed  # noqa: E402
from grpo.rollout import Sample, collate, plan_micro_batches, shard_samples  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402


def fixed_batch(vocab: int, prompts: int, G: int) -> list[Sample]:
    rng = random.Random(0)
    rewards = [float(rng.random() < 0.5) for _ in range(prompts * G)]
    adv, seq_w, _ = O.group_advantages(torch.tensor(rewards, dtype=torch.float64), G, O.ObjectiveConfig())
    samples = []
    for j in range(prompts * G):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 7))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        samples.append(Sample(group=j // G, prompt_ids=p, completion_ids=c,
                              logp_alpha=[-rng.uniform(3.0, 8.0) for _ in c], truncated=False,
                              reward=rewards[j], adv=float(adv[j]), seq_weight=float(seq_w[j])))
    return samples


def main():
    model_dir, out_path, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(TrainConfig, None, [f"model.path={model_dir}", *overrides])
    info = init_distributed()
    torch.manual_seed(0)
    policy = train.build_policy(cfg, info.device, trainable=True)
    ref = train.build_policy(cfg, info.device, trainable=False) if cfg.objective.beta > 0 else None
    optimizer = build_optimizer(policy, cfg.optim)
    scheduler = build_scheduler(optimizer, 10, cfg.optim)
    vocab = policy.lm.config.vocab_size
    samples = shard_samples(fixed_batch(vocab, cfg.grpo.batch_prompts, cfg.grpo.G), info.rank, info.world_size)
    n_micro = int(all_reduce_max(len(plan_micro_batches(samples, cfg.optim.token_budget))))
    plan = plan_micro_batches(samples, cfg.optim.token_budget, n_micro)
    mbs = [collate([samples[j] for j in idx], 0, info.device) for idx in plan]
    local = [O.local_denominators(mb.completion_mask, mb.seq_weight, cfg.objective, mb.truncated) for mb in mbs]
    totals = all_reduce_sum({"seqs": sum(a for a, _ in local), "tokens": sum(b for _, b in local)})
    cache, losses, norms = [], [], []
    for it in range(cfg.grpo.i):
        stats = O.all_reduce_stats(train.sgd_iteration(policy, ref, mbs, cache, cfg,
                                                       (int(totals["seqs"]), int(totals["tokens"])),
                                                       info.world_size, first=(it == 0)))
        grad_norm, finite = train.optimizer_step(policy, optimizer, scheduler, cfg)
        losses.append(float(stats["loss"]))
        norms.append(grad_norm)
    full = gather_full_state_dict(policy.lm)
    if info.rank == 0:
        checksum = float(sum(t.double().abs().sum() for t in full.values()))
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "param_abs_sum": checksum,
                       "micro_batches": len(mbs), "world_size": info.world_size}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
