"""A weights root on disk: what a push directory holds and how old ones are pruned.

Every v iterations the trainer writes the policy (pi_theta -> alpha) as ONE safetensors file in a
fresh directory `weights-v<version>/` under a weights root, next to config.json and a manifest;
the server checks that directory and reloads it in place. This module is what both sides agree on:
names, the manifest's format, reading safetensors headers and tensors, listing and pruning. The
trainer's writer is grpo/serving/weights_writer.py, the server's checks grpo/serving/weights_check.py.

Manifest (manifest.json, written last; its presence marks a complete directory):
    {"format": "grpo-weights/1", "version": 3, "step": 120, "dtype": "bfloat16",
     "hash": "blake3", "files": [{"name": "model.safetensors", "bytes": N, "blake3": "..."}]}
"""
from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Optional

import torch

MANIFEST_NAME = "manifest.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FORMAT = "grpo-weights/1"
SERVING_MARKER = "SERVING"  # a file in the root naming the directory the server serves now
SPARE_FILE = ".spare.safetensors"  # a pruned push's weights file, kept for the next push to overwrite
CONFIG_FILES = ("config.json", "generation_config.json")
_DIR_RE = re.compile(r"^weights-v(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-weights-v\d+-(\d+)-[0-9a-f]+$")
_OLD_RE = re.compile(r"^weights-v\d+\.old$")  # left by a crash inside fsutil.replace_dir
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class WeightPushError(RuntimeError):
    """A weights directory or push that cannot be served; the message says why."""

def weights_dir_name(version: int) -> str:
    return f"weights-v{version:08d}"

def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size (catches truncation)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightPushError(f"{path}: truncated ({size} bytes), not a safetensors file")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise WeightPushError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightPushError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightPushError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            itemsize = ST_ITEMSIZE[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise WeightPushError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if stop - begin != numel * itemsize:
            raise WeightPushError(f"{path}: tensor {name!r} spans {stop - begin} bytes, its shape needs {numel * itemsize}")
        end = max(end, stop)
    if 8 + n + end != size:
        raise WeightPushError(f"{path}: truncated or padded: header describes {8 + n + end} bytes, file has {size}")
    return header

def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file written by write_safetensors, as read-only views of one
    private memory map (no copy: on tmpfs they are the page cache's own pages). Only for checking
    and fingerprinting what was written; the header is checked first (truncation, offsets)."""
    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
        # ACCESS_COPY: torch wants a writable buffer; a private mapping gives one without copying
        # and without any write reaching the file.
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    by_name = {v: k for k, v in ST_DTYPES.items()}
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = by_name.get(info["dtype"])
        if dtype is None:
            raise WeightPushError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not one this reader maps")
        numel = (end - begin) // dtype.itemsize
        t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=8 + header_len + begin) if numel else \
            torch.empty(0, dtype=dtype)
        out[name] = t.view(info["shape"])
    return out

def config_sources(model_dir_or_config: Any) -> dict[str, bytes]:
    """config.json (+ generation_config.json) as bytes, from a model directory or a config object."""
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        src = Path(model_dir_or_config)
        if not (src / "config.json").is_file():
            raise WeightPushError(f"{src}: no config.json (expected the HF model directory being trained)")
        return {n: (src / n).read_bytes() for n in CONFIG_FILES if (src / n).is_file()}
    if hasattr(model_dir_or_config, "to_json_string"):  # a transformers PretrainedConfig
        return {"config.json": model_dir_or_config.to_json_string().encode()}
    raise WeightPushError(f"model_dir_or_config: expected a directory or a config, got {type(model_dir_or_config).__name__}")

def list_weights_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete weights directories (with a manifest) directly under root, oldest version first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _DIR_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / MANIFEST_NAME).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

def _sole_regular_file(path: Path) -> bool:
    """A regular file (not a link) owned by us with no other name: overwriting it changes nothing
    else (a checkpoint that holds alpha's weights as a hard link to a push keeps its own bytes)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.getuid()

def take_spare(root: str | os.PathLike) -> Optional[Path]:
    """The root's spare weights file if it may be overwritten (else None, and a spare that may not
    is removed): the caller moves it into place at once (write_safetensors(reuse=...))."""
    spare = Path(root) / SPARE_FILE
    if not os.path.lexists(spare):
        return None
    if _sole_regular_file(spare):
        return spare
    spare.unlink(missing_ok=True)  # a link or a shared file: not ours to overwrite
    return None

def prune_weights(root: str | os.PathLike, keep_last: int, keep_spare: bool = False) -> None:
    """Delete all but the newest `keep_last` weights directories, and temp dirs of dead writers.

    The directory named in root/SERVING (what the server serves now, its fallback if a push
    fails) is never deleted, whatever its age. keep_spare: the weights file of one deleted
    directory stays as root/SPARE_FILE for the next write to overwrite (if no other name links to it).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last: must be >= 1 (the newest weights are being served), got {keep_last}")
    root = Path(root)
    if not root.is_dir():
        return
    serving = None
    marker = root / SERVING_MARKER
    if marker.is_file():
        serving = marker.read_text().strip()
    dirs = list_weights_dirs(root)
    for _, p in dirs[: max(0, len(dirs) - keep_last)]:
        if p.name != serving:
            if keep_spare and not os.path.lexists(root / SPARE_FILE) and _sole_regular_file(p / WEIGHTS_FILE):
                os.rename(p / WEIGHTS_FILE, root / SPARE_FILE)
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if (m and not _pid_alive(int(m.group(1)))) or _OLD_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
