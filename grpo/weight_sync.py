"""Moving the policy's weights from the trainer to the inference server (pi_theta -> pi_old).

Every v iterations of Algorithm 1 the trainer's theta becomes the sampler's pi_old. The trainer
writes the full state dict, in the serving dtype, as ONE safetensors file in a fresh directory
under a weights root, atomically (temp dir, fsync, rename), next to config.json and a manifest
(version, step, size and hash per file). The server checks the directory (`verify_weights_dir`)
and reloads it in place. Pure functions, no vLLM: the trainer side and the tests use them alone.

Where the bytes go (a push of SmolLM2-135M in bf16 is 269 MB; see bench/weight_sync.py):
- one file written straight from each tensor's memory (safetensors' own `save_file` first builds
  the whole file in a second buffer, a full extra copy), no dtype cast when the tensor already is
  in the serving dtype, and tied weights (lm_head = embed_tokens) written once;
- the hash runs in a second thread over the same memory while the main thread writes (hashlib
  and blake3 release the GIL), so hashing costs wall time only where it is slower than writing;
- under /dev/shm (tmpfs) fsync is free and the server reads from the page cache: no disk at all.

Manifest (manifest.json, written last; its presence marks a complete directory):
    {"format": "grpo-weights/1", "version": 3, "step": 120, "dtype": "bfloat16",
     "hash": "sha256", "files": [{"name": "model.safetensors", "bytes": N, "sha256": "..."}]}
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from grpo.fsutil import HASH_ALGOS, fsync_dir, fsync_file, hash_file, new_hasher, replace_dir  # noqa: F401 (re-exported)
from grpo.models import drop_tied_lm_head

MANIFEST_NAME = "manifest.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FORMAT = "grpo-weights/1"
SERVING_MARKER = "SERVING"  # a file in the root naming the directory the server serves now
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

def _serving_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, config: dict) -> dict[str, torch.Tensor]:
    """CPU, contiguous, floating tensors in `dtype` (no copy when already so); a tied lm_head dropped."""
    out = {}
    for name, t in drop_tied_lm_head(state_dict, config).items():
        if not isinstance(t, torch.Tensor):
            raise WeightPushError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a tensor")
        t = t.detach()
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if t.device.type != "cpu":
            t = t.cpu()
        out[name] = t.contiguous()
    if not out:
        raise WeightPushError("state_dict is empty (on FSDP only rank 0 gets the full state dict)")
    return out


def _header_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise WeightPushError(f"state_dict[{name!r}]: dtype {t.dtype} cannot be stored in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data is 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy; bf16 has no numpy dtype, so view as uint8)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, hash_algo: str = "sha256",
                      metadata: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """Write `tensors` (CPU, contiguous) as one safetensors file; returns (bytes, hex digest).

    The digest is computed in a second thread over the same buffers in file order while this
    thread writes them, so the two overlap instead of adding up.
    """
    header = _header_bytes(tensors, metadata or {"format": "pt"})
    chunks = [memoryview(header)] + [_tensor_bytes(t) for t in tensors.values()]
    hasher = new_hasher(hash_algo)
    hash_error: list[BaseException] = []

    def _hash_all() -> None:
        try:
            for c in chunks:
                hasher.update(c)
        except BaseException as e:  # re-raised in the writing thread
            hash_error.append(e)

    hash_thread = threading.Thread(target=_hash_all, name="weights-hash", daemon=True)
    hash_thread.start()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for c in chunks:
            _write_all(fd, c)
        os.fsync(fd)
    finally:
        os.close(fd)
        hash_thread.join()
    if hash_error:
        raise hash_error[0]
    return sum(len(c) for c in chunks), hasher.hexdigest()


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
                  version: int, step: int, dtype: torch.dtype, *, hash_algo: str = "sha256") -> Path:
    """Write `root/weights-v<version>/` atomically: model.safetensors, config.json(s), manifest.json.

    `state_dict` is the full model in any float dtype (cast to `dtype`, the serving dtype, with no
    copy where it already is). Returns the final directory; an existing directory of the same
    version (a resumed run) is replaced.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightPushError(f"version: must be an integer >= 0, got {version!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = root / weights_dir_name(version)
    configs = _config_sources(model_dir_or_config)
    tensors = _serving_tensors(state_dict, dtype, json.loads(configs["config.json"]))
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        nbytes, digest = write_safetensors(tensors, tmp / WEIGHTS_FILE, hash_algo,
                                           metadata={"format": "pt", "version": str(version)})
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
        actual = hash_file(real / entry["name"], algo)
        if actual != entry[algo]:
            raise WeightPushError(
                f"{real / entry['name']}: {algo} mismatch (manifest {entry[algo][:16]}..., file {actual[:16]}...)")


def check_finite(manifest: dict[str, Any]) -> None:
    """Every floating tensor of the listed safetensors files is finite; raises WeightPushError naming
    the first tensor that holds NaN or Inf (a diverged trainer's push must not reach the sampler)."""
    from safetensors import safe_open

    real = Path(manifest["path"])
    for entry in manifest["files"]:
        if not entry["name"].endswith(".safetensors"):
            continue
        with safe_open(str(real / entry["name"]), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
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


def fingerprint_mismatches(state_dict: dict[str, torch.Tensor], engine: dict, limit: int = 5) -> list[str]:
    """Names of the engine parameters (vLLM's names) whose (numel, sum, sum of squares) differ from
    those of the tensors the trainer pushed, folded into vLLM's packed modules (q/k/v_proj ->
    qkv_proj, gate/up_proj -> gate_up_proj; `engine` is the server's fingerprint reply). A pushed
    tensor the engine does not hold, or an engine parameter nothing was pushed for, is a mismatch too.
    An engine parameter left empty (numel 0) is opaque and skipped: vLLM's CPU backend moves linear
    weights into oneDNN's packed handles, out of reach of named_parameters (on CPU only embeddings,
    norms and biases are checked; on GPU every parameter is)."""
    renames = {sub: packed for packed, subs in engine.get("packed", {}).items() for sub in subs}
    expected: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, t in state_dict.items():
            parts = name.split(".")
            key = ".".join(renames.get(p, p) if i == len(parts) - 2 else p for i, p in enumerate(parts))
            acc = expected.setdefault(key, [0, 0.0, 0.0])
            acc[0] += t.numel()
            acc[1] += float(torch.sum(t, dtype=torch.float64))
            acc[2] += float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)
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


def prune_weights(root: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest `keep_last` weights directories, and temp dirs of dead writers.

    The directory named in root/SERVING (what the server serves now, its fallback if a push
    fails) is never deleted, whatever its age.
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
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if (m and not _pid_alive(int(m.group(1)))) or _OLD_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
