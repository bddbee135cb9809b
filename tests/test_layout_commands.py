"""Every layout command in README.md and docs/ can start: each `torchrun --nproc_per_node=... train.py`
command written there goes through the config loader and the dry run's layout planner and batch
split (grpo/preflight.py, what `train.py --check` runs), on the machine its table row names.

A command's machine: a table row's first cell ("one 8-GPU node", "one GPU", "no GPU", a
CUDA_VISIBLE_DEVICES list); 8 GPUs per node otherwise (the paper's node). `--config ...` or a
bare `...` stands for every paper config (configs/gsm8k_*.yaml, configs/deepscaler_*.yaml).
Benchmark records (docs/benchmarks/) are history, not instructions, and are not read.
"""
import re
import shlex
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.preflight import check_batch_split, plan_training, planned_visible
from grpo.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md"))]
PAPER_CONFIGS = sorted([*ROOT.glob("configs/gsm8k_*.yaml"), *ROOT.glob("configs/deepscaler_*.yaml")])
NODE_GPUS = 8


def _machine_gpus(first_cell: str) -> int:
    cell = first_cell.lower()
    if "no gpu" in cell:
        return 0
    if "one gpu" in cell:
        return 1
    m = re.search(r"(\d+)[- ]gpu", cell)
    return int(m.group(1)) if m else NODE_GPUS


def documented_commands() -> list[tuple[str, str, int]]:
    """(where, command, GPUs per node) for every layout command: torchrun with --nproc_per_node and train.py."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        in_code, block = False, []
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            if in_code:  # a shell command may continue over lines ending in a backslash
                block.append(line.rstrip())
                if not line.rstrip().endswith("\\"):
                    command = " ".join(part.rstrip("\\").strip() for part in block)
                    block = []
                    if "torchrun" in command and "--nproc_per_node" in command and "train.py" in command:
                        found.append((f"{doc.name}:{number}", command, NODE_GPUS))
                continue
            for span in re.findall(r"`([^`]+)`", line):
                if "torchrun" in span and "--nproc_per_node" in span and "train.py" in span:
                    cells = [c.strip() for c in line.split("|")[1:]] if line.startswith("|") else []
                    gpus = _machine_gpus(cells[0]) if cells else NODE_GPUS
                    visible = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", cells[0]) if cells else None
                    if visible:  # the row's machine is the visible list of a node
                        span = f"CUDA_VISIBLE_DEVICES={visible.group(1)} {span}"
                    found.append((f"{doc.name}:{number}", span, gpus))
    return found


def parse(command: str) -> dict:
    """env, torchrun's --nproc_per_node / --nnodes, train.py's --config and overrides."""
    tokens = shlex.split(command)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    assert tokens[0] == "torchrun", command
    launcher, args = tokens[1:tokens.index("train.py")], tokens[tokens.index("train.py") + 1:]
    options = {}
    for i, token in enumerate(launcher):
        for name in ("nproc_per_node", "nnodes"):
            if token.startswith(f"--{name}="):
                options[name] = int(token.split("=", 1)[1])
            elif token == f"--{name}":
                options[name] = int(launcher[i + 1])
    config, overrides, elided, i = None, [], False, 0
    while i < len(args):
        if args[i] == "--config":
            config, i = args[i + 1], i + 2
            continue
        if args[i] in ("--replay",):  # a flag with a value that is not a layout matter
            i += 2
            continue
        if args[i] == "...":
            elided = True
        elif "=" in args[i] and not args[i].startswith("-"):
            overrides.append(args[i])
        i += 1
    configs = PAPER_CONFIGS if config == "..." or (config is None and elided) else \
        [ROOT / config] if config else [None]
    return {"env": env, "nproc": options["nproc_per_node"], "nnodes": options.get("nnodes", 1),
            "configs": configs, "overrides": overrides}


COMMANDS = documented_commands()


def test_the_docs_hold_layout_commands():
    where = {w.split(":")[0] for w, _, _ in COMMANDS}
    assert {"README.md", "layouts.md"} <= where, where
    assert any("tensor_parallel_size=2" in c for _, c, _ in COMMANDS)  # the 6 + 2 layout is among them
    # the fleet rows: launched replicas (of TP 1 and 2) and servers attached by URL
    assert any("server.replicas=" in c and "tensor_parallel_size=2" in c for _, c, _ in COMMANDS)
    assert any("server.replicas=" in c and "gsm8k" in c for _, c, _ in COMMANDS)
    assert any("server.replicas=" in c and "deepscaler" in c for _, c, _ in COMMANDS)
    assert sum("server.urls=" in c for _, c, _ in COMMANDS) >= 2


@pytest.mark.parametrize("where,command,gpus", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_documented_layout_command_can_start(where, command, gpus):
    spec = parse(command)
    for config in spec["configs"]:
        try:
            cfg = load_config(TrainConfig, config, spec["overrides"])
            visible, _ = planned_visible(gpus, env=spec["env"])
            world, line = plan_training(cfg, visible, spec["nproc"], spec["nnodes"])
            check_batch_split(cfg.grpo.batch_prompts, world)
        except ValueError as e:  # ConfigError, LayoutError: the one line train.py would stop with
            error = str(e)
        else:
            assert f"--nproc_per_node={spec['nproc']}" in line
            continue
        pytest.fail(f"{where}: `{command}` with {config.name if config else 'the defaults'} on {gpus} GPUs per node "
                    f"cannot start: {error}", pytrace=False)
