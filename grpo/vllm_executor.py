"""vLLM's multiprocess executor without its busy-waiting, for a CPU server that shares its cores.

    python -m grpo.server ... --idle-spin-s 0      (grpo.inference launches CPU servers this way)

vLLM passes every engine step between its engine-core process and its worker process through
shared-memory queues whose readers poll (sched_yield) for 1 s after each message before they sleep
on a socket. Both ends read: the worker waits for the next step, the engine core for the worker's
result. During generation a step takes well under a second, so the engine core polled for the
whole batch: with the worker on one thread (the core split of sample-ahead) it used 11.2 CPU-s
of a 13.4 s batch on the other core, the core the trainer was meant to have.

Sleeping on the socket at once (vLLM's own busy_loop_s = 0) is not safe either: its wake-up
message can be lost (a PUB socket with a high-water mark of 1), and the reader then rechecks only
after 5 s (SHM_READER_RECHECK_INTERVAL_MS). With the worker side at 0, some tiny-model batches
took 6.3 s instead of 1.3. So a quiet reader sleeps on the socket for at most ACTIVE_POLL_S
while messages are frequent (within a second of the last one) and IDLE_POLL_S after: a lost
wake-up costs at most that, and an idle server wakes ~10 times a second.
Loaded by name (vLLM's --distributed-executor-backend), in the engine-core process; the worker's
side is set through the worker extension (grpo.vllm_worker_ext.GRPOWorkerExtension.grpo_idle_spin).
"""
import os
import time

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

SPIN_ENV = "GRPO_IDLE_SPIN_S"  # seconds a reader busy-waits after each message (unset: vLLM's own 1 s)
ACTIVE_POLL_S = 0.002
IDLE_POLL_S = 0.1


def quiet_reader(condition, spin_s: float) -> None:
    """Make a shared-memory queue reader (vLLM's SpinCondition) busy-wait for spin_s seconds after
    each message, then sleep on its socket in bounded naps instead of until the next message."""
    import zmq

    from vllm.distributed.utils import sched_yield

    def wait(timeout_ms=None) -> None:
        idle_s = time.monotonic() - condition.last_read
        if idle_s <= spin_s:
            sched_yield()
            return
        nap_ms = max(1, int(1000 * (ACTIVE_POLL_S if idle_s <= 1.0 else IDLE_POLL_S)))
        events = dict(condition.poller.poll(timeout=nap_ms if timeout_ms is None else min(nap_ms, timeout_ms)))
        if condition.local_notify_socket in events:  # consume it, as vLLM's own wait does (conflated)
            condition.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    condition.wait = wait


class QuietExecutor(MultiprocExecutor):
    def _post_init_executor(self) -> None:
        super()._post_init_executor()
        spin_s = float(os.environ.get(SPIN_ENV, "1"))
        for mq in self.response_mqs:  # the engine core's side: it reads the workers' results
            quiet_reader(mq._spin_condition, spin_s)
        self.collective_rpc("grpo_idle_spin", args=(spin_s,))  # the workers' side: they read the steps
