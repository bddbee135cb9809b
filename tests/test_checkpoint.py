"""Checkpoints of a real FSDP2 model under a real gloo process group, and the HF export.

Single-process tests run in a world of one (gloo, file store); the two-rank test starts this very
file under `torchrun --nproc_per_node=2` (see `_two_rank_worker` at the bottom).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from grpo.checkpoint import (  # noqa: E402
    CheckpointConfig,
    CheckpointError,
    Checkpointer,
    export_hf,
    verify_checkpoint,
)
from grpo.models import load_model, load_tokenizer  # noqa: E402
from grpo.parallel import close_distributed, shard_model  # noqa: E402
from tiny_models import make_tiny_model_dir  # noqa: E402


class LossModel(torch.nn.Module):
    """The lm inside a wrapper, sharded like train.py does (layers, then the wrapper as root)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, return_logits=False):
        logits = self.lm(input_ids=input_ids).logits.float()
        if return_logits:  # through the root's forward, so FSDP gathers the root's parameters
            return logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def build(model_dir, trainable=True, lr=1e-2):
    lm = load_model(model_dir)
    if not trainable:
        lm.requires_grad_(False)
    model = LossModel(lm)
    shard_model(model, lm, param_dtype=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1) if trainable else None
    return model, optimizer


def train_step(model, optimizer, vocab):
    """One AdamW step on a batch drawn from the global torch RNG; also draws from python/numpy RNGs."""
    ids = torch.randint(0, vocab, (2, 12))
    loss = model(ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), random.random(), float(np.random.rand())


def full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def scramble(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(0.01)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if created:
        close_distributed()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), num_layers=2)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_tied"), num_layers=2, tie_word_embeddings=True)


def test_config_validation():
    assert CheckpointConfig().keep_last == 2
    with pytest.raises(ValueError, match="every: .*-1"):
        CheckpointConfig(every=-1)
    with pytest.raises(ValueError, match="keep_last: .*0"):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ValueError, match="dir: "):
        CheckpointConfig(dir="")
    ck = Checkpointer(CheckpointConfig(every=3), Path("/x/run"))
    assert ck.dir == Path("/x/run/checkpoints")
    assert [s for s in range(10) if ck.due(s)] == [3, 6, 9]
    assert not any(Checkpointer(CheckpointConfig(every=0), Path("r")).due(s) for s in range(10))
    # An iteration of i = 2 optimizer steps: a save is due when the iteration crossed a multiple of 3.
    assert [s for s in range(2, 14, 2) if ck.due(s, steps_taken=2)] == [4, 6, 10, 12]


def test_resume_is_exact(world_of_one, model_dir, tmp_path):
    vocab = load_model(model_dir).config.vocab_size
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model, optimizer = build(model_dir)
    ref_model, _ = build(model_dir, trainable=False)
    for _ in range(2):
        train_step(model, optimizer, vocab)
    ck = Checkpointer(CheckpointConfig(), tmp_path / "run")
    trainer_state = {"step": 2, "stage": 0, "iteration": 2, "weights_version": 1, "weights_dir": "w/v1",
                     "sampler": {"epoch": 0, "cursor": 7, "order": [3, 1, 2]},
                     "scheduler": {"last_epoch": 2, "base_lrs": [0.01], "lr_lambdas": [None]}, "nan_skips": 0}
    path = ck.save(2, model, optimizer, ref_model=ref_model, trainer_state=trainer_state)
    assert path == tmp_path / "run" / "checkpoints" / "step_2"
    assert verify_checkpoint(path) is None
    assert not (path.parent / "step_2.tmp").exists()
    # the next two steps as they happen without interruption
    expected_rand = torch.rand(3)
    continued = [train_step(model, optimizer, vocab) for _ in range(2)]
    params_after = full_params(model)
    ref_params = full_params(ref_model)

    # a fresh process's view: other weights, empty optimizer with another lr, other RNG streams
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    model2, optimizer2 = build(model_dir, lr=3e-3)
    ref_model2, _ = build(model_dir, trainable=False)
    scramble(model2)
    scramble(ref_model2)
    assert ck.latest() == path
    state = ck.load(path, model2, optimizer2, ref_model=ref_model2)
    assert state == trainer_state
    # Same draw as the first run made right after saving; then the same batches (torch RNG),
    # python/numpy draws, Adam moments and step counts: the losses must be equal exactly.
    assert torch.equal(torch.rand(3), expected_rand)
    resumed = [train_step(model2, optimizer2, vocab) for _ in range(2)]
    assert resumed == continued
    after2 = full_params(model2)
    assert all(torch.equal(after2[k], params_after[k]) for k in params_after)
    ref2 = full_params(ref_model2)
    assert all(torch.equal(ref2[k], ref_params[k]) for k in ref_params)
    assert optimizer2.param_groups[0]["lr"] == 1e-2


def test_the_push_copy_travels_with_a_checkpoint_that_holds_one(world_of_one, model_dir, tmp_path):
    """A checkpoint saved inside a v-window holds the trainer's frozen copy of the pushed weights
    (grpo/staleness.py): load restores it. One saved without (at a window boundary, or before the
    copy existed) says so, and load leaves a given copy untouched instead of failing."""
    vocab = load_model(model_dir).config.vocab_size
    torch.manual_seed(0)
    model, optimizer = build(model_dir)
    pushed, _ = build(model_dir, trainable=False)
    scramble(pushed)  # not the policy's weights: the copy must come back as itself
    train_step(model, optimizer, vocab)
    ck = Checkpointer(CheckpointConfig(keep_last=3), tmp_path / "run")
    with_copy = ck.save(1, model, optimizer, trainer_state={"step": 1}, push_model=pushed)
    without = ck.save(2, model, optimizer, trainer_state={"step": 2})
    assert Checkpointer.holds_push_model(with_copy) and not Checkpointer.holds_push_model(without)
    expected = full_params(pushed)

    model2, optimizer2 = build(model_dir)
    pushed2, _ = build(model_dir, trainable=False)
    scramble(pushed2)
    left = full_params(pushed2)
    ck.load(without, model2, optimizer2, push_model=pushed2)
    assert all(torch.equal(v, left[k]) for k, v in full_params(pushed2).items())  # untouched
    ck.load(with_copy, model2, optimizer2, push_model=pushed2)
    got = full_params(pushed2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not all(torch.equal(got[k], full_params(model2)[k]) for k in expected)  # its own weights, not the policy's


def test_latest_skips_broken_and_prunes(world_of_one, model_dir, tmp_path):
    torch.manual_seed(0)
    model, optimizer = build(model_dir)
    ck = Checkpointer(CheckpointConfig(keep_last=5), tmp_path / "run")
    assert ck.latest() is None
    for step in (1, 2, 3):
        ck.save(step, model, optimizer, trainer_state={"step": step})
    d = ck.dir
    assert ck.latest() == d / "step_3"

    (d / "step_3" / "COMPLETE").unlink()  # a save that died before its marker
    with pytest.warns(UserWarning, match="step_3.*COMPLETE"):
        assert ck.latest() == d / "step_2"

    shard = d / "step_2" / "__0_0.distcp"  # a shard cut short after the save (full disk, bad copy)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning) as record:
        assert ck.latest() == d / "step_1"
    messages = [str(w.message) for w in record]
    assert any("step_2" in m and "__0_0.distcp" in m for m in messages), messages

    # same size, one byte flipped in a hashed file
    ts = d / "step_1" / "trainer_state.json"
    raw = bytearray(ts.read_bytes())
    raw[raw.index(b"1")] = ord("7")
    ts.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="trainer_state.json does not match its sha256"):
        assert ck.latest() is None
    with pytest.raises(CheckpointError, match="step_1: cannot load"):
        ck.load(d / "step_1", model, optimizer)

    # a stale .tmp from a crashed save is ignored, then cleaned up by the next save
    (d / "step_9.tmp").mkdir()
    ck.cfg.keep_last = 2
    for step in (4, 5, 6):
        ck.save(step, model, optimizer, trainer_state={"step": step})
    assert sorted(p.name for p in d.iterdir()) == ["step_5", "step_6"]
    assert ck.latest() == d / "step_6"
    # saving the same step again replaces it
    ck.save(6, model, optimizer, trainer_state={"step": 6, "again": True})
    assert json.loads((d / "step_6" / "trainer_state.json").read_text()) == {"step": 6, "again": True}
    assert sorted(p.name for p in d.iterdir()) == ["step_5", "step_6"]


def test_save_rejects_unjsonable_state(world_of_one, model_dir, tmp_path):
    model, optimizer = build(model_dir)
    ck = Checkpointer(CheckpointConfig(), tmp_path)
    with pytest.raises(CheckpointError, match=r"trainer_state\.sampler\.rng: Tensor is not JSON-able"):
        ck.save(1, model, optimizer, trainer_state={"sampler": {"rng": torch.zeros(2)}})
    assert not (tmp_path / "checkpoints" / "step_1").exists()
    # a checkpoint without a ref model cannot fill one
    ck.save(1, model, optimizer, trainer_state={})
    ref_model, _ = build(model_dir, trainable=False)
    with pytest.raises(CheckpointError, match="ref_model"):
        ck.load(ck.latest(), model, optimizer, ref_model=ref_model)


def test_rng_file_has_no_pickle(world_of_one, model_dir, tmp_path):
    from safetensors import safe_open

    model, optimizer = build(model_dir)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    path = Checkpointer(CheckpointConfig(), tmp_path).save(1, model, optimizer)
    with safe_open(str(path / "rng" / "rank_0.safetensors"), framework="pt") as f:
        assert {"torch_cpu", "python_mt", "numpy_mt"} <= set(f.keys())
        assert f.get_tensor("python_mt").shape == (625,)
        assert f.get_tensor("numpy_mt").shape == (624,)
        assert torch.equal(f.get_tensor("torch_cpu"), torch.get_rng_state())
        assert f.metadata()["numpy_name"] == "MT19937"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["world_size"] == 1
    assert "sha256" in manifest["files"]["rng/rank_0.safetensors"]
    assert "sha256" in manifest["files"][".metadata"]


def _logits(model, ids):
    with torch.no_grad():
        if isinstance(model, LossModel):
            return model(ids, return_logits=True)
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("shard_bytes", [None, 60_000])
def test_export_hf_reloads_with_transformers(world_of_one, tied_model_dir, tmp_path, monkeypatch, shard_bytes):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.checkpoint as checkpoint_module

    if shard_bytes is not None:  # force the multi-file layout with an index, as for a large model
        monkeypatch.setattr(checkpoint_module, "EXPORT_SHARD_BYTES", shard_bytes)
    torch.manual_seed(0)
    model, optimizer = build(tied_model_dir)
    vocab = model.lm.config.vocab_size
    train_step(model, optimizer, vocab)  # so the export differs from the source weights
    tokenizer = load_tokenizer(tied_model_dir)
    out = tmp_path / "final"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    result = export_hf(model.lm, tokenizer, tied_model_dir, out, dtype=torch.float32)
    assert result == out
    assert not (tmp_path / "final.tmp").exists() and not (out / "stale.txt").exists()

    ids = torch.randint(0, vocab, (2, 10))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    source = AutoModelForCausalLM.from_pretrained(str(tied_model_dir))
    assert not torch.allclose(_logits(source, ids), _logits(model, ids))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=1e-5)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    keys = set()
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys |= set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    if shard_bytes is None:
        assert files == ["model.safetensors"]
    else:
        assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    assert AutoTokenizer.from_pretrained(str(out)).encode("12 + 7") == tokenizer.encode("12 + 7")


def test_export_hf_bf16(world_of_one, model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, _ = build(model_dir)
    out = export_hf(model.lm, None, model_dir, tmp_path / "final", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # untied: both kept
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, model.lm.config.vocab_size, (1, 8))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0.05, atol=0.05)


@pytest.mark.torchrun
def test_two_ranks_save_and_reload_sharded(world_of_one, model_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MODEL_DIR=str(model_dir),
               RUN_DIR=str(tmp_path / "run"))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__],
        env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    for name in ("__0_0.distcp", "__1_0.distcp", "rng/rank_0.safetensors", "rng/rank_1.safetensors"):
        assert (ckpt / name).stat().st_size > 0, name
    assert json.loads((ckpt / "manifest.json").read_text())["world_size"] == 2
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["checked_tensors"] > 10 and result["rand_rank"] == [0, 1]
    print(f"two-rank checkpoint round trip: {elapsed:.1f} s")

    # Resume the two-rank checkpoint in a world of one: DCP reshards each half into one shard.
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "run" / "expected_step2.safetensors"))
    model, optimizer = build(model_dir)
    scramble(model)
    state = Checkpointer(CheckpointConfig(), tmp_path / "run").load(ckpt, model, optimizer)
    assert state == {"step": 2, "ranks": 2}
    got = full_params(model)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def _two_rank_worker() -> None:
    """Run under torchrun: each rank holds half of every parameter; save, continue, reload, compare."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_dir, run_dir = Path(os.environ["MODEL_DIR"]), Path(os.environ["RUN_DIR"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(100 + rank)  # rank-specific streams, as train.py seeds them
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    model, optimizer = build(model_dir)
    ref_model, _ = build(model_dir, trainable=False)
    # every rank must see the same batch in this test so the model stays one model
    g = torch.Generator().manual_seed(0)

    def step(m, opt):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        loss = m(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(2):
        step(model, optimizer)
    local_shapes = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    full_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert any(local_shapes[k] != full_shapes[k] for k in full_shapes), "parameters are not sharded"
    ck = Checkpointer(CheckpointConfig(), run_dir)
    g_state = g.get_state()
    path = ck.save(2, model, optimizer, ref_model=ref_model, trainer_state={"step": 2, "ranks": 2})
    expected_rand = torch.rand(4)
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in expected.items()}, str(run_dir / "expected_step2.safetensors"))
    osd = optimizer.state_dict()["state"]
    expected_moments = [osd[i]["exp_avg"].full_tensor() for i in sorted(osd)]
    expected_loss = step(model, optimizer)

    model2, optimizer2 = build(model_dir)
    ref_model2, _ = build(model_dir, trainable=False)
    scramble(model2)
    scramble(ref_model2)
    torch.manual_seed(999)
    assert ck.latest() == path
    state = ck.load(path, model2, optimizer2, ref_model=ref_model2)
    assert state == {"step": 2, "ranks": 2}
    assert torch.equal(torch.rand(4), expected_rand), f"rank {rank}: RNG not restored"
    checked = 0
    for k, v in model2.state_dict().items():
        assert torch.equal(v.full_tensor(), expected[k]), k
        checked += 1
    ref_expected = full_params(ref_model)
    for k, v in ref_model2.state_dict().items():
        assert torch.equal(v.full_tensor(), ref_expected[k]), k
    osd2 = optimizer2.state_dict()["state"]
    for i, m in zip(sorted(osd2), expected_moments):
        assert torch.equal(osd2[i]["exp_avg"].full_tensor(), m)
        checked += 1
    g.set_state(g_state)
    assert step(model2, optimizer2) == expected_loss
    # the two ranks restored different streams: gather each rank's first draw
    first = torch.tensor([float(expected_rand[0])])
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, first)
    assert gathered[0] != gathered[1]
    if rank == 0:
        (run_dir / "result.json").write_text(json.dumps({"checked_tensors": checked, "rand_rank": [0, 1]}))
    dist.barrier()


if __name__ == "__main__":
    _two_rank_worker()
    assert close_distributed()  # the models died with the worker function: the group is freed now
