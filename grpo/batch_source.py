"""Where Algorithm 1's loop gets its batches: which weights sample batch k, and when.

The loop asks for batch k after its push decision; what sampled it is this component's business,
so the loop reads the same in every regime (docs/offpolicy.md, "Regimes"):

- **windows** (`grpo.lag: 0`, the default): Algorithm 1 as written. Batch k is sampled from the
  weights pushed at the start of its v-window; with sample-ahead, batch k+1 is generated while
  batch k trains when no push separates them.
- **fixed lag** (`grpo.lag: L >= 1`): batch k is sampled from the weights served L iterations
  earlier, so batches k+1..k+L generate while batch k trains, across pushes too. A batch is still a
  function of (the weights that sampled it, its prompts, its seed): reruns and resumes are bit for
  bit. A push first waits for every batch started on the weights it replaces.
- **asynchronous** (`rollout.mode: async`): a thread keeps a bounded queue of finished groups and
  never waits for the trainer; pushes do not drain it. A group sampled by weights pushed more than
  `rollout.max_staleness` optimizer steps before its batch's first step is dropped, or the sampler
  waits instead of sampling it (`rollout.on_stale`). Every sample carries the version that sampled
  it (`Sample.weights_version`, per token with in-flight updates: `Sample.version_spans`), and its
  log-probs are that version's. Not reproducible: which version samples a group depends on timing.
  With a fleet, a sampler thread per server keeps a call in flight on each, routed to the least
  loaded server.

Everything here runs on rank 0 (the server, the scorer and the prompt sampler live there); the
loop broadcasts what it returns.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Optional

from grpo import metrics
from grpo.rollout import Rollout, SampledGroups, assemble_rollout, sample_groups

ASYNC_KEYS = metrics.declare_many("rollout", {
    "async_dropped_groups": "rollout.mode async: groups dropped for this batch, sampled by weights pushed more than "
                            "rollout.max_staleness optimizer steps before its first step (their prompts are not retried)",
    "async_dropped_total": "rollout.mode async: groups dropped since the run started",
    "async_sampler_waits": "rollout.mode async: times the sampler waited since the last batch (a full queue, or with "
                           "on_stale: wait, a group it would sample would be too stale when trained on)",
    "async_sampler_wait_s": "rollout.mode async: seconds the sampler waited since the last batch",
    "async_queue_groups": "rollout.mode async: groups left in the queue after this batch was taken",
    "async_lag_steps_max": "rollout.mode async: the largest staleness of the batch's groups (optimizer steps from the push "
                           "of a group's oldest version to the batch's first step); never above rollout.max_staleness",
    "async_versions": "rollout.mode async: how many weights versions sampled the batch",
    "async_spanning_frac": "rollout.mode async: fraction of the batch's sequences sampled by more than one weights "
                           "version (rollout.inflight_updates: a push swapped the weights under them; their tokens "
                           "count in the lag buckets of their own versions, tokens_lag*)",
})


@dataclass
class RolloutConfig:
    """How batches are sampled (grpo.batch_source). The fixed lag is `grpo.lag`."""

    mode: Literal["sync", "async"] = "sync"  # sync: Algorithm 1's windows (grpo.lag); async: a sampler that never waits for the trainer
    max_staleness: int = 4  # async: optimizer steps between the push of the weights that sampled a group and its batch's first step, at most
    on_stale: Literal["wait", "drop"] = "wait"  # async: a group past max_staleness is never sampled (the sampler waits) or is dropped
    queue_groups: int = 0  # async: finished groups kept ahead of the trainer, at most (0: two batches)
    groups_per_call: int = 0  # async: prompts per server call, a call in flight per server (0: grpo.batch_prompts); a push waits for the calls in flight
    inflight_updates: bool = False  # async: a push swaps the weights under the calls in flight instead (vLLM's keep mode); each token carries its version

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode: must be 'sync' or 'async', got {self.mode!r}")
        if self.on_stale not in ("wait", "drop"):
            raise ValueError(f"on_stale: must be 'wait' or 'drop', got {self.on_stale!r}")
        for name in ("max_staleness", "queue_groups", "groups_per_call"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.mode == "sync":
            idle = [name for name, default in (("max_staleness", 4), ("on_stale", "wait"), ("queue_groups", 0),
                                               ("groups_per_call", 0), ("inflight_updates", False))
                    if getattr(self, name) != default]
            if idle:
                raise ValueError(f"{idle[0]}: only the asynchronous sampler reads it; set rollout.mode: async "
                                 f"or drop the key")


def batch_index(cfg, stage: int, k: int) -> int:
    """The batch's place in the run's stream of batches (stages continue it)."""
    return stage * cfg.grpo.M + k


# ----------------------------------------------------------------------------------------------
# Windows and fixed lag: deterministic
# ----------------------------------------------------------------------------------------------


@dataclass
class Started:
    """A batch whose prompts are drawn and whose sampling is under way (or done)."""

    index: int
    seed: int
    version: int  # the weights it is sampled from
    weights_dir: Optional[str]  # where those weights lie (None: the model directory, version 0)
    sampler_state: dict  # the prompt sampler's cursor before its prompts were drawn
    future: Future = field(repr=False)


class LaggedBatches:
    """grpo.lag = L >= 0 (L = 0: Algorithm 1 with sample-ahead inside a window).

    `take(g)` waits for batch g (starting it first where nothing has: the run's first batch). After
    the loop has done what it does with batch g on the weights now served (the parity probe right
    after a push), `start_ahead(g)` starts batches up to g + L on those weights, and with
    sample-ahead at L = 0 batch g + 1 while no push can come before it: a seeded batch is generated
    with no other request on the engine (the engine's sampling draws for every request it runs, so
    a probe scored meanwhile would change the batch). `before_push` waits for every started batch:
    each is sampled from the weights it was started on. A checkpoint keeps the prompt cursor from
    before the oldest batch not yet taken, and each such batch's (index, seed, version, weights): a
    resume samples them again, on the same weights, before anything else."""

    def __init__(self, lag: int, sample_ahead: Callable[[int], bool]):
        self.lag = lag
        self.sample_ahead = sample_ahead  # index -> sample it one batch early (L = 0, no push before it)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-source")
        self.started: dict[int, Started] = {}
        self.next_index: Optional[int] = None  # the next batch to start (None: the first take starts it)
        # The engine's threads for a batch, given whether it is generated while another trains (None:
        # the engine's own choice). Set by the CPU fence where the trainer and a CPU engine share cores.
        self.engine_threads: Callable[[bool], Optional[int]] = lambda overlapping: None

    def overlapping(self, index: int) -> bool:
        """Batch `index` generates while another batch trains: a function of its index alone, never
        of timing, so a resumed run samples it as the uninterrupted run did."""
        return self.lag > 0 or self.sample_ahead(index)

    def start_ahead(self, run, progress, g: int, seed_of: Callable[[int], int], last: int) -> None:
        """After batch g is taken and measured: start what the weights now served sample (batches up
        to g + L, and with sample-ahead g + 1). last: the run's last batch index."""
        upto = min(last, g + self.lag)
        while self.next_index <= upto:
            self.start(run, progress.weights_version, progress.weights_dir, self.next_index, seed_of(self.next_index))
        if self.lag == 0 and self.next_index == g + 1 and g + 1 <= last and self.sample_ahead(g + 1):
            self.start(run, progress.weights_version, progress.weights_dir, g + 1, seed_of(g + 1))

    def start(self, run, version: int, weights_dir: Optional[str], index: int, seed: int) -> None:
        """Draw batch `index`'s prompts and sample them (in the pool) from `version`, which the
        server must be serving when the pool gets to it."""
        state_before = run.sampler.state_dict()
        problems = run.sampler.next_batch()
        future = self.pool.submit(sample_groups, run.server, problems, run.tokenizer, run.cfg, run.scorer, seed,
                                  version, self.engine_threads(self.overlapping(index)))
        self.started[index] = Started(index, seed, version, weights_dir, state_before, future)
        self.next_index = index + 1

    def take(self, run, progress, g: int, seed: int) -> Rollout:
        """Batch g (waiting for it), its advantages and weights over the batch; started here on the
        weights now served where no earlier iteration started it (the run's first batch)."""
        if g not in self.started:
            if self.next_index is not None and self.next_index != g:
                raise RuntimeError(f"batch {g}: the batches are started in order, the next is {self.next_index}")
            self.start(run, progress.weights_version, progress.weights_dir, g, seed)
        started = self.started.pop(g)
        if started.seed != seed:
            raise RuntimeError(f"batch {g}: started with seed {started.seed}, taken with {seed}")
        t0 = time.time()
        part = started.future.result()
        rollout = assemble_rollout([part], run.cfg, seed)
        rollout.stats["time_wait_generate"] = time.time() - t0  # what the trainer waited for samples
        return rollout

    def before_push(self) -> None:
        """Every started batch sampled on the weights it started on: wait for them (a push would
        swap the weights under the ones still queued)."""
        wait([s.future for s in self.started.values()])

    def busy(self) -> bool:
        """A batch is being sampled right now (the CPU fence gives the trainer fewer cores meanwhile)."""
        return any(not s.future.done() for s in self.started.values())

    def versions_needed(self) -> set[int]:
        """The versions that sample a started batch not yet taken (kept until it is)."""
        return {s.version for s in self.started.values()}

    def state_dict(self, sampler) -> dict:
        """The prompt cursor before the oldest batch not yet taken, and those batches (index, seed,
        the weights that sample them): a checkpoint's part."""
        pending = sorted(self.started.values(), key=lambda s: s.index)
        return {"sampler": pending[0].sampler_state if pending else sampler.state_dict(),
                "pending": [{"index": s.index, "seed": s.seed, "version": s.version, "weights_dir": s.weights_dir}
                            for s in pending]}

    def resume(self, run, pending: list[dict], served: int, serve: Callable[[Optional[str], int], None]) -> int:
        """Start the batches a checkpoint had started, in order, each on the weights it was started
        on, and wait for them. served: the version the server serves now; serve(dir, version) loads
        another (versions only grow, as the batches' do). Returns the version served after."""
        for item in pending:
            if item["version"] != served:
                self.before_push()
                serve(item["weights_dir"], item["version"])
                served = item["version"]
            self.start(run, item["version"], item["weights_dir"], item["index"], item["seed"])
        self.before_push()
        return served

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Asynchronous: a bounded queue of groups, a staleness bound
# ----------------------------------------------------------------------------------------------


@dataclass
class Group:
    """One prompt's G samples from the asynchronous sampler, with where it came from."""

    part: SampledGroups  # the group alone (its samples' `group` is 0)
    sampler_state: dict  # the prompt sampler's cursor before its prompt was drawn
    version: int  # the oldest version that sampled a token of it

    @classmethod
    def split(cls, part: SampledGroups, states: list[dict], G: int) -> list["Group"]:
        out = []
        for j, state in enumerate(states):
            samples = [replace(s, group=0) for s in part.samples[j * G:(j + 1) * G]]
            one = SampledGroups(samples, part.problems[j:j + 1], part.texts[j * G:(j + 1) * G],
                                {k: v / len(states) if k in ("time_generate", "time_reward") else v
                                 for k, v in part.stats.items()}, part.engine)
            version = min(v for s in samples for v in (s.token_versions() if s.version_spans else [s.weights_version]))
            out.append(cls(one, state, version))
        return out


@dataclass
class Call:
    """A server call of the asynchronous sampler: its prompts' cursors (the prompt sampler's state
    before each was drawn), and its groups once sampled."""

    states: list[dict]
    groups: Optional[list[Group]] = None


class AsyncBatches:
    """rollout.mode: async (module docstring). Sampler threads (rank 0), one per server, each draw
    `groups_per_call` prompts at a time, sample them from whatever the server serves (the fleet
    routes each call to its least loaded server: grpo/serving/fleet.py) and queue each group with
    its version; they never wait for the trainer, except where the queue is full or, with on_stale:
    wait, where a group they would sample now would be consumed past max_staleness. Groups enter the
    queue in the order their prompts were drawn (a call that finishes before an earlier one waits for
    it). `take` assembles a batch from the oldest groups, dropping (on_stale: drop) and counting those
    past the bound. The staleness of a group is counted in optimizer steps from the push of its
    oldest version to its batch's first step, as alpha_lag_steps is.

    rollout.inflight_updates: the calls ask for in-flight updates and every push keeps them (the
    server swaps the weights under them: grpo/serving/engine_weights.py), so a completion spans the
    versions that sampled it (Sample.version_spans); otherwise a push waits for the calls in flight.

    Resume: a checkpoint keeps the prompt cursor from before the oldest group neither trained on nor
    dropped (queued or in flight): those prompts are drawn again, none is lost or repeated (the queue
    is in draw order, so every group after that cursor is one not trained on)."""

    def __init__(self, cfg, engine_threads: Callable[[bool], Optional[int]] = lambda overlapping: None):
        self.cfg = cfg
        r = cfg.rollout
        self.batch = cfg.grpo.batch_prompts
        self.per_call = r.groups_per_call or self.batch
        self.capacity = r.queue_groups or 2 * self.batch
        self.queue: list[Group] = []
        self.calls: dict[int, Call] = {}  # drawn and not yet queued, by their place in the draw order
        self.drawn = 0  # calls drawn so far
        self.cond = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.error: Optional[BaseException] = None
        self.engine_threads = engine_threads
        # what the staleness of a group sampled now will be: the trainer's step at its last take, and
        # the steps of the pushes (version -> step), both set by the trainer
        self.step_at_take = 0
        self.push_steps: dict[int, int] = {}
        self.served = (0, None)  # (version, step of its push) the server serves, as the trainer last pushed
        self.counts = {"dropped": 0, "waits": 0, "wait_s": 0.0}

    # -- the trainer's side ----------------------------------------------------------------------

    def start(self, run, progress) -> None:
        """Begin sampling (after set-up or a resume), from the weights the server serves now: a
        sampler thread per server, each with one call in flight."""
        self.pushed(progress)
        self.step_at_take = progress.step
        servers = getattr(run.server, "servers", [run.server])
        if hasattr(run.server, "set_inflight_updates"):
            run.server.set_inflight_updates(self.cfg.rollout.inflight_updates)
        self.threads = [threading.Thread(target=self._sample_forever, args=(run,), name=f"async-sampler-{r}",
                                         daemon=True) for r in range(len(servers))]
        for thread in self.threads:
            thread.start()

    def pushed(self, progress) -> None:
        """The trainer pushed (or started): the version it serves now and its step."""
        with self.cond:
            for version, step in progress.pushes:
                self.push_steps[version] = step
            self.push_steps[progress.weights_version] = progress.pushed_at_step
            self.served = (progress.weights_version, progress.pushed_at_step)
            self.cond.notify_all()

    def before_push(self) -> None:
        """Nothing to drain: the server lets the calls in flight finish on the weights they started
        on (or, with in-flight updates, swaps the weights under them)."""

    def start_ahead(self, *args) -> None:
        """Nothing to start: the sampler threads sample all the time."""

    def busy(self) -> bool:
        with self.cond:
            return bool(self.calls)

    def staleness(self, version: int, first_step: int) -> Optional[int]:
        pushed = self.push_steps.get(version)
        return None if pushed is None else first_step - pushed

    def take(self, run, progress, g: int, seed: int) -> Rollout:
        """The next batch: the oldest queued groups within the bound (waiting for the sampler where
        the queue runs short), its advantages over the batch; drops and waits counted."""
        t0 = time.time()
        groups, dropped = [], 0
        with self.cond:
            while len(groups) < self.batch:
                if self.error is not None:
                    raise RuntimeError(f"the asynchronous sampler stopped: {self.error}") from self.error
                if not self.queue:
                    self.cond.wait(timeout=1.0)
                    continue
                group = self.queue.pop(0)
                lag = self.staleness(group.version, progress.step)
                if lag is None or lag > self.cfg.rollout.max_staleness:
                    dropped += 1
                    continue
                groups.append(group)
            self.step_at_take = progress.step
            self.counts["dropped"] += dropped
            counts = dict(self.counts)
            self.counts["waits"], self.counts["wait_s"] = 0, 0.0
            queued = len(self.queue)
            self.cond.notify_all()
        rollout = assemble_rollout([grp.part for grp in groups], run.cfg, seed)
        lags = [self.staleness(grp.version, progress.step) for grp in groups]
        rollout.stats.update({
            "time_wait_generate": time.time() - t0, "async_dropped_groups": float(dropped),
            "async_dropped_total": float(counts["dropped"]), "async_sampler_waits": float(counts["waits"]),
            "async_sampler_wait_s": counts["wait_s"], "async_queue_groups": float(queued),
            "async_lag_steps_max": float(max(lags)), "async_versions": float(len(rollout.versions)),
            "async_spanning_frac": sum(s.version_spans is not None for s in rollout.samples) / len(rollout.samples)})
        return rollout

    def state_dict(self, sampler) -> dict:
        """The prompt cursor before the oldest group not yet trained on or dropped."""
        with self.cond:
            if self.queue:
                state = self.queue[0].sampler_state
            elif self.calls:
                state = self.calls[min(self.calls)].states[0]
            else:
                state = sampler.state_dict()
            return {"sampler": dict(state), "dropped": self.counts["dropped"]}

    def load_counts(self, state: dict) -> None:
        self.counts["dropped"] = int(state.get("dropped", 0))

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join(timeout=self.cfg.server.request_timeout_s)

    # -- the sampler threads -----------------------------------------------------------------------

    def _in_flight(self) -> int:
        """Groups drawn and not yet queued (calls in flight, and finished ones waiting for an earlier one)."""
        return sum(len(call.states) for call in self.calls.values())

    def _predicted_staleness(self, ahead: int) -> Optional[int]:
        """The staleness a group sampled now would have when trained on: `ahead` groups (queued, in
        flight, in this call, itself) come before it, a batch of them every i optimizer steps."""
        version, pushed = self.served
        batches = -(-ahead // self.batch)
        first_step = self.step_at_take + self.cfg.grpo.i * batches
        return None if pushed is None else first_step - pushed

    def _may_sample(self) -> bool:
        ahead = len(self.queue) + self._in_flight() + self.per_call
        if ahead > self.capacity:
            return False
        if self.cfg.rollout.on_stale == "wait":
            lag = self._predicted_staleness(ahead)
            return lag is not None and lag <= self.cfg.rollout.max_staleness
        return True

    def _sample_forever(self, run) -> None:
        """One sampler thread: draw a call's prompts, sample them, hand the groups over in draw order."""
        generate = getattr(run.server, "generate_routed", None)
        inflight = self.cfg.rollout.inflight_updates
        server = _Routed(generate, inflight) if generate is not None else run.server
        try:
            while True:
                with self.cond:
                    waited = None
                    while not self.stopping and not self._may_sample():
                        if waited is None:
                            waited = time.time()
                            self.counts["waits"] += 1
                        self.cond.wait(timeout=1.0)
                    if waited is not None:
                        self.counts["wait_s"] += time.time() - waited
                    if self.stopping:
                        return
                    states, problems = [], []
                    for _ in range(self.per_call):
                        states.append(run.sampler.state_dict())
                        problems.append(run.sampler.next_problem())
                    number, self.drawn = self.drawn, self.drawn + 1
                    self.calls[number] = Call(states)
                part = sample_groups(server, problems, run.tokenizer, run.cfg, run.scorer, None, None,
                                     self.engine_threads(True))
                with self.cond:
                    self.calls[number].groups = Group.split(part, states, run.cfg.grpo.G)
                    while self.calls and self.calls[min(self.calls)].groups is not None:  # in draw order
                        self.queue.extend(self.calls.pop(min(self.calls)).groups)
                    self.cond.notify_all()
        except BaseException as e:  # the trainer raises it at its next take
            with self.cond:
                self.error = e
                self.cond.notify_all()


class _Routed:
    """The fleet as sample_groups calls it from a sampler thread: each call whole on the least
    loaded server (ServerFleet.generate_routed), asking for in-flight updates where configured."""

    def __init__(self, generate_routed: Callable, inflight_updates: bool):
        self.generate_routed = generate_routed
        self.inflight_updates = inflight_updates

    def generate(self, prompt_token_ids, n, max_tokens, temperature, top_p=1.0, stop_token_ids=None, seed=None,
                 engine_threads=None):
        return self.generate_routed(prompt_token_ids, n, max_tokens, temperature, top_p, stop_token_ids, seed,
                                    engine_threads, self.inflight_updates)


def make_batch_source(cfg, sample_ahead: Callable[[int], bool]):
    """The regime's batch source (rank 0)."""
    if cfg.rollout.mode == "async":
        return AsyncBatches(cfg)
    return LaggedBatches(cfg.grpo.lag, sample_ahead)
