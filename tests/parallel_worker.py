"""Collectives of grpo.parallel on a real gloo group, for tests/test_parallel.py.

    torchrun --nproc_per_node=2 tests/parallel_worker.py payload OUT_JSON
    torchrun --nproc_per_node=2 tests/parallel_worker.py timeout OUT_JSON TIMEOUT_S SLEEP_S LATE_S
    torchrun --nproc_per_node=2 tests/parallel_worker.py shared_dir OUT_JSON DIR_RANK0 DIR_RANK1
    torchrun --nproc_per_node=2 tests/parallel_worker.py run_name OUT_JSON MODEL_DIR
"""
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from grpo.parallel import all_reduce_max, all_reduce_sum, broadcast_json, close_distributed, init_distributed  # noqa: E402


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "payload":
        info = init_distributed("cpu")
        # A rollout-sized payload (~6 MB of JSON): rank 0's object reaches every rank unchanged.
        obj = {"samples": [{"ids": list(range(i, i + 300)), "logp": [-0.5 - i * 1e-3] * 300, "text": "é" * 50}
                           for i in range(2000)]} if info.rank == 0 else None
        t0 = time.time()
        got = broadcast_json(obj)
        seconds = time.time() - t0
        digest = hashlib.sha256(json.dumps(got, sort_keys=True).encode()).hexdigest()
        sums = all_reduce_sum({"rank": info.rank, "one": 1.0})
        top = all_reduce_max(10.0 * info.rank)
        result = {"rank": info.rank, "digest": digest, "bytes": len(json.dumps(got)), "seconds": seconds,
                  "sum_rank": sums["rank"], "sum_one": sums["one"], "max": top}
    elif mode == "shared_dir":  # rank r sees the run directory as argv[3 + r]: two nodes without a shared fs
        from grpo.checkpoint import CheckpointError, check_shared_directory

        info = init_distributed("cpu")
        try:
            check_shared_directory(sys.argv[3 + info.rank])
            result = {"rank": info.rank, "ok": True}
        except CheckpointError as e:
            result = {"rank": info.rank, "ok": False, "error": str(e)}
    elif mode == "run_name":  # no log.run_name: each rank's default name holds its own start time
        import train

        parsed = f"{out}.rank0-parsed"
        if os.environ.get("RANK") == "1":  # parse in a later second than rank 0 did, whatever the imports took
            while not os.path.exists(parsed):
                time.sleep(0.05)
            time.sleep(1.1)
        cfg, _ = train.parse_args(["--config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                            "tiny_test.yaml"), f"model.path={sys.argv[3]}"])
        if os.environ.get("RANK") == "0":
            open(parsed, "w").close()
        own = cfg.log.run_name
        info = init_distributed("cpu")
        result = {"rank": info.rank, "own": own, "shared": train.shared_run_name(cfg)}
    elif mode == "outlive_agent":  # each rank says who it is, then waits: does it outlive a killed agent?
        info = init_distributed("cpu")
        with open(f"{out}.pid{info.rank}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
        result = {"rank": info.rank}
    else:
        timeout_s, sleep_s = float(sys.argv[3]), float(sys.argv[4])
        # The group's time-out also bounds its set-up, where each rank waits for the other's address:
        # on a loaded machine one rank's imports ended seconds after the other's and the short group
        # failed there, before its broadcast. The ranks meet first, outside the group.
        rank = int(os.environ["RANK"])
        if rank == 1:
            time.sleep(float(sys.argv[5]))  # its imports, seconds slower than rank 0's
        open(f"{out}.arrived{rank}", "w").close()
        while not os.path.exists(f"{out}.arrived{1 - rank}"):
            time.sleep(0.01)
        info = init_distributed("cpu", timeout_s=timeout_s)
        if info.rank == 0:
            time.sleep(sleep_s)  # rank 0 busy (starting vLLM, evaluating) while rank 1 waits
        t0 = time.monotonic()
        try:
            broadcast_json({"ready": True} if info.rank == 0 else None)
            result = {"rank": info.rank, "ok": True}
        except Exception as e:  # the time-out, reported to the test
            result = {"rank": info.rank, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        result["waited_s"] = time.monotonic() - t0
    with open(f"{out}.{info.rank}", "w") as f:
        json.dump(result, f)
    if mode in ("payload", "shared_dir", "run_name") or result["ok"]:
        close_distributed()
    else:
        os._exit(0)  # a timed-out gloo group cannot be torn down cleanly


if __name__ == "__main__":
    main()
