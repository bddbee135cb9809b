"""Does the engine hold what was pushed? Moments per tensor on both sides, compared after a push.

After each load the server reports, per engine parameter, (numel, sum, sum of squares) of what
the engine holds (grpo.serving.worker_ext.grpo_weights_fingerprint); the trainer computes the same
moments from the state dict it pushed, folded into vLLM's packed modules (q/k/v_proj -> qkv_proj,
gate/up_proj -> gate_up_proj), and stops the run naming the tensors that differ. Sums and sums of
squares do not change under the re-layouts a backend applies (transposes, blocking, zero padding),
but any changed value moves them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from grpo.models import drop_tied_lm_head
from grpo.serving.weights_dir import config_sources

SUM_BLOCK = 1 << 12  # tensor_moments sums this many values in fp32, then the block sums in fp64
SIGMAS = 6.0  # how many standard deviations of the summation error a tolerance allows



def tensor_moments(t: torch.Tensor, rounded_to: Optional[torch.dtype] = None,
                   block: int = SUM_BLOCK, chunk: int = 1 << 20) -> tuple[int, float, float]:
    """(numel, sum, sum of squares) of a tensor, accurate to ~1e-8 relative, at memory speed; with
    `rounded_to`, of its values rounded to that dtype first (an fp32 master weight as pushed in bf16).

    fp64 reductions are many times slower on CPU than fp32 ones: here each 1M-element chunk is
    copied into a reused fp32 buffer (no page faults), reduced in fp32 over blocks of SUM_BLOCK and
    the block results summed in fp64. Both ends of a push use this one function; what differs is
    the order of the values (the engine's layout), which `moment_tolerances` bounds."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0, 0.0, 0.0
    rounding = rounded_to is not None and flat.is_floating_point() and flat.dtype != rounded_to
    width = min(chunk, flat.numel())
    buf = torch.empty(width, dtype=torch.float32, device=flat.device)
    sq = torch.empty_like(buf)
    staged = torch.empty(width, dtype=rounded_to, device=flat.device) if rounding else None
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    with torch.no_grad():
        for part in flat.split(chunk):
            x, x2 = buf[: part.numel()], sq[: part.numel()]
            if staged is not None:
                part = staged[: part.numel()].copy_(part)
            x.copy_(part)
            torch.mul(x, x, out=x2)
            m = part.numel() // block
            for i, v in enumerate((x, x2)):
                total[i] += torch.sum(v[: m * block].view(m, block), dim=1).double().sum()
                total[i] += torch.sum(v[m * block:], dtype=torch.float64)
    s, q = total.tolist()
    return int(flat.numel()), s, q

def counted_part(module, param: torch.Tensor) -> torch.Tensor:
    """The part of a tensor-parallel rank's parameter that the merged fingerprint counts. vLLM's
    fused q/k/v projection replicates the k and v heads over ranks when there are more ranks than kv
    heads (num_kv_head_replicas > 1): each rank holds its slice of q and a copy of its kv heads, and
    summed over ranks the copies would count several times. Only the first rank of each replica
    group counts its k and v rows; the others count their q rows alone. Any other parameter: all of it."""
    replicas = getattr(module, "num_kv_head_replicas", 1)
    if replicas <= 1 or getattr(module, "tp_rank", 0) % replicas == 0 or param.dim() == 0:
        return param
    q_rows = module.num_heads * module.head_size  # [q | k | v] along the output dimension (dim 0)
    return param[:q_rows]


def pushed_moments(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, model_dir_or_config: str | Path,
                   skip: Optional[Callable[[str], bool]] = None) -> dict[str, tuple[int, float, float]]:
    """tensor_moments of each tensor a push of `state_dict` in `dtype` sends (tied lm_head dropped,
    floats rounded to `dtype`), computed from the state dict itself, independently of the writer.
    skip(name): leave out tensors the engine's fingerprint cannot show (unseen_by_fingerprint)."""
    config = json.loads(config_sources(model_dir_or_config)["config.json"])
    return {name: tensor_moments(t, rounded_to=dtype) for name, t in drop_tied_lm_head(state_dict, config).items()
            if skip is None or not skip(name)}

def engine_param_name(name: str, renames: dict[str, str]) -> str:
    """vLLM's name for a pushed (HF) tensor: its module folded into the packed one that holds it
    (renames: q_proj/k_proj/v_proj -> qkv_proj, gate_proj/up_proj -> gate_up_proj)."""
    parts = name.split(".")
    return ".".join(renames.get(p, p) if i == len(parts) - 2 else p for i, p in enumerate(parts))

def _renames(engine: dict) -> dict[str, str]:
    return {sub: packed for packed, subs in engine.get("packed", {}).items() for sub in subs}

def unseen_by_fingerprint(engine: dict) -> Callable[[str], bool]:
    """From a fingerprint reply: whether a pushed tensor lands in an engine parameter the fingerprint
    cannot see (numel 0: vLLM's CPU backend packs linear weights into oneDNN handles). Their moments
    are never compared, so the next push need not compute them (on a CPU engine, most of a model's
    weights), on a core the engine's reload wants."""
    renames, opaque = _renames(engine), {k for k, v in engine["params"].items() if _opaque(v)}
    return lambda name: engine_param_name(name, renames) in opaque

def moment_tolerances(numel: int, total: float, sumsq: float, block: int = SUM_BLOCK,
                      accumulate: torch.dtype = torch.float32) -> tuple[float, float]:
    """How far (sum, sum of squares) of the same `numel` values may differ when summed in another
    order (the engine's layout: transposed, fused, padded, sharded, on another device), for
    tensor_moments' summation: fp32 (`accumulate`) sums of `block` values, fp64 across blocks.

    Model: each fp32 addition rounds by a uniform relative error of at most u (half an ulp), so a
    block's recursive sum errs by ~ u sqrt(sum_k S_k^2) over its partial sums S_k. With the block's
    values of mean m and spread r, S_k ~ k m + sqrt(k) r, which gives per block
    u (B^1.5 |m| / 3 + B r / sqrt(6)), and over the numel / B independent blocks
    u (B |total| / (3 sqrt(numel)) + sqrt(B sumsq / 6)); for the squares (all >= 0, spread ~ their
    mean) u (B / 3 + sqrt(B / 3)) sumsq / sqrt(numel). SIGMAS of those: recursive summation is the
    worst order there is (torch's reductions are pairwise inside a block, about 100x better), so a
    reordering passes, while one changed element moves the figures far more than that."""
    n = max(int(numel), 1)
    u = torch.finfo(accumulate).eps / 2
    b = min(block, n)
    tol_sum = SIGMAS * u * (b * abs(total) / (3 * math.sqrt(n)) + math.sqrt(b * max(sumsq, 0.0) / 6))
    tol_sq = SIGMAS * u * (b / 3 + math.sqrt(b / 3)) * max(sumsq, 0.0) / math.sqrt(n)
    return tol_sum + 1e-30, tol_sq + 1e-30


def _ranks(entry) -> list[tuple[int, float, float]]:
    """An engine parameter's moments per tensor-parallel rank (a single triple: one rank)."""
    if entry and isinstance(entry[0], (list, tuple)):
        return [tuple(r) for r in entry]
    return [tuple(entry)]


def held_moments(entry, expected_numel: int) -> tuple[int, float, float]:
    """What the engine holds of one parameter, over its tensor-parallel ranks: a parameter every rank
    holds whole (norms, replicated biases: each rank's numel covers the pushed one) is rank 0's; a
    sharded one (each rank a slice) is the sum of the slices. Replicas must agree, else the
    parameter is reported as the rank that differs most, which the comparison then catches."""
    ranks = _ranks(entry)
    if len(ranks) == 1:
        return ranks[0]
    if all(r[0] >= expected_numel for r in ranks):
        tol_s, tol_q = moment_tolerances(*ranks[0])
        for r in ranks[1:]:
            if abs(r[1] - ranks[0][1]) > tol_s or abs(r[2] - ranks[0][2]) > tol_q:
                return r
        return ranks[0]
    return (sum(r[0] for r in ranks), sum(r[1] for r in ranks), sum(r[2] for r in ranks))


def _opaque(entry) -> bool:
    return all(r[0] == 0 for r in _ranks(entry))


def fingerprint_mismatches(pushed: dict[str, tuple[int, float, float]], engine: dict, limit: int = 5) -> list[str]:
    """Names of the engine parameters (vLLM's names) whose (numel, sum, sum of squares) differ from
    those of the tensors the trainer pushed (`pushed`: pushed_moments) by more than the summation
    order explains (moment_tolerances), folded into vLLM's packed modules (q/k/v_proj -> qkv_proj,
    gate/up_proj -> gate_up_proj; `engine` is the server's fingerprint reply, a triple per
    parameter or a list of them, one per tensor-parallel rank). A pushed tensor the engine does not
    hold, or an engine parameter nothing was pushed for, is a mismatch too. An engine parameter
    left empty (numel 0) is opaque and skipped: vLLM's CPU backend moves fp32 linear weights into
    oneDNN's packed handles, out of reach of named_parameters (there only embeddings, norms and
    biases are checked; on GPU every parameter is)."""
    renames = _renames(engine)
    expected: dict[str, list[float]] = {}
    for name, moments in pushed.items():
        acc = expected.setdefault(engine_param_name(name, renames), [0, 0.0, 0.0])
        for i in range(3):
            acc[i] += moments[i]
    opaque = {k for k, v in engine["params"].items() if _opaque(v)}
    held_names = {k for k in engine["params"] if k not in opaque}
    bad = sorted((set(expected) - opaque) ^ held_names)
    for name in sorted(set(expected) & held_names):
        n_e, s_e, q_e = expected[name]
        n_h, s_h, q_h = held_moments(engine["params"][name], int(n_e))
        tol_s, tol_q = moment_tolerances(int(n_e), s_e, q_e)
        # numel may differ by zero padding (same sums); values may not
        if abs(s_e - s_h) > tol_s or abs(q_e - q_h) > tol_q or n_h < n_e:
            bad.append(name)
    return bad[:limit] if len(bad) <= limit else bad[:limit] + [f"... {len(bad) - limit} more"]
