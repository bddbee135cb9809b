"""GRPO updates on a fixed batch under torchrun, written out for tests/test_train_step.py.

    torchrun --nproc_per_node=N tests/fsdp_step_worker.py MODEL_DIR CASES_JSON OUT_DIR

One launch runs a list of cases one after another in the same process group (each launch pays
~20 s of start-up: torchrun, imports, gloo; a step on the tiny model takes a second or two). Each
case builds its own models, optimizer and Trainer from its own config, exactly as a launch of its
own did, and rank 0 writes its figures to OUT_DIR/<name>.json as soon as it is done (a case that
fails or hangs leaves the earlier ones' figures). After the last case the group is closed and
OUT_DIR/closed.json says whether it was freed and which threads were left.

CASES_JSON holds a list of cases: {"name", "batch", "overrides": [key=value ...]} and optionally
  "no_skip": true        masked sequences run forward and backward like the others (the reference
                         for the trainer's skip of eq. 8's masked groups)
  "rank_memory": [bytes of rank 0, bytes of rank 1, ...]
                         the device memory each rank reads (grpo.parallel.device_memory_bytes answers
                         that figure on that rank), as ranks on unlike nodes would (optim.grad_sync
                         auto decides from it)
  "kind": "ref_swap"     pi_ref <- pi_theta (grpo.policy.copy_policy) after no-grad forwards, in
                         place of GRPO steps (reference_swap); "batch" is then unused

BATCH: "fixed" (random lengths) or "skewed" (the first half of the groups long, one sequence longer
than a small token budget, the second half short: ranks plan different micro-batch counts), or
"masked" / "allmasked" (every other group / every group with one reward for all its completions:
zero variance, masked by eq. 8 when objective.mask_zero_variance is on); "grouped" / "grouped-masked":
"fixed" / "masked" with one prompt per group (optim.share_prompts needs it).
Runs train.py's own steps (plan_batch, sgd_iteration, optimizer_step) on a seeded batch, so the
1-rank and 2-rank results can be compared number for number.

What a case leaves in the process that a launch of its own did not have: a plugin's registrations
(registries refuse a name twice, so they stay once imported), hence a case that names plugins must
come after every case that does not (refused otherwise); compiled graphs (torch._dynamo is reset
after a compiled case); the patched functions of no_skip and rank_memory (restored after the case).
"""
import contextlib
import gc
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

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
from grpo.policy import copy_policy  # noqa: E402
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


def reference_swap(cfg, info) -> dict:
    """pi_ref <- pi_theta under FSDP2 bf16 mixed precision, after no-grad forwards of both (which leave
    the root's parameters unsharded): the log-prob gaps before and after the swap, and whether the
    frozen copy's parameters stay leaves without gradient."""
    policy = train.build_policy(cfg, info.device, trainable=True)
    ref = train.build_policy(cfg, info.device, trainable=False)
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    index = torch.arange(5, 11)
    targets = ids.view(-1)[index + 1]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)  # pi_theta moves away from pi_ref
        before = (policy(ids, index, targets)[0] - ref(ids, index, targets)[0]).abs().max().item()
    copy_policy(ref, policy)  # as train.py calls it: gradients enabled around it
    params = list(ref.parameters())
    leaves = sum(p.is_leaf and not p.requires_grad and p.grad_fn is None for p in params)
    with torch.no_grad():
        after = (policy(ids, index, targets)[0] - ref(ids, index, targets)[0]).abs().max().item()
    return {"before": before, "after": after, "frozen_parameters": len(params), "leaves_without_grad": leaves}


@contextlib.contextmanager
def patched(case: dict):
    """The case's stand-ins for what a launch of its own set in its environment, restored after it."""
    contributing, device_memory_bytes = train.contributing, parallel.device_memory_bytes
    if case.get("no_skip"):  # the reference: every sequence runs forward and backward
        train.contributing = lambda completion_mask, *a, **k: torch.ones(completion_mask.shape[0], dtype=torch.bool)
    if case.get("rank_memory"):  # this rank's figure of the case's per-rank device memory
        memory = int(case["rank_memory"][int(os.environ.get("RANK", "0"))])
        parallel.device_memory_bytes = lambda device, ranks_on_node=1: memory
    try:
        yield
    finally:
        train.contributing, parallel.device_memory_bytes = contributing, device_memory_bytes


CASE_TIMEOUT_S = 600  # what a launch of one case was given; before their fix, unlike ranks hung


def end_unless_done(case: dict) -> threading.Timer:
    """Ends this rank (torchrun then ends the others) if the case is not done within CASE_TIMEOUT_S:
    a hung collective fails its case in bounded time, naming it, and the cases before it keep their figures."""
    def end():
        print(f"case {case['name']}: not done after {CASE_TIMEOUT_S} s", flush=True)
        os._exit(3)
    timer = threading.Timer(CASE_TIMEOUT_S, end)
    timer.daemon = True
    timer.start()
    return timer


def main():
    model_dir, cases_path, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    with open(cases_path) as f:
        cases = json.load(f)
    info = init_distributed()
    plugins_from = None  # the first case that imported plugins: they stay registered for the cases after it
    for case in cases:
        print(f"case {case['name']}: started", flush=True)
        started, deadline = time.monotonic(), end_unless_done(case)
        overrides = case["overrides"]
        if plugins_from is not None and not any(o.startswith("plugins=") for o in overrides):
            raise SystemExit(f"case {case['name']}: runs after {plugins_from}, whose plugins stay registered; "
                             "put cases that name plugins last")
        if any(o.startswith("plugins=") for o in overrides):
            plugins_from = plugins_from or case["name"]
        cfg = load_config(TrainConfig, None, [f"model.path={model_dir}", *overrides])
        with patched(case):
            result = reference_swap(cfg, info) if case.get("kind") == "ref_swap" else run_steps(cfg, info, case["batch"])
        if cfg.model.compile:
            torch._dynamo.reset()  # the compiled layers' graphs hold the case's sharded models (and the group)
        gc.collect()  # the case's models live in reference cycles (module hooks): free them before the next
        if info.rank == 0:
            (out_dir / f"{case['name']}.json").write_text(json.dumps(result))
        deadline.cancel()
        print(f"case {case['name']}: done in {time.monotonic() - started:.1f} s", flush=True)
    closed = {"group_freed": close_distributed(), "threads_after_close": native_thread_names()}
    if info.rank == 0:
        (out_dir / "closed.json").write_text(json.dumps(closed))


def native_thread_names() -> list[str]:
    """This process's OS threads by name (gloo's are gloo_tcp_loop and pt_gloo_runloop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


if __name__ == "__main__":
    main()
