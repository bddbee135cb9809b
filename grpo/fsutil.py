"""Filesystem helpers for what must survive a crash: durable writes, atomic directory replacement,
file hashes. Used by checkpoints, weight pushes, model building and the server.

A directory appears complete or not at all: it is written under a temporary name, its files and
itself fsynced, then renamed into place (rename is atomic within a filesystem), and the parent
fsynced so the rename itself is durable.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
from pathlib import Path

HASH_ALGOS = ("sha256", "blake3")


class HashError(ValueError):
    """An unknown or unavailable hash algorithm."""


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's new entries and renames durable (a no-op where directories cannot be
    opened for fsync)."""
    try:
        fsync_file(path)
    except OSError:
        pass


def write_durable(path: str | os.PathLike, data: str | bytes) -> None:
    """Write a small file and fsync it before returning."""
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename a finished `tmp` directory to `final`, durably. An existing `final` (the same step or
    version written again, e.g. after a resume) is moved aside first, since a directory cannot be
    renamed over a non-empty one, and removed after."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def new_hasher(algo: str, threads: int = 1):
    """A hashlib-style hasher; `threads` > 1 lets blake3 hash one large update on several cores
    (sha256 is sequential by construction)."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "blake3":
        try:
            import blake3  # a vLLM dependency, so present wherever the server runs
        except ImportError as e:
            raise HashError("hash 'blake3' needs the blake3 package (pip install blake3)") from e
        return blake3.blake3(max_threads=max(1, threads))
    raise HashError(f"hash: expected one of {list(HASH_ALGOS)}, got {algo!r}")


def hash_file(path: str | os.PathLike, algo: str = "sha256", threads: int = 1) -> str:
    """Hex digest of a file, hashed from a memory map (no read copy; refuses to follow a symlink)."""
    hasher = new_hasher(algo, threads)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if os.fstat(fd).st_size:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                hasher.update(mm)
    finally:
        os.close(fd)
    return hasher.hexdigest()
