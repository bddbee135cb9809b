"""Trainer-side weight writing and server-side checking (no vLLM; real files, real safetensors)."""
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open

from grpo.serving.weights_check import check_hashes, check_weights_dir, resolve_under_root
from grpo.serving.weights_dir import (SERVING_MARKER, SPARE_FILE, WeightPushError, list_weights_dirs, prune_weights,
                                      weights_dir_name)
from grpo.serving.weights_writer import write_weights


def verify_weights_dir(path, root):
    """What the server checks of a push before serving it: everything but the hashes, then the hashes."""
    manifest = check_weights_dir(path, root)
    check_hashes(manifest)
    return manifest


def _config_dir(tmp_path, tie=False):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tie}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return d


def _state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(10, 4, generator=g),
    }


def test_write_weights_roundtrip_bf16(tmp_path):
    sd = _state_dict()
    root = tmp_path / "root"
    out = write_weights(sd, _config_dir(tmp_path), root, version=3, step=120, dtype=torch.bfloat16)
    assert out == root / "weights-v00000003"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "manifest.json", "model.safetensors"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["version"], manifest["step"], manifest["dtype"], manifest["hash"]) == (3, 120, "bfloat16", "sha256")
    data = (out / "model.safetensors").read_bytes()
    assert manifest["files"] == [{"name": "model.safetensors", "bytes": len(data),
                                  "sha256": hashlib.sha256(data).hexdigest()}]
    # 4 tensors of 40 + 24 + 4 + 40 elements, 2 bytes each in bf16, after the header
    assert len(data) - 8 - int.from_bytes(data[:8], "little") == (40 + 24 + 4 + 40) * 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(sd)
        for k, v in sd.items():
            got = f.get_tensor(k)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, v.to(torch.bfloat16))
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == "0o600"
    assert verify_weights_dir(out, root)["version"] == 3
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


def test_tied_lm_head_is_written_once_and_hf_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = write_weights(model.state_dict(), src, tmp_path / "root", version=1, step=1, dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_rewritten_version_replaces_and_empty_state_dict_is_refused(tmp_path):
    cfg = _config_dir(tmp_path)
    write_weights(_state_dict(), cfg, tmp_path / "root", version=1, step=0, dtype=torch.float32)
    zeros = {k: torch.zeros_like(v) for k, v in _state_dict().items()}
    out = write_weights(zeros, cfg, tmp_path / "root", version=1, step=7, dtype=torch.float32)  # a resumed run
    assert verify_weights_dir(out, tmp_path / "root")["step"] == 7
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not f.get_tensor("model.norm.weight").any()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["weights-v00000001"]
    with pytest.raises(WeightPushError, match="empty"):
        write_weights({}, cfg, tmp_path / "root", version=2, step=0, dtype=torch.float32)
    with pytest.raises(WeightPushError, match="config.json"):
        write_weights(_state_dict(), tmp_path, tmp_path / "root", version=3, step=0, dtype=torch.float32)


def test_blake3_manifest_verifies(tmp_path):
    import blake3

    out = write_weights(_state_dict(), _config_dir(tmp_path), tmp_path / "r", 0, 0, torch.bfloat16, hash_algo="blake3")
    entry = json.loads((out / "manifest.json").read_text())["files"][0]
    assert entry["blake3"] == blake3.blake3((out / "model.safetensors").read_bytes()).hexdigest()
    verify_weights_dir(out, tmp_path / "r")


@pytest.fixture
def pushed(tmp_path):
    root = tmp_path / "root"
    out = write_weights(_state_dict(), _config_dir(tmp_path), root, version=5, step=9, dtype=torch.float32)
    return root, out


def test_hash_check_threads_follow_this_process_cores_not_the_machines(pushed, monkeypatch):
    """A server pinned to a few cores of a big machine hashes with those cores but one: the machine's
    core count (os.cpu_count) would start more threads than the process may run."""
    import grpo.serving.weights_check as weights_check

    root, out = pushed
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a big machine; this process keeps its own cores
    threads_used = []
    real_hash_file = weights_check.hash_file

    def recording_hash_file(path, algo, threads=1):
        threads_used.append(threads)
        return real_hash_file(path, algo, threads=threads)

    monkeypatch.setattr(weights_check, "hash_file", recording_hash_file)
    check_hashes(check_weights_dir(out, root))
    assert threads_used == [max(1, len(os.sched_getaffinity(0)) - 1)]


def test_flipped_byte_fails_the_hash_only(pushed):
    root, out = pushed
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: the header still parses, sizes still match
    f.write_bytes(bytes(data))
    check_weights_dir(out, root)  # structure is fine...
    with pytest.raises(WeightPushError, match="sha256 mismatch"):
        verify_weights_dir(out, root)  # ...the content is not


def test_truncated_file_is_refused(pushed):
    root, out = pushed
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(WeightPushError, match="truncated"):
        check_weights_dir(out, root)
    # even if the manifest is "fixed" to the new size, the header gives the truncation away
    m = json.loads((out / "manifest.json").read_text())
    m["files"][0]["bytes"] = len(data) - 100
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(WeightPushError, match="truncated or padded"):
        check_weights_dir(out, root)


def test_missing_manifest_and_stray_file(pushed):
    root, out = pushed
    (out / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(WeightPushError, match="extra.safetensors is not listed"):
        check_weights_dir(out, root)
    (out / "manifest.json").unlink()
    with pytest.raises(WeightPushError, match="no manifest.json"):
        check_weights_dir(out, root)


def test_paths_outside_root_are_refused(pushed, tmp_path):
    root, out = pushed
    assert resolve_under_root(out.name, root) == out.resolve()  # relative to the root is fine
    with pytest.raises(WeightPushError, match="not inside the weights root"):
        check_weights_dir(root / ".." / "model", root)
    with pytest.raises(WeightPushError, match="not inside the weights root"):
        check_weights_dir("/etc", root)
    with pytest.raises(WeightPushError, match="not inside the weights root"):
        check_weights_dir(root, root)
    # a symlink inside the root that points out of it
    (root / "escape").symlink_to(tmp_path / "model")
    with pytest.raises(WeightPushError, match="not inside the weights root"):
        check_weights_dir(root / "escape", root)
    # a symlinked weights file inside a legitimate directory
    f = out / "model.safetensors"
    real = tmp_path / "elsewhere.safetensors"
    f.rename(real)
    f.symlink_to(real)
    with pytest.raises(WeightPushError, match="not a regular file"):
        check_weights_dir(out, root)


def test_prune_keeps_last_and_serving(tmp_path):
    root = tmp_path / "root"
    cfg = _config_dir(tmp_path)
    for v in range(1, 6):
        write_weights(_state_dict(), cfg, root, version=v, step=v, dtype=torch.bfloat16)
    (root / SERVING_MARKER).write_text(weights_dir_name(2) + "\n")
    dead_tmp = root / ".tmp-weights-v00000009-999999999-abcd"  # pid beyond pid_max: a dead writer
    dead_tmp.mkdir()
    live_tmp = root / f".tmp-weights-v00000009-{os.getpid()}-abcd"
    live_tmp.mkdir()
    prune_weights(root, keep_last=2)
    assert [v for v, _ in list_weights_dirs(root)] == [2, 4, 5]
    assert not dead_tmp.exists() and live_tmp.exists()
    with pytest.raises(ValueError, match="keep_last"):
        prune_weights(root, keep_last=0)


def _push(root, cfg, version, sd, keep_last=2):
    """What InferenceServer.push does to the root: write reusing the spare, then prune keeping one."""
    out = write_weights(sd, cfg, root, version=version, step=version, dtype=torch.bfloat16, reuse_spare=True)
    prune_weights(root, keep_last=keep_last, keep_spare=True)
    return out


def _read_all(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_a_push_overwrites_the_pruned_push_in_place(tmp_path):
    """A fresh 269 MB tmpfs file costs 0.2-0.5 s of page allocation on this VM, overwriting one
    already there 0.05 s: the pruned push's file becomes the next push's (same inode), with the
    next push's bytes, whatever its size was (a larger or smaller model resizes it)."""
    root, cfg = tmp_path / "root", _config_dir(tmp_path)
    _push(root, cfg, 1, _state_dict())
    inode_v1 = os.stat(root / weights_dir_name(1) / "model.safetensors").st_ino
    _push(root, cfg, 2, _state_dict())
    assert not (root / SPARE_FILE).exists()  # two kept, nothing pruned yet
    _push(root, cfg, 3, _state_dict())
    assert [v for v, _ in list_weights_dirs(root)] == [2, 3]
    assert os.stat(root / SPARE_FILE).st_ino == inode_v1
    for version, scale, extra in ((4, 2.0, 0), (5, -1.0, 7), (6, 0.5, 0)):  # same, larger, smaller tensors
        spare_inode = os.stat(root / SPARE_FILE).st_ino
        sd = {k: scale * v for k, v in _state_dict().items()}
        if extra:
            sd["model.layers.1.mlp.up_proj.weight"] = torch.randn(extra, 4)
        out = _push(root, cfg, version, sd)
        assert os.stat(out / "model.safetensors").st_ino == spare_inode
        assert verify_weights_dir(out, root)["version"] == version  # hash and size as in the manifest
        got = _read_all(out / "model.safetensors")
        assert sorted(got) == sorted(sd)
        assert all(torch.equal(got[k], sd[k].to(torch.bfloat16)) for k in sd)


def test_a_push_held_by_another_name_is_never_overwritten(tmp_path):
    """A checkpoint saved inside a v-window holds alpha's weights as hard links to the push where it
    can: that file must keep its bytes, so it never becomes the spare. A spare that is not a plain
    file of ours (a symlink) is removed, not written through."""
    root, cfg = tmp_path / "root", _config_dir(tmp_path)
    _push(root, cfg, 1, _state_dict())
    held = tmp_path / "checkpoint-alpha.safetensors"
    os.link(root / weights_dir_name(1) / "model.safetensors", held)
    before = held.read_bytes()
    for v in range(2, 6):
        _push(root, cfg, v, {k: v * t for k, t in _state_dict().items()})
    assert held.read_bytes() == before
    assert os.stat(root / SPARE_FILE).st_ino != os.stat(held).st_ino
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"not weights")
    (root / SPARE_FILE).unlink()
    os.symlink(target, root / SPARE_FILE)
    out = _push(root, cfg, 6, _state_dict())
    assert target.read_bytes() == b"not weights"
    assert verify_weights_dir(out, root)["version"] == 6


def test_the_writer_gives_back_the_threads_it_narrows(tmp_path):
    """write_safetensors copies on one torch thread while its hash thread runs; the caller's count
    is restored afterwards, also when a copy fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        write_weights(_state_dict(), _config_dir(tmp_path), tmp_path / "root", 1, 1, torch.bfloat16)
        assert torch.get_num_threads() == 2
        bad = {**_state_dict(), "model.norm.weight": torch.empty(4, device="meta")}  # its copy fails
        with pytest.raises((RuntimeError, NotImplementedError)):
            write_weights(bad, tmp_path / "model", tmp_path / "root", 2, 2, torch.bfloat16)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_writer_casts_while_writing_any_layout(tmp_path):
    """write_weights takes the trainer's tensors as they are (fp32 masters, transposed views,
    integer buffers, empty tensors) and casts only the floating ones while copying them into
    the file: the file equals safetensors' own reading of the cast tensors, byte for byte in
    values, and read_safetensors' memory-mapped views equal them too."""
    from grpo.serving.weights_dir import read_safetensors

    g = torch.Generator().manual_seed(3)
    sd = {
        "model.embed_tokens.weight": torch.randn(37, 5, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 11, generator=g).t(),  # not contiguous
        "model.layers.0.self_attn.q_proj.bias": torch.randn(3, generator=g, dtype=torch.float64),
        "model.rotary.inv_freq_steps": torch.arange(7, dtype=torch.int64),  # not floating: kept as is
        "model.empty": torch.empty(0, 4),
    }
    out = write_weights(sd, _config_dir(tmp_path), tmp_path / "r", 1, 1, torch.bfloat16, hash_algo="blake3")
    verify_weights_dir(out, tmp_path / "r")
    views = read_safetensors(out / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(sd)
        for k, v in sd.items():
            want = v.to(torch.bfloat16) if v.is_floating_point() else v
            got = f.get_tensor(k)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), k
            assert torch.equal(views[k], want), k


def test_tensor_moments_match_fp64_on_odd_shapes():
    """The fast moments agree with fp64 reductions to ~1e-8 (the fingerprint tolerance is 1e-6) on
    shapes that leave partial blocks and chunks, in fp32 and bf16, and with rounding to bf16."""
    from grpo.serving.fingerprint import tensor_moments

    g = torch.Generator().manual_seed(4)
    for shape in [(1,), (4095,), (4097,), (3, 1000, 357), ((1 << 20) + 4099,)]:
        base = torch.randn(*shape, generator=g) * 0.02 + 0.003
        for t, rounded in ((base, None), (base.to(torch.bfloat16), None), (base, torch.bfloat16)):
            ref = t.to(rounded) if rounded is not None else t
            n, s, q = tensor_moments(t, rounded_to=rounded)
            s64 = float(torch.sum(ref, dtype=torch.float64))
            q64 = float(torch.sum(ref.double() ** 2))
            assert n == t.numel()
            assert abs(s - s64) <= 1e-8 * (q64 * n) ** 0.5, (shape, t.dtype, rounded)
            assert abs(q - q64) <= 1e-7 * q64, (shape, t.dtype, rounded)
    assert tensor_moments(torch.empty(0)) == (0, 0.0, 0.0)
    # rounding matters: an fp32 value between two bf16 values has other moments than its bf16 self
    x = torch.full((10,), 1.0 + 2 ** -10)
    assert tensor_moments(x)[1] != tensor_moments(x, rounded_to=torch.bfloat16)[1] == 10.0


def test_fingerprint_mismatches_folds_packed_modules_and_names_the_culprit():
    from grpo.serving.fingerprint import fingerprint_mismatches, tensor_moments

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, 3, generator=g) for _ in range(3))
    norm = torch.randn(3, generator=g)
    pushed = {f"model.layers.0.self_attn.{n}_proj.weight": tensor_moments(t) for n, t in zip("qkv", (q, k, v))}
    pushed["model.norm.weight"] = tensor_moments(norm)
    engine = {"packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
              "params": {"model.layers.0.self_attn.qkv_proj.weight": tensor_moments(torch.cat([q, k, v])),
                         "model.norm.weight": tensor_moments(norm)}}
    assert fingerprint_mismatches(pushed, engine) == []
    engine["params"]["model.layers.0.self_attn.qkv_proj.weight"] = tensor_moments(torch.cat([q, k, v + 1e-3]))
    assert fingerprint_mismatches(pushed, engine) == ["model.layers.0.self_attn.qkv_proj.weight"]
    engine["params"]["model.layers.0.self_attn.qkv_proj.weight"] = (0, 0.0, 0.0)  # opaque (oneDNN): skipped
    assert fingerprint_mismatches(pushed, engine) == []
    del engine["params"]["model.norm.weight"]  # pushed but not held
    assert fingerprint_mismatches(pushed, engine) == ["model.norm.weight"]


def test_moments_the_fingerprint_cannot_see_are_not_computed(tmp_path):
    """On a CPU engine the linear weights are packed into oneDNN handles (numel 0 in the
    fingerprint): after the first push the trainer leaves their moments out, and the check of what
    it still computes passes, and still names a norm the engine holds wrongly."""
    from grpo.serving.fingerprint import fingerprint_mismatches, pushed_moments, tensor_moments, unseen_by_fingerprint

    sd = {"model.embed_tokens.weight": torch.randn(10, 4), "model.norm.weight": torch.randn(4),
          "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(2, 4),
          "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6)}
    cfg = _config_dir(tmp_path, tie=True)
    held = {k: tensor_moments(v, rounded_to=torch.bfloat16) for k, v in sd.items() if "proj" not in k}
    engine = {"packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
              "params": {**held, "model.layers.0.self_attn.qkv_proj.weight": (0, 0.0, 0.0),
                         "model.layers.0.mlp.down_proj.weight": (0, 0.0, 0.0)}}
    skip = unseen_by_fingerprint(engine)
    assert [skip(k) for k in sd] == [False, False, True, True, True]
    pushed = pushed_moments(sd, torch.bfloat16, cfg, skip=skip)
    assert sorted(pushed) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert fingerprint_mismatches(pushed, engine) == []
    engine["params"]["model.norm.weight"] = tensor_moments(2 * sd["model.norm.weight"], rounded_to=torch.bfloat16)
    assert fingerprint_mismatches(pushed, engine) == ["model.norm.weight"]


def test_check_finite_names_the_tensor_with_nan_or_inf(tmp_path):
    from grpo.serving.weights_check import check_finite, check_weights_dir

    for bad in (float("nan"), float("inf"), float("-inf")):
        sd = _state_dict()
        sd["model.layers.0.mlp.up_proj.weight"][2, 1] = bad
        root = tmp_path / f"r{bad}"
        out = write_weights(sd, _config_dir(tmp_path) if not (tmp_path / "model").exists() else tmp_path / "model",
                            root, 1, 1, torch.bfloat16)
        with pytest.raises(WeightPushError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight: holds NaN or Inf"):
            check_finite(check_weights_dir(out, root))
    out = write_weights(_state_dict(), tmp_path / "model", tmp_path / "ok", 1, 1, torch.bfloat16)
    check_finite(check_weights_dir(out, tmp_path / "ok"))


def _qwen_layer(g):
    """One decoder layer of Qwen2.5-0.5B at full size, as the trainer holds it (fp32 masters)."""
    shapes = {"self_attn.q_proj.weight": (896, 896), "self_attn.k_proj.weight": (128, 896),
              "self_attn.v_proj.weight": (128, 896), "mlp.gate_proj.weight": (4864, 896),
              "mlp.up_proj.weight": (4864, 896), "mlp.down_proj.weight": (896, 4864)}
    layer = {f"model.layers.0.{k}": torch.randn(*v, generator=g) * 0.02 for k, v in shapes.items()}
    layer["model.layers.0.input_layernorm.weight"] = 1.0 + torch.randn(896, generator=g) * 0.05
    return layer


def _engine_layout(hf: dict, tp: int) -> dict:
    """The same bf16 values as a GPU engine holds them: q/k/v and gate/up fused, the fused weights
    transposed, down_proj split over tp ranks by columns, the fused ones by rows, norms on every rank."""
    p = "model.layers.0."
    bf = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    fused = {p + "self_attn.qkv_proj.weight": torch.cat([bf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
             p + "mlp.gate_up_proj.weight": torch.cat([bf[p + "mlp.gate_proj.weight"], bf[p + "mlp.up_proj.weight"]])}
    ranks = []
    for r in range(tp):
        params = {name: t.chunk(tp, dim=0)[r].t().contiguous() for name, t in fused.items()}
        params[p + "mlp.down_proj.weight"] = bf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[r].contiguous()
        params[p + "input_layernorm.weight"] = bf[p + "input_layernorm.weight"].clone()
        ranks.append(params)
    return {"packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
            "ranks": ranks}


def _reply(layout: dict) -> dict:
    from grpo.serving.engine_weights import merge_rank_fingerprints
    from grpo.serving.fingerprint import tensor_moments

    per_rank = [{"params": {k: tensor_moments(v) for k, v in params.items()}, "packed": layout["packed"]}
                for params in layout["ranks"]]
    return merge_rank_fingerprints(per_rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_fingerprint_accepts_a_reordered_full_size_layer_and_catches_one_changed_element(tp):
    """On GPU every linear weight is visible to the fingerprint, summed by the engine in its own
    layout (fused, transposed, sharded over tensor-parallel ranks). The tolerance follows from the
    summation (moment_tolerances): reordered sums of a full-size Qwen2.5-0.5B layer pass, and one
    element changed by a weight's typical size is named, in a slice or in one replica of a norm."""
    from grpo.serving.fingerprint import fingerprint_mismatches, tensor_moments

    g = torch.Generator().manual_seed(9)
    hf = _qwen_layer(g)
    pushed = {k: tensor_moments(v, rounded_to=torch.bfloat16) for k, v in hf.items()}
    layout = _engine_layout(hf, tp)
    assert fingerprint_mismatches(pushed, _reply(layout)) == []

    p = "model.layers.0."
    down = layout["ranks"][-1][p + "mlp.down_proj.weight"]
    down.view(-1)[12345] += 0.02  # one element of 4.4M, by one standard deviation of the weights
    assert fingerprint_mismatches(pushed, _reply(layout)) == [p + "mlp.down_proj.weight"]
    down.view(-1)[12345] -= 0.02
    qkv = layout["ranks"][0][p + "self_attn.qkv_proj.weight"]
    i = int(qkv.float().abs().argmax())
    qkv.view(-1)[i] = -qkv.view(-1)[i]  # a sign flip: the sum of squares cannot see it, the sum can
    assert fingerprint_mismatches(pushed, _reply(layout)) == [p + "self_attn.qkv_proj.weight"]
    qkv.view(-1)[i] = -qkv.view(-1)[i]
    layout["ranks"][-1][p + "input_layernorm.weight"][7] += 0.01  # one replica of a norm holds another value
    assert fingerprint_mismatches(pushed, _reply(layout)) == [p + "input_layernorm.weight"]


def test_kv_heads_replicated_over_tensor_parallel_ranks_count_once():
    """R1-Distill-1.5B / Qwen2.5-1.5B have 2 kv heads: on 4 tensor-parallel ranks vLLM gives each
    rank 3 q heads and a copy of one kv head (num_kv_head_replicas 2). Summed over ranks the copies
    counted twice and a right load was refused; each replica group now counts its k/v rows once."""
    from types import SimpleNamespace

    from grpo.serving.engine_weights import merge_rank_fingerprints
    from grpo.serving.fingerprint import counted_part, fingerprint_mismatches, tensor_moments

    g = torch.Generator().manual_seed(3)
    head, hidden, q_heads, kv_heads, tp = 128, 1536, 12, 2, 4
    p = "model.layers.0.self_attn."
    hf = {p + "q_proj.weight": torch.randn(q_heads * head, hidden, generator=g) * 0.02,
          p + "k_proj.weight": torch.randn(kv_heads * head, hidden, generator=g) * 0.02,
          p + "v_proj.weight": torch.randn(kv_heads * head, hidden, generator=g) * 0.02}
    pushed = {k: tensor_moments(v, rounded_to=torch.bfloat16) for k, v in hf.items()}
    bf = {k: v.bfloat16() for k, v in hf.items()}
    replicas, per_rank_q = tp // kv_heads, q_heads // tp

    def fingerprint(count):
        ranks = []
        for r in range(tp):
            kv = slice((r // replicas) * head, (r // replicas + 1) * head)
            qkv = torch.cat([bf[p + "q_proj.weight"][r * per_rank_q * head:(r + 1) * per_rank_q * head],
                             bf[p + "k_proj.weight"][kv], bf[p + "v_proj.weight"][kv]])
            module = SimpleNamespace(num_kv_head_replicas=replicas, tp_rank=r, num_heads=per_rank_q, head_size=head)
            ranks.append({"params": {p + "qkv_proj.weight": tensor_moments(count(module, qkv))},
                          "packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}})
        return merge_rank_fingerprints(ranks)

    assert fingerprint_mismatches(pushed, fingerprint(counted_part)) == []
    everything = fingerprint(lambda module, t: t)  # what summing every rank's whole slice gives
    assert fingerprint_mismatches(pushed, everything) == [p + "qkv_proj.weight"]
