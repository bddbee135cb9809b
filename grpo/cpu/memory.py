"""glibc malloc for CPU processes that free and re-allocate the same large tensors over and over.

A trainer on CPU (FSDP2's all-gather buffers and bf16 casts, activations, gradients: the same sizes
every micro-batch) and a CPU vLLM engine (every weight push re-allocates its layers) free and
re-allocate big tensors all the time. With glibc's defaults a block above the mmap threshold
(dynamic, at most 32 MiB) is unmapped when freed and the next one maps fresh pages: a page fault
per 4 KiB. These settings keep freed memory in the heap: the process stays at its high-water mark,
as it would on a GPU's caching allocator (docs/cpu.md has the page-fault counts and timings).
"""
from __future__ import annotations

import ctypes
import ctypes.util

# (glibc's environment name, mallopt parameter, value). mallopt takes a C int, so 2 GiB - 1 is the
# most a trim threshold can be; the mmap threshold covers SmolLM2's embedding (113 MB in fp32).
SETTINGS = (
    ("MALLOC_MMAP_THRESHOLD_", -3, 128 << 20),  # M_MMAP_THRESHOLD: blocks below this come from the heap
    ("MALLOC_TRIM_THRESHOLD_", -1, (1 << 31) - 1),  # M_TRIM_THRESHOLD: free memory kept at the heap's top
    ("MALLOC_TOP_PAD_", -2, 256 << 20),  # M_TOP_PAD: extra asked of the system each time the heap grows
)


def malloc_env() -> dict[str, str]:
    """The settings for a child process (glibc reads them from its environment at start-up)."""
    return {name: str(value) for name, _, value in SETTINGS}


def keep_freed_memory() -> bool:
    """Apply the settings to this process from now on (mallopt). False where the C library has no
    mallopt (not glibc): nothing changes there."""
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for _, param, value in SETTINGS)
