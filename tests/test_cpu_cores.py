"""The CPU fence's core decisions (grpo/cpu/cores.py): which cores a CPU engine binds, and how the
trainer and the engine split shared cores. Pure functions, table-tested."""
import pytest
import torch

from grpo.cpu.cores import CoreSharing, CoreSplit, core_split, engine_cores, parse_cpu_list
from grpo.layout import plan_layout

V8 = [str(i) for i in range(8)]


def _cpu_layout(**kw):
    kw = {"server_device": "auto", "attached": False, "node_rank": 0, "rank": 0, "local_rank": 0,
          "local_world_size": 1, **kw}
    return plan_layout([], **kw)


def test_parse_cpu_list():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list("3") == [3]
    assert parse_cpu_list("0,1") == [0, 1]


@pytest.mark.parametrize("case,layout,world,threads,trainer_cores,server_cores,expected", [
    # this machine: 2 cores, the server bound to both; overlapped each gets one, alone each gets both
    ("2 cores", "cpu", 1, 2, {0, 1}, [0, 1], CoreSplit(2, 1, 2, 1)),
    ("3 cores", "cpu", 1, 3, {0, 1, 2}, [0, 1, 2], CoreSplit(3, 2, 3, 1)),
    ("4 cores: the server has the upper half", "cpu", 1, 2, {0, 1}, [2, 3], None),
    ("one trainer thread: nothing to hand over", "cpu", 1, 1, {0, 1}, [0, 1], None),
    ("a server bound to one core", "cpu", 1, 2, {0, 1}, [1], None),
    ("two trainer ranks", "cpu", 2, 2, {0, 1}, [0, 1], None),
    ("attached server", "attached", 1, 2, {0, 1}, None, None),
    ("GPU trainers, server on its own GPU", "gpu", 1, 2, {0, 1}, None, None),
    ("GPU trainers, CPU server", "gpu-cpu-server", 1, 2, {0, 1}, [0, 1], None),
])
def test_core_split_only_where_trainer_and_cpu_server_share_cores(case, layout, world, threads, trainer_cores,
                                                                   server_cores, expected):
    plan = {"cpu": lambda: _cpu_layout(), "attached": lambda: _cpu_layout(attached=True),
            "gpu": lambda: plan_layout(V8, server_device="auto", attached=False, node_rank=0, rank=0, local_rank=0,
                                       local_world_size=7),
            "gpu-cpu-server": lambda: plan_layout(V8, server_device="cpu", attached=False, node_rank=0, rank=0,
                                                  local_rank=0, local_world_size=8)}[layout]()
    assert core_split(plan, world, threads, trainer_cores, server_cores) == expected, case




def test_engine_cores_take_the_upper_half_of_four_or_more():
    assert engine_cores("0-1") == "0-1"  # asked for: kept
    assert engine_cores(None, [0, 1]) == "0,1"  # shared with the trainer
    assert engine_cores(None, [0, 1, 2, 3]) == "2,3"
    assert engine_cores(None, [0, 1, 2, 3, 4]) == "2,3,4"


def test_core_sharing_fits_the_trainer_around_each_forward():
    sampling = [True]
    sharing = CoreSharing(CoreSplit(2, 1, 2, 1), lambda: sampling[0])
    assert (sharing.engine_threads(True), sharing.engine_threads(False)) == (1, 2)
    module = torch.nn.Linear(2, 2)
    seen = []

    def forward_runs_on(*_):
        seen.append(torch.get_num_threads())
        sampling[0] = False  # the batch sampled ahead arrives while this forward runs

    module.register_forward_hook(forward_runs_on)  # registered first: runs before sharing's own post-forward fit
    sharing.attach(module)
    before = torch.get_num_threads()
    try:
        module(torch.ones(1, 2))
        assert seen == [1]  # the engine sampled ahead: the forward ran on the core it left
        assert torch.get_num_threads() == 2  # the batch came in meanwhile: the backward gets both cores
        module(torch.ones(1, 2))
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)
