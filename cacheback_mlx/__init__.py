"""cacheback-mlx: lossless, training-free speculative decoding on MLX.

    from cacheback_mlx import load, generate
    model, tokenizer = load()                     # the embedded default model
    print(generate("Write a haiku", drafter="ngram"))
"""

import os

from . import blas, malloc

blas.preload_openblas()  # must run before the first `import mlx.core`
malloc.fix_mmap_threshold()  # keeps a long-running server's memory flat (malloc.py)
# MLX's CUDA backend runs float32 matmuls of several rows in TF32 (10-bit mantissas) and one-row
# products in full float32, so a verify pass and plain decoding round differently: on an H200 the
# tiny-family tests failed 59 times with it and greedy-token tests all passed without it
# (docs/BENCHMARKS.md §15). Exact output comes first; a user may still set it to 1.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

_API = {"load": "loader", "generate": "api", "stream_generate": "api", "Session": "api",
        "make_drafter": "drafters", "drafter_names": "drafters", "CachebackError": "errors"}


def __getattr__(name):  # lazy, so `import cacheback_mlx` stays cheap for the CLI's --help
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(name)


__all__ = list(_API)
__version__ = "0.1.0"
