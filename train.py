"""Iterative GRPO with verifiable rewards, on- and off-policy: Algorithm 1 of Mroueh et al. (2505.22257).

    torchrun --nproc_per_node=N train.py --config configs/cpu_demo.yaml [grpo.v=10 optim.lr=1e-6 ...] [--resume]

for stage s < S:                                   (the reference policy is refreshed after each)
  for iteration k < M:
    sample a batch of prompts
    if k mod v == 0: push pi_theta to the inference server     (alpha <- pi_theta; v > 1 is off-policy)
    sample G completions per prompt from alpha, with alpha's log-probs
    rewards, group advantages (eq. 2), zero-variance mask (eq. 8)
    for i SGD iterations: forward, objective (eq. 6/7), backward, optimizer step
  pi_ref <- pi_theta

Rank 0 talks to the server and scores; the batch is broadcast and every rank trains on its share
(FSDP2). The helpers above `main` are the loop's steps; the loop itself is at the bottom.
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import kernels
from grpo import objective as O
from grpo.checkpoint import Checkpointer, export_hf
from grpo.client import InferenceServer, InferenceServerError
from grpo.config import ConfigError, load_config, save_config, to_dict
from grpo.data import build_prompt, encode_prompt, load_problems, make_sampler
from grpo.evaluation import evaluate
from grpo.metrics import MetricsLogger
from grpo.models import load_model, load_tokenizer
from grpo.optim import build_optimizer, build_scheduler
from grpo.parallel import (all_reduce_max, all_reduce_sum, broadcast_json, gather_full_state_dict,
                           init_distributed, shard_model)
from grpo.policy import PolicyLogprobs
from grpo.rewards import RewardScorer
from grpo.rollout import Sample, collate, plan_micro_batches, shard_samples
from grpo.train_config import TrainConfig
from grpo.weight_sync import prune_weights, write_weights


# ------------------------------------------------------------------------------------------------
# Set-up
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description="GRPO (Algorithm 1 of 2505.22257) with an FSDP2 trainer and a vLLM server")
    ap.add_argument("--config", help="YAML config (configs/*.yaml)")
    ap.add_argument("--resume", action="store_true", help="continue the run from its latest complete checkpoint")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.v=10 optim.lr=1e-6")
    args = ap.parse_args(argv)
    cfg = load_config(TrainConfig, args.config, args.overrides)
    if not cfg.log.run_name:
        # A fresh directory per run: an existing run is only ever continued with --resume.
        cfg.log.run_name = (Path(args.config).stem if args.config else "run") + time.strftime("-%Y%m%d-%H%M%S")
    return cfg, args


def build_policy(cfg: TrainConfig, device: torch.device, trainable: bool) -> PolicyLogprobs:
    """The HF model wrapped for per-token log-probs and sharded with FSDP2 (per layer + root)."""
    on_gpu = device.type == "cuda"
    lm = load_model(cfg.model.path, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
    if not trainable:
        lm.requires_grad_(False)
    lm.to(device)
    param_dtype = {"auto": torch.bfloat16 if on_gpu else None, "float32": None, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    policy = PolicyLogprobs(lm, cfg.grpo.temperature, cfg.kernels)
    return shard_model(policy, lm, param_dtype, cfg.model.activation_checkpointing and trainable)


def serve_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype vLLM serves in (server.dtype; "auto" = the model directory's own dtype), so a push
    needs no conversion on the server side."""
    if cfg.server.dtype != "auto":
        return getattr(torch, cfg.server.dtype)
    import json

    config_path = Path(cfg.model.path) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    name = config.get("torch_dtype") or config.get("dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.bfloat16


# ------------------------------------------------------------------------------------------------
# The steps of one iteration
# ------------------------------------------------------------------------------------------------

def push_weights(policy, server, cfg, state: dict, is_main: bool) -> float:
    """alpha <- pi_theta: gather the full state dict on rank 0, write it atomically, load it in vLLM.

    Collective (every rank gathers its shards). Records the new version and directory in `state`
    (a resumed run re-serves that exact directory); returns the bytes pushed."""
    full_state = gather_full_state_dict(policy.lm)  # {} on ranks > 0
    version = state["weights_version"] + 1
    nbytes = 0.0
    if is_main:
        # An attached server with no shared filesystem gets bytes (push_mode=bytes) from a local dir.
        root = server.weights_root or Path(cfg.log.out_dir) / cfg.log.run_name / "weights"
        weights_dir = write_weights(full_state, cfg.model.path, root, version=version,
                                    step=state["step"], dtype=serve_dtype(cfg))
        reply = server.client.push_weights(weights_dir, version=version, mode=cfg.server.push_mode)
        prune_weights(root, cfg.server.keep_last)
        nbytes = float(reply.get("bytes", 0))
        state["weights_dir"] = str(weights_dir)
    state["weights_version"] = version
    state["weights_dir"] = broadcast_json(state["weights_dir"])
    return nbytes


def sample_rollouts(server, problems, tokenizer, cfg: TrainConfig, scorer, batch_seed: int
                    ) -> tuple[list[Sample], dict, list[dict]]:
    """Rank 0: G completions per prompt from alpha, rewards, advantages (eq. 2) and mask (eq. 8).

    batch_seed fixes the server's sampling and RED-Drop's choices for this batch, so a resumed run
    repeats exactly what the uninterrupted run would have done."""
    G = cfg.grpo.G
    prompt_ids = [encode_prompt(tokenizer, build_prompt(tokenizer, p, cfg.data)) for p in problems]
    t0 = time.time()
    result = server.client.generate(prompt_ids, n=G, max_tokens=cfg.grpo.max_new_tokens,
                                    temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, seed=batch_seed)
    t_generate = time.time() - t0
    completions = [c for per_prompt in result.completions for c in per_prompt]
    golds = [p.answer for p in problems for _ in range(G)]
    t0 = time.time()
    rewards, reward_info = scorer.score([c.text for c in completions], golds)
    t_reward = time.time() - t0
    correct = reward_info.get("correct", rewards)
    adv, seq_weight, adv_stats = O.group_advantages(torch.tensor(rewards, dtype=torch.float64), G, cfg.objective,
                                                    generator=torch.Generator().manual_seed(batch_seed))
    samples = [
        Sample(group=j // G, prompt_ids=prompt_ids[j // G], completion_ids=list(c.token_ids),
               logp_alpha=[float(x) for x in c.logprobs], truncated=c.finish_reason == "length",
               reward=float(rewards[j]), correct=float(correct[j]), adv=float(adv[j]), seq_weight=float(seq_weight[j]))
        for j, c in enumerate(completions)
    ]
    lengths = [len(s.completion_ids) for s in samples]
    rollout_stats = {
        **{k: v for k, v in adv_stats.items()},
        "pass_rate": sum(s.correct for s in samples) / len(samples),
        "completion_len_mean": sum(lengths) / len(lengths),
        "truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "reward_timeouts": float(reward_info.get("timeouts", 0)),
        "weights_version_sampled": float(result.weights_version),
        "time_generate": t_generate,
        "time_reward": t_reward,
        "prompt_tokens": float(sum(len(p) for p in prompt_ids) * G),
        "completion_tokens": float(sum(lengths)),
    }
    table = [{"prompt": problems[s.group].prompt, "completion": c.text, "reward": s.reward, "gold": problems[s.group].answer}
             for s, c in list(zip(samples, completions))[::G][:8]]
    return samples, rollout_stats, table


def sgd_iteration(policy, ref_policy, micro_batches, cache: list[dict], cfg: TrainConfig, denominators,
                  world_size: int, first: bool) -> dict[str, torch.Tensor]:
    """One pass over this rank's micro-batches: forward, objective, backward (gradients accumulate).

    On the first SGD iteration on a batch the parameters are still pi_k, so pi_k's log-probs are the
    forward's own (detached) and are cached for the next i-1 iterations (ratio_anchor=exact needs
    them; approx uses them as PPO's pi_old); pi_ref's log-probs are computed once here too.
    """
    num_seqs, num_tokens = denominators
    totals = None
    for j, mb in enumerate(micro_batches):
        # FSDP2 reduce-scatters after every backward unless told to wait for the last micro-batch.
        policy.set_requires_gradient_sync(j == len(micro_batches) - 1)
        logp, entropy = policy(mb.input_ids, mb.completion_index, mb.completion_tokens, with_entropy=first)
        if first:
            logp_ref = None
            if ref_policy is not None:
                with torch.no_grad():
                    logp_ref, _ = ref_policy(mb.input_ids, mb.completion_index, mb.completion_tokens)
            cache.append({"logp_k": logp.detach(), "logp_ref": logp_ref,
                          "entropy_sum": entropy.detach().sum() if entropy is not None else torch.zeros(())})
        logp_k, logp_ref = cache[j]["logp_k"], cache[j]["logp_ref"]
        mask = mb.completion_mask.bool()
        weights = O.token_weights(mb.completion_mask, mb.seq_weight, cfg.objective, num_seqs=num_seqs,
                                  num_tokens=num_tokens, max_len=cfg.grpo.max_new_tokens, truncated=mb.truncated)[mask]
        adv = mb.adv[mb.seq_of_token]
        loss, stats = kernels.grpo_objective(logp, mb.logp_alpha, logp_k, logp_ref, adv, weights, cfg.objective,
                                             config=cfg.kernels)
        # FSDP2 averages gradients over ranks; the weights already hold global denominators, so
        # scale back up to get the gradient of the whole batch's loss.
        (loss * world_size).backward()
        stats["entropy_sum"] = cache[j]["entropy_sum"]
        totals = stats if totals is None else O.merge_stats(totals, stats)
    return totals


def optimizer_step(policy, optimizer, scheduler, cfg: TrainConfig) -> tuple[float, bool]:
    """Clip, then step unless the gradient is not finite (then the step is skipped and counted)."""
    params = [p for p in policy.parameters() if p.grad is not None]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=True)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()  # the schedule follows optimizer steps attempted, so a skip does not shift it
    return grad_norm, finite


@torch.no_grad()
def refresh_reference(ref_policy, policy) -> None:
    """pi_ref <- pi_theta (end of a stage). Same sharding on both, so a local copy of each shard."""
    # FSDP2 leaves the root's parameters unsharded after a forward it did not backprop through
    # (the no-grad reference pass); reshard so both sides are DTensor shards.
    ref_policy.reshard()
    policy.reshard()
    for p_ref, p in zip(ref_policy.parameters(), policy.parameters()):
        p_ref.copy_(p)


def run_eval(server, tokenizer, eval_problems, cfg: TrainConfig, scorer) -> dict:
    summary, _ = evaluate(server.client, tokenizer, eval_problems, cfg.eval_data, cfg.eval, scorer)
    return {f"eval/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}


# ------------------------------------------------------------------------------------------------
# Algorithm 1
# ------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    try:
        cfg, args = parse_args(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    dist_info = init_distributed()
    rank, world, device, is_main = dist_info.rank, dist_info.world_size, dist_info.device, dist_info.is_main
    if cfg.grpo.batch_prompts % world:
        raise ConfigError(f"grpo.batch_prompts: {cfg.grpo.batch_prompts} prompts do not split over {world} ranks")
    torch.manual_seed(cfg.seed + rank)
    run_dir = Path(cfg.log.out_dir) / cfg.log.run_name
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    # Ctrl-C / SIGTERM: finish the current optimizer step, checkpoint, exit (agreed by all ranks).
    stop_requested = {"flag": False}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_requested.__setitem__("flag", True))

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    policy = build_policy(cfg, device, trainable=True)
    ref_policy = build_policy(cfg, device, trainable=False) if cfg.objective.beta > 0 else None
    optimizer = build_optimizer(policy, cfg.optim)
    total_steps = cfg.grpo.S * cfg.grpo.M * cfg.grpo.i
    scheduler = build_scheduler(optimizer, total_steps, cfg.optim)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir)

    # The server starts out serving the model directory itself as weights version 0 (= pi_theta_0).
    state = {"step": 0, "stage": 0, "iteration": 0, "weights_version": 0, "weights_dir": "",
             "nan_skips": 0, "sampler": None, "scheduler": None}
    if args.resume:
        latest = checkpointer.latest()
        if latest is None:
            raise SystemExit(f"--resume: no complete checkpoint under {checkpointer.dir}")
        state = checkpointer.load(latest, policy, optimizer, ref_policy)
        scheduler.load_state_dict(state["scheduler"])

    server = scorer = sampler = None
    eval_problems = None
    if is_main:
        sampler = make_sampler(cfg.data, cfg.grpo.batch_prompts, seed=cfg.seed)
        if state["sampler"] is not None:
            sampler.load_state_dict(state["sampler"])
        scorer = RewardScorer(cfg.reward)
        if cfg.eval_data is not None:
            eval_problems = load_problems(cfg.eval_data)
        server = InferenceServer.launch(cfg.model.path, cfg.server, run_dir)
    logger = MetricsLogger(cfg.log, run_dir, to_dict(cfg), rank, resume=args.resume)
    if args.resume:
        logger.truncate_after(state["step"])
    if args.resume and state["iteration"] % cfg.grpo.v != 0 and state["weights_dir"]:
        # Resumed inside a v-window: alpha is the policy of the last push, not pi_theta. Re-serve
        # that exact directory (uploaded, so a new weights root does not matter); if it is gone,
        # say so and serve pi_theta instead. (No push yet: the server's version 0 is alpha.)
        old_dir = Path(state["weights_dir"]) if state["weights_dir"] else None
        have_old = broadcast_json(bool(is_main and old_dir is not None and (old_dir / "manifest.json").is_file()))
        if have_old:
            if is_main:
                server.client.push_weights(old_dir, version=state["weights_version"], mode="bytes")
        else:
            if is_main:
                print(f"[train] resume: the last pushed weights ({old_dir}) are gone; serving the current policy, "
                      "so this v-window is not an exact repeat", file=sys.stderr)
            push_weights(policy, server, cfg, state, is_main)

    def checkpoint():
        state["sampler"] = sampler.state_dict() if is_main else None
        state["sampler"] = broadcast_json(state["sampler"])
        state["scheduler"] = scheduler.state_dict()
        checkpointer.save(state["step"], policy, optimizer, ref_policy, trainer_state=dict(state))

    def evaluate_now():
        """Eval on the held-out set with pi_theta, which the server holds right after a push."""
        if is_main and eval_problems is not None:
            logger.log({"step": state["step"], **run_eval(server, tokenizer, eval_problems, cfg, scorer)})

    try:
        progress = logger.progress(total_steps, initial=state["step"])
        for stage in range(state["stage"], cfg.grpo.S):
            for k in range(state["iteration"], cfg.grpo.M):
                t_iter = time.time()
                # -- push weights every v iterations (alpha <- pi_theta); at step 0 the server
                #    already holds pi_theta_0 as version 0
                t0 = time.time()
                sync_bytes = 0.0
                if k % cfg.grpo.v == 0 and state["step"] > 0:
                    sync_bytes = push_weights(policy, server, cfg, state, is_main)
                time_sync = time.time() - t0
                # -- held-out eval, only right after a push so that the server holds pi_theta
                if k % cfg.grpo.v == 0 and (state["step"] == 0 or (
                        cfg.eval_every and (stage * cfg.grpo.M + k) % cfg.eval_every == 0)):
                    evaluate_now()

                # -- sample prompts, G completions each, rewards, advantages, mask (rank 0)
                payload = None
                if is_main:
                    problems = sampler.next_batch()
                    batch_seed = (cfg.seed * 1_000_003 + stage * cfg.grpo.M + k) % 2**31
                    try:
                        samples, rollout_stats, table = sample_rollouts(server, problems, tokenizer, cfg, scorer, batch_seed)
                    except InferenceServerError as e:
                        print(f"[train] inference server failed ({e}); restarting and re-pushing", file=sys.stderr)
                        server.restart()
                        server.client.push_weights(Path(state["weights_dir"]), version=state["weights_version"],
                                                   mode=cfg.server.push_mode)
                        samples, rollout_stats, table = sample_rollouts(server, problems, tokenizer, cfg, scorer, batch_seed)
                    payload = {"samples": [s.to_json() for s in samples], "stats": rollout_stats, "table": table}
                payload = broadcast_json(payload)
                samples = shard_samples([Sample(**s) for s in payload["samples"]], rank, world)
                rollout_stats = payload["stats"]

                # -- micro-batches (same count on every rank) and the batch's global denominators
                t0 = time.time()
                local_plan = plan_micro_batches(samples, cfg.optim.token_budget)
                num_micro = int(all_reduce_max(len(local_plan)))
                plan = plan_micro_batches(samples, cfg.optim.token_budget, num_micro)
                micro_batches = [collate([samples[j] for j in idx], tokenizer.pad_token_id, device) for idx in plan]
                local = [O.local_denominators(mb.completion_mask, mb.seq_weight, cfg.objective, mb.truncated) for mb in micro_batches]
                totals = all_reduce_sum({"seqs": sum(a for a, _ in local), "tokens": sum(b for _, b in local)})
                denominators = (max(int(totals["seqs"]), 1), max(int(totals["tokens"]), 1))

                # -- i SGD iterations on this batch
                cache: list[dict] = []
                for it in range(cfg.grpo.i):
                    t0 = t0 if it == 0 else time.time()
                    stats = sgd_iteration(policy, ref_policy, micro_batches, cache, cfg, denominators, world, first=(it == 0))
                    stats = O.all_reduce_stats(stats)
                    grad_norm, finite = optimizer_step(policy, optimizer, scheduler, cfg)
                    if not finite:
                        state["nan_skips"] += 1
                        if is_main:
                            print(f"[train] step {state['step']}: non-finite gradient, step skipped", file=sys.stderr)
                    state["step"] += 1
                    time_train = time.time() - t0
                    train_stats = O.finalize_stats(stats)
                    n_tok = max(train_stats["num_tokens"], 1.0)
                    metrics = {
                        "step": state["step"], "stage": stage, "iteration": k, "sgd_iteration": it,
                        "weights_version": state["weights_version"],
                        **{key: rollout_stats[key] for key in ("reward_mean", "reward_std", "pass_rate", "masked_frac",
                                                               "zero_var_frac", "completion_len_mean", "truncated_frac",
                                                               "reward_timeouts", "bound_M", "bound_M_nonzero")},
                        "loss": train_stats["loss"], "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                        "clip_frac": train_stats["clip_frac"], "clip_low_frac": train_stats["clip_low_frac"],
                        "clip_high_frac": train_stats["clip_high_frac"], "kl": train_stats["kl_mean"],
                        "is_weight_mean": train_stats["is_weight_mean"], "is_weight_max": train_stats["is_weight_max"],
                        "is_capped_frac": train_stats["is_capped_frac"], "ratio_mean": train_stats["ratio_mean"],
                        "tv_pik_alpha": train_stats["tv_mean"], "kl_pik_alpha": train_stats["kl_pik_alpha_mean"],
                        "entropy": float(stats["entropy_sum"]) / n_tok, "nan_skips": state["nan_skips"],
                        "time_generate": rollout_stats["time_generate"], "time_reward": rollout_stats["time_reward"],
                        "time_train": time_train, "time_sync": time_sync, "sync_bytes": sync_bytes,
                        "tokens_per_s": (rollout_stats["prompt_tokens"] + rollout_stats["completion_tokens"])
                                        / max(time.time() - t_iter, 1e-9),
                    }
                    logger.log(metrics)
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl']:.4f}",
                                         clip=f"{metrics['clip_frac']:.3f}", ver=metrics["weights_version"])
                    sync_bytes, time_sync = 0.0, 0.0
                if is_main and cfg.log.sample_table_every and k % cfg.log.sample_table_every == 0:
                    logger.log_samples(state["step"], payload["table"])

                state["iteration"] = k + 1
                every = cfg.checkpoint.every
                if every and state["step"] // every > (state["step"] - cfg.grpo.i) // every:
                    checkpoint()
                if all_reduce_max(float(stop_requested["flag"])) > 0:
                    checkpoint()
                    if is_main:
                        print(f"[train] stopped at step {state['step']}; resume with --resume", file=sys.stderr)
                    return 130
            # -- end of stage: pi_ref <- pi_theta
            if ref_policy is not None:
                refresh_reference(ref_policy, policy)
            state["stage"], state["iteration"] = stage + 1, 0

        checkpoint()
        if eval_problems is not None or cfg.eval_data is not None:
            push_weights(policy, server, cfg, state, is_main)
            evaluate_now()
        export_hf(policy.lm, tokenizer, cfg.model.path, run_dir / "final", dtype=serve_dtype(cfg))
        return 0
    finally:
        logger.close()
        if server is not None:
            server.stop()
        if scorer is not None:
            scorer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
