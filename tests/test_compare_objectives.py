"""scripts/compare_objectives.py on a recorded stream: every objective's update on the same batches
from the same parameters, as a table and a plot (in-process, a tiny random model)."""
import json
import sys
from pathlib import Path

import pytest

from grpo.models import load_tokenizer
from grpo.recording import model_and_tokenizer, record_batch
from test_missing_stats import config, rollout_of
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import compare_objectives  # noqa: E402


@pytest.fixture
def recorded(tmp_path):
    """A run directory with three recorded batches (2 prompts x 4 completions, rewards with signal)
    and the config it ran with."""
    model = make_tiny_model_dir(tmp_path / "tiny", arch="qwen2")
    run = tmp_path / "run"
    cfg = config(B=2, G=4)
    made_with = model_and_tokenizer(model, load_tokenizer(model))
    for k in range(3):
        record_batch(run, 0, k, 100 + k, rollout_of(cfg, reward=lambda j: float((j + k) % 2), seed=100 + k), made_with)
    (run / "config.yaml").write_text(f"model:\n  path: {model}\n  dtype: float32\ngrpo:\n  G: 4\n  batch_prompts: 2\n"
                                     f"  max_new_tokens: 8\noptim:\n  lr: 1.0e-2\nkernels:\n  backend: torch\n")
    return run


def test_the_objectives_updates_on_the_same_batches(recorded, capsys):
    out = recorded / "cmp"
    code = compare_objectives.main(["--run", str(recorded), "--out", str(out), "--objective", "grpo",
                                    "--objective", "cispo: objective.loss=cispo objective.advantage=none",
                                    "--objective", "reinforce: objective.loss=reinforce"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "compare.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 3 and (out / "compare.png").stat().st_size > 0
    table = (out / "compare.md").read_text().splitlines()
    assert len(table) == 2 + 9 and table[2].startswith("| 0 | 0 | grpo |")
    by = {(r["iteration"], r["objective"]): r for r in rows}
    for k in range(3):
        assert by[(k, "grpo")]["cosine_to_reference"] == pytest.approx(1.0)
        assert all(by[(k, name)]["grad_norm"] > 0 for name in ("grpo", "cispo", "reinforce"))
        # at pi = pi_k GRPO's gradient is -A (pi_k/alpha) grad log pi and REINFORCE's -A grad log pi:
        # close but not equal directions, while CISPO (unscaled advantages, token mean) differs more
        assert 0.5 < by[(k, "reinforce")]["cosine_to_reference"] < 1.0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 9


def test_main_gives_back_the_lm_heads_cpu_math_mode_it_found(recorded):
    """compare_objectives takes the trainer's CPU math mode for its LM head (grpo.cpu.bf16) while it
    runs, and gives the process back the mode it found: run in another program's process (a test, a
    notebook), it left oneDNN's bf16 mode installed where a CPU honours it (AMX), and the next exact
    fp32 head in that process took bf16-rounded gradients."""
    import kernels.lm_head as lm_head

    def found():  # a mode this process had, which main must leave in place
        raise AssertionError("not entered: main installs its own mode while it runs")

    lm_head.set_cpu_bf16_gemms(found)
    try:
        assert compare_objectives.main(["--run", str(recorded), "--out", str(recorded / "cmp"),
                                        "--objective", "grpo"]) == 0
        assert lm_head.CPU_BF16_GEMMS is found
    finally:
        lm_head.set_cpu_bf16_gemms(None)


def test_a_run_that_recorded_nothing_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("grpo:\n  G: 4\n")
    assert compare_objectives.main(["--run", str(tmp_path), "--objective", "grpo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare_objectives: ") and "log.save_rollouts" in err and "\n" not in err


def test_follow_compares_each_batch_where_the_run_had_moved(recorded):
    """--follow: the first batch is compared at the starting parameters (the same rows as without
    it), the later ones after the run's own updates (other numbers); rows carry the lag and the
    run objective's gradient norms (v = 1, i = 1: lag 0, one norm per batch)."""
    args = ["--run", str(recorded), "--objective", "grpo", "--objective", "reinforce: objective.loss=reinforce"]
    assert compare_objectives.main([*args, "--out", str(recorded / "still")]) == 0
    assert compare_objectives.main([*args, "--out", str(recorded / "moving"), "--follow"]) == 0
    read = lambda d: [json.loads(line) for line in (recorded / d / "compare.jsonl").read_text().splitlines()]  # noqa: E731
    still, moving = read("still"), read("moving")
    assert [r["alpha_lag_steps"] for r in moving] == [0] * 6 and all(len(r["run_grad_norms"]) == 1 for r in moving)
    assert [r["grad_norm"] for r in moving[:2]] == pytest.approx([r["grad_norm"] for r in still[:2]], rel=1e-6)
    assert moving[0]["run_grad_norms"][0] > 0  # the run's step had a gradient: the parameters moved
    assert all(abs(m["grad_norm"] - s["grad_norm"]) > 1e-6 * s["grad_norm"] for m, s in zip(moving[2:], still[2:]))
