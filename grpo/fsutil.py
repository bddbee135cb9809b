"""Filesystem helpers for what must survive a crash: durable writes, atomic directory replacement,
file hashes, a full disk said in one line. Used by checkpoints, weight pushes, rollout recording,
model building and the server.

A directory appears complete or not at all: it is written under a temporary name, its files and
itself fsynced, then renamed into place (rename is atomic within a filesystem), and the parent
fsynced so the rename itself is durable. A write that finds its filesystem full leaves the
previous complete one as it was and raises NoSpaceError, naming the path and the space it needed.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator, Optional

HASH_ALGOS = ("sha256", "blake3")


class HashError(ValueError):
    """An unknown or unavailable hash algorithm."""


class NoSpaceError(OSError):
    """A write that found its filesystem full (or its quota spent); the message names the path,
    the space the write needed and what was free."""


_FULL = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still write on the filesystem of `path` (or of its nearest
    existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _says_full(error: BaseException) -> bool:
    """Whether `error`, or one it wraps (its cause, its context, DCP's per-rank failures), is ENOSPC
    or EDQUOT; libraries that drop the errno (safetensors' Rust writer) still say it in words."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) in _FULL or "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        todo += [failure[0] for failure in getattr(e, "failures", {}).values()]  # DCP's CheckpointException
    return False


def no_space(error: BaseException, path: str | os.PathLike, needed: int,
             errno_lost: bool = False) -> Optional[NoSpaceError]:
    """`error` as a NoSpaceError naming `path` and the `needed` bytes, when it came from a full
    filesystem: an ENOSPC / EDQUOT in it, or, for a writer that loses the errno (errno_lost: DCP's
    stream writer says "unexpected pos"), less space left there than the whole write needed.
    None for any other error."""
    free = free_bytes(path)
    if not (_says_full(error) or (errno_lost and free < needed)):
        return None
    return NoSpaceError(f"{path}: no space left on device: the write needs {human_bytes(needed)}, "
                        f"{human_bytes(free)} is free there")


def preallocate(fd: int, size: int) -> None:
    """Reserve `size` bytes for the open file `fd` (ENOSPC now, where the filesystem is full).
    Without it, a memory-mapped write into a full tmpfs is no error but a SIGBUS that kills the
    process. A filesystem without fallocate is left to fail at the write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


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


# grpo-<kind>-[<name>-]h<host>p<owner pid>s<its start time>-<mkdtemp's 8 random characters>
# (h<host> absent from names made before it was added)
_OWNED_NAME = re.compile(r"^grpo-([a-z]+)-(?:.+-)?(?:h([0-9a-f]{8}))?p(\d+)s(\d+)-[a-z0-9_]{8}$")


def _host_tag() -> str:
    """This machine, in 8 hex digits: a pid says nothing about a process on another machine, and a
    TMPDIR can be on a filesystem that several nodes share."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owned_kind(name: str) -> Optional[str]:
    """The kind of an owned_dir directory named `name` ("weights", "tmp"), None for any other name."""
    match = _OWNED_NAME.match(name)
    return match[1] if match else None


def owner_gone(name: str) -> bool:
    """The process that made owned_dir directory `name` is gone (not running, or its pid now another
    process's); never for a directory made on another machine, whose processes cannot be seen here."""
    _, host, pid, started = _OWNED_NAME.match(name).groups()
    if host is not None and host != _host_tag():
        return False
    return process_started(int(pid)) not in (0, int(started))


def process_started(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks after boot; 0 where /proc does not say), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc here: the pid alone says whether it runs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name's ")"


def owned_dir(parent: Path, kind: str, name: str = "") -> Path:
    """A fresh directory under `parent` only this user can read, named after its owner (this process
    on this machine, and when it started): grpo-<kind>-[<name>-]h<host>p<pid>s<start>-XXXXXXXX. What a
    SIGKILLed process leaves there is reclaimed by the next call for the same kind on the same machine
    (reclaim_owned), before it makes its own."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    reclaim_owned(parent, kind)
    pid = os.getpid()
    named = f"{name}-" if name else ""
    prefix = f"grpo-{kind}-{named}h{_host_tag()}p{pid}s{process_started(pid) or 0}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def reclaim_owned(parent: Path, kind: str) -> list[Path]:
    """Remove the owned_dir directories of `kind` under `parent` whose owner process is gone (not
    running, or its pid now another process's; on this machine); only this user's own directories,
    never a link."""
    gone = []
    for p in Path(parent).iterdir():
        try:
            if owned_kind(p.name) != kind or p.is_symlink() or not p.is_dir() or p.lstat().st_uid != os.getuid():
                continue
        except FileNotFoundError:  # reclaimed meanwhile by another process starting beside this one (a rank)
            continue
        if owner_gone(p.name):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


# A Unix socket's path has at most 107 bytes, and vLLM puts its engine's ZMQ sockets at
# <TMPDIR>/<uuid4> (37 more bytes): a TMPDIR longer than this would stop the engine from starting.
_TMPDIR_MAX_LEN = 107 - 37


@contextlib.contextmanager
def own_temp_dir() -> Iterator[Path]:
    """This process's temporary files, and those of every process it starts, in one directory it owns.

    A SIGKILLed process leaves what it (or a library in it) made in TMPDIR for a normal exit to
    remove: W&B's media, artifact and port directories and its service's sockets, vLLM's ZMQ
    sockets and process-group file, a compiler's half-written files. Here TMPDIR (environment and
    tempfile) is an owned_dir of this process for as long as the context lasts; it is removed at
    the end, and after a kill by the next process that makes one in the same place. A process
    started by one that owns its TMPDIR (a server started by a trainer) uses that one as it is:
    its parent's directory holds its leftovers, and the nested name would be longer. Inductor's
    compiled-kernel cache, which lives in TMPDIR by default, stays where it was, shared by runs."""
    parent = Path(tempfile.gettempdir())
    if owned_kind(parent.name) == "tmp":
        yield parent
        return
    own = owned_dir(parent, "tmp")
    if len(str(own)) > _TMPDIR_MAX_LEN:  # a long TMPDIR already: files go where they went before
        own.rmdir()
        yield parent
        return
    saved = {key: os.environ.get(key) for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    if saved["TORCHINDUCTOR_CACHE_DIR"] is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = default_cache_dir()  # read while TMPDIR is still the parent
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, str(own)
    os.environ["TMPDIR"] = str(own)  # what the processes it starts inherit
    try:
        yield own
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(own, ignore_errors=True)
