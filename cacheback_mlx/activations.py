"""SwiGLU for the engine's passes on MLX's CPU backend.

mlx-lm's `swiglu(gate, x) = silu(gate) * x` is one compiled MLX kernel, but on the x86 CPU wheels
its sigmoid runs at ~17 ns an element: a pass of 8 rows of the default model spends ~6 ms in it,
a first pass of ~40 rows ~30 ms, and prefilling a 1,000-token prompt ~0.7 s. Here the sigmoid's
exp is attention.py's range-reduced polynomial (within ~1 ulp of float32 exp) on exp(-|gate|),
which never overflows: sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|).
Two compiled elementwise kernels, 6-8x faster alone (passes of 16-64 rows 5-12% cheaper, docs
§1); the result is within ~3e-7 relative of mlx-lm's.

Used only while the engine builds its own passes (verify.py's `engine_pass()`), on the CPU, in
float32, for passes of several rows: plain mlx-lm in the same process (the reference the tests
compare against, and `bench`'s baseline) keeps its own kernel, as do Metal and CUDA.
CACHEBACK_MLX_FAST_SILU=0 turns it off (to measure it).
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models import activations as mlx_lm_activations

from .attention import exp_parts

enabled = os.environ.get("CACHEBACK_MLX_FAST_SILU", "1") != "0"
VERSION = 1  # part of the verify-cost cache key (costs.cost_path)
MIN_SIZE = 4096  # elements of the gate: below (one or two rows) MLX's kernel is as fast
stock = mlx_lm_activations.swiglu
_local = threading.local()


@contextmanager
def engine_pass():
    """While the engine builds a pass's graph on this thread: the faster SwiGLU applies."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def _parts(gate: mx.array) -> tuple[mx.array, mx.array]:
    return exp_parts(-mx.abs(gate), 0.0)


def _tail(gate: mx.array, x: mx.array, e: mx.array) -> mx.array:
    return gate * (mx.where(gate >= 0, 1.0, e) / (1.0 + e)) * x


_compiled = (mx.compile(_parts, shapeless=True), mx.compile(_tail, shapeless=True))


def cpu_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x with the polynomial exp (plain ops when kernels cannot be compiled)."""
    parts, tail = _compiled or (_parts, _tail)
    p, bits = parts(gate)
    return tail(gate, x, p * bits.view(mx.float32))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`, with cpu_swiglu where it applies."""
    global _compiled
    if (enabled and getattr(_local, "on", False) and gate.size >= MIN_SIZE
            and gate.dtype == x.dtype == mx.float32 and mx.default_device() == mx.cpu):
        try:
            return cpu_swiglu(gate, x)
        except Exception as e:  # noqa: BLE001 - MLX's CPU compiler needs a C++ compiler
            if _compiled is None:
                raise
            print(f"cacheback-mlx: no compiled SwiGLU kernel ({type(e).__name__}: {e}); using plain ops",
                  file=sys.stderr)
            _compiled = None
            return cpu_swiglu(gate, x)
    return stock(gate, x)


def install(module_names) -> None:
    """Route the SwiGLU of these mlx-lm model modules through swiglu above (once each)."""
    for name in module_names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "swiglu", None) is stock:
            module.swiglu = swiglu
