"""Nothing a researcher sets is silently ignored (grpo/registry.py): a knob that collides with
another owner's is refused when it is registered, a knob set while its owner is not selected is
refused when the config is read, and every error that comes from a user's module names its file.
Each through train.py's own entry: one line on stderr, exit 2, before anything is started."""
from pathlib import Path

import pytest

from plugins import EXAMPLES, registered

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "tiny_test.yaml")


def refused(capsys, *overrides) -> str:
    """train.py on the tests' config with these overrides: exit 2 and one line (returned)."""
    import train

    assert train.main(["--config", CONFIG, *overrides]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: "), lines
    return lines[0]


def plugin(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


# ---- a knob that collides is refused at registration -------------------------------------------

COLLIDES_WITH_A_LOSS = '''
from grpo.losses import register_loss, LOSSES
from grpo.registry import Knob

@register_loss("my_cispo", equation="-", paper="-",
               knobs=(Knob("eps_high_is", 0.5, float, "my own IS clip"),))
def my_cispo(x, cfg):
    return LOSSES["cispo"].fn(x, cfg)
'''

COLLIDES_WITH_A_FIELD = '''
from grpo.rewards import register_term
from grpo.registry import Knob

@register_term("tidy", range=(0.0, 1.0), equation="-", knobs=(Knob("timeout_s", 1.0, float, "my timeout"),))
def tidy(c, cfg):
    return 1.0
'''


def test_a_knob_another_owner_declares_otherwise_is_refused_naming_both(tmp_path, capsys):
    """CISPO's eps_high_is (default 0.28) declared again by a plugin loss with default 0.5: before, the
    plugin's knob kept the library's default and check, silently."""
    path = plugin(tmp_path, "my_cispo.py", COLLIDES_WITH_A_LOSS)
    with registered(path):
        line = refused(capsys, f"plugins=[{path}]", "objective.loss=my_cispo")
    for needle in (f"plugins: {path}", "knob 'eps_high_is' of loss my_cispo", "my_cispo.py", "(default 0.5)",
                   "collides with the knob of loss cispo (default 0.28)"):
        assert needle in line, (needle, line)
    from grpo.losses import LOSSES
    assert "my_cispo" not in LOSSES  # refused: the registry is as it was


def test_a_knob_named_like_a_field_of_its_section_is_refused(tmp_path, capsys):
    path = plugin(tmp_path, "tidy.py", COLLIDES_WITH_A_FIELD)
    with registered(path):
        line = refused(capsys, f"plugins=[{path}]")
    assert "knob 'timeout_s' of reward term tidy" in line and "tidy.py" in line and "has a field of that name" in line


# ---- a knob whose owner is not selected is refused when the config is read --------------------

@pytest.mark.parametrize("overrides, needles", [
    (["objective.eps_low_is=0.5"],  # CISPO's, with the default loss grpo
     ["objective.eps_low_is: set to 0.5, but loss cispo, which reads it, is not selected",
      "select it (objective.loss: cispo), or drop the key"]),
    (["objective.adv_eps=0.01", "objective.advantage=none", "objective.loss=reinforce"],  # three estimators own it
     ["objective.adv_eps: set to 0.01, but none of its owners (advantage group, advantage batch, advantage "
      "reinforce_pp) is selected", "objective.advantage: group or objective.advantage: batch"]),
    (["objective.red_tau=2.0"],  # RED-Weight's temperature while `red` is none
     ["objective.red_tau: set to 2.0, but advantage step red_weight", "(objective.red: weight)"]),
    (["reward.overlong_buffer=4"],  # a term's knob while the term is not in reward.terms
     ["reward.overlong_buffer: set to 4, but reward term overlong", "reward.terms: {overlong: <weight>}"]),
], ids=["loss", "advantage", "step", "reward term"])
def test_a_knob_set_while_its_owner_is_not_selected_is_refused(capsys, overrides, needles):
    line = refused(capsys, *overrides)
    assert CONFIG in line
    for needle in needles:
        assert needle in line, (needle, line)


def test_knobs_of_the_selected_owner_and_switches_pass():
    from grpo.config import load_config
    from grpo.train_config import TrainConfig

    cfg = load_config(TrainConfig, CONFIG, ["objective.loss=cispo", "objective.eps_low_is=0.5", "objective.red=none",
                                            "objective.mask_zero_variance=false", "objective.adv_eps=0.01",
                                            "reward.terms={correct: 1.0, overlong: 0.5}", "reward.overlong_buffer=4",
                                            "objective.red_tau=1.0"])  # its default: no effect either way
    assert cfg.objective.eps_low_is == 0.5 and cfg.reward.overlong_buffer == 4


def test_a_plugin_knob_set_without_its_loss_names_the_plugin_file(capsys):
    path = EXAMPLES / "dual_clip.py"
    with registered("dual_clip.py"):
        line = refused(capsys, f"plugins=[{path}]", "objective.dual_clip_c=5.0")
        assert "objective.dual_clip_c: set to 5.0, but loss dual_clip (" in line and "dual_clip.py" in line
        line = refused(capsys, f"plugins=[{path}]", "objective.loss=dual_clip", "objective.dual_clip_c=0.5")
        assert "objective.dual_clip_c: must be > 1, got 0.5 (loss dual_clip, " in line and "dual_clip.py" in line


# ---- every error from a plugin names its file --------------------------------------------------

def test_a_plugins_own_value_error_names_its_file(tmp_path, capsys):
    path = plugin(tmp_path, "broken.py", "raise ValueError('my threshold must be positive')\n")
    with registered(path):
        line = refused(capsys, f"plugins=[{path}]")
    assert f"plugins: {path}: ValueError: my threshold must be positive" in line


def test_a_duplicate_registration_names_the_plugin_and_the_first_owner(tmp_path, capsys):
    path = plugin(tmp_path, "again.py", "from grpo.advantages import register_advantage\n\n\n"
                                        "@register_advantage('group', equation='-', paper='-')\n"
                                        "def group(r, keep, cfg):\n    return r\n")
    with registered(path):
        line = refused(capsys, f"plugins=[{path}]")
    assert f"plugins: {path}: ValueError: advantage 'group' is already registered (by grpo.advantages)" in line
    first = EXAMPLES / "answer_sentence.py"
    second = plugin(tmp_path, "answer_sentence_too.py", first.read_text())
    with registered(first):
        line = refused(capsys, f"plugins=[{first}, {second}]")
    assert f"plugins: {second}: ValueError: reward term 'answer_sentence' is already registered (by " in line
    assert "examples/answer_sentence.py)" in line


def test_a_plugin_losss_own_check_names_its_file(tmp_path, capsys):
    path = plugin(tmp_path, "checked.py", '''
from grpo.losses import LOSSES, register_loss


def _check(cfg):
    if cfg.eps_high < 0.25:
        raise ValueError(f"eps_high: my_loss needs >= 0.25, got {cfg.eps_high}")


@register_loss("my_loss", equation="-", paper="-", check=_check)
def my_loss(x, cfg):
    return LOSSES["grpo"].fn(x, cfg)
''')
    with registered(path):
        line = refused(capsys, f"plugins=[{path}]", "objective.loss=my_loss")
    assert "objective.eps_high: my_loss needs >= 0.25, got 0.2 (loss my_loss, " in line and "checked.py" in line


# ---- the sampling regime's keys, together (grpo/batch_source.py, grpo/push_policy.py) ----------

@pytest.mark.parametrize("overrides, needles", [
    (["rollout.mode=async", "grpo.lag=1"], ["grpo.lag:", "rollout.max_staleness"]),
    (["rollout.max_staleness=2"], ["max_staleness: only the asynchronous sampler reads it", "rollout.mode: async"]),
    (["grpo.lag=1", "grpo.sample_ahead=true"], ["grpo.sample_ahead:", "drop grpo.sample_ahead"]),
    (["push.policy=drift"], ["grpo.v: with push.policy: drift", "(it is 2)"]),  # tiny_test.yaml's v
    (["push.tv_threshold=0.1"], ["tv_threshold: only push.policy: drift reads it"]),
    (["push.policy=drift", "grpo.v=1", "push.ess_threshold=0.5"], ["ess_threshold: read with push.signal: is_weight_ess"]),
    (["grpo.lag=2", "grpo.v=1"], ["server.keep_last: must be >= 3 with grpo.lag: 2"]),
    (["push.policy=drift", "grpo.v=1", "log.split_staleness=false"], ["log.split_staleness: false does not measure"]),
])
def test_a_regime_key_that_is_idle_or_contradicts_another_is_refused(capsys, overrides, needles):
    line = refused(capsys, *overrides)
    for needle in needles:
        assert needle in line, line


def test_the_drift_push_schedule_decides_from_the_last_measurement_within_its_bounds():
    """grpo.push_policy.PushSchedule by hand: every v iterations; or by the drift measured on the batch
    just trained, never within min_interval of the last push, always at max_interval."""
    from grpo.push_policy import PushConfig, PushSchedule

    every = PushSchedule(PushConfig(), v=3)
    assert [every.due(k, since=0).push for k in range(7)] == [True, False, False, True, False, False, True]
    drift = PushSchedule(PushConfig(policy="drift", tv_threshold=0.05, min_interval=2, max_interval=4), v=1)
    drift.measured({"tv_staleness": 0.07})
    assert drift.due(5, since=1).push is False  # within min_interval, whatever the drift
    assert drift.due(5, since=2) == drift.due(5, since=3)
    assert drift.due(5, since=2).reason == "drift"
    drift.measured({"tv_staleness": 0.049})
    assert drift.due(5, since=3).push is False and drift.due(5, since=4).reason == "ceiling"
    drift.measured({})  # not measured (a batch with no active token): only the ceiling
    assert drift.due(5, since=3).push is False
    ess = PushSchedule(PushConfig(policy="drift", signal="is_weight_ess", ess_threshold=0.8), v=1)
    ess.measured({"is_weight_ess": 0.81})
    assert not ess.due(1, since=1).push
    ess.measured({"is_weight_ess": 0.8})
    assert ess.due(1, since=1).reason == "drift"
    restored = PushSchedule(PushConfig(policy="drift", tv_threshold=0.05), v=1)
    restored.load_state_dict(drift.state_dict())
    assert restored.last == drift.last is None


def test_the_pushed_copies_a_regime_keeps():
    """Instruments.push_copies: none on policy, one per version a batch in training may lag by."""
    from grpo.config import load_config
    from grpo.instruments import Instruments
    from grpo.train_config import TrainConfig

    def copies(*overrides):
        return Instruments.push_copies(load_config(TrainConfig, CONFIG, list(overrides)))

    assert copies("grpo.v=1") == 0  # on policy: pi_push is pi_k
    assert copies("grpo.v=4") == 1
    assert copies("grpo.v=1", "grpo.lag=1") == 2 and copies("grpo.v=2", "grpo.lag=3") == 2
    assert copies("grpo.v=1", "rollout.mode=async", "rollout.max_staleness=1", "grpo.i=1") == 3
    assert copies("grpo.v=1", "grpo.lag=9", "server.keep_last=10") == 4  # at most MAX_PUSH_COPIES
    assert copies("grpo.v=4", "log.split_staleness=false") == 0
