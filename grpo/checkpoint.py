"""Checkpoints of an FSDP2 training run, and the final export as an HF model directory.

A checkpoint `<dir>/step_<N>/` holds:
- the policy's, the optimizer's and (when given) the reference model's sharded state, written with
  torch.distributed.checkpoint (DCP): every rank writes its own shards (`__<rank>_0.distcp`) plus
  the global `.metadata`, so a checkpoint of any size never gathers on one rank, and DCP reshards
  on load when the world size changed;
- `trainer_state.json`: the loop's plain state (step, stage, iteration, weights_version, data
  cursor, scheduler state, counters), written by rank 0;
- `rng/rank_<r>.safetensors`: each rank's RNG states (torch CPU, CUDA, python `random`, numpy) as
  tensors, with the few scalars in the safetensors metadata. Not through DCP: DCP stores
  non-tensor objects by pickling them, and rank-specific keys would make every rank's load plan
  name keys that only one rank owns. A safetensors file per rank is pickle-free and a rank reads
  only its own.
- `manifest.json` (every file with its size, sha256 of the small ones) and `COMPLETE` (sha256 of
  the manifest), both written by rank 0 after every rank has finished writing.

Saving is atomic: everything goes to `step_<N>.tmp/`, rank 0 writes manifest and marker, fsyncs,
and renames the directory, so a crash leaves either a complete checkpoint or a `.tmp` directory
that `latest()` ignores. `latest()` also re-checks the manifest, so a checkpoint truncated later
(a partial copy) is skipped with a warning in favour of the one before. A save that finds the disk
full removes its `.tmp` directory and raises grpo.fsutil.NoSpaceError naming the checkpoint and
its size; the checkpoints before it stay as they were (old ones are pruned only after a save).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from grpo.fsutil import free_bytes, fsync_dir, fsync_file, hash_file, human_bytes, no_space, replace_dir, write_durable
from grpo.models import LM_HEAD_KEY, drop_tied_lm_head

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
RNG_DIR = "rng"
FORMAT_VERSION = 1
# Files up to this size get a sha256 in the manifest (metadata, trainer state, RNG); the tensor
# shards get only their size: hashing gigabytes at every save would cost more than writing them.
HASH_MAX_BYTES = 16 * 2**20
# HF's default shard size for save_pretrained; bigger exports are split with an index file.
EXPORT_SHARD_BYTES = 5 * 2**30


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the directory and why."""


@dataclass
class CheckpointConfig:
    """The `checkpoint:` section."""

    every: int = 0  # save every N optimizer steps (0: only at the end and on Ctrl-C / SIGTERM)
    keep_last: int = 2  # complete checkpoints kept on disk; older ones are deleted after each save
    dir: Optional[str] = None  # where step_<N>/ directories go (relative: from the working dir); default <run_dir>/checkpoints

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"every: must be an integer >= 0 (0 = only at the end), got {self.every!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last: must be an integer >= 1, got {self.keep_last!r}")
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir.strip()):
            raise ValueError(f"dir: must be a non-empty path or null, got {self.dir!r}")


# ---------------------------------------------------------------------------------------------
# process-group helpers (everything also works without a process group, as a world of one)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ok(ok: bool) -> bool:
    """True on every rank iff `ok` on every rank: a failing rank must not leave the others in a barrier."""
    if not dist.is_initialized():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_shared_directory(path: str | os.PathLike, key: str = "checkpoint.dir") -> None:
    """Every rank sees the directory rank 0 created (collective): rank 0 leaves a file with a fresh
    name in it and every rank looks for it. Without a shared filesystem a multi-node run would
    write each node's checkpoint files into a directory of its own, and rank 0 would wait for the
    others in a barrier for hours; here every rank stops at start-up with one line instead."""
    import secrets

    from grpo.parallel import broadcast_json

    path = Path(path)
    made = None  # rank 0: the file's name, or why it could not be made (every rank then stops alike)
    if _rank() == 0:
        name = f".shared-{secrets.token_hex(8)}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(f"{os.uname().nodename}\n")
            made = {"name": name}
        except OSError as e:
            made = {"error": f"{type(e).__name__}: {e}"}
    made = broadcast_json(made)
    if "error" in made:
        raise CheckpointError(f"{key}: rank 0 cannot write into {path} ({made['error']})")
    name = made["name"]
    seen = (path / name).is_file()
    everywhere = _all_ok(seen)
    _barrier()
    if _rank() == 0:
        (path / name).unlink(missing_ok=True)
    if not everywhere:
        where = "this rank" if not seen else "another rank"
        raise CheckpointError(f"{key}: {path.resolve()} is not the directory rank 0 created ({where} on "
                              f"{os.uname().nodename} does not see it): checkpoints need a filesystem shared by "
                              f"every node")


def _run_on_rank0(fn, what: str):
    """Run `fn` on rank 0 only; every rank raises if it failed (rank 0 with the original error)."""
    error: Optional[BaseException] = None
    result = None
    if _rank() == 0:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below after the other ranks know
            error = e
    if not _all_ok(error is None):
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on rank 0 (see its error)")
    return result


# ---------------------------------------------------------------------------------------------
# files: fsync, hashing, manifest


def _link_or_copy_tree(source: Path, dest: Path) -> None:
    """dest <- the files of source: hard links on the same filesystem (free), else copies (e.g.
    from /dev/shm to disk). Weight files are never modified in place, so a link is a snapshot."""
    dest.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.is_symlink():
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copyfile(f, dest / f.name)


def _build_manifest(ckpt: Path, step: int, has_optimizer: bool, has_ref_model: bool, has_push_model: bool) -> dict:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file():
            rel = p.relative_to(ckpt).as_posix()
            if rel in (MANIFEST, COMPLETE):
                continue
            fsync_file(p)
            size = p.stat().st_size
            entry: dict[str, Any] = {"size": size}
            if size <= HASH_MAX_BYTES:
                entry["sha256"] = hash_file(p, "sha256")
            files[rel] = entry
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": _world_size(),
        "has_optimizer": has_optimizer,
        "has_ref_model": has_ref_model,
        "has_push_model": has_push_model,
        "torch": torch.__version__,
        "files": files,
    }


def verify_checkpoint(path: Path) -> Optional[str]:
    """None if `path` is a complete checkpoint whose files match its manifest, else the reason."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    marker = path / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (the save did not finish)"
    try:
        manifest_bytes = (path / MANIFEST).read_bytes()
    except OSError:
        return f"no readable {MANIFEST}"
    if marker.read_text().strip() != hashlib.sha256(manifest_bytes).hexdigest():
        return f"{MANIFEST} does not match the sha256 recorded in {COMPLETE}"
    try:
        manifest = json.loads(manifest_bytes)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is not a valid manifest"
    for rel, entry in files.items():
        p = path / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and hash_file(p, "sha256") != entry["sha256"]:
            return f"{rel} does not match its sha256 in the manifest"
    return None


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict at their full size: what DCP writes of it over
    all ranks (a DTensor counts its global shape)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def _step_of(path: Path) -> Optional[int]:
    name = path.name
    if not name.startswith("step_"):
        return None
    digits = name[len("step_"):]
    return int(digits) if digits.isdigit() else None


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# RNG states as tensors (no pickle)


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s.cpu()
    py_version, py_internal, py_gauss_next = random.getstate()
    tensors["python_mt"] = torch.tensor(py_internal, dtype=torch.int64)  # 624 words + position
    np_name, np_keys, np_pos, np_has_gauss, np_cached_gaussian = np.random.get_state()
    tensors["numpy_mt"] = torch.from_numpy(np_keys.astype(np.int64))
    # json.dumps writes floats with repr, which round-trips exactly.
    meta = {
        "python_version": str(py_version),
        "python_gauss_next": json.dumps(py_gauss_next),
        "numpy_name": np_name,
        "numpy_pos": str(int(np_pos)),
        "numpy_has_gauss": str(int(np_has_gauss)),
        "numpy_cached_gaussian": json.dumps(float(np_cached_gaussian)),
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        saved = sorted(k for k in tensors if k.startswith("torch_cuda_"))
        if len(saved) != torch.cuda.device_count():
            warnings.warn(f"checkpoint holds CUDA RNG states of {len(saved)} devices, this process sees "
                          f"{torch.cuda.device_count()}; restoring the ones both have")
        for i in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"torch_cuda_{i}"], device=i)
    random.setstate((int(meta["python_version"]), tuple(tensors["python_mt"].tolist()),
                     json.loads(meta["python_gauss_next"])))
    np.random.set_state((meta["numpy_name"], tensors["numpy_mt"].numpy().astype(np.uint32),
                         int(meta["numpy_pos"]), int(meta["numpy_has_gauss"]),
                         json.loads(meta["numpy_cached_gaussian"])))


def _first_unjsonable(obj: Any, where: str) -> Optional[str]:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _first_unjsonable(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is not a string"
            bad = _first_unjsonable(v, f"{where}.{k}")
            if bad:
                return bad
        return None
    return f"{where}: {type(obj).__name__} is not JSON-able"


# ---------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores a run under `dir/step_<N>/`; `save` and `load` are collective."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir is not None else Path(run_dir) / "checkpoints"

    def due(self, step: int, steps_taken: int = 1) -> bool:
        """Whether the periodic schedule (every `checkpoint.every` optimizer steps) asks for a
        checkpoint now, after optimizer steps step - steps_taken + 1 .. step. The trainer saves
        between iterations only (an iteration takes i steps): a multiple of `every` crossed
        anywhere in that range counts."""
        every = self.cfg.every
        return every > 0 and step > 0 and step // every > (step - steps_taken) // every

    def _state(self, model, optimizer, ref_model, push_model=None) -> dict:
        # Sharded state dicts: DTensors of this rank's shards; DCP writes each rank's part.
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        if ref_model is not None:
            state["ref_model"] = get_model_state_dict(ref_model)
        if push_model is not None:
            state["push_model"] = get_model_state_dict(push_model)
        return state

    def save(self, step: int, model, optimizer, ref_model=None, trainer_state: Optional[dict] = None,
             extra_dirs: Optional[dict[str, str | os.PathLike]] = None, push_model=None) -> Path:
        """Write checkpoint `step_<step>` (all ranks call) and prune to keep_last; returns its path.
        `push_model`: the trainer's frozen copy of the weights it last pushed (saved inside a
        v-window, where they differ from `model`; grpo/staleness.py).
        `extra_dirs` (name -> a directory on rank 0, e.g. the sampler alpha's weights inside a
        v-window) are stored in it under `name/` (hard links where the filesystem allows, else
        copies) and covered by its manifest like every other file."""
        trainer_state = {} if trainer_state is None else trainer_state
        bad = _first_unjsonable(trainer_state, "trainer_state")
        if bad:
            raise CheckpointError(f"save(step={step}): {bad}")
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"step_{step}.tmp"
        state = self._state(model, optimizer, ref_model, push_model)
        needed = state_bytes(state) + sum(_tree_bytes(Path(d)) for d in (extra_dirs or {}).values())
        try:
            self._save(step, final, tmp, state, optimizer is not None, ref_model is not None, push_model is not None,
                       trainer_state, extra_dirs)
        except BaseException as e:  # CheckpointException (DCP's, gathered from every rank) is a BaseException
            # DCP's stream writer reports a full disk as "unexpected pos", without the errno
            full = no_space(e, final, needed, errno_lost=isinstance(e, CheckpointException))
            if full is None:
                raise
            if _rank() == 0:  # every rank knows the save failed (DCP and _all_ok agree on it): free its space
                _rmtree(tmp)
            raise full from None
        return final

    def _save(self, step: int, final: Path, tmp: Path, state: dict, has_optimizer: bool, has_ref_model: bool,
              has_push_model: bool, trainer_state: dict, extra_dirs: Optional[dict]) -> None:
        def prepare():
            self.dir.mkdir(parents=True, exist_ok=True)
            _rmtree(tmp)  # left by a save that crashed
            (tmp / RNG_DIR).mkdir(parents=True)

        _run_on_rank0(prepare, f"checkpoint save: preparing {tmp}")

        dcp.save(state, checkpoint_id=tmp)

        from safetensors.torch import save_file

        rng_tensors, rng_meta = _rng_state()
        rng_path = tmp / RNG_DIR / f"rank_{_rank()}.safetensors"
        why = None
        try:  # every rank writes its own file: it makes its directory itself (it may not see rank 0's)
            rng_path.parent.mkdir(parents=True, exist_ok=True)
            save_file(rng_tensors, str(rng_path), metadata=rng_meta)
            fsync_file(rng_path)
        except Exception as e:  # an OSError, or safetensors' own error for the same I/O failure
            why = f"{type(e).__name__}: {e}"
        if not _all_ok(why is None):  # a failing rank must not leave the others waiting in a barrier
            raise CheckpointError(f"checkpoint save: rank {_rank()} {why or 'waited for a rank that could not write'} "
                                  f"its RNG state under {tmp}; checkpoint.dir must be on a filesystem every node shares")

        def finalize():
            for name, source in (extra_dirs or {}).items():
                _link_or_copy_tree(Path(source), tmp / name)
            write_durable(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1) + "\n")
            manifest = json.dumps(_build_manifest(tmp, step, has_optimizer, has_ref_model, has_push_model),
                                  indent=1) + "\n"
            write_durable(tmp / MANIFEST, manifest)
            write_durable(tmp / COMPLETE, hashlib.sha256(manifest.encode()).hexdigest() + "\n")
            fsync_dir(tmp)
            replace_dir(tmp, final)  # the same step saved again (e.g. after a resume) replaces it
            self._prune()

        _run_on_rank0(finalize, f"checkpoint save: finalizing {final}")

    def room_warning(self, checkpoint_bytes: int) -> Optional[str]:
        """Why checkpoint.dir cannot hold keep_last + 1 checkpoints of `checkpoint_bytes` each (a save
        writes the new one before it prunes the oldest), counting the space the ones already there
        take; None when it can."""
        wanted = (self.cfg.keep_last + 1) * checkpoint_bytes
        room = free_bytes(self.dir) + sum(_tree_bytes(p) for p in self.checkpoints())
        if room >= wanted:
            return None
        return (f"checkpoint.dir {self.dir}: {human_bytes(room)} of room holds fewer than checkpoint.keep_last + 1 = "
                f"{self.cfg.keep_last + 1} checkpoints of this run ({human_bytes(checkpoint_bytes)} each); a save "
                f"will stop the run on a full disk")

    def _prune(self) -> None:
        """Keep the newest keep_last valid checkpoints; delete older step dirs (valid or broken:
        the run has moved past them) and .tmp dirs left by crashed saves."""
        steps = self.checkpoints()
        valid = [p for p in steps if verify_checkpoint(p) is None]
        kept = valid[-self.cfg.keep_last:]
        newest = _step_of(kept[-1]) if kept else -1
        for p in steps:
            if p not in kept and _step_of(p) < newest:
                _rmtree(p)
        for p in self.dir.glob("step_*.tmp"):
            _rmtree(p)

    def checkpoints(self) -> list[Path]:
        """Every step_<N> directory (complete or not), oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(_step_of(p), p) for p in self.dir.iterdir() if p.is_dir()]
        return [p for _, p in sorted((s, p) for s, p in found if s is not None)]

    @staticmethod
    def holds_push_model(path: Path) -> bool:
        """Whether checkpoint `path` (complete) holds a push_model."""
        return bool(json.loads((Path(path) / MANIFEST).read_text()).get("has_push_model", False))

    def latest(self) -> Optional[Path]:
        """The newest checkpoint that is complete and matches its manifest; None if there is none.

        Not collective: every rank reaches the same answer on a shared filesystem."""
        for path in reversed(self.checkpoints()):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}")
        return None

    def load(self, path: Path, model, optimizer, ref_model=None, push_model=None) -> dict:
        """Restore model, optimizer, ref model and this rank's RNG from `path` (all ranks call);
        `push_model` too where the checkpoint holds one (`holds_push_model`), else it is left as is.

        Returns the trainer_state dict given to `save`."""
        path = Path(path)
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"{path}: cannot load: {problem}")
        manifest = json.loads((path / MANIFEST).read_text())
        if ref_model is not None and not manifest["has_ref_model"]:
            raise CheckpointError(f"{path}: a ref_model was given but the checkpoint holds none")
        if optimizer is not None and not manifest["has_optimizer"]:
            raise CheckpointError(f"{path}: an optimizer was given but the checkpoint holds no optimizer state")
        if not manifest.get("has_push_model", False):
            push_model = None
        state = self._state(model, optimizer, ref_model, push_model)
        dcp.load(state, checkpoint_id=path)  # fills the DTensor shards in place
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(model, state["model"])
        if ref_model is not None:
            set_model_state_dict(ref_model, state["ref_model"])
        if push_model is not None:
            set_model_state_dict(push_model, state["push_model"])
        trainer_state = json.loads((path / TRAINER_STATE).read_text())

        from safetensors import safe_open

        rng_path = path / RNG_DIR / f"rank_{_rank()}.safetensors"
        if rng_path.is_file():
            with safe_open(str(rng_path), framework="pt") as f:
                _set_rng_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
        else:
            warnings.warn(f"{path}: no RNG state for rank {_rank()} (saved with world size "
                          f"{manifest['world_size']}, now {_world_size()}); RNG streams are not restored")
        return trainer_state


# ---------------------------------------------------------------------------------------------
# export


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: expected a torch dtype or one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def _write_hf_dir(full_sd: dict, tokenizer, src: Path, out_dir: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(src))
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in full_sd.items()}
    untied = drop_tied_lm_head(tensors, json.loads((src / "config.json").read_text()))
    if len(untied) < len(tensors):
        # The full state dict returns tied weights as two copies; HF checkpoints keep only the
        # embedding (from_pretrained re-ties). Unequal copies mean sharding broke the tie.
        embed_key = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
        if embed_key is None or not torch.equal(tensors[embed_key], tensors[LM_HEAD_KEY]):
            raise CheckpointError("export_hf: config ties word embeddings but lm_head.weight differs from "
                                  "embed_tokens.weight (was the tie broken during training?)")
    tensors = untied

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    _rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and shard_bytes + nbytes > EXPORT_SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][k] = v
        shard_bytes += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config.dtype = dtype
    config.save_pretrained(str(tmp))
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    else:
        for p in src.iterdir():
            if p.is_file() and (p.name.startswith("tokenizer") or p.name in (
                    "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")):
                shutil.copy2(p, tmp / p.name)
    for p in tmp.iterdir():
        fsync_file(p)
    fsync_dir(tmp)
    replace_dir(tmp, out_dir)


def export_hf(model, tokenizer, src_model_dir, out_dir, dtype=torch.bfloat16) -> Path:
    """Write the (FSDP-sharded) `model` as an HF directory: safetensors + config + tokenizer.

    Collective: the full state dict is gathered onto rank 0's CPU (others get {}), and rank 0
    writes `out_dir` atomically (a .tmp directory, then a rename). `src_model_dir` provides the
    config and generation config; `tokenizer` (or, if None, the source's tokenizer files) goes
    along so the directory loads with AutoModelForCausalLM/AutoTokenizer and serves in vLLM."""
    dtype = _as_dtype(dtype)
    out_dir = Path(out_dir)
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write() -> None:
        try:
            _write_hf_dir(full_sd, tokenizer, Path(src_model_dir), out_dir, dtype)
        except Exception as e:
            _rmtree(out_dir.with_name(out_dir.name + ".tmp"))
            needed = sum(v.numel() * (dtype.itemsize if v.is_floating_point() else v.element_size())
                         for v in full_sd.values())
            full = no_space(e, out_dir, needed)
            if full is not None:
                raise full from None
            raise

    _run_on_rank0(write, f"export_hf to {out_dir}")
    return out_dir
