"""The off-policy instruments' maths: the parity probe (grpo/parity.py) and the staleness split
(grpo/staleness.py), both registered instruments reduced by grpo/instruments.py, against
hand-computed values; the trainer's side of the probe against HF."""
import copy
import math

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.instruments import INSTRUMENTS, Reduction, Tokens
from grpo.metrics import train_row
from grpo.parity import ParityConfig, ParityProbe, ProbeSequence, parity_stats, trainer_logprobs, warn_if_apart
from grpo.progress import Progress
from grpo.rollout import Sample
from grpo.shared_prompt import use_shared_prompt_attention
from grpo.staleness import SPLIT_KEYS
from grpo.train_config import TrainConfig
from kernels import KernelConfig
from tiny_models import make_tiny_model_dir


# ---- the parity probe's statistics ------------------------------------------------------------

def test_parity_stats_by_hand():
    # d = trainer - engine = [0, 0.5, -0.1]; w = e^d = [1, 1.6487212707, 0.9048374180]
    # |d|: max 0.5, mean 0.2; k3 = w - 1 - d = [0, 0.1487212707, 0.0048374180] -> mean 0.0511862296
    # tv = |w - 1| / 2 = [0, 0.3243606354, 0.0475812910] -> mean 0.1239806421; |d| > 0.2: 1 of 3
    stats = parity_stats([[-1.0, -2.0], [-0.5]], [[-1.0, -1.5], [-0.6]], threshold=0.2)
    assert stats["parity_max_abs"] == pytest.approx(0.5, abs=1e-12)
    assert stats["parity_mean_abs"] == pytest.approx(0.2, abs=1e-12)
    assert stats["parity_kl"] == pytest.approx(0.0511862296, abs=1e-10)
    assert stats["parity_tv"] == pytest.approx(0.1239806421, abs=1e-10)
    assert stats["parity_frac_over"] == pytest.approx(1 / 3)
    assert stats["parity_tokens"] == 3 and stats["parity_filtered_frac"] == 0.0


def test_parity_of_identical_log_probs_is_zero_and_quiet(capsys):
    logp = [[-0.3, -4.0, -1.25], [-2.5]]
    stats = parity_stats(logp, copy.deepcopy(logp), threshold=0.1)
    assert {k: stats[k] for k in ("parity_max_abs", "parity_mean_abs", "parity_kl", "parity_tv",
                                  "parity_frac_over")} == dict.fromkeys(
        ("parity_max_abs", "parity_mean_abs", "parity_kl", "parity_tv", "parity_frac_over"), 0.0)
    assert warn_if_apart(stats, ParityConfig(), version=3) is None
    assert capsys.readouterr().err == ""


def test_a_token_the_engine_filtered_out_is_counted_apart_not_averaged_as_infinity():
    """With top_p < 1 a probe token (drawn by an older alpha) can leave the served weights'
    nucleus: the engine scores it -inf. It is counted in parity_filtered_frac; the gap statistics
    are those of the other tokens (here d = 0 on the one left)."""
    stats = parity_stats([[float("-inf"), -1.0]], [[-3.0, -1.0]], threshold=0.1)
    assert stats["parity_filtered_frac"] == 0.5 and stats["parity_tokens"] == 2
    assert stats["parity_max_abs"] == 0.0 and stats["parity_kl"] == 0.0 and stats["parity_frac_over"] == 0.0
    none_left = parity_stats([[float("-inf")]], [[-2.0]], threshold=0.1)
    assert none_left == {"parity_tokens": 1.0, "parity_filtered_frac": 1.0}  # the rest is missing, not NaN


def test_parity_refuses_misaligned_sequences():
    with pytest.raises(ValueError, match="tokens per sequence"):
        parity_stats([[-1.0, -2.0]], [[-1.0]], threshold=0.1)


def test_the_warning_is_one_line_naming_the_bound(capsys):
    stats = parity_stats([[-1.0, -2.0]], [[-1.5, -2.0]], threshold=0.1)  # kl = (e^-0.5 - 1 + 0.5) / 2 = 0.0533
    line = warn_if_apart(stats, ParityConfig(warn_kl=0.01), version=7)
    err = capsys.readouterr().err
    assert line is not None and err == line + "\n" and "\n" not in line
    assert "version 7" in line and "parity.warn_kl 0.01" in line and "0.0533" in line
    assert warn_if_apart(stats, ParityConfig(warn_kl=0.06), version=7) is None  # under the bound: quiet


# ---- the probe: drawn once, kept with the run --------------------------------------------------

def _batch(groups: int, G: int) -> list[Sample]:
    return [Sample(group=j, prompt_ids=[1, 2, j + 3], completion_ids=list(range(10 + r, 20 + 3 * r)),
                   logp_alpha=[-1.0] * (10 + 2 * r), truncated=False) for j in range(groups) for r in range(G)]


def test_the_probe_takes_one_completion_per_prompt_first_then_cuts_them(tmp_path):
    samples = _batch(groups=3, G=4)
    probe = ParityProbe.draw(samples, ParityConfig(sequences=5, max_tokens=12), G=4, where={"iteration": 0})
    # first completion of prompts 0, 1, 2, then the second of prompts 0, 1
    assert [s.prompt_ids[-1] for s in probe.sequences] == [3, 4, 5, 3, 4]
    assert [s.completion_ids for s in probe.sequences] == [list(range(10, 20))] * 3 + [list(range(11, 23))] * 2
    assert probe.num_tokens == 3 * 10 + 2 * 12
    assert probe.drawn_with(ParityConfig(sequences=5, max_tokens=12))
    assert not probe.drawn_with(ParityConfig(sequences=5, max_tokens=64))  # a resume with other settings draws anew
    probe.save(tmp_path)
    assert ParityProbe.load(tmp_path) == probe
    assert not list(tmp_path.glob(".*"))  # the temporary file was renamed into place
    assert ParityProbe.load(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("key,value", [("sequences", -1), ("max_tokens", 0), ("every", 0), ("threshold", 0.0),
                                       ("warn_kl", -1e-3), ("sequences", True)])
def test_bad_parity_settings_name_their_key(key, value):
    with pytest.raises(ConfigError, match=f"parity.{key}"):
        load_config(TrainConfig, None, [f"parity.{key}={str(value).lower()}"])


# ---- the trainer's side of the probe ------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("share_prompts", [False, "sdpa", "flex"])
def test_the_trainer_scores_the_probe_as_hf_does(tmp_path, share_prompts):
    from grpo.models import load_model
    from grpo.policy import Policy

    T = 0.7
    lm = load_model(make_tiny_model_dir(tmp_path / "tiny", arch="qwen2"), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    probe = ParityProbe([ProbeSequence(torch.randint(1, 400, (p,), generator=g).tolist(),
                                       torch.randint(1, 400, (c,), generator=g).tolist())
                         for p, c in ((5, 7), (9, 3), (4, 1))], {})
    want = []
    with torch.no_grad():
        for s in probe.sequences:
            logits = lm(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, len(s.prompt_ids) - 1:-1]
            want.append(torch.log_softmax(logits.double() / T, -1).gather(
                -1, torch.tensor(s.completion_ids)[:, None])[:, 0].tolist())
    if share_prompts:
        assert use_shared_prompt_attention(lm, share_prompts) == share_prompts
    got = trainer_logprobs(Policy(lm, T, KernelConfig(backend="torch")), probe, pad_id=0,
                           device=torch.device("cpu"), share_prompts=bool(share_prompts))
    assert [len(x) for x in got] == [7, 3, 1]
    for g_seq, w_seq in zip(got, want):
        assert g_seq == pytest.approx(w_seq, abs=2e-5)


# ---- the staleness split --------------------------------------------------------------------------

def split(logp_alpha, logp_push, logp_k, active, parts=((0, None),)) -> dict[str, float]:
    """The registered staleness split over the active tokens, the tokens cut into micro-batches."""
    reduction = Reduction([INSTRUMENTS["staleness_split"]])
    for lo, hi in parts:
        a, k = logp_alpha[lo:hi], logp_k[lo:hi]
        reduction.add(Tokens(logp=k, logp_old=k, logp_alpha=a, active=active[lo:hi], adv=torch.zeros_like(a),
                             seq_index=torch.zeros_like(a, dtype=torch.long), cfg=None, logp_push=logp_push[lo:hi]))
    return reduction.result(collective=False)


def test_the_split_by_hand():
    # per token (alpha, push, k): (-1.0, -1.1, -0.9), (-2.0, -2.0, -2.2), (-0.5, -0.4, -0.4) inactive
    # token 1: w_push = e^-0.1 = 0.9048374180, w = e^0.1 = 1.1051709181
    #   tv_mismatch 0.0475812910, kl_mismatch 0.9048374180 - 1 + 0.1 = 0.0048374180
    #   tv_staleness |1.1051709181 - 0.9048374180| / 2 = 0.1001667500
    #   kl_staleness 1.1051709181 - 0.9048374180 - 0.9048374180 * 0.2 = 0.0193660164
    # token 2: w_push = 1, w = e^-0.2 = 0.8187307531: mismatch 0, tv_staleness 0.0906346235,
    #   kl_staleness 0.8187307531 - 1 + 0.2 = 0.0187307531
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731 (-1.1 is not a float32)
    means = split(f64([-1.0, -2.0, -0.5]), f64([-1.1, -2.0, -0.4]), f64([-0.9, -2.2, -0.4]),
                  torch.tensor([True, True, False]))
    assert means["tv_mismatch"] == pytest.approx(0.0475812910 / 2, abs=1e-8)
    assert means["kl_mismatch"] == pytest.approx(0.0048374180 / 2, abs=1e-8)
    assert means["tv_staleness"] == pytest.approx((0.1001667500 + 0.0906346235) / 2, abs=1e-8)
    assert means["kl_staleness"] == pytest.approx((0.0193660164 + 0.0187307531) / 2, abs=1e-8)


def test_on_policy_staleness_is_exactly_zero_and_mismatch_is_the_objectives_tv_and_kl():
    """pi_push is pi_k (the trainer passes the same log-probs): both staleness terms are exactly 0,
    and the mismatch terms are the objective's own tv_pik_alpha and kl_pik_alpha."""
    from grpo.objective import ObjectiveConfig, finalize_stats, objective

    g = torch.Generator().manual_seed(3)
    logp_k = -torch.rand(50, generator=g) * 3
    logp_alpha = logp_k + 0.05 * torch.randn(50, generator=g)
    active = torch.rand(50, generator=g) > 0.2
    means = split(logp_alpha, logp_k, logp_k, active)
    assert means["tv_staleness"] == 0.0 and means["kl_staleness"] == 0.0
    _, stats = objective(logp_k.clone(), logp_alpha, None, None, torch.ones(50), active.float(), ObjectiveConfig())
    fin = finalize_stats(stats)
    assert means["tv_mismatch"] == pytest.approx(fin["tv_mean"], rel=1e-5)
    assert means["kl_mismatch"] == pytest.approx(fin["kl_pik_alpha_mean"], rel=1e-4)


def test_the_split_adds_over_micro_batches_and_an_empty_one_is_missing():
    g = torch.Generator().manual_seed(1)
    a, p, k = (-torch.rand(12, generator=g) for _ in range(3))
    on = torch.ones(12, dtype=torch.bool)
    whole = split(a, p, k, on)
    parts = split(a, p, k, on, parts=((0, 5), (5, 5), (5, None)))  # an empty micro-batch among them
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-12)
    empty = split(a, p, k, torch.zeros(12, dtype=torch.bool))
    assert all(math.isnan(empty[key]) for key in SPLIT_KEYS)
    rollout_stats = {"reward_mean": 0.0, "prompt_tokens": 1.0, "completion_tokens": 1.0}
    row = train_row(progress=Progress(step=1), stage=0, iteration=0, sgd_iteration=0, rollout_stats=rollout_stats,
                    train_stats={"loss": 0.0}, sampled_version=0, entropy=math.nan, grad_norm=0.0, lr=1.0, time_train=0.0, time_sync=0.0,
                    sync_bytes=0.0, iteration_seconds=1.0, instruments={**empty, "parity_kl": 0.5})
    assert not set(SPLIT_KEYS) & set(row) and row["parity_kl"] == 0.5
