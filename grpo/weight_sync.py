"""Moving the policy's weights from the trainer to the inference server (pi_theta -> pi_old).

Every v iterations of Algorithm 1 the trainer's theta becomes the sampler's pi_old. The trainer
writes the full state dict, in the serving dtype, as ONE safetensors file in a fresh directory
under a weights root, atomically (temp dir, fsync, rename), next to config.json and a manifest
(version, step, size and hash per file). The server checks the directory (`verify_weights_dir`)
and reloads it in place. Pure functions, no vLLM: the trainer side and the tests use them alone.

Where the time goes (a push of SmolLM2-135M in bf16 is 269 MB; bench/weight_sync.py prints each
stage): on one CPU rank the gather returns the fp32 parameters themselves; the writer sizes the
file, memory-maps it and copies each tensor into its place, casting on the way (no intermediate
cast buffer: its page faults cost more than the cast), while a second thread hashes each tensor's
bytes as soon as they are in place; tied weights (lm_head = embed_tokens) are written once; under
/dev/shm (tmpfs) fsync is free and the server reads from the page cache. Fresh pages are what a
write costs most (269 MB into new tmpfs pages: 0.2-0.5 s on this VM, against 0.05 s into pages
already there), so in path mode the trainer's prune keeps the pruned push's file as a spare
(`SPARE_FILE`) and the next write overwrites it in place. The server hashes and
checks finiteness (one aminmax per tensor) in a thread while vLLM reloads, and reports its
engine's fingerprint (`tensor_moments` per parameter), which the trainer compares with moments it
computed from its own state dict while the server was loading.

Manifest (manifest.json, written last; its presence marks a complete directory):
    {"format": "grpo-weights/1", "version": 3, "step": 120, "dtype": "bfloat16",
     "hash": "sha256", "files": [{"name": "model.safetensors", "bytes": N, "sha256": "..."}]}
"""
from __future__ import annotations

import json
import mmap
import os
import queue
import re
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from grpo.fsutil import HASH_ALGOS, fsync_dir, fsync_file, hash_file, new_hasher, replace_dir  # noqa: F401 (re-exported)
from grpo.models import drop_tied_lm_head

MANIFEST_NAME = "manifest.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FORMAT = "grpo-weights/1"
SERVING_MARKER = "SERVING"  # a file in the root naming the directory the server serves now
SPARE_FILE = ".spare.safetensors"  # a pruned push's weights file, kept for the next push to overwrite
_DIR_RE = re.compile(r"^weights-v(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-weights-v\d+-(\d+)-[0-9a-f]+$")
_OLD_RE = re.compile(r"^weights-v\d+\.old$")  # left by a crash inside fsutil.replace_dir
_CONFIG_FILES = ("config.json", "generation_config.json")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class WeightPushError(RuntimeError):
    """A weights directory or push that cannot be served; the message says why."""


def weights_dir_name(version: int) -> str:
    return f"weights-v{version:08d}"


# ----------------------------------------------------------------------------- writing (trainer)

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
        if stored not in _ST_DTYPES:
            raise WeightPushError(f"state_dict[{name!r}]: dtype {stored} cannot be stored in safetensors")
        nbytes = t.numel() * stored.itemsize
        header[name] = {"dtype": _ST_DTYPES[stored], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data is 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, hash_algo: str = "sha256",
                      metadata: Optional[dict[str, str]] = None, reuse: Optional[Path] = None) -> tuple[int, str]:
    """Write `tensors` (any device, layout and float dtype) as one safetensors file with every
    floating tensor in `dtype`; returns (bytes, hex digest).

    The file is sized first and memory-mapped, and each tensor is copied straight into its place:
    the cast, the device-to-host copy and the write are one pass, with no intermediate tensor (a
    fresh 269 MB cast buffer alone costs more in page faults than the copy). A second thread
    hashes each tensor's bytes, in file order, as soon as they are in place (hashlib and blake3
    release the GIL), so the hash overlaps the copying.

    reuse: an existing file of ours (a spare, see take_spare) moved to `path` and overwritten in
    place, resized to fit: its pages are already allocated, which on tmpfs is most of a write's
    cost. The mapping is populated in one call (MAP_POPULATE) rather than page by page.
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
            # The copies on one thread: the hash thread has the next core. A cast-copy is memory-bound
            # (0.03 s for SmolLM2 on 1 or 2 threads), and a 2-thread team sharing a core with the
            # hash waits at every barrier.
            threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
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
    by_name = {v: k for k, v in _ST_DTYPES.items()}
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


def _config_sources(model_dir_or_config: Any) -> dict[str, bytes]:
    """config.json (+ generation_config.json) as bytes, from a model directory or a config object."""
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        src = Path(model_dir_or_config)
        if not (src / "config.json").is_file():
            raise WeightPushError(f"{src}: no config.json (expected the HF model directory being trained)")
        return {n: (src / n).read_bytes() for n in _CONFIG_FILES if (src / n).is_file()}
    if hasattr(model_dir_or_config, "to_json_string"):  # a transformers PretrainedConfig
        return {"config.json": model_dir_or_config.to_json_string().encode()}
    raise WeightPushError(f"model_dir_or_config: expected a directory or a config, got {type(model_dir_or_config).__name__}")


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
    configs = _config_sources(model_dir_or_config)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ----------------------------------------------------------------------------- checking (server)

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
            itemsize = _ST_ITEMSIZE[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise WeightPushError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if stop - begin != numel * itemsize:
            raise WeightPushError(f"{path}: tensor {name!r} spans {stop - begin} bytes, its shape needs {numel * itemsize}")
        end = max(end, stop)
    if 8 + n + end != size:
        raise WeightPushError(f"{path}: truncated or padded: header describes {8 + n + end} bytes, file has {size}")
    return header


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
        # all cores but one: the engine reloads on that one meanwhile
        actual = hash_file(real / entry["name"], algo, threads=max(1, (os.cpu_count() or 1) - 1))
        if actual != entry[algo]:
            raise WeightPushError(
                f"{real / entry['name']}: {algo} mismatch (manifest {entry[algo][:16]}..., file {actual[:16]}...)")


def check_finite(manifest: dict[str, Any]) -> None:
    """Every floating tensor of the listed safetensors files is finite; raises WeightPushError naming
    the first tensor that holds NaN or Inf (a diverged trainer's push must not reach the sampler).
    One min/max pass per tensor over the file's memory map (aminmax propagates NaN and shows Inf;
    isfinite(t).all() materialises a mask and is ~40x slower on CPU)."""
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


def tensor_moments(t: torch.Tensor, rounded_to: Optional[torch.dtype] = None,
                   block: int = 1 << 12, chunk: int = 1 << 20) -> tuple[int, float, float]:
    """(numel, sum, sum of squares) of a tensor, accurate to ~1e-8 relative, at memory speed; with
    `rounded_to`, of its values rounded to that dtype first (an fp32 master weight as pushed in bf16).

    fp64 reductions are ~15x slower on CPU (0.33 s vs 0.02 s for a 28M-element bf16 embedding):
    here each 1M-element chunk is copied into a reused fp32 buffer (no page faults), reduced in
    fp32 over blocks of 4096 (error ~1e-7 of a block) and the block results summed in fp64.
    Both ends of a push use this one function, so their figures agree to that accuracy."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0, 0.0, 0.0
    rounding = rounded_to is not None and flat.is_floating_point() and flat.dtype != rounded_to
    width = min(chunk, flat.numel())
    buf = torch.empty(width, dtype=torch.float32, device=flat.device)
    sq = torch.empty_like(buf)
    staged = torch.empty(width, dtype=rounded_to, device=flat.device) if rounding else None
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    with torch.no_grad():
        for part in flat.split(chunk):
            x, x2 = buf[: part.numel()], sq[: part.numel()]
            if staged is not None:
                part = staged[: part.numel()].copy_(part)
            x.copy_(part)
            torch.mul(x, x, out=x2)
            m = part.numel() // block
            for i, v in enumerate((x, x2)):
                total[i] += torch.sum(v[: m * block].view(m, block), dim=1).double().sum()
                total[i] += torch.sum(v[m * block:], dtype=torch.float64)
    s, q = total.tolist()
    return int(flat.numel()), s, q


def pushed_moments(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, model_dir_or_config: str | Path,
                   skip: Optional[Callable[[str], bool]] = None) -> dict[str, tuple[int, float, float]]:
    """tensor_moments of each tensor a push of `state_dict` in `dtype` sends (tied lm_head dropped,
    floats rounded to `dtype`), computed from the state dict itself, independently of the writer.
    skip(name): leave out tensors the engine's fingerprint cannot show (unseen_by_fingerprint)."""
    config = json.loads(_config_sources(model_dir_or_config)["config.json"])
    return {name: tensor_moments(t, rounded_to=dtype) for name, t in drop_tied_lm_head(state_dict, config).items()
            if skip is None or not skip(name)}


def engine_param_name(name: str, renames: dict[str, str]) -> str:
    """vLLM's name for a pushed (HF) tensor: its module folded into the packed one that holds it
    (renames: q_proj/k_proj/v_proj -> qkv_proj, gate_proj/up_proj -> gate_up_proj)."""
    parts = name.split(".")
    return ".".join(renames.get(p, p) if i == len(parts) - 2 else p for i, p in enumerate(parts))


def _renames(engine: dict) -> dict[str, str]:
    return {sub: packed for packed, subs in engine.get("packed", {}).items() for sub in subs}


def unseen_by_fingerprint(engine: dict) -> Callable[[str], bool]:
    """From a fingerprint reply: whether a pushed tensor lands in an engine parameter the fingerprint
    cannot see (numel 0: vLLM's CPU backend packs linear weights into oneDNN handles). Their moments
    are never compared, so the next push need not compute them: on CPU that is 4/5 of SmolLM2's
    weights, whose moments took 0.11-0.23 s on a core the engine's reload wanted."""
    renames, opaque = _renames(engine), {k for k, v in engine["params"].items() if v[0] == 0}
    return lambda name: engine_param_name(name, renames) in opaque


def fingerprint_mismatches(pushed: dict[str, tuple[int, float, float]], engine: dict, limit: int = 5) -> list[str]:
    """Names of the engine parameters (vLLM's names) whose (numel, sum, sum of squares) differ from
    those of the tensors the trainer pushed (`pushed`: pushed_moments), folded into vLLM's packed
    modules (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj; `engine` is the server's
    fingerprint reply). A pushed tensor the engine does not hold, or an engine parameter nothing
    was pushed for, is a mismatch too. An engine parameter left empty (numel 0) is opaque and
    skipped: vLLM's CPU backend moves fp32 linear weights into oneDNN's packed handles, out of
    reach of named_parameters (there only embeddings, norms and biases are checked; on GPU every
    parameter is)."""
    renames = _renames(engine)
    expected: dict[str, list[float]] = {}
    for name, moments in pushed.items():
        acc = expected.setdefault(engine_param_name(name, renames), [0, 0.0, 0.0])
        for i in range(3):
            acc[i] += moments[i]
    held = {k: v for k, v in engine["params"].items() if v[0] > 0}
    opaque = {k for k, v in engine["params"].items() if v[0] == 0}
    bad = sorted((set(expected) - opaque) ^ set(held))
    for name in sorted(set(expected) & set(held)):
        (n_e, s_e, q_e), (n_h, s_h, q_h) = expected[name], held[name]
        scale = (q_e * n_e) ** 0.5 + 1e-30  # >= sum |x|: bounds the rounding of either sum
        # numel may differ by zero padding (same sums); values may not
        if abs(s_e - s_h) > 1e-6 * scale or abs(q_e - q_h) > 1e-6 * max(q_e, 1e-30) or n_h < n_e:
            bad.append(name)
    return bad[:limit] if len(bad) <= limit else bad[:limit] + [f"... {len(bad) - limit} more"]


def verify_weights_dir(path: str | os.PathLike, root: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete, intact weights directory under `root` (with 'path' added).

    Raises WeightPushError with the reason: outside the root, symlink, missing or malformed
    manifest, missing/extra/truncated file, bad safetensors header, hash mismatch.
    """
    manifest = check_weights_dir(path, root)
    check_hashes(manifest)
    return manifest


# ----------------------------------------------------------------------------- pruning

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
