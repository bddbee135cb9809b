"""The trainer's half of a weight push: the full state dict written as a weights directory.

`write_weights` writes `root/weights-v<version>/` atomically (temp dir, fsync, rename): one
safetensors file in the serving dtype, the model's config files and the manifest last. The file is
sized first and memory-mapped, and each tensor is copied straight into its place (the cast, the
device-to-host copy and the write are one pass, with no intermediate cast buffer whose fresh pages
would cost more than the copy); a second thread hashes each tensor's bytes as soon as they are in
place; tied weights (lm_head = embed_tokens) are written once. In path mode the trainer's prune
keeps the pruned push's file as a spare (grpo.serving.weights_dir.SPARE_FILE) and the next write
overwrites it in place, since allocating fresh pages is most of a write's cost on tmpfs.
"""
from __future__ import annotations

import json
import mmap
import os
import queue
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from grpo.fsutil import fsync_dir, fsync_file, new_hasher, no_space, preallocate, replace_dir
from grpo.models import drop_tied_lm_head
from grpo.provenance import usable_cores
from grpo.serving.weights_dir import (MANIFEST_FORMAT, MANIFEST_NAME, ST_DTYPES, WEIGHTS_FILE, WeightPushError,
                                      config_sources, take_spare, weights_dir_name)


def _serving_tensors(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The tensors to write, as they are (the writer casts while copying), a tied lm_head dropped."""
    out = {}
    for name, t in drop_tied_lm_head(state_dict, config).items():
        if not isinstance(t, torch.Tensor):
            raise WeightPushError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a tensor")
        out[name] = t.detach()
    if not out:
        raise WeightPushError("state_dict is empty (on FSDP only rank 0 gets the full state dict)")
    return out

def _stored_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype

def _header_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        stored = _stored_dtype(t, dtype)
        if stored not in ST_DTYPES:
            raise WeightPushError(f"state_dict[{name!r}]: dtype {stored} cannot be stored in safetensors")
        nbytes = t.numel() * stored.itemsize
        header[name] = {"dtype": ST_DTYPES[stored], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data is 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw

def copy_threads() -> int:
    """Threads for the writer's copies: all of this process's cores but the hash thread's."""
    return max(1, min(torch.get_num_threads(), len(usable_cores()) - 1))


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, hash_algo: str = "sha256",
                      metadata: Optional[dict[str, str]] = None, reuse: Optional[Path] = None) -> tuple[int, str]:
    """Write `tensors` (any device, layout and float dtype) as one safetensors file with every
    floating tensor in `dtype`; returns (bytes, hex digest).

    The file is sized first and memory-mapped, and each tensor is copied straight into its place:
    the cast, the device-to-host copy and the write are one pass, with no intermediate tensor (a
    fresh cast buffer alone costs more in page faults than the copy). A second thread
    hashes each tensor's bytes, in file order, as soon as they are in place (hashlib and blake3
    release the GIL), so the hash overlaps the copying.

    reuse: an existing file of ours (a spare, see take_spare) moved to `path` and overwritten in
    place, resized to fit: its pages are already allocated, which on tmpfs is most of a write's
    cost. The mapping is populated in one call (MAP_POPULATE) rather than page by page. The file's
    space is reserved before the mapping: an OSError (ENOSPC) when the filesystem cannot hold it.
    """
    header = _header_bytes(tensors, dtype, metadata or {"format": "pt"})
    total = len(header) + sum(t.numel() * _stored_dtype(t, dtype).itemsize for t in tensors.values())
    hasher = new_hasher(hash_algo)
    ready: queue.SimpleQueue = queue.SimpleQueue()  # (begin, end) byte ranges in place, None at the end
    hash_error: list[BaseException] = []
    if reuse is not None:
        os.rename(reuse, path)  # same directory tree, so atomic; `path` must not exist (a fresh temp dir)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        preallocate(fd, total)  # a full filesystem is an error here, not a SIGBUS in the copy
        with mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as mm:
            view = memoryview(mm)

            def _hash_in_order() -> None:
                try:
                    while (span := ready.get()) is not None:
                        hasher.update(view[span[0]:span[1]])
                except BaseException as e:  # re-raised in the writing thread
                    hash_error.append(e)
                    while ready.get() is not None:  # drain, so the writer never blocks on us
                        pass

            hash_thread = threading.Thread(target=_hash_in_order, name="weights-hash", daemon=True)
            hash_thread.start()
            # The copies on every core but one: the hash thread has that one. A thread team that
            # shares a core with the hash waits at every barrier.
            threads_before = torch.get_num_threads()
            torch.set_num_threads(copy_threads())
            try:
                view[: len(header)] = header
                ready.put((0, len(header)))
                offset = len(header)
                for t in tensors.values():
                    stored = _stored_dtype(t, dtype)
                    if t.numel():
                        dst = torch.frombuffer(mm, dtype=stored, count=t.numel(), offset=offset)
                        try:
                            dst.view(t.shape).copy_(t)  # cast + device-to-host + write, in one copy
                        finally:
                            del dst  # an export left alive would make closing the map fail
                    end = offset + t.numel() * stored.itemsize
                    ready.put((offset, end))
                    offset = end
            finally:
                torch.set_num_threads(threads_before)
                ready.put(None)
                hash_thread.join()
                view.release()
            mm.flush()  # msync: a no-op on tmpfs, the write-back on a disk root
        os.fsync(fd)
    finally:
        os.close(fd)
    if hash_error:
        raise hash_error[0]
    return total, hasher.hexdigest()

def write_weights(state_dict: dict[str, torch.Tensor], model_dir_or_config: str | Path, root: str | Path,
                  version: int, step: int, dtype: torch.dtype, *, hash_algo: str = "sha256",
                  reuse_spare: bool = False) -> Path:
    """Write `root/weights-v<version>/` atomically: model.safetensors, config.json(s), manifest.json.

    `state_dict` is the full model in any float dtype (cast to `dtype`, the serving dtype, with no
    copy where it already is). Returns the final directory; an existing directory of the same
    version (a resumed run) is replaced. reuse_spare: overwrite the root's spare file (left by
    prune_weights(keep_spare=True)) instead of allocating a new one.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightPushError(f"version: must be an integer >= 0, got {version!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = root / weights_dir_name(version)
    configs = config_sources(model_dir_or_config)
    tensors = _serving_tensors(state_dict, json.loads(configs["config.json"]))
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        nbytes, digest = write_safetensors(tensors, tmp / WEIGHTS_FILE, dtype, hash_algo,
                                           metadata={"format": "pt", "version": str(version)},
                                           reuse=take_spare(root) if reuse_spare else None)
        for name, data in configs.items():
            (tmp / name).write_bytes(data)
        manifest = {
            "format": MANIFEST_FORMAT, "version": version, "step": int(step),
            "dtype": str(dtype).removeprefix("torch."), "hash": hash_algo, "created": time.time(),
            "files": [{"name": WEIGHTS_FILE, "bytes": nbytes, hash_algo: digest}],
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        for name in list(configs) + [MANIFEST_NAME]:
            fsync_file(tmp / name)
        fsync_dir(tmp)
        # Atomic: a reader sees no directory or a complete one. A run resumed from a checkpoint may
        # write a version again: the older directory is replaced.
        replace_dir(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        needed = sum(t.numel() * _stored_dtype(t, dtype).itemsize for t in tensors.values())  # + a header of KBs
        full = no_space(e, final, needed + sum(map(len, configs.values())))
        if full is not None:
            raise full from None
        raise
    return final
