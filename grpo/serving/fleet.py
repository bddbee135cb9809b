"""Several inference servers behind one push: the trainer's view of a fleet.

    fleet = ServerFleet.launch(model_dir, cfg.server, run_dir, gpus=layout.replica_gpus)  # or server.urls
    result = fleet.generate(prompt_ids, n=G, max_tokens=200, temperature=0.1, seed=batch_seed)
    fleet.push(full_state_dict, version=3, step=120)
    fleet.stop()

The same calls as one grpo.serving.inference.InferenceServer (train.py, grpo/rollout.py, the
instruments and the evaluation use either); with one server every call is that server's own, so a
one-server run is exactly what it was.

One version everywhere. A push is written (once per weights root: launched servers have one each,
attached servers share the run's staging directory, uploaded to each), then loaded by every server
in parallel, each engine's fingerprint checked against the pushed tensors. Only when every server
holds the new version does the push return. If a write fails, no server has loaded anything. If a
server refuses the load (or its fingerprint differs), every server that took the new version is
taken back to the one it served before: a launched server is restarted onto it, an attached one
reset to its model directory (POST /grpo/weights/reset, the one way versions go down on a running
server) and re-pushed it. If that fails too, the fleet refuses to sample until a push reaches every
server. Either way the push raises, and no batch is ever sampled from two versions: generate checks
that every share came from one. A run starts every server at version 0 (start_versions): an
attached server still serving another run's push, or this run's from past the checkpoint a resume
starts from, is reset first.

Same numbers. A batch's groups go to servers by index, group g to server g mod R, and the batch is
put back in group order. Each server samples its share as one seeded batch (the server reseeds its
engine's sampler once per request: per-request vLLM seeds kill the CPU engine), server r with
server_seed(seed, r): server 0 keeps the batch's seed, so a one-server fleet samples what one
server did. A batch is then a function of (weights version, prompts, seed, R): the same with any
R on resume, not the same across different R (each engine's random stream covers its own share).

A server that dies mid-batch is restarted by its InferenceServer, which re-serves the version it
held and samples its share again with the same seed; attached servers are not restarted.

Routed calls (the asynchronous sampler, which gave up determinism anyway: grpo/batch_source.py).
`generate_routed` sends one call whole to the least loaded server, by the load each engine reports
(GET /grpo/load: its unfinished requests, then the prompt tokens waiting for prefill), the calls
this fleet has routed there counting as soon as they are sent. The sampler keeps one call in flight
per server, so a server that finishes first starts the next call at once instead of waiting for
the slowest share of a batch, and a server busy with other work (an evaluation, another client)
gets less. The deterministic g mod R split stays for every seeded batch.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from grpo import metrics
from grpo.cpu import CPUConfig
from grpo.serving.client import AttachError, GenerationResult, InferenceServerError, ScoreResult
from grpo.serving.inference import InferenceServer, ServerConfig, weights_parent

metrics.declare("fleet_server*", "time", "with several inference servers (server.replicas or server.urls): "
                "fleet_server<r>_groups, the batch's groups server r sampled (groups g with g mod R = r), "
                "fleet_server<r>_seconds, its generate time, and after a probed push fleet_server<r>_parity_*, "
                "the parity probe scored by server r alone (grpo/parity.py; parity_* are server 0's); with "
                "rollout.mode async, fleet_server<r>_share, the fraction of the batch's groups sampled by server r "
                "(each call routed to the least loaded server) "
                "([layouts.md](layouts.md#a-fleet-of-servers))")


class FleetPushError(InferenceServerError):
    """A push that did not reach every server; the message says which refused and what each serves now."""


def server_seed(seed: Optional[int], r: int) -> Optional[int]:
    """The seed of server r's share of a batch: the batch's own for server 0, a hash of (seed, r)
    for the others, so that no two shares of one batch and no two batches draw the same stream."""
    if seed is None or r == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{r}".encode(), digest_size=4).digest(), "little") % 2**31


def shares(num_groups: int, num_servers: int) -> list[list[int]]:
    """The groups each server samples: group g to server g mod R."""
    return [list(range(r, num_groups, num_servers)) for r in range(num_servers)]


class ServerFleet:
    """Inference servers that sample one batch together and take every push together."""

    def __init__(self, servers: Sequence[InferenceServer]) -> None:
        if not servers:
            raise ValueError("a fleet needs at least one server")
        self.servers = list(servers)
        self._split: Optional[str] = None  # why the servers may hold different versions (a push not taken back)
        self._routing = threading.Lock()
        self._routed = [0] * len(self.servers)  # engine requests of the routed calls in flight, per server

    # -- construction
    @classmethod
    def launch(cls, model_dir: str | Path, cfg: ServerConfig, run_dir: str | Path,
               gpus: Sequence[Optional[str]] = (None,), gpu_memory_utilization: Optional[float] = None,
               cpu: Optional[CPUConfig] = None) -> "ServerFleet":
        """Attach to every server.urls (server.url: `attach`) or launch one server per entry of `gpus` (each
        replica's CUDA_VISIBLE_DEVICES, grpo.layout's replica_gpus; None: this machine's CPU), in
        parallel. One server is launched as before (run_dir/server); several as run_dir/server<r>,
        on server.port + r where a port is set. A server that fails to start stops the others."""
        if cfg.attached:
            return cls.attach(model_dir, cfg, run_dir)
        gpus = list(gpus)
        many = len(gpus) > 1
        configs = cls.replica_configs(cfg, model_dir, run_dir, len(gpus))
        starts = [lambda r=r: InferenceServer.launch(model_dir, configs[r], run_dir, gpu=gpus[r],
                                                     gpu_memory_utilization=gpu_memory_utilization, cpu=cpu,
                                                     name=f"server{r}" if many else "server")
                  for r in range(len(gpus))]
        if len(starts) == 1:
            return cls([starts[0]()])
        with concurrent.futures.ThreadPoolExecutor(len(starts), thread_name_prefix="fleet-start") as pool:
            futures = [pool.submit(start) for start in starts]
            concurrent.futures.wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for server in started:
                server.stop()
            raise failed[0]
        return cls(started)

    @classmethod
    def attach(cls, model_dir: str | Path, cfg: ServerConfig, run_dir: str | Path) -> "ServerFleet":
        """The running servers of server.urls (server.url), each asked at once whether it answers and
        takes the token (grpo.serving.client.attach): AttachError, one line naming every URL that
        failed and why, before a run starts anything else. Nothing on any server is changed here
        (start_versions resets them, once the run has started)."""
        configs = [replace(cfg, url=url, urls=None, replicas=1) for url in cfg.attached_urls]
        with concurrent.futures.ThreadPoolExecutor(len(configs), thread_name_prefix="fleet-attach") as pool:
            futures = [pool.submit(InferenceServer.launch, model_dir, c, run_dir) for c in configs]
        failed = [f.exception() for f in futures if f.exception() is not None]
        for error in failed:
            if not isinstance(error, AttachError):
                raise error
        if failed:
            raise AttachError("; ".join(str(e) for e in failed))
        return cls([f.result() for f in futures])

    @staticmethod
    def replica_configs(cfg: ServerConfig, model_dir: str | Path, run_dir: str | Path, replicas: int
                        ) -> list[ServerConfig]:
        """Each launched server's own config: one server each (on server.port + r where a port is
        set), and the parent of its private weights root decided once for all of them
        (grpo.serving.inference.weights_parent): every server has a root of its own there and a push
        writes one copy into each, so /dev/shm is chosen only when it holds the pushes of all R."""
        parent = weights_parent(cfg, Path(model_dir), Path(run_dir).resolve(), roots=replicas)
        return [replace(cfg, replicas=1, port=cfg.port + r if cfg.port else 0, weights_root=str(parent))
                for r in range(replicas)]

    # -- parallel calls
    def _each(self, call: Callable[[int, InferenceServer], object], which: Optional[Sequence[int]] = None
              ) -> list[tuple[object, Optional[BaseException]]]:
        """call(r, server) for every server (or those in `which`) at once: [(result, exception)]."""
        which = range(len(self.servers)) if which is None else which
        with concurrent.futures.ThreadPoolExecutor(max(len(which), 1), thread_name_prefix="fleet") as pool:
            futures = [pool.submit(call, r, self.servers[r]) for r in which]
        return [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]

    @staticmethod
    def _raise_first(outcomes) -> list:
        for _, error in outcomes:
            if error is not None:
                raise error
        return [result for result, _ in outcomes]

    # -- what the loop asks
    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, stop_token_ids: Optional[list[int]] = None,
                 seed: Optional[int] = None, engine_threads: Optional[int] = None) -> GenerationResult:
        """n samples of every prompt: group g from server g mod R (seeded server_seed(seed, r)), back
        in group order. result.engine names each server's groups and seconds (fleet_server<r>_*)."""
        if len(self.servers) == 1:
            return self.servers[0].generate(prompt_token_ids, n, max_tokens, temperature, top_p, stop_token_ids,
                                            seed, engine_threads)
        if self._split:
            raise InferenceServerError(f"the fleet does not sample: {self._split}")
        groups = shares(len(prompt_token_ids), len(self.servers))

        def share(r: int, server: InferenceServer):
            t0 = time.perf_counter()
            result = server.generate([prompt_token_ids[g] for g in groups[r]], n, max_tokens, temperature, top_p,
                                     stop_token_ids, server_seed(seed, r), engine_threads)
            return result, time.perf_counter() - t0

        busy = [r for r in range(len(self.servers)) if groups[r]]
        results = dict(zip(busy, self._raise_first(self._each(share, busy))))
        versions = {r: result.weights_version for r, (result, _) in results.items()}
        if len(set(versions.values())) > 1:
            raise InferenceServerError(f"the fleet's servers sampled one batch with different weights versions "
                                       f"({', '.join(f'{self.servers[r].url}: {v}' for r, v in versions.items())})")
        completions: list = [None] * len(prompt_token_ids)
        engine: dict = {}
        for r in range(len(self.servers)):
            engine[f"fleet_server{r}_groups"] = float(len(groups[r]))
            if r in results:
                result, seconds = results[r]
                for j, g in enumerate(groups[r]):
                    completions[g] = result.completions[j]
                engine[f"fleet_server{r}_seconds"] = seconds
                engine.update({f"fleet_server{r}_{key}": value for key, value in result.engine.items()})
        version = next(iter(versions.values())) if versions else self.weights_version()
        return GenerationResult(completions, version, engine)

    def generate_routed(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                        top_p: float = 1.0, stop_token_ids: Optional[list[int]] = None, seed: Optional[int] = None,
                        engine_threads: Optional[int] = None, inflight_updates: bool = False) -> GenerationResult:
        """n samples of every prompt, the whole call on the least loaded server (`least_loaded`); for
        callers that gave up determinism (the asynchronous sampler: no seed there). With several
        servers result.engine says which one sampled it: fleet_server<r>_share, 1 for it and 0 for
        the others (a batch's mean is each server's share of its groups)."""
        if self._split:
            raise InferenceServerError(f"the fleet does not sample: {self._split}")
        requests = len(prompt_token_ids) * n
        r = self.least_loaded(requests)
        try:
            result = self.servers[r].generate(prompt_token_ids, n, max_tokens, temperature, top_p, stop_token_ids,
                                              seed, engine_threads, inflight_updates)
        finally:
            with self._routing:
                self._routed[r] -= requests
        if len(self.servers) > 1:
            result.engine.update({f"fleet_server{s}_share": float(s == r) for s in range(len(self.servers))})
        return result

    def least_loaded(self, requests: int) -> int:
        """The server a routed call of `requests` engine requests goes to, counted there until it
        returns: the least loaded by what its engine reports (InferenceServer.load: unfinished
        requests, then prompt tokens waiting for prefill), where the requests this fleet has routed
        there count as soon as they are sent (the engine counts them only once they arrive: two
        calls routed at once must not both see the same idle server); a server that does not answer
        comes last (a dead one is restarted by the call that finds it, if none is left); ties go to
        the lowest index."""
        if len(self.servers) == 1:
            loads = [(None, None)]
        else:
            loads = self._each(lambda r, s: s.load())

        def key(r: int) -> tuple:
            load, error = loads[r]
            if load is None:
                return (error is not None, self._routed[r], 0, r)
            return (False, max(int(load["requests"]), self._routed[r]), int(load["queued_tokens"]), r)

        with self._routing:
            r = min(range(len(self.servers)), key=key)
            self._routed[r] += requests
        return r

    def set_inflight_updates(self, on: bool) -> None:
        """Pushes swap the weights under the generates that asked for inflight_updates (on) or wait
        for them (off, the default) on every server."""
        for server in self.servers:
            server.inflight_updates = on

    def score(self, sequences: list[tuple[list[int], list[int]]], temperature: float, top_p: float = 1.0,
              top_k: int = -1) -> ScoreResult:
        """Server 0 scores (what a one-server run's callers ask)."""
        return self.servers[0].score(sequences, temperature, top_p, top_k)

    def score_each(self, sequences: list[tuple[list[int], list[int]]], temperature: float, top_p: float = 1.0,
                   top_k: int = -1) -> list[ScoreResult]:
        """Every server scores the same sequences, at once (the parity probe checks each engine)."""
        return self._raise_first(self._each(lambda r, s: s.score(sequences, temperature, top_p, top_k)))

    def push(self, state_dict: dict[str, torch.Tensor], version: int, step: int) -> dict:
        """alpha <- these weights on every server, or on none (FleetPushError; see the module's
        docstring). Returns server 0's reply with bytes summed over the servers and the whole
        push's seconds; reply["servers"] holds each server's."""
        if len(self.servers) == 1:
            return self.servers[0].push(state_dict, version, step)
        t0 = time.perf_counter()
        # written once per root (attached servers share the run's staging directory), in parallel
        roots: dict[Path, list[int]] = {}
        for r, server in enumerate(self.servers):
            roots.setdefault(server.push_root, []).append(r)
        writers = [rs[0] for rs in roots.values()]
        written = dict(zip(writers, self._raise_first(
            self._each(lambda r, s: s.write(state_dict, version, step), writers))))
        dirs = {r: written[rs[0]] for rs in roots.values() for r in rs}
        t1 = time.perf_counter()
        before = [server.served for server in self.servers]
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push-moments") as pool:
            expected = pool.submit(self.servers[0]._moments, state_dict)  # one model, one dtype: the same for all
            outcomes = self._each(lambda r, s: s.load_checked(dirs[r], version, expected))
        refused = [(r, error) for r, (_, error) in enumerate(outcomes) if error is not None]
        if refused:
            self._take_back(version, before, refused)
        for r in writers:
            self.servers[r].prune()
        self._split = None
        replies = [reply for reply, _ in outcomes]
        return {**replies[0], "bytes": sum(float(reply["bytes"]) for reply in replies),
                "seconds": time.perf_counter() - t0, "write_seconds": t1 - t0, "servers": replies}

    def _take_back(self, version: int, before: list, refused: list[tuple[int, BaseException]]) -> None:
        """Every server that holds `version` goes back to what it served before; then raise."""
        reasons = "; ".join(f"{self.servers[r].url} refused it ({str(e).splitlines()[0]})" for r, e in refused)

        def held(r: int, server: InferenceServer) -> int:
            return server.weights_version()

        now = self._each(held)
        moved = [r for r, (v, error) in enumerate(now) if error is not None or v == version]
        kept = self._each(lambda r, s: s.revert(before[r]), moved)
        stuck = [self.servers[r].url for r, (_, error) in zip(moved, kept) if error is not None]
        if stuck:
            self._split = (f"the push of version {version} was refused ({reasons}), and {', '.join(stuck)} could not "
                           f"be taken back; a push that reaches every server lets the fleet sample again")
            raise FleetPushError(self._split)
        old = sorted({b[1] if b else 0 for b in before})
        raise FleetPushError(f"push of version {version}: {reasons}; every server serves version "
                             f"{', '.join(map(str, old))} as before")

    def serve(self, weights_dir: str | Path, version: int) -> dict:
        """Every server serves an existing weights directory as `version` (a resumed run's alpha)."""
        replies = self._raise_first(self._each(lambda r, s: s.serve(weights_dir, version)))
        self._split = None
        return replies[0]

    def start_versions(self) -> None:
        """Every server at version 0, the model directory (InferenceServer.start_versions)."""
        self._raise_first(self._each(lambda r, s: s.start_versions()))
        self._split = None

    def weights_version(self) -> int:
        """The version every server serves (InferenceServerError if they differ)."""
        versions = self._raise_first(self._each(lambda r, s: s.weights_version()))
        if len(set(versions)) > 1:
            raise InferenceServerError(f"the fleet's servers serve different weights versions: "
                                       f"{dict(zip((s.url for s in self.servers), versions))}")
        return versions[0]

    def stop(self) -> None:
        """Every server stopped, at once (the launcher gives a finishing rank seconds, not minutes)."""
        self._each(lambda r, s: s.stop())

    # -- what one server's callers read
    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def cpu_cores(self) -> Optional[list[int]]:
        """A launched CPU engine's cores (grpo/cpu/cores.py splits them with the trainer): one server only."""
        return self.servers[0].cpu_cores if len(self.servers) == 1 else None

    def __repr__(self) -> str:
        return f"ServerFleet({self.urls!r})"

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

