"""train.py with its inference server SIGKILLed at chosen points (for tests/test_faults.py).

    torchrun ... tests/fault_train.py --config ... [overrides]     GRPO_TEST_FAULTS=generate:1,push:1,generate_mid:5

generate:N       the whole server process group is killed right before the N-th generation call
generate_mid:N   ... 0.1 s into the N-th generation call (while it runs)
push:N           ... right before the N-th weight push
The run must finish with every step and the uninterrupted run's numbers: the server object
restarts the server, re-serves alpha, and the batch is sampled again with its seed.
"""
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from grpo.serving.inference import InferenceServer  # noqa: E402

FAULTS = set(os.environ.get("GRPO_TEST_FAULTS", "").split(","))
calls = {"generate": 0, "push": 0}
real_generate, real_push = InferenceServer.generate, InferenceServer.push


def kill(server: InferenceServer) -> None:
    print(f"[fault_train] SIGKILL the server's process group ({server.pid})", file=sys.stderr, flush=True)
    try:
        os.killpg(server.pid, signal.SIGKILL)  # the server leads its own session: engine core included
    except ProcessLookupError:
        pass


def generate(self, *args, **kwargs):
    calls["generate"] += 1
    if f"generate:{calls['generate']}" in FAULTS:
        kill(self)
    if f"generate_mid:{calls['generate']}" in FAULTS:
        threading.Timer(0.1, kill, (self,)).start()
    return real_generate(self, *args, **kwargs)


def push(self, *args, **kwargs):
    calls["push"] += 1
    if f"push:{calls['push']}" in FAULTS:
        kill(self)
    return real_push(self, *args, **kwargs)


InferenceServer.generate, InferenceServer.push = generate, push

if __name__ == "__main__":
    sys.exit(train.main())
