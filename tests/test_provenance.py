"""grpo.provenance: the commit, checkout state and machine a run records at every start."""
import json
import subprocess

from grpo import provenance

AMD = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
AMX = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "PATH": "/usr/bin:/bin"})


def test_the_commit_and_whether_the_checkout_changed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "train.py").write_text("print(1)\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "runs").mkdir()
    (repo / "runs" / "metrics.jsonl").write_text("{}\n")  # ignored: a run's outputs are not a change of the code
    tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"], capture_output=True,
                          text=True).stdout.strip()
    assert provenance.code_state(repo) == {"commit": head, "tree": tree, "dirty": False, "changed": []}
    # the same files committed again (a squash, a rebase): another commit, the same tree
    git(repo, "commit", "-q", "--amend", "-m", "squashed")
    again = provenance.code_state(repo)
    assert again["commit"] != head and again["tree"] == tree
    (repo / "train.py").write_text("print(2)\n")
    (repo / "new.py").write_text("")
    state = provenance.code_state(repo)
    assert state["commit"] == again["commit"] and state["dirty"] is True and sorted(state["changed"]) == ["new.py", "train.py"]
    assert provenance.code_state(tmp_path / "not-a-checkout") == {"commit": None, "tree": None, "dirty": None,
                                                                            "changed": []}


def test_the_machine_from_cpuinfo():
    m = provenance.machine(AMD)
    assert (m["cpu"], m["cpu_kind"], m["flags"]) == ("AMD EPYC 7B13", "AVX2 only", ["fpu", "sse", "avx2", "fma"])
    assert m["cores"] >= 1 and m["usable_cores"] >= 1
    assert provenance.machine(AMX)["cpu_kind"] == "AMX"
    assert provenance.machine_text({"cpu": "AMD EPYC 7B13", "cpu_kind": "AVX2 only", "usable_cores": 2}) == \
        "2 x AMD EPYC 7B13 (AVX2 only)"


def test_every_start_adds_a_line_and_a_line_cut_short_is_a_start_of_unknown_commit(tmp_path):
    run = tmp_path / "run"
    first = provenance.record(run, argv=["train.py", "--config", "c.yaml"], root=tmp_path)
    provenance.record(run, argv=["train.py", "--resume"], root=tmp_path)
    starts = provenance.read(run)
    assert [s["argv"][-1] for s in starts] == ["c.yaml", "--resume"] and starts[0] == json.loads(json.dumps(first))
    assert starts[0]["commit"] is None and starts[0]["machine"]["cores"] >= 1  # tmp_path is no checkout
    with open(run / provenance.FILE, "a") as f:
        f.write('{"started": "2026-')  # killed while writing
    assert provenance.read(run)[-1] == {"commit": None, "dirty": None, "unreadable": '{"started": "2026-'}
    assert provenance.read(tmp_path / "elsewhere") == []
