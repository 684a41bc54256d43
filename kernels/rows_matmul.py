"""x @ w.T for a pass of a few rows, each row with the bits of the one-row step (MLX's CUDA gemv).

A decoding step multiplies ONE row by each weight matrix, and MLX's CUDA backend runs that as its
matrix-vector kernel (gemv: a warp per weight row; lane l sums columns l*n, l*n+32n, ... n at a
time with float accumulation, then a warp reduce). A verify pass of R rows goes to cuBLAS, whose
tiles sum in another order: the same logits differ in the last bits, and in float16/bfloat16 near
ties flip (docs/BENCHMARKS.md §15). This kernel runs the gemv's exact sequence of float operations
for each of R rows while reading each weight once: lane l loads its weight elements, then adds
their products with each row's elements into that row's own sum, in the gemv's order; each sum is
then reduced across the warp as the gemv does. Each row thus gets the bits the one-row step gives.

`reference` is the definition in plain MLX (one matmul per row: the gemv itself); `check` compares
the kernel with it on this machine (kernels/__init__.py decides from that whether it runs).
CUDA only: Metal's gemv sums in another order (no Metal version yet).
"""

from __future__ import annotations

import time

import mlx.core as mx

MAX_ROWS = 64  # the largest pass it takes (the GPU's draft budget 63 + the root)
WARP, ROWS_PER_BLOCK = 32, 8  # as MLX's gemv: a warp per weight row, 8 warps a block

HEADER = "#include <cooperative_groups/reduce.h>\n"

# x: [R, K], w: [N, K] (both row-contiguous), out: [R, N]; template T (dtype) and RMAX (the most rows
# this build takes). Read at run time: R (x's rows, R <= RMAX) and the columns a lane loads at
# once, NPT: 4 when K % 128 == 0, 2 when K % 64 == 0, else 1, as the gemv chooses them. A row's sum
# sees the same float operations in the same order whatever RMAX is (rows past R are skipped,
# never computed) and whether NPT is fixed at build time or read at run time.
SOURCE = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int n_rows = w_shape[0];
    const int cols = w_shape[1];
    const int rows = x_shape[0];
    const int npt = (cols % 128 == 0) ? 4 : ((cols % 64 == 0) ? 2 : 1);
    const int row = blockIdx.x * 8 + threadIdx.y;
    if (row < n_rows) {
        float sums[RMAX];
#pragma unroll
        for (int r = 0; r < RMAX; ++r) {
            sums[r] = 0.0f;
        }
        const T* wrow = w + (size_t)row * cols;
        for (int col = npt * warp.thread_rank(); col < cols; col += 32 * npt) {
            float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j < npt) {
                    m[j] = static_cast<float>(wrow[col + j]);
                }
            }
#pragma unroll
            for (int r = 0; r < RMAX; ++r) {
                if (r < rows) {
                    const T* xr = x + (size_t)r * cols + col;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (j < npt) {
                            sums[r] += m[j] * static_cast<float>(xr[j]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RMAX; ++r) {
            if (r < rows) {  // the same for the whole warp: every lane takes part in the reduce
                float s = cg::reduce(warp, sums[r], cg::plus<float>());
                if (warp.thread_rank() == 0) {
                    out[(size_t)r * n_rows + row] = static_cast<T>(s);
                }
            }
        }
    }
"""

# MLX compiles each template instance of a custom CUDA kernel with NVRTC in every process (~2 s
# each on an H100 host; it keeps only its own kernels on disk), so only the dtype and a bound on
# the rows are template parameters: two builds a dtype take every pass of 2-64 rows at any lane
# width, and `check` compiles both before the first pass instead of one per row count and lane
# width in the middle of a decoding.
RMAX_BUILDS = (8, MAX_ROWS)


def rmax(rows: int) -> int:
    """The build that takes a pass of `rows` rows: the smallest of RMAX_BUILDS that holds them."""
    return next(b for b in RMAX_BUILDS if rows <= b)


_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="cacheback_rows_gemv", input_names=["x", "w"], output_names=["out"],
                                      source=SOURCE, header=HEADER)
    return _kernel


def lane_width(k: int) -> int:
    """Columns a lane loads at once, as MLX's gemv chooses them (its inputs are aligned); the
    kernel works it out from K the same way."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def gemv_applies(w: mx.array) -> bool:
    """Whether MLX's CUDA backend runs one row times w.T as its gemv (`can_use_gemv`: K a multiple
    of 32), whose bits this kernel gives; elsewhere the one-row step runs cuBLAS."""
    return w.shape[-1] % 32 == 0


def rows_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [R, K] @ w [N, K].T -> [R, N] on a CUDA GPU, 1 <= R <= MAX_ROWS, float16/bfloat16/float32."""
    r, n = x.shape[0], w.shape[0]
    return _get_kernel()(inputs=[x, w], template=[("T", x.dtype), ("RMAX", rmax(r))],
                         grid=(WARP * ((n + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK), ROWS_PER_BLOCK, 1),
                         threadgroup=(WARP, ROWS_PER_BLOCK, 1), output_shapes=[(r, n)], output_dtypes=[x.dtype])[0]


def reference(x: mx.array, w: mx.array) -> mx.array:
    """The definition: each row alone through MLX's one-row matmul (what a decoding step runs)."""
    return mx.concatenate([x[i : i + 1] @ w.T for i in range(x.shape[0])], axis=0)


def _ms(fn) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0)


def faster(fast, slow, repeats: int = 15, tries: int = 3) -> tuple[bool, float, float]:
    """Whether fast() takes less time than slow() on this machine: (verdict, fast ms, slow ms), the
    median of `repeats` calls each, the two called in turns after one call each to warm up, measured
    again up to `tries` times before fast() is called the slower. A first check in a process (a GPU
    raising its clocks, an allocator filling) once timed a kernel at 0.284 ms against 0.164 ms row
    by row, where the next process timed it at 0.131 against 0.209: one measurement is not a verdict."""
    mx.eval(fast())
    mx.eval(slow())
    for _ in range(tries):
        a, b = [], []
        for _ in range(repeats):
            a.append(_ms(fast))
            b.append(_ms(slow))
        f, s = sorted(a)[repeats // 2], sorted(b)[repeats // 2]
        if f < s:
            return True, f, s
    return False, f, s


# (N, K): a lane width of 2, 4 and 1 (the last N filling no block of 8), and one big enough to time;
# rows: both builds, full and not
CHECK_SHAPES = ((384, 576), (640, 1536), (196, 224), (2048, 2048))
CHECK_ROWS = (2, 5, 8, 16, 64)


def check(dtype, rows=CHECK_ROWS, shapes=CHECK_SHAPES, seed: int = 0) -> tuple[bool, str]:
    """On this machine: does the kernel give the one-row bits for every row, and is it faster than
    running the rows one by one? (ok, reason)"""
    key = mx.random.key(seed)
    for n, k in shapes:
        w = (mx.random.normal((n, k), key=mx.random.key(seed + n * 7919 + k)) * k**-0.5).astype(dtype)
        for r in rows:
            x = mx.random.normal((r, k), key=mx.random.key(seed + n * 7919 + k + 100 + r)).astype(dtype)
            got, want = rows_matmul(x, w), reference(x, w)
            same = mx.all(got.view(mx.uint16 if dtype != mx.float32 else mx.uint32)
                          == want.view(mx.uint16 if dtype != mx.float32 else mx.uint32)).item()
            if not same:
                return False, f"{r} rows of [{n}, {k}] differ from the one-row step's bits"
    n, k = shapes[-1]
    w = mx.random.normal((n, k), key=key).astype(dtype)
    x = mx.random.normal((16, k), key=key).astype(dtype)
    ok, fast, slow = faster(lambda: rows_matmul(x, w), lambda: reference(x, w))
    if not ok:
        return False, f"slower than one row at a time ({fast:.3f} vs {slow:.3f} ms, 16 rows of [{n}, {k}])"
    return True, f"bits equal to the one-row step; 16 rows of [{n}, {k}] {fast:.3f} ms vs {slow:.3f} ms row by row"
