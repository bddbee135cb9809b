"""The log-prob parity probe: engine mismatch measured where the weights are the same.

Right after a push the inference engine serves the weights the trainer holds (cast to the serving
dtype), yet the two compute different log-probs for the same tokens: other kernels, precision,
batch shapes. That gap is part of every importance weight pi_k / alpha and is not staleness. The
probe measures it alone:

    probe = ParityProbe.draw(first_batch_samples, cfg)   # once per run, kept in <run>/parity_probe.json
    engine = server.score(probe.pairs(), T, top_p)       # the engine's sampler log-probs of the probe's tokens
    trainer = trainer_logprobs(policy, probe, ...)       # the trainer's, same weights, same T
    row.update(parity_stats(engine.logprobs, trainer, cfg.threshold))

after each push (every `parity.every`-th), before the first optimizer step on the new weights.
The probe's tokens are fixed for the run, so its numbers are comparable from push to push: a gap
that grows at a constant weight history points at the engine, not at the policy.

Per token, d = log pi_trainer - log pi_engine and w = exp(d); the statistics are those the trainer
logs of pi_k against alpha (grpo/objective.py: tv = |w - 1| / 2, kl_pik_alpha = w - 1 - log w)
with the engine in alpha's place, so on the probe's own tokens, on policy, the per-batch mismatch
(grpo/staleness.py) and the probe measure the same quantity (docs/offpolicy.md).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from grpo import metrics
from grpo.fsutil import fsync_dir, write_durable
from grpo.serving.client import SCORE_MAX_TOKENS

PROBE_FILE = "parity_probe.json"
FORMAT = "grpo-parity-probe/1"


@dataclass
class ParityConfig:
    """The `parity:` section: the log-prob parity probe (docs/offpolicy.md)."""

    sequences: int = 4  # probe sequences, drawn once from the run's first batch (0: no probe)
    max_tokens: int = 64  # completion tokens scored per probe sequence (its first ones)
    every: int = 1  # probe after every n-th push (the engine scores a request per probe sequence at T = 1, else per token)
    threshold: float = 0.1  # |log pi_trainer - log pi_engine| above which a token counts in parity_frac_over
    warn_kl: float = 1e-2  # one warning line when parity_kl (per token) exceeds this (bf16 engines sit near 1e-3)

    def __post_init__(self):
        for name in ("sequences", "max_tokens", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "sequences" else 1):
                bound = ">= 0 (0: no probe)" if name == "sequences" else ">= 1"
                raise ValueError(f"{name}: must be an integer {bound}, got {value!r}")
        if self.sequences * self.max_tokens > SCORE_MAX_TOKENS:
            raise ValueError(f"sequences x max_tokens: {self.sequences} x {self.max_tokens} probe tokens, more than "
                             f"the server scores in one request ({SCORE_MAX_TOKENS})")
        for name in ("threshold", "warn_kl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")


@dataclass
class ProbeSequence:
    prompt_ids: list[int]
    completion_ids: list[int]  # the first parity.max_tokens tokens of a sampled completion


@dataclass
class ParityProbe:
    sequences: list[ProbeSequence]
    drawn_at: dict  # where it came from: {"stage", "iteration", "weights_version"} and the settings it was drawn with

    @classmethod
    def draw(cls, samples: list, cfg: ParityConfig, G: int, where: dict) -> "ParityProbe":
        """`cfg.sequences` sequences of a batch (grpo.rollout.Sample, a group's G adjacent): the first
        completion of each group first, so the probe covers as many prompts as it can, then the
        second of each, and so on. Deterministic: a resumed run that draws again draws the same."""
        order = [j * G + r for r in range(G) for j in range(len(samples) // G)]
        chosen = [samples[i] for i in order[:cfg.sequences]]
        return cls([ProbeSequence(list(s.prompt_ids), list(s.completion_ids[:cfg.max_tokens])) for s in chosen],
                   {**where, "sequences": cfg.sequences, "max_tokens": cfg.max_tokens})

    def settings(self) -> dict:
        return {key: self.drawn_at.get(key) for key in ("sequences", "max_tokens")}

    def drawn_with(self, cfg: ParityConfig) -> bool:
        """Whether this probe is what `cfg` would draw (its sequences and token cut)."""
        return self.settings() == {"sequences": cfg.sequences, "max_tokens": cfg.max_tokens}

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        return [(s.prompt_ids, s.completion_ids) for s in self.sequences]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.sequences)

    def to_json(self) -> dict:
        return {"format": FORMAT, "drawn_at": self.drawn_at, "sequences": [asdict(s) for s in self.sequences]}

    @classmethod
    def from_json(cls, obj: dict) -> "ParityProbe":
        if obj.get("format") != FORMAT:
            raise ValueError(f"not a parity probe of format {FORMAT}: {obj.get('format')!r}")
        return cls([ProbeSequence(**s) for s in obj["sequences"]], obj["drawn_at"])

    def save(self, run_dir: str | os.PathLike) -> Path:
        """Atomically, beside the run's config: a resumed run probes the same tokens."""
        path = Path(run_dir) / PROBE_FILE
        tmp = path.with_name(f".{PROBE_FILE}.tmp")
        write_durable(tmp, json.dumps(self.to_json()) + "\n")
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return path

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> Optional["ParityProbe"]:
        path = Path(run_dir) / PROBE_FILE
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None


MEANINGS = {
    "parity_tokens": "the parity probe's scored tokens: on the first step after each push (and the first of the run) "
                     "the engine and the trainer score the same tokens with the same weights "
                     "([offpolicy.md](offpolicy.md))",
    "parity_filtered_frac": "fraction of probe tokens the engine's top-k/top-p filter leaves out",
    "parity_max_abs": "max |log pi_trainer - log pi_engine| over the probe",
    "parity_mean_abs": "mean |log pi_trainer - log pi_engine|",
    "parity_kl": "mean of w - 1 - log w, w = pi_trainer / pi_engine (the k3 term of kl_mismatch on the probe)",
    "parity_tv": "mean of |w - 1| / 2",
    "parity_frac_over": "fraction of probe tokens with |d log p| > `parity.threshold`",
}
PARITY_KEYS = tuple(MEANINGS)
REDUCE = {"parity_tokens": "sum", "parity_max_abs": "max"}  # the others: means
metrics.declare("time_parity", "time", "the parity probe after a push, both sides ([offpolicy.md](offpolicy.md))")


def parity_terms(x) -> dict[str, torch.Tensor]:
    """The instrument (grpo.instruments.Tokens of the probe: logp the trainer's, logp_alpha the
    engine's, cfg the `parity:` section): per probe token, NaN where a term is not defined (a token
    the engine's top-k/top-p filter left out has no d), so the registry's means skip it."""
    filtered = torch.isneginf(x.logp_alpha)
    d = torch.where(filtered, torch.nan, x.logp.double() - x.logp_alpha.double())
    w = torch.exp(d)
    return {"parity_tokens": torch.ones_like(d), "parity_filtered_frac": filtered.double(),
            "parity_max_abs": d.abs(), "parity_mean_abs": d.abs(), "parity_kl": w - 1.0 - d,
            "parity_tv": 0.5 * (w - 1.0).abs(),
            "parity_frac_over": torch.where(filtered, torch.nan, (d.abs() > x.cfg.threshold).double())}


def parity_stats(engine: list[list[float]], trainer: list[list[float]], threshold: float) -> dict[str, float]:
    """The probe's numbers from the engine's and the trainer's log-probs of the same tokens (lists
    per sequence): the registered instrument `parity` (`parity_terms`) over the N probe tokens:
      parity_tokens                     N
      parity_filtered_frac              fraction the engine's top-k/top-p filter leaves out under the
                                        served weights (log-prob -inf; the trainer has no such filter):
                                        a probe token drawn by an older alpha can leave the nucleus
    and over the others, with d = trainer - engine and w = exp(d):
      parity_max_abs, parity_mean_abs   max and mean |d|
      parity_kl                         mean of w - 1 - log w (>= 0; the k3 term of kl_mismatch: on the tokens
                                        alpha sampled, an estimate of KL(alpha || trainer); on the fixed probe
                                        after later pushes, a divergence score on fixed tokens)
      parity_tv                         mean of |w - 1| / 2
      parity_frac_over                  fraction of tokens with |d| > threshold
    (missing when the engine filtered every token)."""
    from grpo.instruments import probe_stats

    if [len(e) for e in engine] != [len(t) for t in trainer]:
        raise ValueError(f"parity: engine scored {[len(e) for e in engine]} tokens per sequence, "
                         f"the trainer {[len(t) for t in trainer]}")
    return probe_stats(engine, trainer, ParityConfig(threshold=threshold))


@torch.no_grad()
def trainer_logprobs(policy, probe: ParityProbe, pad_id: int, device: torch.device, share_prompts: bool
                     ) -> list[list[float]]:
    """The trainer's log-probs of the probe's completion tokens at the policy's temperature, one
    forward of the whole probe (collective under FSDP: every rank calls with the same probe).
    share_prompts: the model's attention takes grpo.batching.collate_groups rows (a group of one
    per probe sequence)."""
    from grpo.batching import collate, collate_groups
    from grpo.rollout import Sample

    samples = [Sample(group=j, prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                      logp_alpha=[0.0] * len(s.completion_ids), truncated=False)
               for j, s in enumerate(probe.sequences)]
    mb = collate_groups([[s] for s in samples], pad_id, device) if share_prompts else collate(samples, pad_id, device)
    logp, _ = policy(mb.input_ids, mb.completion_index, mb.completion_tokens, position_ids=mb.position_ids,
                     segments=mb.segments)
    flat = logp.float().cpu().tolist()
    out, start = [], 0
    for s in probe.sequences:
        out.append(flat[start:start + len(s.completion_ids)])
        start += len(s.completion_ids)
    return out


class ParityVersionError(RuntimeError):
    """An engine scored the probe with other weights than the trainer pushed."""


def engine_parity(server, probe: "ParityProbe", trainer: list[list[float]], cfg: ParityConfig, version: int,
                  temperature: float, top_p: float = 1.0) -> dict[str, float]:
    """The probe scored by the engine against the trainer's log-probs of the same weights (version):
    parity_* (parity_stats). A fleet of several servers (grpo/serving/fleet.py) scores it on every
    server, since each engine loaded the push on its own: parity_* are server 0's, and
    fleet_server<r>_parity_* each server's. One warning line per engine past parity.warn_kl.
    InferenceServerError as the server raises it; ParityVersionError if a server scored with other
    weights."""
    each = server.score_each if len(getattr(server, "servers", ())) > 1 else None
    scored = each(probe.pairs(), temperature=temperature, top_p=top_p) if each else \
        [server.score(probe.pairs(), temperature=temperature, top_p=top_p)]
    for r, s in enumerate(scored):
        if s.weights_version != version:
            who = f"server {r}" if len(scored) > 1 else "the server"
            raise ParityVersionError(f"parity probe: {who} scored with weights version {s.weights_version}, "
                                     f"the trainer pushed version {version}")
    per_server = [parity_stats(s.logprobs, trainer, cfg.threshold) for s in scored]
    if len(per_server) == 1:
        warn_if_apart(per_server[0], cfg, version)
        return per_server[0]
    out = dict(per_server[0])
    for r, stats in enumerate(per_server):
        warn_if_apart(stats, cfg, version, engine=f"the engine of server {r} ({server.servers[r].url})")
        out.update({f"fleet_server{r}_{key}": value for key, value in stats.items() if key != "parity_tokens"})
    return out


def warn_if_apart(stats: dict[str, float], cfg: ParityConfig, version: int, engine: str = "the engine"
                  ) -> Optional[str]:
    """One line on stderr when the engine and the trainer disagree past parity.warn_kl on the same
    weights; returns it (None when quiet)."""
    kl = stats.get("parity_kl")
    if kl is None or not kl > cfg.warn_kl:
        return None
    line = (f"[train] parity: {engine} and the trainer disagree on weights version {version}: KL {kl:.3g} per "
            f"token > parity.warn_kl {cfg.warn_kl:g} (max |d log p| {stats['parity_max_abs']:.3g}, "
            f"{100 * stats['parity_frac_over']:.1f}% of the scored probe tokens past {cfg.threshold:g}); "
            "docs/offpolicy.md")
    print(line, file=sys.stderr)
    return line
