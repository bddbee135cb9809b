"""train.py with rank 1 lost at a chosen step (for tests/test_lost_rank.py).

    torchrun --nproc_per_node=2 tests/lost_rank_train.py --config ... [overrides]     GRPO_TEST_LOST=inside:3

inside:N   at step N rank 1 waits inside a collective (the first all-gather of its forward) while
           rank 0 is busy outside any (a 60 s pause, as a long generation would keep it), and is
           SIGKILLed there after 1 s
outside:N  at step N rank 1 is SIGKILLed outside any collective (1 s into a pause of its own) while
           rank 0 waits for it inside one
setup      in start-up, once the process group is up, rank 1 is SIGKILLed 1 s into loading the
           tokenizer while rank 0 is busy there (a 60 s pause, as starting the server keeps it)
A hung rank needs no help: the test stops it with SIGSTOP from outside.
"""
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402

where, _, at = os.environ.get("GRPO_TEST_LOST", "").partition(":")
rank = int(os.environ.get("RANK", "0"))
calls = [0]
real_sgd_iteration = train.sgd_iteration


def sgd_iteration(*args, **kwargs):
    calls[0] += 1  # one per optimizer step
    if where and calls[0] == int(at):
        if rank == 1:
            print(f"[lost_rank_train] rank 1 dies in 1 s, {where} a collective", file=sys.stderr, flush=True)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            if where == "outside":
                time.sleep(60)
        elif where == "inside":
            time.sleep(60)
    return real_sgd_iteration(*args, **kwargs)


real_load_tokenizer = train.load_tokenizer


def load_tokenizer(*args, **kwargs):
    if where == "setup":
        if rank == 1:
            print("[lost_rank_train] rank 1 dies in 1 s, in start-up", file=sys.stderr, flush=True)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        time.sleep(60)
    return real_load_tokenizer(*args, **kwargs)


train.sgd_iteration = sgd_iteration
train.load_tokenizer = load_tokenizer

if __name__ == "__main__":
    sys.exit(train.main())
