"""Evaluate a model on a math test set: K samples per problem from the vLLM server, scored by math-verify.

    python eval.py --config configs/eval_gsm8k.yaml model=runs/v1-i1 eval.k=50
    python eval.py --model .cache/models/smollm2 --dataset gsm8k_test --k 4 --n-problems 200 --max-tokens 256

Writes to out_dir (default runs/eval/<dataset>-<model>-<time>):
  records.jsonl  one line per problem: id, prompt, gold, completions, extracted answers, correctness,
                 rewards, token counts, finish reasons
  summary.json   Pass@1 over K samples (the paper's metric), unbiased pass@k and maj@k for eval.pass_k,
                 mean completion length, truncation rate, wall time, and what was evaluated
  config.yaml    the resolved config (rerun with --config out_dir/config.yaml)
  server/        the launched server's log

`model` is an HF model directory (config.json + *.safetensors + tokenizer), or a training run's
directory: then its `final/` export is used if it is one, else the newest HF directory (with a
tokenizer) one or two levels down. The server is the training server (grpo.serving.server), launched
here, or attached with server.url=http://host:port (eval never pushes weights).
Bad input (unknown dataset, a data file that does not read, no weights, a server that does not
start, an attached one that does not answer or refuses the token) ends with one line
`eval.py: error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from grpo import preflight
from grpo.config import ConfigError, apply_overrides, load_config, save_config
from grpo.cpu import CPUConfig
from grpo.data import DataConfig, DataError, load_problems
from grpo.evaluation import EvalConfig, evaluate
from grpo.fsutil import own_temp_dir
from grpo.layout import LayoutError, plan_layout, visible_gpus
from grpo.models import ModelPathError, resolve_model_path
from grpo.rewards import RewardConfig, RewardError, RewardScorer
from grpo.serving.client import AttachError, InferenceServerError
from grpo.serving.fleet import ServerFleet
from grpo.serving.inference import ServerConfig

REPO_ROOT = Path(__file__).resolve().parent


@dataclass
class EvalRunConfig:
    plugins: list[str] = field(default_factory=list)  # the user's own modules (reward terms: docs/extending.md)
    model: str = ".cache/models/smollm2"  # HF model directory, or a run directory (its final/ or newest export)
    out_dir: Optional[str] = None  # output directory; None = runs/eval/<dataset>-<model>-<YYYYmmdd-HHMMSS>
    data: DataConfig = field(default_factory=DataConfig)  # dataset and prompt format (as in training)
    reward: RewardConfig = field(default_factory=RewardConfig)  # correctness checking (math-verify workers)
    server: ServerConfig = field(default_factory=ServerConfig)  # the vLLM server: launched, or attached by url
    cpu: CPUConfig = field(default_factory=CPUConfig)  # a server launched on this machine's CPU
    eval: EvalConfig = field(default_factory=EvalConfig)  # samples per problem, temperature, pass@k list, ...


class EvalError(Exception):
    """Input eval.py cannot use; the message says what and where."""


# ----------------------------------------------------------------------------- finding the model

def _has_weights(d: Path) -> bool:
    return (d / "config.json").is_file() and (any(d.glob("*.safetensors")) or any(d.glob("*.bin")))


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def resolve_model_dir(model: str) -> Path:
    """The HF directory to serve: `model` itself, or the export found in a run directory.

    In a run directory: `final/` if it holds a model, else the most recently written HF directory
    (config.json + *.safetensors + tokenizer files) one or two levels down. Server weight pushes
    (no tokenizer) and DCP checkpoints (no config.json) are not exports and are skipped.
    """
    path = Path(model)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    if not path.exists():  # a hub id (through the HF cache / hub), or one line saying what to pass
        try:
            return Path(resolve_model_path(model))
        except ModelPathError as e:
            raise EvalError(f"model: {model} does not exist and is no usable hub id "
                            f"({str(e).split('; ', 1)[0].removeprefix('model.path: ')}); give an HF model "
                            f"directory or a run directory") from None
    if not path.is_dir():
        raise EvalError(f"model: {model} is a file; expected an HF model directory or a run directory")
    if (path / "config.json").is_file():
        if not _has_weights(path):
            raise EvalError(f"model: {path} has config.json but no weights (*.safetensors)")
        if not _has_tokenizer(path):
            raise EvalError(f"model: {path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
        return path.resolve()
    final = path / "final"
    if _has_weights(final) and _has_tokenizer(final):
        return final.resolve()
    exports = [d for d in [*path.glob("*"), *path.glob("*/*")]
               if d.is_dir() and not d.name.endswith((".tmp", ".old")) and _has_weights(d) and _has_tokenizer(d)]
    if not exports:
        raise EvalError(f"model: {path} holds no model weights: expected config.json + *.safetensors in it, "
                        f"or a run directory with an exported HF model in final/ (or a subdirectory)")
    return max(exports, key=lambda d: max(f.stat().st_mtime for f in d.glob("*.safetensors"))).resolve()


# ----------------------------------------------------------------------------- config

def build_config(config_path: Optional[str], overrides: list[str]) -> EvalRunConfig:
    # Attaching to a server needs no weights root here: eval never pushes weights. ServerConfig
    # insists on one for push_mode "path", so an attach without either gets push_mode "bytes".
    data: dict = {}
    if config_path and Path(config_path).is_file():
        try:
            data = yaml.safe_load(Path(config_path).read_text()) or {}
        except yaml.YAMLError:
            data = {}  # load_config reports it, naming the file
    if isinstance(data, dict):
        server = apply_overrides(json.loads(json.dumps(data)), list(overrides)).get("server") or {}
        if isinstance(server, dict) and server.get("url") and not server.get("weights_root") \
                and "push_mode" not in server:
            overrides = [*overrides, "server.push_mode=bytes"]
    return load_config(EvalRunConfig, config_path, overrides)


def default_out_dir(cfg: EvalRunConfig, model_dir: Path) -> Path:
    dataset = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(cfg.data.dataset).stem)
    model_name = model_dir.name if model_dir.name != "final" else model_dir.parent.name
    return REPO_ROOT / "runs" / "eval" / f"{dataset}-{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ----------------------------------------------------------------------------- main

def run(cfg: EvalRunConfig) -> dict:
    from grpo.models import load_tokenizer

    t_start = time.monotonic()
    model_dir = resolve_model_dir(cfg.model)
    problems = load_problems(cfg.data)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg, model_dir)
    attached = None
    if cfg.server.attached:  # it answers and takes the token, before anything is written or started
        try:
            attached = ServerFleet.attach(model_dir, cfg.server, out_dir)
        except AttachError as e:
            raise EvalError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.yaml")
    tokenizer = load_tokenizer(model_dir)
    n_eval = min(len(problems), cfg.eval.n_problems or len(problems))
    print(f"eval: {model_dir} on {cfg.data.dataset}: {n_eval} of {len(problems)} problems x K={cfg.eval.k} "
          f"at T={cfg.eval.temperature}, {cfg.eval.max_tokens} tokens -> {out_dir}", file=sys.stderr)
    with RewardScorer(cfg.reward) as scorer:
        try:
            layout = plan_layout(visible_gpus(), server_device=cfg.server.device, attached=cfg.server.attached,
                                 rank=0, local_rank=0, local_world_size=0, node_rank=0,
                                 memory_fraction=cfg.server.gpu_memory_utilization,
                                 server_gpus=cfg.server.tensor_parallel_size, replicas=cfg.server.replicas)
        except LayoutError as e:
            raise EvalError(str(e)) from None
        try:
            server = attached or ServerFleet.launch(model_dir, cfg.server, out_dir,
                                                    gpus=layout.replica_gpus or (layout.server_gpu,),
                                                    gpu_memory_utilization=layout.server_memory_fraction, cpu=cfg.cpu)
        except InferenceServerError as e:
            log = out_dir / "server" / "server.log"
            raise EvalError(f"the inference server did not start: {str(e).splitlines()[0]}"
                            + (f" (full log: {log})" if log.is_file() else "")) from None
        with server:
            print(f"eval: server ready at {server.url} after {time.monotonic() - t_start:.0f} s", file=sys.stderr)
            summary, records = evaluate(server, tokenizer, problems, cfg.data, cfg.eval, scorer, progress=True)
    summary = {
        "model": str(model_dir), "dataset": cfg.data.dataset, "k": cfg.eval.k, "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p, "max_tokens": cfg.eval.max_tokens, "server_seed": cfg.server.seed,
        **summary, "total_wall_time_s": time.monotonic() - t_start,
    }
    with open(out_dir / "records.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["out_dir"] = str(out_dir)
    return summary


def parse_args(argv: Optional[list[str]]) -> tuple[Optional[str], list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be set as key=value, e.g. eval.pass_k=[1,8] server.seed=1.")
    p.add_argument("--config", help="YAML config (configs/eval_*.yaml)")
    p.add_argument("--model", help="model or run directory (= model=...)")
    p.add_argument("--dataset", help="a named set (gsm8k_test, math500, aime24, amc23, ...), arithmetic, a Hub id, "
                                     "a dataset folder or a .jsonl/.json/.parquet path (docs/data.md)")
    p.add_argument("--k", type=int, help="samples per problem (= eval.k)")
    p.add_argument("--temperature", type=float, help="= eval.temperature")
    p.add_argument("--max-tokens", type=int, help="= eval.max_tokens")
    p.add_argument("--n-problems", type=int, help="evaluate the first N problems (= eval.n_problems)")
    p.add_argument("--out", help="output directory (= out_dir)")
    p.add_argument("--url", help="attach to a running server instead of launching one (= server.url)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    preflight.add_arguments(p, trainer=False)
    ns = p.parse_args(argv)
    flags = {"model": ns.model, "data.dataset": ns.dataset, "eval.k": ns.k, "eval.temperature": ns.temperature,
             "eval.max_tokens": ns.max_tokens, "eval.n_problems": ns.n_problems, "out_dir": ns.out,
             "server.url": ns.url}
    # Flags first: an explicit key=value given as well wins.
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + ns.overrides
    if ns.check:  # the dry run: every start-up decision, one line each, nothing started (grpo/preflight.py)
        sys.exit(preflight.check_evaluation(lambda: build_config(ns.config, overrides), resolve_model_dir, ns.gpus,
                                            errors=(EvalError,)))
    return ns.config, overrides


def main(argv: Optional[list[str]] = None) -> int:
    config_path, overrides = parse_args(argv)
    try:
        cfg = build_config(config_path, overrides)
        summary = run(cfg)
    except (ConfigError, EvalError, DataError, FileNotFoundError) as e:
        print(f"eval.py: error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:  # a reward term failed past reward.max_failed_frac, or left its range: one line
        print(f"eval.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("eval.py: interrupted", file=sys.stderr)
        return 130
    shown = {k: v for k, v in summary.items() if k.startswith(("pass@", "maj@"))}
    print("eval: " + "  ".join(f"{k}={v:.4f}" for k, v in shown.items()))
    print(f"eval: mean_completion_tokens={summary['mean_completion_tokens']:.1f}  "
          f"truncation_rate={summary['truncation_rate']:.3f}  wall_time_s={summary['wall_time_s']:.1f}  "
          f"-> {summary['out_dir']}")
    return 0


if __name__ == "__main__":
    with own_temp_dir():  # its temporary files and its server's: reclaimed after a kill
        code = main()
    sys.exit(code)
