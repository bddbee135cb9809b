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
