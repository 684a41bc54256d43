"""glibc: a fixed mmap threshold, so a long-running process's memory stays flat.

glibc serves an allocation above its mmap threshold with its own mmap, returned to the system on
free. The threshold starts at 128 KiB but is dynamic: freeing such a block raises it to that
block's size (up to 32 MiB). SSD re-indexes its buffer after every request, in a background
thread, with arrays a little bigger each time; once the threshold has risen, those arrays come
from the threads' malloc arenas instead, and the holes they leave are never reused or trimmed. A
server's resident memory then grew ~2 MB per second under the soak test (docs/BENCHMARKS.md §12),
with no Python object and no MLX buffer growing. Setting the threshold explicitly turns the
dynamic adjustment off, as glibc documents (mallopt(3)); blocks of 1 MiB and more are then always
mapped and unmapped whole.

MLX keeps freed buffers in its own cache for reuse, but on Linux's CPU backend that cache is
limited to 32 MB. A prefill chunk of 512 rows frees more than that per layer, so its buffers went
back to malloc, which unmapped them: 56,000-600,000 page faults to prefill 1,050 tokens of the
default model (0.2-2.4 GB faulted in again). `raise_mlx_cache_limit` (called by the loader on the
CPU, after the weights are in place) lifts the limit to 256 MB: then a few hundred faults once the
cache is warm, and the prefill is faster (docs/BENCHMARKS.md §1).

Only on Linux with glibc; left alone when the user set MALLOC_MMAP_THRESHOLD_ themselves, or with
CACHEBACK_MLX_MALLOC=0 (which leaves MLX's cache limit alone too).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
THRESHOLD = 1 << 20
MLX_CACHE = 256 << 20  # bytes of freed buffers MLX keeps for reuse on the CPU, at least

status: str = "not attempted"
"""What happened, for `cacheback-mlx doctor` and the tests."""
mlx_cache: str = "MLX's default"
"""The limit of MLX's buffer cache, for `cacheback-mlx doctor`."""


def fix_mmap_threshold(threshold: int = THRESHOLD) -> str:
    global status
    if sys.platform != "linux":
        status = f"not needed on {sys.platform}"
    elif os.environ.get("CACHEBACK_MLX_MALLOC", "1") == "0":
        status = "off (CACHEBACK_MLX_MALLOC=0)"
    elif "MALLOC_MMAP_THRESHOLD_" in os.environ:
        status = "left to MALLOC_MMAP_THRESHOLD_"
    else:
        try:
            libc = ctypes.CDLL(None)
            gnu = libc.gnu_get_libc_version  # glibc only (musl's mallopt does nothing)
            gnu.restype = ctypes.c_char_p
            ok = libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
            # the dynamic raise moved the trim threshold to twice the mmap one: set it back too
            ok = ok and libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold) == 1
            status = f"mmap threshold fixed at {threshold >> 10} KiB (glibc {gnu().decode()})" if ok \
                else "mallopt refused the mmap threshold"
        except (OSError, AttributeError) as e:
            status = f"not glibc ({e})"
    return status


def raise_mlx_cache_limit(limit: int = MLX_CACHE) -> None:
    """On MLX's CPU device, let MLX keep at least `limit` bytes of freed buffers (a larger limit
    is put back as it was; Metal and CUDA are left alone)."""
    import mlx.core as mx

    global mlx_cache
    if os.environ.get("CACHEBACK_MLX_MALLOC", "1") == "0" or mx.default_device() != mx.cpu:
        return
    before = mx.set_cache_limit(limit)
    if before > limit:
        mx.set_cache_limit(before)
    elif before < limit:
        mlx_cache = f"{limit >> 20} MB (MLX's default here: {before >> 20} MB)"
