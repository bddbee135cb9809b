"""grpo.vllm_executor.quiet_reader on vLLM's real shared-memory message queue (no engine started).

The server's engine-core and worker processes pass every engine step through these queues; the
engine-level effect (the engine core no longer polls through a whole batch) is tested on a real
engine in tests/test_server.py::test_a_batch_on_one_thread_leaves_the_other_core_to_the_trainer.
"""
import threading
import time

import pytest

from grpo.vllm_executor import ACTIVE_POLL_S, quiet_reader


def _queue_pair():
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(n_reader=1, n_local_reader=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank=0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join()
    return writer, reader


def _read_after(writer, reader, delay_s: float) -> float:
    """Seconds the reader takes to get a message the writer enqueues `delay_s` after it starts waiting."""
    got = {}

    def read():
        got["msg"] = reader.dequeue(timeout=30)
        got["at"] = time.monotonic()

    t = threading.Thread(target=read)
    t.start()
    time.sleep(delay_s)
    sent = time.monotonic()
    writer.enqueue("step")
    t.join(timeout=30)
    assert got.get("msg") == "step"
    return got["at"] - sent


def test_a_lost_wake_up_costs_milliseconds_not_seconds():
    """A reader that sleeps on its socket relies on the writer's wake-up message, which vLLM's PUB
    socket (high-water mark 1) can drop; vLLM's own reader with busy_loop_s = 0 then found the
    message only at its 5 s recheck (seen as 6.3 s tiny-model batches that took 1.3 s otherwise).
    The quiet reader naps for at most ACTIVE_POLL_S while messages are frequent, so a lost wake-up
    is found within milliseconds. The loss is made certain here: the writer sends no wake-ups."""
    writer, reader = _queue_pair()
    quiet_reader(reader._spin_condition, 0.0)
    writer._spin_condition.notify = lambda: None  # every wake-up lost
    for _ in range(3):
        assert _read_after(writer, reader, 0.05) < 0.1


@pytest.mark.parametrize("spin_s", [0.0, 0.5])
def test_a_quiet_reader_gets_every_message_in_order(spin_s):
    writer, reader = _queue_pair()
    quiet_reader(reader._spin_condition, spin_s)
    got = []
    t = threading.Thread(target=lambda: got.extend(reader.dequeue(timeout=30) for _ in range(50)))
    t.start()
    for i in range(50):
        writer.enqueue(i)
        if i % 10 == 0:
            time.sleep(ACTIVE_POLL_S * 3)
    t.join(timeout=30)
    assert got == list(range(50))


def test_a_quiet_reader_does_not_spin_while_it_waits():
    """vLLM's reader yields in a loop for 1 s after each message (a full core); the quiet one
    sleeps: waiting 0.5 s for the next message costs it a few ms of CPU."""
    writer, reader = _queue_pair()
    quiet_reader(reader._spin_condition, 0.0)
    _read_after(writer, reader, 0.0)  # a message was just read: vLLM's reader would spin now
    cpu = {}

    def read():
        t0 = time.thread_time()
        reader.dequeue(timeout=30)
        cpu["s"] = time.thread_time() - t0

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.5)
    writer.enqueue("late")
    t.join(timeout=30)
    assert cpu["s"] < 0.1, f"the waiting reader used {cpu['s']:.3f} CPU-s in 0.5 s"
