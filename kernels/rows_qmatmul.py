"""A quantized layer's x @ w.T for a pass of a few rows, each row with the bits of the one-row step.

A decoding step runs a quantized linear layer (mlx-lm's affine 4- and 8-bit layouts) on one row,
and MLX's CUDA backend runs that as its quantized matrix-vector kernel (qmv: a warp per weight row;
lane l dequantizes E weights at a time, w * scale + bias in the activations' dtype, and adds their
products with x into E sums, half-precision sums for 4 bits and float ones for 8; the E sums are
then added in float and reduced across the warp). Passes of 8 rows or more go to its tiled
quantized matmul instead, which sums in another order: in float16 and bfloat16 near ties flip
(kernels/rows_matmul.py says the same of plain layers). This kernel runs the qmv's operations for
each row of a pass, with the same CUTLASS array operations MLX's qmv calls (MLX ships CUTLASS's
headers for its own run-time compiled kernels), while reading each weight once: a warp takes a
few weight rows and a block a few of the pass's rows (LAYOUT), the blocks of the same weight rows
follow one another so that their weights come from the cache, and each element of x a lane loads
serves all its weight rows.

`reference` is the definition in plain MLX (one quantized matmul per row: the qmv itself); `check`
compares the kernel with it on this machine (kernels/__init__.py decides from that whether it
runs). CUDA only; affine quantization of 4 or 8 bits, groups of 32, 64 or 128, float16/bfloat16.
"""

from __future__ import annotations

import mlx.core as mx

from .rows_matmul import faster

MAX_ROWS = 64
WARP, WARPS = 32, 8  # a block's warps
LAYOUT = (2, 4)  # (weight rows a warp takes, pass rows a block takes): registers for 8 x 16 sums a lane
BITS, GROUPS, DTYPES = (4, 8), (32, 64, 128), (mx.float16, mx.bfloat16)

HEADER = """
#include <cooperative_groups/reduce.h>
// Under NVRTC the CUDA std headers MLX's kernels include define these as macros, and CUTLASS's
// floating_point_nvrtc.h declares them as enumerators (MLX's own run-time compiled CUTLASS kernels
// undefine them the same way)
#if defined(__CUDACC_RTC__)
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#endif
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace cacheback {
template <typename T> struct Cutlass;
template <> struct Cutlass<__half> { using type = cutlass::half_t; };
template <> struct Cutlass<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <int B> struct Quant;
template <> struct Quant<4> { using type = cutlass::uint4b_t; };
template <> struct Quant<8> { using type = uint8_t; };
template <int B, typename T> struct Sum { using type = T; };  // qmv sums in T below 8 bits
template <typename T> struct Sum<8, T> { using type = float; };

// qmv's multiply-add of x and the dequantized weights into its sums: in T, or in float for 8 bits
template <int E, typename CT>
__device__ __forceinline__ void fma_into(const cutlass::Array<CT, E>& x_vec, const cutlass::Array<CT, E>& w_dq,
                                         CT* out) {
  auto* out_vec = reinterpret_cast<cutlass::Array<CT, E>*>(out);
  *out_vec = cutlass::fma(x_vec, w_dq, *out_vec);
}
template <int E, typename CT>
__device__ __forceinline__ void fma_into(const cutlass::Array<CT, E>& x_vec, const cutlass::Array<CT, E>& w_dq,
                                         float* out) {
  auto* out_vec = reinterpret_cast<cutlass::Array<float, E>*>(out);
  cutlass::NumericArrayConverter<float, CT, E> converter_ft;
  cutlass::Array<float, E> x_f = converter_ft(x_vec);
  cutlass::Array<float, E> w_f = converter_ft(w_dq);
  *out_vec = cutlass::fma(x_f, w_f, *out_vec);
}
}  // namespace cacheback
"""

# x: [R, K] (T), w: [N, K * BITS / 32] (uint32), scales and biases: [N, K / GROUP] (T), out: [R, N].
# Templates T, BITS, GROUP, WR (weight rows a warp takes) and PR (pass rows a block takes). A block
# is 8 warps over 8 * WR weight rows and PR rows of x; blockIdx.x = weight block * chunks + chunk,
# so the blocks of one weight block follow one another. Each lane loads its E elements of a row
# of x once for its WR weight rows (the loads of x, not the multiply-adds, bound a warp that takes
# one), and each of the WR x PR sums sees qmv's operations in qmv's order. E (elements a lane takes
# at once) as qmv picks it for 16-bit activations: 16 for 4 bits, 8 for 8. K must be a multiple
# of E (qmv's own tail reads past K otherwise); the caller sees to it.
SOURCE = """
    using CT = typename cacheback::Cutlass<T>::type;
    using Q = typename cacheback::Quant<BITS>::type;
    using S = typename cacheback::Sum<BITS, CT>::type;
    constexpr int E = (BITS <= 4) ? 16 : 8;
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int n = w_shape[0];
    const int k = x_shape[1];
    const int rows = x_shape[0];
    const int chunks = (rows + PR - 1) / PR;
    const int chunk = blockIdx.x % chunks;
    const int row0 = ((blockIdx.x / chunks) * 8 + threadIdx.y) * WR;
    if (row0 < n) {
        const int nw = min(WR, n - row0);
        const int r0 = chunk * PR;
        const int nr = min(PR, rows - r0);
        const int groups = k / GROUP;
        const size_t row_bytes = (size_t)k * BITS / 8;
        const uint8_t* w0 = reinterpret_cast<const uint8_t*>(w) + (size_t)row0 * row_bytes;
        const CT* s0 = reinterpret_cast<const CT*>(scales) + (size_t)row0 * groups;
        const CT* b0 = reinterpret_cast<const CT*>(biases) + (size_t)row0 * groups;
        const CT* xs = reinterpret_cast<const CT*>(x) + (size_t)r0 * k;
        S sums[PR][WR][E] = {};
        auto tile = [&](int idx) {
            cutlass::Array<CT, E> w_dq[WR];
#pragma unroll
            for (int j = 0; j < WR; ++j) {
                if (j < nw) {
                    CT scale = s0[(size_t)j * groups + idx / GROUP];
                    CT bias = b0[(size_t)j * groups + idx / GROUP];
                    auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, E>*>(w0 + j * row_bytes + idx * BITS / 8));
                    cutlass::NumericArrayConverter<CT, Q, E> converter_tq;
                    w_dq[j] = converter_tq(w_vec);
                    w_dq[j] = w_dq[j] * CT(scale) + bias;
                }
            }
#pragma unroll
            for (int r = 0; r < PR; ++r) {
                if (r < nr) {
                    auto x_vec = *(reinterpret_cast<const cutlass::Array<CT, E>*>(xs + (size_t)r * k + idx));
#pragma unroll
                    for (int j = 0; j < WR; ++j) {
                        if (j < nw) {
                            cacheback::fma_into<E, CT>(x_vec, w_dq[j], sums[r][j]);
                        }
                    }
                }
            }
        };
        constexpr int per_warp = 32 * E;
        for (int t = 0; t < k / per_warp; ++t) {
            tile(warp.thread_rank() * E + t * per_warp);
        }
        const int rest = k % per_warp;
        if (rest != 0) {
            const int idx = warp.thread_rank() * E + k - rest;
            if (idx < k) {
                tile(idx);
            }
        }
#pragma unroll
        for (int r = 0; r < PR; ++r) {
#pragma unroll
            for (int j = 0; j < WR; ++j) {
                if (r < nr && j < nw) {  // the same for the whole warp: every lane takes part in the reduce
                    float s{0};
#pragma unroll
                    for (int i = 0; i < E; ++i) {
                        s += sums[r][j][i];
                    }
                    s = cg::reduce(warp, s, cg::plus<float>{});
                    if (warp.thread_rank() == 0) {
                        reinterpret_cast<CT*>(out)[(size_t)(r0 + r) * n + row0 + j] = static_cast<CT>(s);
                    }
                }
            }
        }
    }
"""

_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="cacheback_rows_qmv", input_names=["x", "w", "scales", "biases"],
                                      output_names=["out"], source=SOURCE, header=HEADER)
    return _kernel


def elements(bits: int) -> int:
    """Weights a lane dequantizes at once, as MLX's qmv picks them for 16-bit activations."""
    return 16 if bits <= 4 else 8


def applies(x: mx.array, w: mx.array, scales: mx.array, biases, bits: int, group_size: int, mode: str) -> bool:
    """Whether this kernel takes the layer: affine 4/8 bits, a group size qmv knows, 16-bit
    activations the dtype of the scales, K a multiple of what a lane takes at once and of the group."""
    k = x.shape[-1]
    return (mode == "affine" and biases is not None and bits in BITS and group_size in GROUPS
            and x.dtype in DTYPES and scales.dtype == x.dtype and biases.dtype == x.dtype
            and k % elements(bits) == 0 and k % group_size == 0 and w.shape[-1] * 32 == k * bits
            and w.ndim == 2)


def rows_qmatmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int,
                 group_size: int, layout: tuple[int, int] = LAYOUT) -> mx.array:
    """x [R, K] @ dequantized w [N, K].T -> [R, N] on a CUDA GPU, 1 <= R <= MAX_ROWS. `layout`:
    (weight rows a warp takes, pass rows a block takes); every layout gives the same bits."""
    r, n = x.shape[0], w.shape[0]
    wr, pr = layout
    chunks = (r + pr - 1) // pr
    blocks = ((n + WARPS * wr - 1) // (WARPS * wr)) * chunks
    return _get_kernel()(inputs=[x, w, scales, biases],
                         template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("WR", wr), ("PR", pr)],
                         grid=(WARP * blocks, WARPS, 1), threadgroup=(WARP, WARPS, 1),
                         output_shapes=[(r, n)], output_dtypes=[x.dtype])[0]


def reference(x, w, scales, biases, bits: int, group_size: int) -> mx.array:
    """The definition: each row alone through MLX's quantized matmul (what a decoding step runs)."""
    return mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, scales, biases, transpose=True,
                                               group_size=group_size, bits=bits) for i in range(x.shape[0])])


# (N, K): K with and without a tail past the last whole sweep of the warp (K % (32 E)), N not a
# multiple of a block's weight rows nor of a warp's; the last one big enough to time. Rows: one
# block's chunk filled and not, several chunks, the last filled and not, the most a pass takes.
CHECK_SHAPES = ((384, 512), (197, 640), (640, 1536), (2048, 2048))
CHECK_ROWS = (2, 3, 4, 6, 8, 9, 16, 64)


def _layer(n: int, k: int, dtype, bits: int, group_size: int, seed: int):
    w = (mx.random.normal((n, k), key=mx.random.key(seed + n * 7919 + k)) * k**-0.5).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def check(dtype, bits: int, group_size: int, rows=CHECK_ROWS, shapes=CHECK_SHAPES, seed: int = 0,
          layout: tuple[int, int] = LAYOUT):
    """On this machine: does the kernel give the one-row bits for every row, and is it faster than
    running the rows one by one? (ok, reason)"""
    view = mx.uint16
    for n, k in shapes:
        wq, scales, biases = _layer(n, k, dtype, bits, group_size, seed)
        for r in rows:
            x = mx.random.normal((r, k), key=mx.random.key(seed + n * 7919 + k + 100 + r)).astype(dtype)
            got = rows_qmatmul(x, wq, scales, biases, bits, group_size, layout)
            want = reference(x, wq, scales, biases, bits, group_size)
            if not mx.all(got.view(view) == want.view(view)).item():
                return False, f"{r} rows of [{n}, {k}] ({bits} bits) differ from the one-row step's bits"
    n, k = shapes[-1]
    wq, scales, biases = _layer(n, k, dtype, bits, group_size, seed + 1)
    x = mx.random.normal((16, k), key=mx.random.key(seed)).astype(dtype)
    ok, fast, slow = faster(lambda: rows_qmatmul(x, wq, scales, biases, bits, group_size, layout),
                            lambda: reference(x, wq, scales, biases, bits, group_size))
    if not ok:
        return False, f"slower than one row at a time ({fast:.3f} vs {slow:.3f} ms, 16 rows of [{n}, {k}])"
    return True, (f"bits equal to the one-row step; 16 rows of [{n}, {k}] {fast:.3f} ms vs {slow:.3f} ms "
                  f"row by row")
