"""The exact-rows matmul (kernels/) on a CUDA GPU: bits and speed by rows, and what a verify pass
of several rows gives against one-row decoding steps, kernels on and off.

    python -m tools.ab.gpu_rows [--model M] [--dtypes float16,bfloat16] [--rows 1,2,4,8,16,32,64]
        [--pass-cost float16] [--qbits 4,8] [--long-prompt N]

1. Per weight shape (the default model's, and an 8B model's) and rows R: ms of one R-row product
   through MLX's matmul (cuBLAS past one row) and through the kernel, and how many of the R rows
   have the one-row step's bits (`x[i:i+1] @ w.T`, MLX's gemv).
2. Per dtype: a prompt prefilled, then T tokens fed one at a time (plain decoding) vs the same T
   tokens in one pass: rows whose logits have equal bits, the largest difference, equal argmax;
   where a chain's rows differ, the first layer whose keys or values for them differ.
   --long-prompt N adds a prompt of ~N tokens: past 256 keys MLX gives a one-row step cuDNN's
   attention when its keys are a slice of a cache buffer whose length is a multiple of 256 (its
   `use_cudnn_for_decoding`), and its own vector kernel otherwise, so a tree row's gathered keys
   (an array of their own length) would take the other kernel: row-by-row attention lays each
   row's keys, past 256 of them, out as a slice of ceil(n / 256) * 256 places (the buffer mlx-lm's
   step has at that length), and the variant "keys of their own length" shows the rows without
   that. Then: one query over the same 300 keys laid out as slices of buffers of 512, 768 and 556
   positions, and as an array of their own: which give the bits of the 512 one; and over the 512
   one, a query laid out as a pass row's (a view into T rows) and as kernels/attention.step_query
   lays it out: which give a step's bits (cuDNN's plan there depends on the query's strides too).
3. With --pass-cost: ms of a whole verify pass by rows: kernels off, matmul only, both with the
   attention rows a call each, and in one call (rows_sdpa).
4. With --qbits 4,8: table 1 for quantized weights (an 8B model's layers and head, groups of 64),
   MLX's quantized matmul against kernels/rows_qmatmul.py. With --model random:NAME:q4 the passes
   of 2. run on quantized layers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import cacheback_mlx  # noqa: F401 - first: it sets MLX's environment (blas.py, TF32)

import click
import numpy as np

SHAPES = {"135M": ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)),
          "8B": ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))}


def _per_op_ms(mx, make, ops: int = 20, repeats: int = 7) -> float:
    """ms per product: `ops` independent products evaluated together (launch gaps hidden as in a
    pass), the median of `repeats`."""
    mx.eval(make(0))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([make(i) for i in range(ops)])
        times.append((time.perf_counter() - t0) / ops)
    return 1e3 * sorted(times)[len(times) // 2]


def matmul_table(mx, kernels, dtypes, rows):
    from cacheback_mlx.kernels import rows_matmul

    print("| dtype | model | [N, K] | rows | MLX ms | kernel ms | one row ms | MLX rows exact | kernel rows exact |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in dtypes:
        view = mx.uint32 if dtype == mx.float32 else mx.uint16
        for model, shapes in SHAPES.items():
            for n, k in shapes:
                key = mx.random.key(n + k)
                w = (mx.random.normal((n, k), key=key) * k**-0.5).astype(dtype)
                ones = [mx.random.normal((1, k), key=mx.random.key(i)).astype(dtype) for i in range(20)]
                mx.eval(ones)
                one = _per_op_ms(mx, lambda i: ones[i] @ w.T)
                for r in rows:
                    xs = [mx.random.normal((r, k), key=mx.random.key(1000 + i)).astype(dtype) for i in range(20)]
                    mx.eval(xs)
                    ref = rows_matmul.reference(xs[0], w)
                    plain = xs[0] @ w.T
                    fast = rows_matmul.rows_matmul(xs[0], w)
                    same_plain = mx.all(plain.view(view) == ref.view(view), axis=1).sum().item()
                    same_fast = mx.all(fast.view(view) == ref.view(view), axis=1).sum().item()
                    t_plain = _per_op_ms(mx, lambda i: xs[i] @ w.T)
                    t_fast = _per_op_ms(mx, lambda i: rows_matmul.rows_matmul(xs[i], w))
                    print(f"| {dtype} | {model} | [{n}, {k}] | {r} | {t_plain:.4f} | {t_fast:.4f} | {one:.4f} | "
                          f"{same_plain}/{r} | {same_fast}/{r} |", flush=True)


QSHAPES = SHAPES["8B"] + ((128256, 4096),)  # an 8B model's layers and its output head


QLAYOUTS = ((2, 4), (1, 8), (4, 4))  # (weight rows a warp takes, pass rows a block takes); the first: the default


def qmatmul_table(mx, dtypes, rows, bits_list, group_size: int = 64):
    """The same for quantized weights (mlx-lm's affine layout): MLX's quantized matmul of R rows
    (its one-row qmv below 8 rows, its tiled kernel from 8) against the exact-rows kernel in each
    of QLAYOUTS (ms; rows with the one-row bits)."""
    from cacheback_mlx.kernels import rows_qmatmul

    names = [f"kernel {wr}x{pr}" for wr, pr in QLAYOUTS]
    print("| dtype | bits | [N, K] | rows | one row ms | MLX ms | " + " | ".join(f"{n} ms" for n in names)
          + " | MLX rows exact | " + " | ".join(f"{n} exact" for n in names) + " |")
    print("|---|---:|---|---:|---:|---:|" + "---:|" * (2 * len(names) + 1))
    for dtype in dtypes:
        for bits in bits_list:
            for n, k in QSHAPES:
                w = (mx.random.normal((n, k), key=mx.random.key(n + k)) * k**-0.5).astype(dtype)
                layer = mx.quantize(w, group_size=group_size, bits=bits)
                del w

                def mlx(x):
                    return mx.quantized_matmul(x, *layer, transpose=True, group_size=group_size, bits=bits)

                ones = [mx.random.normal((1, k), key=mx.random.key(i)).astype(dtype) for i in range(20)]
                mx.eval(layer, ones)
                one = _per_op_ms(mx, lambda i: mlx(ones[i]))
                for r in rows:
                    xs = [mx.random.normal((r, k), key=mx.random.key(1000 + i)).astype(dtype) for i in range(20)]
                    mx.eval(xs)
                    ref = rows_qmatmul.reference(xs[0], *layer, bits, group_size).view(mx.uint16)

                    def exact(out):
                        return f"{mx.all(out.view(mx.uint16) == ref, axis=1).sum().item()}/{r}"

                    times, same = [_per_op_ms(mx, lambda i: mlx(xs[i]))], [exact(mlx(xs[0]))]
                    for lay in QLAYOUTS:
                        times.append(_per_op_ms(mx, lambda i: rows_qmatmul.rows_qmatmul(xs[i], *layer, bits,
                                                                                          group_size, lay)))
                        same.append(exact(rows_qmatmul.rows_qmatmul(xs[0], *layer, bits, group_size, lay)))
                    print(f"| {dtype} | {bits} | [{n}, {k}] | {r} | {one:.4f} | "
                          + " | ".join(f"{t:.4f}" for t in times) + " | " + " | ".join(same) + " |", flush=True)


PROMPTS = ("def fibonacci(n):\n    ", "The capital of France is",
           "Write a short story about a robot who learns to paint.")
VARIANTS = (("off", False, False, False), ("matmul", True, False, False),
            ("matmul+attention, a call per row", True, True, False), ("matmul+attention", True, True, True),
            ("matmul+attention, keys of their own length", True, True, True))
STEP = 256  # mlx-lm's KVCache grows its buffers in steps of this many positions


def long_text(tokens: int) -> str:
    """About `tokens` tokens of plain prose (the default model's tokenizer: ~1.05 a word)."""
    words = ("The river ran past the old mill and the children counted the boats that went by each "
             "morning before school. ").split()
    return " ".join(words[i % len(words)] for i in range(int(tokens / 1.05)))


@contextmanager
def own_length_layout(attention):
    """Each row's keys as an array of their own length (kernels/attention.py before it laid rows past
    256 keys out as the step's cache slice)."""
    attention.set_cache_layout(False)
    try:
        yield
    finally:
        attention.set_cache_layout(True)


def _equal_rows(mx, one, many):
    one, many = one.astype(mx.float32), many.astype(mx.float32)
    equal = mx.all(one == many, axis=1).sum().item()
    argmax = (mx.argmax(one, axis=1) == mx.argmax(many, axis=1)).sum().item()
    return equal, mx.abs(one - many).max().item(), argmax


def first_differing_layer(mx, steps, cache, cached: int, rows: int, label: str) -> None:
    """Where a pass's rows part from the steps': the first layer whose keys or values for the
    pass's positions (written by the pass, and by one step each) differ, and in which rows; the
    keys of a layer follow from the layer below's output, so a difference starting there with
    equal keys below lies in that layer's attention or feed-forward of the layer before."""
    for i, (a, b) in enumerate(zip(steps, cache)):
        for what, x, y in (("keys", a.keys, b.keys), ("values", a.values, b.values)):
            x, y = x[..., cached : cached + rows, :], y[..., cached : cached + rows, :]
            if not mx.array_equal(x, y).item():
                differ = mx.any(x != y, axis=(0, 1, 3)).tolist()
                print(f"  ({label}: layer {i}'s {what} differ first, rows {[r for r, d in enumerate(differ) if d]})")
                return
    print(f"  ({label}: every layer's keys and values equal: the last layer's attention, feed-forward or head)")


def pass_rows(mx, kernels, lm_name, dtypes, chain_len: int = 8, prompts=PROMPTS):
    """A chain pass (mlx-lm's caches) and a tree pass (the engine's verify_pass) against one-row
    steps, with the kernels off, the matmul on, and the matmul and row-by-row attention on."""
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.kernels import attention as rows_attention
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    from mlx_lm.models.cache import make_prompt_cache

    print(f"\n{lm_name or 'default model'}: a prompt, then tokens one at a time vs in one pass")
    print("| dtype | kernels | pass | prompt | rows with equal bits | max abs diff | equal argmax |")
    print("|---|---|---|---:|---:|---:|---:|")
    tree = DraftTree(np.array([11, 12, 13, 14, 15, 16, 17]), np.array([-1, 0, 1, -1, 3, 0, 5]))
    paths = [tree_path(tree, i) for i in range(len(tree))]
    for dtype in dtypes:
        lm = load_cached(lm_name, str(dtype).split(".")[-1])
        model = lm.model
        kernels.attach(model)
        ModelCache(model)  # routes the model's attention through the engine's (attention.install)
        for name, on, attention, sdpa in VARIANTS:
            kernels.set_enabled(on, attention, sdpa)
            layout = (lambda: own_length_layout(rows_attention)) if "own length" in name else nullcontext
            for p, prompt in enumerate(prompts):
                ids = lm.tokenizer.encode(prompt)
                chain = [(ids[-1] * 7 + 13 * i) % 1000 + 100 for i in range(chain_len)]
                steps = make_prompt_cache(model)
                model(mx.array(ids)[None], cache=steps)
                one = mx.stack([model(mx.array([[t]]), cache=steps)[0, -1] for t in chain])
                cache = make_prompt_cache(model)
                model(mx.array(ids)[None], cache=cache)
                with kernels.rows_pass(), layout():
                    many = model(mx.array(chain)[None], cache=cache)[0]
                    mx.eval(many)
                e, d, a = _equal_rows(mx, one, many)
                print(f"| {dtype} | {name} | chain | {p} | {e}/{chain_len} | {d:.3g} | {a}/{chain_len} |", flush=True)
                if e < chain_len:
                    first_differing_layer(mx, steps, cache, len(ids), chain_len, f"{name}, chain, prompt {p}")
                # a tree: the root (the prompt's last token) and 7 nodes on 3 branches
                ours = ModelCache(model)
                prefill(model, ours, ids[:-1])
                with layout():
                    got = verify_pass(model, ours, [ids[-1]], tree)
                    mx.eval(got)
                want = []
                for path in [[]] + paths:
                    ref = make_prompt_cache(model)
                    model(mx.array(ids[:-1])[None], cache=ref)
                    for t in [ids[-1]] + [int(tree.tokens[j]) for j in path]:
                        last = model(mx.array([[t]]), cache=ref)[0, -1]
                    want.append(last)
                e, d, a = _equal_rows(mx, mx.stack(want), got)
                print(f"| {dtype} | {name} | tree | {p} | {e}/{len(want)} | {d:.3g} | {a}/{len(want)} |", flush=True)
        kernels.set_enabled(True, True, True)
    from cacheback_mlx.kernels import attention

    print(f"attention rows grouped by length: {attention.grouping.ok} ({attention.grouping.checked} passes checked)")


def layout_bits(mx, dtypes, n: int = 300):
    """One query over n keys: a slice of a buffer of ceil(n / STEP) * STEP positions (mlx-lm's
    step), of one STEP more (after a pass rolled back), of a length no multiple of STEP, and the
    keys as an array of their own: which give the first's bits."""
    room = -(-n // STEP) * STEP
    print(f"\none query over {n} keys laid out as: bits equal to those over a slice of a {room} buffer?")
    print(f"| dtype | slice of {room + STEP} | slice of {n + STEP} | own array |")
    print("|---|---|---|---|")
    for dtype in dtypes:
        q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(1)).astype(dtype)
        kv = mx.random.normal((2, 1, 3, n, 64), key=mx.random.key(2)).astype(dtype)

        def over(capacity):
            if capacity is None:
                k, v = kv[0] + 0, kv[1] + 0
            else:
                bufs = [mx.zeros((1, 3, capacity, 64), dtype=dtype) for _ in range(2)]
                for b, x in zip(bufs, kv):
                    b[..., :n, :] = x
                mx.eval(bufs)
                k, v = bufs[0][..., :n, :], bufs[1][..., :n, :]
            mx.eval(k, v)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
            mx.eval(out)
            return out

        ref = over(room)
        same = [mx.array_equal(over(c), ref).item() for c in (room + STEP, n + STEP, None)]
        print(f"| {dtype} | " + " | ".join("equal" if e else "differ" for e in same) + " |", flush=True)
    query_layout_bits(mx, dtypes, n, room)


def query_layout_bits(mx, dtypes, n: int, room: int, rows: int = 8):
    """One query over n keys in a slice of a `room` buffer (a step's keys past STEP: cuDNN on CUDA),
    the query laid out as a step's ([1, 1, H, D] seen as [1, H, 1, D]), as a view of row i of a
    pass's [1, H, T, D] queries, and as kernels/attention.step_query lays that row out: which
    give the step's bits."""
    from cacheback_mlx.kernels.attention import step_query

    print(f"\none query over {n} keys (a slice of a {room} buffer): a pass row's query gives the step's bits?")
    print("| dtype | row | pass row's view | step_query |")
    print("|---|---:|---|---|")
    for dtype in dtypes:
        qs = mx.random.normal((1, rows, 9, 64), key=mx.random.key(3)).astype(dtype)
        kv = mx.random.normal((2, 1, 3, n, 64), key=mx.random.key(4)).astype(dtype)
        bufs = [mx.zeros((1, 3, room, 64), dtype=dtype) for _ in range(2)]
        for b, x in zip(bufs, kv):
            b[..., :n, :] = x
        mx.eval(bufs, qs)
        k, v = bufs[0][..., :n, :], bufs[1][..., :n, :]
        passed = qs.transpose(0, 2, 1, 3)  # [1, H, T, D]: a pass's queries, as the model lays them out
        for i in (0, rows // 2, rows - 1):
            step = mx.array(qs[:, i : i + 1]).transpose(0, 2, 1, 3)  # a step's own [1, 1, H, D] projection
            want = mx.fast.scaled_dot_product_attention(step, k, v, scale=0.125)
            got = [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
                   for q in (passed[:, :, i : i + 1], step_query(passed, i))]
            mx.eval(want, *got)
            print(f"| {dtype} | {i} | " + " | ".join("equal" if mx.array_equal(g, want).item() else "differ"
                                                    for g in got) + " |", flush=True)


def tree_path(tree, i: int) -> list[int]:
    """Node indices from the root's child down to node i."""
    path = []
    while i >= 0:
        path.append(i)
        i = int(tree.parents[i])
    return path[::-1]


def engine_vs_mlx_lm(mx, lm_name, dtype):
    """The engine's prefill and one-row pass against mlx-lm's on the same prompt: cached keys and
    logits with equal bits (where plain decoding with `none` could part from mlx-lm)."""
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    from mlx_lm.models.cache import make_prompt_cache

    lm = load_cached(lm_name, dtype)
    model = lm.model
    print(f"\nengine vs mlx-lm, {dtype}: prefill all but the last token, then one row")
    print("| prompt | tokens | layers with equal keys | equal values | logits equal bits | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p, prompt in enumerate(PROMPTS + ("Summarize: " + "the quick brown fox jumps over the lazy dog. " * 40,)):
        ids = lm.tokenizer.encode(prompt)
        ref = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=ref)
        want = model(mx.array([ids[-1:]]), cache=ref)[0, -1]
        ours = ModelCache(model)
        prefill(model, ours, ids[:-1])
        got = verify_pass(model, ours, [ids[-1]], DraftTree.empty())[0]
        n = len(ids)
        ks = vs = 0
        for a, b in zip(ref, ours.layers):
            ks += mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
            vs += mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()
        same = mx.array_equal(want, got).item()
        diff = mx.abs(want.astype(mx.float32) - got.astype(mx.float32)).max().item()
        print(f"| {p} | {n} | {ks}/{len(ref)} | {vs}/{len(ref)} | {same} | {diff:.3g} |", flush=True)


def pass_cost(mx, kernels, lm_name, dtype, rows, cached: int = 512, repeats: int = 7):
    """ms of one verify pass (a draft tree of r rows: the root and r - 1 nodes, 4 to a level)
    after `cached` tokens, kernels off, matmul only, matmul + row-by-row attention; the median of
    `repeats`, the three interleaved so a busy spell hits them alike."""
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    lm = load_cached(lm_name, dtype)
    model = lm.model
    kernels.attach(model)
    cache = ModelCache(model)
    prefill(model, cache, [(100 + i) % 5000 for i in range(cached)])
    print(f"\n{lm.name}, {dtype}: ms of one verify pass after {cached} cached tokens (median of {repeats})")
    print("| rows | off | matmul | matmul + attention, a call per row | matmul + attention |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        n = r - 1
        tree = DraftTree(np.arange(n) % 50 + 200, np.array([i // 4 - 1 if i >= 4 else -1 for i in range(n)])
                         if n else np.zeros(0, np.int32))
        variants = [v for v in VARIANTS if "own length" not in v[0]]
        times = {v[0]: [] for v in variants}
        for _ in range(repeats + 1):
            for name, on, attention, sdpa in variants:
                kernels.set_enabled(on, attention, sdpa)
                t0 = time.perf_counter()
                mx.eval(verify_pass(model, cache, [7], tree))
                times[name].append(time.perf_counter() - t0)
                cache.trim(cached)
        med = {k: 1e3 * sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}  # the first: warm-up
        print(f"| {r} | " + " | ".join(f"{med[v[0]]:.2f}" for v in variants) + " |", flush=True)
    kernels.set_enabled(True, True, True)


@click.command()
@click.option("--model", "-m", default=None)
@click.option("--dtypes", default="float16,bfloat16")
@click.option("--rows", default="1,2,4,8,16,32,64")
@click.option("--skip-matmul", is_flag=True)
@click.option("--matmul-dtypes", default=None, help="dtypes of the matmul table (default: --dtypes)")
@click.option("--pass-cost", "pass_cost_dtype", default=None, help="also time whole verify passes in this dtype")
@click.option("--long-prompt", default=0, show_default=True, help="also a prompt of about this many tokens")
@click.option("--qbits", default="", help="also the quantized matmul table at these bits (comma list: 4,8)")
def main(model, dtypes, rows, skip_matmul, matmul_dtypes, pass_cost_dtype, long_prompt, qbits):
    from cacheback_mlx import kernels

    import mlx.core as mx

    dts = [getattr(mx, d) for d in dtypes.split(",")]
    print(kernels.describe(), flush=True)
    if not skip_matmul:
        try:
            matmul_table(mx, kernels, [getattr(mx, d) for d in (matmul_dtypes or dtypes).split(",")],
                         [int(r) for r in rows.split(",")])
        except Exception as e:  # noqa: BLE001 - report it and go on to the passes
            print(f"matmul table stopped: {type(e).__name__}: {e}")
    if qbits:
        try:
            qmatmul_table(mx, [getattr(mx, d) for d in (matmul_dtypes or dtypes).split(",")],
                          [int(r) for r in rows.split(",")], [int(b) for b in qbits.split(",")])
        except Exception as e:  # noqa: BLE001 - report it and go on to the passes
            print(f"quantized matmul table stopped: {type(e).__name__}: {e}")
    prompts = PROMPTS + ((long_text(long_prompt),) if long_prompt else ())
    steps = [lambda: pass_rows(mx, kernels, model, dts, prompts=prompts), lambda: layout_bits(mx, dts),
             lambda: engine_vs_mlx_lm(mx, model, "float16")]
    if pass_cost_dtype:
        steps.append(lambda: pass_cost(mx, kernels, model, pass_cost_dtype, [int(r) for r in rows.split(",")]))
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - report it and go on
            import traceback

            traceback.print_exc()
            print(f"stopped: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
