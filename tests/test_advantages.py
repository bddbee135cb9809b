"""grpo/advantages.py against values worked out by hand: every registered estimator and step, the
bound's M under the reward's range, the docs and presets from the registry, and replay computing
a recorded batch's advantages through the function sampling calls (under RLOO, by hand)."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpo import advantages, registry
from grpo.advantages import ADVANTAGES, STEPS, batch_advantages, group_advantages
from grpo.config import read_yaml
from grpo.objective import ObjectiveConfig
from grpo.recording import RecordedStream, record_batch
from grpo.rewards import RewardConfig
from grpo.rollout import Rollout, Sample
from grpo.train_config import TrainConfig
from hand_computed import close, t

ROOT = Path(__file__).resolve().parent.parent
REWARDS = [1, 0, 0, 1, 0, 0, 0, 1]  # G = 4: group 0 {1,0,0,1} mean 1/2 var 1/4; group 1 {0,0,0,1} mean 1/4 var 3/16


def adv_of(name: str, rewards=REWARDS, G: int = 4, **cfg):
    adv, weight, stats = group_advantages(t(rewards), G, ObjectiveConfig(advantage=name, **cfg))
    return adv, weight, stats


def test_group_is_eq2():
    adv, weight, _ = adv_of("group", adv_eps=1e-4)
    s0, s1 = math.sqrt(1 / 4 + 1e-4), math.sqrt(3 / 16 + 1e-4)
    close(adv, [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.75 / s1])
    close(weight, [1.0] * 8)


def test_batch_divides_by_the_batch_std():
    adv, _, _ = adv_of("batch", adv_eps=1e-4)
    sb = math.sqrt(3 / 8 * 5 / 8 + 1e-4)  # the batch's 8 rewards: mean 3/8, population var 15/64
    close(adv, [0.5 / sb, -0.5 / sb, -0.5 / sb, 0.5 / sb, -0.25 / sb, -0.25 / sb, -0.25 / sb, 0.75 / sb])


def test_none_is_the_centred_reward():
    adv, _, _ = adv_of("none")
    close(adv, [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75])


def test_rloo_subtracts_the_mean_of_the_others():
    adv, _, _ = adv_of("rloo")
    # group 0: r_0 = 1, the others {0, 0, 1} mean 1/3 -> 2/3; r_1 = 0, others {1, 0, 1} -> -2/3
    # group 1: r_3 = 1, others {0, 0, 0} -> 1; r_0 = 0, others {0, 0, 1} -> -1/3
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0])


def test_rloo_with_red_drop_leaves_one_out_of_the_kept_samples():
    # group {1,0,0,0}: RED-Drop keeps the positive and one negative; among n = 2 kept: 1 - 0 and 0 - 1
    adv, weight, stats = adv_of("rloo", rewards=[1, 0, 0, 0], red="drop")
    kept = torch.nonzero(weight).flatten().tolist()
    assert kept[0] == 0 and len(kept) == 2
    close(adv[kept], [1.0, -1.0])
    assert stats["red_drop_frac"] == 0.5
    adv, _, _ = adv_of("rloo", rewards=[1, 0], G=2)
    close(adv, [1.0, -1.0])  # G = 2: the other sample is the baseline


def test_reinforce_pp_normalises_the_centred_rewards_over_the_batch():
    adv, _, _ = adv_of("reinforce_pp", adv_eps=1e-4)
    # centred: 1/2, -1/2, -1/2, 1/2, -1/4, -1/4, -1/4, 3/4: mean 0, mean square (4/4 + 3/16 + 9/16) / 8 = 7/32
    s = math.sqrt(7 / 32 + 1e-4)
    close(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.75 / s])
    # with RED-Drop the centred rewards of the kept samples no longer average to 0
    adv, weight, _ = adv_of("reinforce_pp", rewards=[1, 0, 0, 0, 1, 1, 0, 1], red="drop", adv_eps=1e-4)
    kept = weight.bool()
    # kept: group 0 {1, 0}: 1/2, -1/2; group 1 {1,1,0,1}: 1/4, 1/4, -3/4, 1/4 -> mean 0, mean square
    # (1/4 + 1/4 + 3/16 + 9/16) / 6 = 5/24
    s = math.sqrt(5 / 24 + 1e-4)
    close(adv[kept], [0.5 / s, -0.5 / s, 0.25 / s, 0.25 / s, -0.75 / s, 0.25 / s])
    close(adv[~kept], [0.0, 0.0])


def test_the_steps_run_as_registered_and_report():
    assert [s.name for s in STEPS.values()] == ["red_drop", "zero_variance_mask", "red_weight"]
    adv, weight, stats = adv_of("none", rewards=[1, 1, 1, 0, 1, 0], G=3, mask_zero_variance=True)
    close(weight, [0, 0, 0, 1, 1, 1])
    assert stats["masked_frac"] == 0.5 and stats["zero_var_frac"] == 0.5
    adv, weight, _ = adv_of("none", rewards=[1, 0, 0, 0], red="weight", red_tau=0.5)
    close(weight, [math.exp(1.5), math.exp(-0.5), math.exp(-0.5), math.exp(-0.5)])


def test_bound_M_scales_rewards_by_the_rewards_range():
    # rewards in [-1, 1] (correct + overlong): {1, -1, -1, 1} is {1, 0, 0, 1} in [0, 1]: var 1/4
    _, _, stats = group_advantages(t([1, -1, -1, 1]), 4, ObjectiveConfig(adv_eps=1e-4), reward_range=(-1.0, 1.0))
    s0 = math.sqrt(0.25 + 1e-4)
    close(stats["bound_M"], (1 - s0) / s0)
    with pytest.raises(ValueError, match="reward_range"):
        group_advantages(t([1, 0]), 2, ObjectiveConfig(), reward_range=(1.0, 1.0))


def test_config_names_and_knobs_come_from_the_registry():
    with pytest.raises(ValueError, match=r"^advantage: must be one of \['batch', 'group', 'none'"):
        ObjectiveConfig(advantage="gae")
    with pytest.raises(ValueError, match=r"^adv_eps: must be in \(0, 1\)"):
        ObjectiveConfig(adv_eps=1.0)
    with pytest.raises(ValueError, match=r"^red: must be one of"):
        ObjectiveConfig(red="both")
    assert {k.name for k in advantages.knobs()} == {"adv_eps", "red", "mask_zero_variance", "red_tau"}


@pytest.mark.parametrize("entry", ADVANTAGES.values(), ids=lambda e: e.name)
def test_every_preset_selects_its_advantage(entry):
    if entry.preset is not None:
        cfg = ObjectiveConfig(**read_yaml(ROOT / "configs" / "objectives" / f"{entry.preset}.yaml")["objective"])
        assert cfg.advantage == entry.name


def test_docs_list_every_advantage_and_step_as_the_registry_says():
    block = registry.generated_block(ROOT / "docs" / "objectives.md", advantages.DOCS_BEGIN, advantages.DOCS_END)
    assert block.strip() == advantages.markdown().strip(), \
        "docs/objectives.md is stale: python -m grpo.advantages --write docs/objectives.md"


def test_a_replay_under_rloo_computes_the_advantages_sampling_would(tmp_path):
    """A recorded batch replayed under another estimator: RecordedStream.rollout calls
    batch_advantages, the function sample_rollout calls, so the advantages are RLOO's of the recorded
    rewards (by hand below), and under the recording's own config they are the recorded ones."""
    cfg = TrainConfig()
    cfg.grpo = replace(cfg.grpo, G=4, batch_prompts=2, M=1)
    made_with = {"model": json.dumps({"model_type": "qwen2", "vocab_size": 64}), "tokenizer": "0" * 64}
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    adv, weight, _ = batch_advantages(rewards, cfg, seed=11)  # the recorded run: eq. 2
    samples = [Sample(group=j // 4, prompt_ids=[5, 6], completion_ids=[7, 8 + j], logp_alpha=[-0.5, -1.0],
                      truncated=False, reward=r, correct=r, adv=adv[j], seq_weight=weight[j]) for j, r in enumerate(rewards)]
    record_batch(tmp_path, 0, 0, 11, Rollout(samples, {}), made_with)
    stream = RecordedStream(tmp_path)
    stream.check(cfg, made_with, None)  # as a replay's start-up does (no model directory here: weights unchecked)

    assert [s.adv for s in stream.rollout(0, 0, cfg).samples] == adv  # the run's own config: as trained on
    rloo = replace(cfg, objective=replace(cfg.objective, advantage="rloo"))
    replayed = stream.rollout(0, 0, rloo)
    close([s.adv for s in replayed.samples], [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0])
    assert [s.seq_weight for s in replayed.samples] == [1.0] * 8
    assert replayed.stats["reward_mean"] == 3 / 8 and replayed.stats["pass_rate"] == 3 / 8
    # a penalty term widens the reward's range: the same rewards, another bound_M
    wide = replace(rloo, reward=RewardConfig(terms={"correct": 1.0, "overlong": 1.0}))
    assert stream.rollout(0, 0, wide).stats["bound_M"] != replayed.stats["bound_M"]
