"""grpo.cpu.engine: the bind values it understands, and that restricting a process reaches
every thread it has and starts (a real subprocess). The engine itself is tested in
tests/test_server.py (one engine process using about one core, an engine that dies with its server)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo.cpu.cores import bind_cores


def test_bind_values():
    assert bind_cores("0-1") == [0, 1]
    assert bind_cores("2,3") == [2, 3]
    assert bind_cores("0-2,5") == [0, 1, 2, 5]
    for other in (None, "", "auto", "nobind", "0-1|2-3"):
        assert bind_cores(other) is None, other


@pytest.mark.torchrun
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_restrict_process_reaches_threads_started_before_and_after():
    core = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import json, os, threading, torch
        from grpo.cpu.engine import restrict_process
        stop = threading.Event()
        early = threading.Thread(target=stop.wait, daemon=True); early.start()   # a socket thread, say
        restrict_process([{core}])
        late = threading.Thread(target=stop.wait, daemon=True); late.start()
        torch.ones(4096, 4096) @ torch.ones(4096, 4096)   # starts the OpenMP team
        masks = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]
        print(json.dumps({{"masks": masks, "torch_threads": torch.get_num_threads()}}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["masks"]) >= 3  # main, early, late (and the OpenMP team, one thread here)
    assert all(mask == [core] for mask in got["masks"]), got["masks"]
    assert got["torch_threads"] == 1
