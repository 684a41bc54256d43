"""The engine's own GPU kernels, each used only where this machine has shown it right and fast.

`rows_matmul` (CUDA): the linear layers of a verify pass of 2-64 rows, each row with the bits of
MLX's one-row matrix-vector kernel, reading each weight once. A decoding step runs that one-row
kernel; cuBLAS, which MLX runs for several rows, rounds differently, so in float16 and bfloat16 a
pass could pick another token than plain decoding where two logits nearly tie.
`rows_qmatmul` (CUDA): the same for quantized layers (mlx-lm's affine 4- and 8-bit layouts), each
row with the bits of MLX's one-row quantized kernel (qmv), which MLX leaves for its tiled one
from 8 rows up.
`attention` (plain MLX, where rows_matmul runs): the pass's attention row by row, each row as the
one-row step calls MLX's attention. With both, every row of a pass has the one-row step's logits
bit for bit (docs/BENCHMARKS.md §15).
`rows_sdpa` (CUDA): those rows in one call a layer where the step runs MLX's vector attention
kernel (up to 255 keys in half precision, 1,024 in float32), each row with that kernel's bits;
checked per dtype and head dim at first use (CACHEBACK_MLX_ROWS_SDPA=0: a call per row).

The matmul is checked at its first use in a process, per dtype (the quantized one per dtype, bits
and group size), against its plain-MLX reference (`check` in each file): bits equal to the one-row
step and faster than running the rows one by one, else it is skipped with one warning (and the
row-by-row attention with it).
MLX compiles a custom CUDA kernel's builds in every process (it keeps only its own on disk), so
the check compiles every build a pass can use (2 a dtype; 1 a quantized kind) up front, none in the middle of a
decoding (when a dtype had 12 builds in the check and up to ~12 more in passes, the check alone
took ~28 s a dtype on an H100 host). The kernels run only inside the engine's verify passes
(`verify_pass()`), never in prefill or in plain mlx-lm in the same process.
CACHEBACK_MLX_KERNELS=0 turns them off, CACHEBACK_MLX_ROWS_ATTENTION=0 the attention alone;
`cacheback-mlx doctor` shows which run.

`pass_attention` (plain MLX, CUDA, float16/bfloat16): the attention of any other verify pass as MLX's
own ops rather than cuDNN's kernel, which builds a new plan for every key length, so for nearly
every pass of a decoding (54-94 ms a pass on an H100 at the default model's size, against 8-13 ms).
Not a kernel: CACHEBACK_MLX_CUDNN_PASSES=1 gives those passes back to MLX's choice.

`rows_addmm` (plain MLX): a plain linear layer with a bias, which MLX runs through cuBLAS even for
one row, goes row by row in a pass, each row through the step's own one-row call (a quantized
layer adds its bias apart, so the quantized kernel covers those).

Not covered yet (so not exact in float16/bfloat16 on a GPU there): quantized layouts other than
affine 4/8 bits, mixture-of-experts layers, sliding windows, passes shared by several sequences,
Metal. The prompt goes through the model as mlx-lm's generate_step puts it in half precision on a
GPU (engine.prompt_as_mlx_lm_default), so that the caches hold mlx-lm's bits before the first pass.
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import mlx.core as mx

from . import attention as _attention
from . import plain_attention as _plain_attention
from . import rows_addmm, rows_matmul, rows_qmatmul, rows_sdpa

ENV = "CACHEBACK_MLX_KERNELS"
enabled = os.environ.get(ENV, "1") != "0"
ATTENTION_ENV = "CACHEBACK_MLX_ROWS_ATTENTION"
attention_enabled = os.environ.get(ATTENTION_ENV, "1") != "0"
SDPA_ENV = "CACHEBACK_MLX_ROWS_SDPA"
sdpa_enabled = os.environ.get(SDPA_ENV, "1") != "0"  # rows_sdpa: a pass's attention rows in one call
CUDNN_ENV = "CACHEBACK_MLX_CUDNN_PASSES"
cudnn_passes = os.environ.get(CUDNN_ENV, "0") == "1"  # let MLX give verify passes cuDNN's attention
_checked: dict = {}  # dtype, or (dtype, bits, group size) for quantized layers -> (ok, reason), once a process
_biased: dict = {}  # dtype -> (ok, reason): biased layers row by row (rows_addmm), once a process
_sdpa: dict = {}  # (dtype, head dim) -> (ok, reason): attention rows in one call (rows_sdpa), once a process
_local = threading.local()


_CUDA = mx.cuda.is_available()  # asked once: on_cuda() is asked in every verify pass's layers


def on_cuda() -> bool:
    return _CUDA and mx.default_device().type == mx.DeviceType.gpu


def set_enabled(on: bool, attention: bool | None = None, sdpa: bool | None = None) -> None:
    """Turn the kernels on or off in this process (what CACHEBACK_MLX_KERNELS sets at start);
    `attention`: the row-by-row attention too (CACHEBACK_MLX_ROWS_ATTENTION), `sdpa`: its rows in
    one call (CACHEBACK_MLX_ROWS_SDPA), when given."""
    global enabled, attention_enabled, sdpa_enabled
    enabled = bool(on)
    if attention is not None:
        attention_enabled = bool(attention)
    if sdpa is not None:
        sdpa_enabled = bool(sdpa)


def one_line(e: Exception) -> str:
    """An exception as one line: a compiler's log (NVRTC's, many lines) cut to its first error."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    if len(lines) <= 1:
        return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    error = next((x for x in lines if "error" in x), lines[0])
    head = lines[0] if error is lines[0] else f"{lines[0]} {error}"
    return f"{type(e).__name__}: {head} (and {len(lines) - 1 - (error is not lines[0])} more lines)"


def _once(store: dict, key, check, off: str) -> bool:
    """A first-use check's verdict, kept in `store` under `key`: check() -> (ok, reason), run once a
    process; a check that fails or cannot build or run says so once (`off`: what stays MLX's own)."""
    if key not in store:
        try:
            store[key] = check()
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build or run is skipped, said once
            store[key] = (False, one_line(e))
        if not store[key][0]:
            print(f"cacheback-mlx: {off}: {store[key][1]}", file=sys.stderr)
    return store[key][0]


def usable(dtype) -> bool:
    """Whether rows_matmul runs for this dtype here (checked once, at its first use)."""
    if not (enabled and on_cuda()) or dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return False
    return _once(_checked, dtype, lambda: rows_matmul.check(dtype), f"exact-rows matmul off for {dtype}")


def usable_quantized(dtype, bits: int, group_size: int) -> bool:
    """Whether rows_qmatmul runs for quantized layers of this dtype, bits and group size here
    (checked once, at its first use)."""
    if not (enabled and on_cuda()) or dtype not in rows_qmatmul.DTYPES:
        return False
    return _once(_checked, (dtype, bits, group_size), lambda: rows_qmatmul.check(dtype, bits, group_size),
                 f"exact-rows quantized matmul off for {bits}-bit {dtype}, groups of {group_size}")


def usable_sdpa(dtype, head_dim: int) -> bool:
    """Whether rows_sdpa takes a pass's attention rows in this dtype and head dim here (checked
    once, at its first use)."""
    if (not (enabled and sdpa_enabled and on_cuda()) or dtype not in rows_sdpa.DTYPES
            or head_dim not in rows_sdpa.HEAD_DIMS):
        return False
    return _once(_sdpa, (dtype, head_dim), lambda: rows_sdpa.check(dtype, head_dim),
                 f"one-call attention rows off for {dtype}, head dim {head_dim} (a call per row instead)")


def _all_rows(sinks):
    """rows_attention's all_rows: the pass's rows in one rows_sdpa call where it applies and was
    checked here (every row within the keys for which the step runs the vector kernel)."""
    def run(queries, keys, values, plan, scale):
        if (not rows_sdpa.applies(queries, keys, sinks) or plan.most_keys > rows_sdpa.max_keys(queries.dtype)
                or not usable_sdpa(queries.dtype, queries.shape[-1])):
            return None
        keymap, counts = plan.keymap(queries.shape[2])
        return rows_sdpa.rows_sdpa(queries, keys, values, keymap, counts, scale)
    return run


def usable_biased(dtype) -> bool:
    """Whether a pass's biased plain linear layers of this dtype go row by row here (rows_addmm;
    checked once, at its first use)."""
    if not (enabled and on_cuda()) or dtype not in rows_addmm.DTYPES:
        return False
    return _once(_biased, dtype, lambda: rows_addmm.check(dtype),
                 f"biased linear layers keep MLX's own matmul for {dtype}")


def _exact_linear(dtype) -> bool:
    """Whether a pass's linear layers in this dtype have the one-row bits here: a checked kernel,
    plain or quantized (the row-by-row attention is worth its cost only then)."""
    quantized = [ok for key, (ok, _) in _checked.items() if isinstance(key, tuple) and key[0] == dtype]
    if any(quantized):
        return True
    return usable(dtype) if not quantized or dtype in _checked else False


VERSION = 4  # part of the verify-cost cache key (costs.cost_path), with what is on


def cost_key() -> str:
    """What of these changes a pass's cost here ("" where none of them can run: the CPU)."""
    if not on_cuda():
        return ""
    return (f"kernels/{VERSION}/{'on' if enabled else 'off'}/{'rows-attention' if attention_enabled else ''}"
            f"{'+sdpa' if attention_enabled and sdpa_enabled else ''}/{'cudnn' if cudnn_passes else 'mlx-ops'}")


def describe() -> str:
    """One line for `doctor`."""
    other = (f"MLX's choice (cuDNN in float16/bfloat16; {CUDNN_ENV}=1)" if cudnn_passes else
             "MLX's plain ops, not cuDNN (which plans again for every key length)")
    if not on_cuda():
        return "engine's GPU kernels: none on this device (CUDA only so far)"
    if not enabled:
        return f"engine's GPU kernels: off ({ENV}=0); verify passes' attention: {other}"
    parts = []
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        if dtype == mx.float32 and dtype not in _checked:  # each check compiles its builds (~2 s each)
            parts.append(f"{dtype}: checked at its first use")
            continue
        usable(dtype)
        ok, reason = _checked[dtype]
        parts.append(f"{dtype}: {'on' if ok else 'off'} ({reason})")
    for key, (ok, reason) in _checked.items():
        if isinstance(key, tuple):
            parts.append(f"{key[1]}-bit {key[0]}, groups of {key[2]}: {'on' if ok else 'off'} ({reason})")
    for (dtype, dim), (ok, reason) in _sdpa.items():
        parts.append(f"one-call attention rows {dtype}, head dim {dim}: {'on' if ok else 'off'} ({reason})")
    for dtype, (ok, reason) in _biased.items():
        parts.append(f"biased layers {dtype}: {'row by row' if ok else 'off'} ({reason})")
    attention = ("on" if attention_enabled else f"off ({ATTENTION_ENV}=0)")
    if attention_enabled:
        attention += (", its rows in one call where checked (rows_sdpa)" if sdpa_enabled
                      else f", a call per row ({SDPA_ENV}=0)")
    return ("exact-rows matmul (verify passes): " + "; ".join(parts) + f"; row-by-row attention: {attention}"
            + f"; other passes' attention: {other}")


def exactness() -> str:
    """One line for `doctor`: in which dtypes greedy output equals mlx-lm's plain decoding here."""
    device = mx.default_device()
    if device == mx.cpu:
        return ("exact greedy output (equal to mlx-lm's plain decoding): float32, tested on the CPU; "
                "other dtypes not checked on the CPU")
    if not on_cuda():
        return ("exact greedy output: not checked on this GPU (Metal); passes of several rows may round "
                "differently from one-row steps, most in float16/bfloat16 (`doctor --model M --rounding` "
                "measures it)")
    f32 = ("float32 (TF32 off)" if os.environ.get("MLX_ENABLE_TF32") == "0"
           else "not float32 while TF32 is on (MLX_ENABLE_TF32=1)")
    if enabled and attention_enabled and usable(mx.float16) and usable(mx.bfloat16):
        half = ("float16/bfloat16 in plain, biased (row by row) and affine 4/8-bit quantized linear layers and "
                "attention (kernels on; each kind once checked at first use), not yet in sliding windows or "
                "passes shared by several requests")
    else:
        half = ("not float16/bfloat16 (without both kernels on, a pass of several rows rounds differently "
                "from a one-row step)")
    return f"exact greedy output (equal to mlx-lm's plain decoding): {f32}; {half}"


@contextmanager
def rows_pass(real: int | None = None):
    """While the engine builds a verify pass on this thread: its linear layers may use the kernel.
    `real`: the pass's rows before its padding (nobody sees padding rows: their attention is not
    computed row by row)."""
    before = getattr(_local, "on", False), getattr(_local, "real", None)
    _local.on, _local.real = True, real
    try:
        yield
    finally:
        _local.on, _local.real = before


def in_rows_pass() -> bool:
    return getattr(_local, "on", False)


def exact_rows(x: mx.array, w: mx.array) -> mx.array | None:
    """x @ w.T through the kernel when it applies here (a verify pass, 2..MAX_ROWS rows, a checked
    dtype), else None (the caller runs MLX's own matmul)."""
    if not in_rows_pass() or x.dtype != w.dtype or x.ndim < 2:
        return None
    rows = x.size // x.shape[-1]
    if not 2 <= rows <= rows_matmul.MAX_ROWS or not usable(x.dtype):
        return None
    x2 = x.reshape(rows, x.shape[-1])
    # MLX runs a one-row product as its gemv only where K is a multiple of 32 (else cuBLAS's): there
    # the kernel, elsewhere each row through the step's own call
    out = rows_matmul.rows_matmul(x2, w) if rows_matmul.gemv_applies(w) else rows_matmul.reference(x2, w)
    return out.reshape(*x.shape[:-1], w.shape[0])


def exact_rows_biased(x: mx.array, w: mx.array, b: mx.array) -> mx.array | None:
    """x @ w.T + b with each row through the one-row step's own call (rows_addmm) when it applies
    here (a verify pass, 2..MAX_ROWS rows, a checked dtype), else None."""
    if not in_rows_pass() or x.ndim < 2 or x.dtype != w.dtype:
        return None
    rows = x.size // x.shape[-1]
    if not 2 <= rows <= rows_addmm.MAX_ROWS or not usable_biased(x.dtype):
        return None
    out = rows_addmm.rows_addmm(x.reshape(rows, x.shape[-1]), w, b)
    return out.reshape(*x.shape[:-1], w.shape[0])


def exact_rows_quantized(x: mx.array, layer) -> mx.array | None:
    """x @ the quantized layer's weight.T (before its bias) through rows_qmatmul when it applies
    here (a verify pass, 2..MAX_ROWS rows, a checked dtype, bits and group size), else None."""
    if not in_rows_pass() or x.ndim < 2:
        return None
    rows = x.size // x.shape[-1]
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    bits, group_size = layer.bits, layer.group_size
    if (not 2 <= rows <= rows_qmatmul.MAX_ROWS
            or not rows_qmatmul.applies(x, w, scales, biases, bits, group_size, getattr(layer, "mode", "affine"))
            or not usable_quantized(x.dtype, bits, group_size)):
        return None
    out = rows_qmatmul.rows_qmatmul(x.reshape(rows, x.shape[-1]), w, scales, biases, bits, group_size)
    return out.reshape(*x.shape[:-1], w.shape[0])


def rows_attention(stock, queries, keys, values, cache, scale, mask, sinks):
    """A verify pass's attention row by row as the one-row step runs it (kernels/attention.py),
    on CUDA where the exact-rows matmul runs; None elsewhere (the caller runs the pass's own)."""
    if not (attention_enabled and in_rows_pass() and _exact_linear(queries.dtype)):
        return None
    return _attention.rows_attention(stock, queries, keys, values, cache, scale, mask, sinks,
                                     getattr(_local, "real", None), all_rows=_all_rows(sinks))


def pass_attention(queries, keys, values, scale, mask, sinks):
    """A verify pass's attention in float16/bfloat16 on CUDA as MLX's plain ops rather than cuDNN's
    kernel, which plans again for each new key length (kernels/plain_attention.py); None elsewhere
    (the caller runs MLX's)."""
    if (cudnn_passes or sinks is not None or not in_rows_pass() or queries.shape[2] < 2
            or queries.dtype not in (mx.float16, mx.bfloat16) or not on_cuda()):
        return None
    return _plain_attention.attention(queries, keys, values, scale, mask)


def attach(model) -> int:
    """Route the model's plain and quantized linear layers through exact_rows /
    exact_rows_quantized (kernels/linear.py), and check the kernels now for their dtypes (bits and
    group sizes) rather than in the first pass; returns how many layers."""
    from ..footprint import head_dim
    from .linear import convert

    kinds = convert(model)
    dtypes = set()
    for kind in set(kinds):
        if isinstance(kind, tuple) and kind[0] == "biased":
            usable_biased(kind[1])
            dtypes.add(kind[1])
        elif isinstance(kind, tuple):
            usable_quantized(*kind)
            dtypes.add(kind[0])
        else:
            usable(kind)
            dtypes.add(kind)
    dim = head_dim(model)
    if attention_enabled and dim:  # the attention rows' kernel too, in the dtypes the passes run
        for dtype in dtypes:
            usable_sdpa(dtype, dim)
    return len(kinds)


__all__ = ["attach", "describe", "exact_rows", "exact_rows_biased", "exact_rows_quantized", "exactness",
           "pass_attention", "rows_pass", "usable", "usable_biased", "usable_quantized"]
