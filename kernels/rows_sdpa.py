"""A verify pass's attention, every row in one call, each row with the bits of the one-row step.

A decoding step's attention (one query, no mask) runs on MLX's CUDA backend as its vector kernel
(`sdpa_vector`, one pass over the keys up to 1,024 of them) except where cuDNN takes it (float16
and bfloat16 past 256 keys, over a cache buffer of whole 256-position steps). That kernel gives a
query a block of 32 warps: warp w takes keys w, w + 32, w + 64, ... in order; its 32 lanes each
hold D / 32 of the query's elements (scaled by scale * log2 e in float), sum their products with a
key's, reduce them across the warp into the score, and keep a running maximum, a running sum of
exp2(score - max) and running outputs, rescaled as the maximum moves; the 32 warps' partial
results are then merged through shared memory (maxima, sums rescaled and added, outputs
transposed and added across the warp) and divided by the sum's correctly rounded reciprocal.

This kernel runs those operations in that order for every row of a pass at once (a block per head
and row), each row over the keys the step would see: the cached ones and the pass rows on its path,
read in place from the pass's key and value buffers through an index map (kernels/attention.py's
_Plan), so a tree row needs no gathered copy. kernels/attention.py sends it the rows the step would
give the vector kernel, and keeps one call per row for the rest.

`reference` is the definition in plain MLX (one attention call per row over its gathered keys: the
step's call); `check` compares the two on this machine (kernels/__init__.py decides from that
whether it runs). CUDA only; head dims 64, 96 and 128 (the vector kernel's); no attention sinks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .rows_matmul import faster

HEAD_DIMS = (64, 96, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
VECTOR_MAX_KEYS = 1024  # past these the vector kernel runs in two passes (another order)
CUDNN_FROM = 256  # float16/bfloat16 steps past this many keys may run cuDNN's kernel instead


def max_keys(dtype) -> int:
    """The most keys a row may see for this kernel to give the step's bits: the vector kernel's one
    pass, and in half precision below the keys where a step may run cuDNN's kernel."""
    return VECTOR_MAX_KEYS if dtype == mx.float32 else CUDNN_FROM - 1


HEADER = "#include <cooperative_groups/reduce.h>\n"

# q: [1, H, R, D], k and v: [1, Hk, S, D] (any strides; the pass's cache slices), keymap: [R, NMAX]
# int32 (row r's i-th key is k[..., keymap[r, i], :]), counts: [R] int32 (keys row r sees; 0 for a
# padding row, which gets zeros), scale: [1] float32; out: [1, H, R, D] row-contiguous. Template:
# T (dtype), D (head dim). grid (32 * 32 * H, R), block (1024): x = head's block, y = row.
SOURCE = """
    constexpr int BN = 32;
    constexpr int VPT = D / 32;
    constexpr double LOG2E = 1.44269504088896340736;
    __shared__ float outputs[BN][32 + 1];
    __shared__ float max_scores[BN];
    __shared__ float sum_exp_scores[BN];
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int wid = warp.meta_group_rank();
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int heads = q_shape[1];
    const int rows = q_shape[2];
    const int gqa = heads / k_shape[1];
    const int kv_head = head / gqa;
    const int nmax = keymap_shape[1];
    const int n = counts[row];
    const float scale_log2 = scale[0] * LOG2E;  // in double, then rounded to float, as the step's
    const T* qp = q + head * q_strides[1] + row * q_strides[2];
    const T* kb = k + kv_head * k_strides[1];
    const T* vb = v + kv_head * v_strides[1];
    float qv[VPT], kv[VPT], o[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        qv[i] = scale_log2 * static_cast<float>(qp[(VPT * lane + i) * q_strides[3]]);
        o[i] = 0.f;
    }
    float max_score = Limits<float>::finite_min();
    float sum_exp = 0.f;
    for (int i = wid; i < n; i += BN) {
        const int64_t pos = keymap[(int64_t)row * nmax + i];
        const T* kp = kb + pos * k_strides[2];
        const T* vp = vb + pos * v_strides[2];
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            kv[j] = kp[(VPT * lane + j) * k_strides[3]];
        }
        float score = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            score += qv[j] * kv[j];
        }
        score = cg::reduce(warp, score, cg::plus<float>());
        float new_max = max(max_score, score);
        float factor = exp2f(max_score - new_max);
        float exp_score = exp2f(score - new_max);
        max_score = new_max;
        sum_exp = sum_exp * factor + exp_score;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            o[j] = o[j] * factor + exp_score * static_cast<float>(vp[(VPT * lane + j) * v_strides[3]]);
        }
    }
    if (lane == 0) {
        max_scores[wid] = max_score;
        sum_exp_scores[wid] = sum_exp;
    }
    block.sync();
    max_score = max_scores[lane];
    float new_max = cg::reduce(warp, max_score, cg::greater<float>());
    float factor = exp2f(max_score - new_max);
    sum_exp = cg::reduce(warp, sum_exp_scores[lane] * factor, cg::plus<float>());
    sum_exp = sum_exp == 0 ? 0 : __frcp_rn(sum_exp);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        outputs[lane][wid] = o[i];
        block.sync();
        float ot = outputs[wid][lane] * factor;
        o[i] = cg::reduce(warp, ot, cg::plus<float>()) * sum_exp;
        block.sync();
    }
    if (lane == 0) {
        T* op = out + ((int64_t)head * rows + row) * D;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            op[VPT * wid + i] = static_cast<T>(o[i]);
        }
    }
"""

_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="cacheback_rows_sdpa",
                                      input_names=["q", "k", "v", "keymap", "counts", "scale"],
                                      output_names=["out"], source=SOURCE, header=HEADER,
                                      ensure_row_contiguous=False)
    return _kernel


def applies(queries: mx.array, keys: mx.array, sinks) -> bool:
    """Whether the kernel takes this pass's attention shape: one sequence, a head dim the vector
    kernel has, grouped heads, no sinks, a dtype it checks."""
    B, H, _, D = queries.shape
    return (B == 1 and sinks is None and D in HEAD_DIMS and keys.shape[-1] == D and H % keys.shape[1] == 0
            and queries.dtype in DTYPES and keys.dtype == queries.dtype)


def rows_sdpa(queries: mx.array, keys: mx.array, values: mx.array, keymap: mx.array, counts: mx.array,
              scale: float) -> mx.array:
    """Attention of each of the R rows of [1, H, R, D] queries over its own keys of [1, Hk, S, D]
    keys and values: row r over keys keymap[r, :counts[r]] in that order -> [1, H, R, D]."""
    _, H, R, D = queries.shape
    return _get_kernel()(inputs=[queries, keys, values, keymap, counts, mx.array([scale], dtype=mx.float32)],
                         template=[("T", queries.dtype), ("D", D)], grid=(1024 * H, R, 1),
                         threadgroup=(1024, 1, 1), output_shapes=[(1, H, R, D)],
                         output_dtypes=[queries.dtype])[0]


def reference(queries, keys, values, keymap, counts, scale: float) -> mx.array:
    """The definition: each row alone through MLX's attention over its keys gathered into an array
    of their own (the vector kernel's call, as a one-row step under CUDNN_FROM keys makes it)."""
    km, n = np.array(keymap), np.array(counts)
    outs = []
    for r in range(queries.shape[2]):
        if n[r] == 0:
            outs.append(mx.zeros_like(queries[:, :, r : r + 1]))
            continue
        idx = mx.array(km[r, : n[r]])
        k, v = mx.take(keys, idx, axis=2), mx.take(values, idx, axis=2)
        outs.append(mx.fast.scaled_dot_product_attention(queries[:, :, r : r + 1], k, v, scale=scale))
    return mx.concatenate(outs, axis=2)


def tree_keymap(cached: int, parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(keymap, counts) for a pass of len(parents) rows after `cached` keys, parents[i] being row
    i's parent row (-1 for a row with none): each row sees every cached key, then the rows on its
    path down to itself, in that order."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    counts = np.array([cached + len(path) for path in paths], np.int32)
    keymap = np.zeros((len(parents), int(counts.max())), np.int32)
    for i, path in enumerate(paths):
        keymap[i, : counts[i]] = np.concatenate([np.arange(cached), cached + np.array(path)])
    return keymap, counts


# (heads, kv heads, cached keys): grouped 3:1 and 4:1, past one warp's 32 keys and several times
# round the 32 warps, and near the most keys a row may have (checked per dtype as max_keys allows)
CHECK_SHAPES = ((9, 3, 40), (8, 2, 200))
CHECK_PARENTS = [-1, 0, 1, 0, 3, 0, 5, 6, 2]  # a root and a tree of 8: chains, branches, depths 1-4


def check(dtype, head_dim: int, seed: int = 0) -> tuple[bool, str]:
    """On this machine: does the kernel give every row the step's bits, and is it faster than a
    call per row? (ok, reason)"""
    for heads, kv_heads, cached in CHECK_SHAPES + ((4, 4, max_keys(dtype) - len(CHECK_PARENTS)),):
        keymap, counts = tree_keymap(cached, CHECK_PARENTS)
        counts[-1] = 0  # a padding row: zeros
        R, S = len(CHECK_PARENTS), cached + len(CHECK_PARENTS)
        key = mx.random.key(seed + heads * 1009 + cached)
        q = mx.random.normal((1, R, heads, head_dim), key=key).astype(dtype).transpose(0, 2, 1, 3)
        buf = mx.random.normal((2, 1, kv_heads, S + 64, head_dim), key=mx.random.key(seed + 7)).astype(dtype)
        k, v = buf[0][:, :, :S], buf[1][:, :, :S]  # slices of a longer buffer, as a cache's
        km, n = mx.array(keymap), mx.array(counts)
        got = rows_sdpa(q, k, v, km, n, head_dim**-0.5)
        want = reference(q, k, v, km, n, head_dim**-0.5)
        if not mx.array_equal(got.view(mx.uint8), want.view(mx.uint8)).item():
            return False, f"rows over {cached} cached keys ({heads}/{kv_heads} heads) differ from the step's bits"
    ok, fast, slow = faster(lambda: rows_sdpa(q, k, v, km, n, head_dim**-0.5),
                            lambda: reference(q, k, v, km, n, head_dim**-0.5))
    if not ok:
        return False, f"slower than a call per row ({fast:.3f} vs {slow:.3f} ms, {R} rows)"
    return True, f"bits equal to the step's; {R} rows in {fast:.3f} ms vs {slow:.3f} ms a call per row"
