"""pi_ref <- pi_theta under FSDP2 bf16 mixed precision, after no-grad forwards of both (which leave
the root's parameters unsharded). Prints the log-prob gaps before and after the swap as JSON.

    torchrun --nproc_per_node=N tests/ref_swap_worker.py MODEL_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import train  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.parallel import close_distributed, init_distributed  # noqa: E402
from grpo.policy import copy_policy  # noqa: E402
from grpo.train_config import TrainConfig  # noqa: E402

cfg = load_config(TrainConfig, None, [f"model.path={sys.argv[1]}", "model.dtype=bfloat16", "objective.beta=0.1"])
info = init_distributed()
policy = train.build_policy(cfg, info.device, trainable=True)
ref = train.build_policy(cfg, info.device, trainable=False)
ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
index = torch.arange(5, 11)
targets = ids.view(-1)[index + 1]
with torch.no_grad():
    for p in policy.parameters():
        p.add_(0.01)  # pi_theta moves away from pi_ref
    before = (policy(ids, index, targets)[0] - ref(ids, index, targets)[0]).abs().max().item()
copy_policy(ref, policy)  # as train.py calls it: gradients enabled around it
params = list(ref.parameters())
leaves = sum(p.is_leaf and not p.requires_grad and p.grad_fn is None for p in params)
with torch.no_grad():
    after = (policy(ids, index, targets)[0] - ref(ids, index, targets)[0]).abs().max().item()
if info.rank == 0:
    print(json.dumps({"before": before, "after": after, "frozen_parameters": len(params), "leaves_without_grad": leaves}))
del policy, ref  # the sharded models hold the group: release them so that it is freed now
close_distributed()
