"""Rollouts as plain records: sharding keeps groups whole, JSON round trips are exact."""
import json

from grpo.rollout import Rollout, Sample, shard_samples


def make(group, p, c):
    return Sample(group=group, prompt_ids=list(range(10, 10 + p)), completion_ids=list(range(100, 100 + c)),
                  logp_alpha=[-0.5] * c, truncated=False, adv=float(group), seq_weight=1.0)


def test_shard_samples_keeps_groups_whole():
    samples = [make(g, 1, 1) for g in range(4) for _ in range(3)]
    shards = [shard_samples(samples, r, 2) for r in range(2)]
    assert [s.group for s in shards[0]] == [0, 0, 0, 1, 1, 1]
    assert [s.group for s in shards[1]] == [2, 2, 2, 3, 3, 3]


def test_rollout_json_round_trip():
    rollout = Rollout([make(0, 2, 3), make(1, 1, 1)], {"reward_mean": 0.25}, [{"prompt": "p", "reward": 1.0}])
    again = Rollout.from_json(json.loads(json.dumps(rollout.to_json())))
    assert again == rollout
