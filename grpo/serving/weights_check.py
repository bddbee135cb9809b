"""The server's half of a weight push: a directory is served only if it passes these checks.

Location (strictly inside the server's own private weights root, symlinks resolved), manifest,
listed files (regular, exact size, no stray safetensors), safetensors headers, then hashes and
finiteness (the server runs those in a thread while vLLM reloads, and rolls back on failure).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch

from grpo.fsutil import HASH_ALGOS, hash_file
from grpo.provenance import usable_cores
from grpo.serving.weights_dir import MANIFEST_FORMAT, MANIFEST_NAME, WeightPushError, read_safetensors, read_safetensors_header


def resolve_under_root(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """`path` (absolute, or relative to root) as a real path strictly inside the real root.

    Symlinks are resolved first, so a link pointing out of the root is refused like `..` is.
    """
    root_real = Path(os.path.realpath(root))
    p = Path(path)
    candidate = p if p.is_absolute() else root_real / p
    real = Path(os.path.realpath(candidate))
    if real == root_real or root_real not in real.parents:
        raise WeightPushError(f"{path}: refused, not inside the weights root {root_real}")
    return real

def check_weights_dir(path: str | os.PathLike, root: str | os.PathLike) -> dict[str, Any]:
    """Everything but the hashes: location, manifest, listed files (regular, exact size), headers.

    Cheap (no tensor data is read), so the server runs it before loading anything.
    """
    real = resolve_under_root(path, root)
    if not real.is_dir():
        raise WeightPushError(f"{path}: not a directory")
    manifest_path = real / MANIFEST_NAME
    if not manifest_path.is_file():
        raise WeightPushError(f"{real}: no {MANIFEST_NAME} (incomplete or not written by write_weights)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightPushError(f"{manifest_path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise WeightPushError(f"{manifest_path}: format is not {MANIFEST_FORMAT!r}")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightPushError(f"{manifest_path}: version must be an integer >= 0, got {version!r}")
    algo = manifest.get("hash")
    if algo not in HASH_ALGOS:
        raise WeightPushError(f"{manifest_path}: hash must be one of {list(HASH_ALGOS)}, got {algo!r}")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise WeightPushError(f"{manifest_path}: 'files' must be a non-empty list")
    listed = set()
    for entry in files:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise WeightPushError(f"{manifest_path}: file entry {entry!r} must name a plain file in the directory")
        if not isinstance(entry.get(algo), str) or not isinstance(entry.get("bytes"), int):
            raise WeightPushError(f"{manifest_path}: file entry {name!r} needs 'bytes' and '{algo}'")
        st = os.lstat(real / name) if os.path.lexists(real / name) else None
        if st is None:
            raise WeightPushError(f"{real}: {name} is listed in the manifest but missing")
        if not stat.S_ISREG(st.st_mode):
            raise WeightPushError(f"{real}: {name} is not a regular file (symlinks are refused)")
        if st.st_size != entry["bytes"]:
            raise WeightPushError(f"{real}: {name} has {st.st_size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if name.endswith(".safetensors"):
            read_safetensors_header(real / name)
        listed.add(name)
    # vLLM loads every *.safetensors in the directory: one the manifest does not vouch for is refused.
    stray = sorted(p.name for p in real.glob("*.safetensors") if p.name not in listed)
    if stray:
        raise WeightPushError(f"{real}: {stray[0]} is not listed in the manifest")
    if not (real / "config.json").is_file() or (real / "config.json").is_symlink():
        raise WeightPushError(f"{real}: no config.json")
    return dict(manifest, path=str(real))

def check_hashes(manifest: dict[str, Any]) -> None:
    """Recompute each listed file's hash; raises WeightPushError naming the first mismatch."""
    algo, real = manifest["hash"], Path(manifest["path"])
    for entry in manifest["files"]:
        # all this process's cores but one: the engine reloads on that one meanwhile
        actual = hash_file(real / entry["name"], algo, threads=max(1, len(usable_cores()) - 1))
        if actual != entry[algo]:
            raise WeightPushError(
                f"{real / entry['name']}: {algo} mismatch (manifest {entry[algo][:16]}..., file {actual[:16]}...)")

def check_finite(manifest: dict[str, Any]) -> None:
    """Every floating tensor of the listed safetensors files is finite; raises WeightPushError naming
    the first tensor that holds NaN or Inf (a diverged trainer's push must not reach the sampler).
    One min/max pass per tensor over the file's memory map (aminmax propagates NaN and shows Inf;
    isfinite(t).all() materialises a mask, many times slower)."""
    real = Path(manifest["path"])
    for entry in manifest["files"]:
        if not entry["name"].endswith(".safetensors"):
            continue
        for name, t in read_safetensors(real / entry["name"]).items():
            if t.is_floating_point() and t.numel():
                lo, hi = torch.aminmax(t)
                if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                    raise WeightPushError(f"tensor {name}: holds NaN or Inf values")

def check_weights_root(root: str | os.PathLike) -> Path:
    """The weights root is this user's own real directory that no one else can write: else another
    local user could plant or swap weights that then pass verification. Created 0700 if missing."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        root.mkdir(parents=True, mode=0o700)
        st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise WeightPushError(f"weights root {root}: is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise WeightPushError(f"weights root {root}: not a directory")
    if st.st_uid != os.getuid():
        raise WeightPushError(f"weights root {root}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o022:
        raise WeightPushError(f"weights root {root}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod go-w it or use another directory")
    return root
