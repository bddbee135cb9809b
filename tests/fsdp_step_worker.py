"""GRPO updates on a fixed batch under torchrun, written out for tests/test_train_step.py.

    torchrun --nproc_per_node=N tests/fsdp_step_worker.py MODEL_DIR OUT_JSON BATCH [key=value ...]

BATCH: "fixed" (random lengths) or "skewed" (the first half of the groups long, one sequence longer
than a small token budget, the second half short: ranks plan different micro-batch counts), or
"masked" / "allmasked" (every other group / every group with one reward for all its completions:
zero variance, masked by eq. 8 when objective.mask_zero_variance is on); "grouped" / "grouped-masked":
"fixed" / "masked" with one prompt per group (optim.share_prompts needs it). With GRPO_NO_SKIP=1 in the
environment, masked sequences run forward and backward like the others (the reference for the skip).
Runs train.py's own steps (plan_batch, sgd_iteration, optimizer_step) on a seeded batch, so the
1-rank and 2-rank results can be compared number for number.

GRPO_TEST_RANK_MEMORY=<bytes of rank 0>,<bytes of rank 1>,... in the environment: the device memory
each rank reads (grpo.parallel.device_memory_bytes answers that figure on that rank), as ranks on
unlike nodes would (optim.grad_sync auto decides from it).
"""
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import train  # noqa: E402
from grpo import objective as O  # noqa: E402
from grpo.advantages import group_advantages  # noqa: E402
from grpo import parallel  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.optim import build_optimizer, build_scheduler  # noqa: E402
from grpo.parallel import close_distributed, gather_full_state_dict, gradient_sync_plan, init_distributed  # noqa: E402
from grpo.rollout import Rollout, Sample  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402


def fixed_batch(vocab: int, prompts: int, G: int, skewed: bool = False, masked: str = "",
                objective: O.ObjectiveConfig = O.ObjectiveConfig(), grouped: bool = False) -> list[Sample]:
    """grouped: a group's samples share one prompt (as a real rollout's do; the shared-prompt layout
    needs it); otherwise every sample has a prompt of its own."""
    rng = random.Random(0)
    rewards = [float(rng.random() < 0.5) for _ in range(prompts * G)]
    for j in range(prompts * G):
        if masked == "allmasked" or (masked == "masked" and (j // G) % 2 == 0):
            rewards[j] = float((j // G) % 3 == 0)  # one value per group
    adv, seq_w, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, objective)
    samples = []
    for j in range(prompts * G):
        long = skewed and j < prompts * G // 2
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 30) if long else rng.randint(3, 7))]
        if grouped:
            p = p if j % G == 0 else samples[-1].prompt_ids
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(10, 20) if long else rng.randint(1, 9))]
        if skewed and j == 0:
            c = c + [rng.randrange(3, vocab) for _ in range(100)]  # longer than the budget on its own
        samples.append(Sample(group=j // G, prompt_ids=p, completion_ids=c,
                              logp_alpha=[-rng.uniform(3.0, 8.0) for _ in c], truncated=False,
                              reward=rewards[j], adv=float(adv[j]), seq_weight=float(seq_w[j])))
    return samples


def run_steps(cfg, info, batch_kind: str) -> dict:
    """i SGD iterations of train.py on the seeded batch: this rank's figures (the models die here)."""
    torch.manual_seed(0)
    policy = train.build_policy(cfg, info.device, trainable=True)
    ref = train.build_policy(cfg, info.device, trainable=False) if cfg.objective.beta > 0 else None
    optimizer = build_optimizer(policy, cfg.optim)
    memory = parallel.device_memory_bytes(info.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    sync_every, sync_why = gradient_sync_plan(cfg.optim.grad_sync, policy, memory)  # as train.py's set-up plans it
    run = train.Trainer(cfg=cfg, dist=info, policy=policy, pad_token_id=0, ref_policy=ref, optimizer=optimizer,
                        scheduler=build_scheduler(optimizer, 10, cfg.optim), sync_every_micro_batch=sync_every)
    plans = [None] * info.world_size
    torch.distributed.all_gather_object(plans, [sync_every, sync_why])  # before any step: seen even if the steps hang
    print(json.dumps({"gradient_sync_plans": plans}), flush=True)
    vocab = policy.lm.config.vocab_size
    if os.environ.get("GRPO_NO_SKIP") == "1":  # the reference: every sequence runs forward and backward
        train.contributing = lambda completion_mask, *a, **k: torch.ones(completion_mask.shape[0], dtype=torch.bool)
    batch = fixed_batch(vocab, cfg.grpo.batch_prompts, cfg.grpo.G, skewed=batch_kind == "skewed",
                        masked=batch_kind.removeprefix("grouped-") if "masked" in batch_kind else "", objective=cfg.objective,
                        grouped=batch_kind.startswith("grouped"))
    mbs, denominators, _ = train.plan_batch(run, Rollout(batch, {}, []))
    cache, losses, norms, entropies, kls, instruments = train.BatchCache(), [], [], [], [], []
    for it in range(cfg.grpo.i):
        stats, entropy_sum = train.sgd_iteration(run, mbs, cache, denominators)
        instruments.append(run.instruments.row(it))  # the registered instruments of the step, all ranks reduced
        grad_norm, finite = train.optimizer_step(run)
        losses.append(float(stats["loss"]))
        kls.append(O.finalize_stats(stats)["kl_mean"])
        norms.append(grad_norm)
        entropies.append(entropy_sum / max(float(stats["num_tokens"]), 1.0))  # what train.py logs at each step
    # pi_ref's forwards left FSDP2's root gathered; the step reshards it (every parameter a DTensor shard)
    ref_resharded = ref is None or all(isinstance(p, DTensor) for p in ref.parameters())
    full = gather_full_state_dict(policy.lm)
    # Padded tokens of each micro-batch of this rank, and whether it holds one sequence only.
    shapes = [[int(mb.input_ids.numel()), int(mb.completion_mask.shape[0])] for mb in mbs]
    all_shapes = [None] * info.world_size
    torch.distributed.all_gather_object(all_shapes, shapes)
    checksum = float(sum(t.double().abs().sum() for t in full.values()))
    return {"losses": losses, "grad_norms": norms, "param_abs_sum": checksum, "entropies": entropies, "kls": kls,
            "micro_batches": len(mbs), "world_size": info.world_size, "gradient_sync_plans": plans,
            "shapes": all_shapes, "ref_resharded": ref_resharded,
            "rows": sum(int(mb.input_ids.shape[0]) for mb in mbs),  # this rank's (shared-prompt: group rows)
            "instruments": instruments}


def report_memory(per_rank: str) -> None:
    """grpo.parallel.device_memory_bytes answers this rank's figure of GRPO_TEST_RANK_MEMORY."""
    memory = int(per_rank.split(",")[int(os.environ.get("RANK", "0"))])
    parallel.device_memory_bytes = lambda device, ranks_on_node=1: memory


def main():
    model_dir, out_path, batch_kind, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    if os.environ.get("GRPO_TEST_RANK_MEMORY"):
        report_memory(os.environ["GRPO_TEST_RANK_MEMORY"])
    cfg = load_config(TrainConfig, None, [f"model.path={model_dir}", *overrides])
    info = init_distributed()
    result = run_steps(cfg, info, batch_kind)
    result["group_freed"] = close_distributed()
    result["threads_after_close"] = native_thread_names()
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def native_thread_names() -> list[str]:
    """This process's OS threads by name (gloo's are gloo_tcp_loop and pt_gloo_runloop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


if __name__ == "__main__":
    main()
