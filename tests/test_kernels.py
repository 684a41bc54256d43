"""kernels/: the exact-rows matmul and row-by-row attention of verify passes on a CUDA GPU.

On this CPU the kernels never run (the engine keeps MLX's own ops); what can be checked here is
that routing leaves everything else alone and that the row-by-row attention is the attention.
The checks that need CUDA run only where MLX has it."""

from cacheback_mlx import kernels
from cacheback_mlx.kernels import attention as rows_attention
from cacheback_mlx.kernels import linear, plain_attention, rows_matmul, rows_qmatmul, rows_sdpa
from cacheback_mlx.positions import TreePass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map_with_path

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16, bias=False)
        self.biased = nn.Linear(16, 8)

    def __call__(self, ids):
        h = self.embed(ids)
        return self.embed.as_linear(self.proj(h)), self.biased(h)


def test_convert_keeps_parameters_and_outputs():
    mx.random.seed(0)
    model = Tiny()
    before = dict(tree_flatten(model.parameters()))
    ids = mx.array([[1, 2, 3, 4]])
    want = model(ids)
    kinds = linear.convert(model)
    assert sorted(kinds, key=str) == sorted([mx.float32, mx.float32, ("biased", mx.float32)], key=str)
    assert isinstance(model.proj, linear.RowsLinear) and isinstance(model.biased, linear.RowsBiasedLinear)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    if mx.cuda.is_available():  # the kernels run there: a pass's rows get the one-row call's bits
        rows = [model(ids[:, i : i + 1]) for i in range(ids.shape[1])]
        want = [mx.concatenate([r[j] for r in rows], axis=1) for j in range(2)]
    with kernels.rows_pass():
        got = model(ids)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    assert linear.convert(model) == []  # converting again changes nothing


@pytest.mark.skipif(mx.cuda.is_available(), reason="on CUDA the kernel does run")
def test_kernels_stay_off_without_cuda():
    x, w = mx.ones((4, 16)), mx.ones((8, 16))
    with kernels.rows_pass():
        assert kernels.exact_rows(x, w) is None
        assert kernels.rows_attention(None, mx.ones((1, 2, 4, 8)), None, None, None, 1.0, "causal", None) is None
    assert "none on this device" in kernels.describe()
    q = mx.ones((1, 2, 4, 8), dtype=mx.float16)
    with kernels.rows_pass():
        assert kernels.pass_attention(q, q, q, 1.0, "causal", None) is None  # MLX's own here


@cuda
def test_half_precision_passes_on_cuda_take_the_plain_attention():
    q = mx.random.normal((1, 4, 8, 64)).astype(mx.float16)
    k = mx.random.normal((1, 4, 300, 64)).astype(mx.float16)
    with kernels.rows_pass():
        got = kernels.pass_attention(q, k, k, 0.125, "causal", None)
    assert got is not None and kernels.pass_attention(q, k, k, 0.125, "causal", None) is None  # passes only
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-2).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_pass_attention_is_mlx_attention_bit_for_bit(dtype):
    """The composition that replaces cuDNN in CUDA's half-precision verify passes gives the bits of
    MLX's attention on the CPU (which runs its own composition there): grouped heads, every kind
    of mask a pass hands it. Both on the CPU wherever the test runs (a GPU's attention kernels sum
    in other orders)."""
    with mx.stream(mx.cpu):
        _compare_with_mlx_attention(dtype)


def _compare_with_mlx_attention(dtype):
    T, S, D = 7, 40, 64
    keep = mx.random.uniform(shape=(T, S), key=mx.random.key(5)) > 0.3
    keep = mx.concatenate([keep[:, :-1], mx.ones((T, 1), dtype=mx.bool_)], axis=1)  # a row sees a key
    for heads, kv_heads in ((9, 3), (4, 4), (8, 1)):
        q, k, v = (mx.random.normal((1, h, n, D), key=mx.random.key(i)).astype(dtype)
                   for i, (h, n) in enumerate(((heads, T), (kv_heads, S), (kv_heads, S))))
        masks = {"none": None, "causal": "causal", "bool [T, S]": keep, "bool [1, 1, T, S]": keep[None, None],
                 "bool per head": mx.broadcast_to(keep, (1, heads, T, S)),
                 "additive": mx.where(keep, 0.0, -1e4).astype(dtype)}
        for name, mask in masks.items():
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            got = plain_attention.attention(q, k, v, 0.125, mask)
            assert got.shape == want.shape and mx.array_equal(got, want).item(), (dtype, heads, kv_heads, name)


def _attention_inputs(rows, cached, seed=0):
    k = mx.random.key(seed)
    q = mx.random.normal((1, 4, rows, 32), key=k)
    keys = mx.random.normal((1, 2, cached + rows, 32), key=mx.random.key(seed + 1))
    values = mx.random.normal((1, 2, cached + rows, 32), key=mx.random.key(seed + 2))
    return q, keys, values


def _masked(q, keys, values, seen):
    """The pass's own attention with its full mask (what rows_attention replaces)."""
    rows, cached = q.shape[2], keys.shape[2] - q.shape[2]
    mask = mx.array(np.concatenate([np.ones((rows, cached), bool), seen], axis=1))
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=32**-0.5, mask=mask)


def _stock(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):
    assert mask is None and q.shape[2] == 1  # each row as a decoding step: one query, no mask
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


class TreeCache:
    def __init__(self, host):
        self.tree_pass = TreePass()
        self.tree_pass.set(None, None, host=host)


def test_rows_attention_is_the_attention_of_a_chain_and_a_tree():
    q, keys, values = _attention_inputs(rows=6, cached=20)
    chain = rows_attention.rows_attention(_stock, q, keys, values, None, 32**-0.5, "causal", None)
    assert mx.allclose(chain, _masked(q, keys, values, np.tril(np.ones((6, 6), bool))), atol=1e-5).item()
    # root, two children of the root, a grandchild under the second, and a padding row (sees the root)
    seen = np.eye(6, dtype=bool)
    seen[1:, 0] = True
    seen[4, 2] = True
    tree = rows_attention.rows_attention(_stock, q, keys, values, TreeCache(seen), 32**-0.5,
                                         mx.array(seen), None)
    assert mx.allclose(tree, _masked(q, keys, values, seen), atol=1e-5).item()


def test_a_pass_works_out_what_its_rows_see_once_for_all_its_layers(monkeypatch):
    """Every layer of a pass sees the same rows: their key indices are built once a pass (not once
    a layer), and a pass that sees other rows, or more cached keys, gets its own."""
    built = []
    real_keys_seen = rows_attention._keys_seen
    monkeypatch.setattr(rows_attention, "_keys_seen", lambda *a: built.append(a[1]) or real_keys_seen(*a))
    monkeypatch.setattr(rows_attention.grouping, "ok", False)  # row by row
    q, keys, values = _attention_inputs(rows=6, cached=20, seed=4)
    one = np.eye(6, dtype=bool)
    one[1:, 0] = True
    other = one.copy()
    other[5, 3] = True  # another tree of the same size
    for seen in (one, one, one, other, one):
        got = rows_attention.rows_attention(_stock, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen), None)
        assert mx.allclose(got, _masked(q, keys, values, seen), atol=1e-5).item()
    assert built == [2, 3, 4, 5] * 3  # rows 2..5 are gathered (row 1 sees rows 0..1: a slice); 3 plans
    q2, keys2, values2 = _attention_inputs(rows=6, cached=21, seed=5)  # one key more: a new plan
    got = rows_attention.rows_attention(_stock, q2, keys2, values2, TreeCache(one), 32**-0.5, mx.array(one), None)
    assert mx.allclose(got, _masked(q2, keys2, values2, one), atol=1e-5).item() and len(built) == 16


def test_rows_past_256_keys_read_a_slice_of_a_buffer_of_whole_256_steps(monkeypatch):
    """Past 256 keys MLX on CUDA picks a one-query attention kernel by the keys' buffer (cuDNN for a
    slice of a buffer of whole 256-position steps): each row reads its keys as the one-row step
    reads its cache, a slice of a buffer of the fewest whole steps that hold them: the pass's own
    where it has that length, else its keys gathered into one. The values are the pass's own."""
    monkeypatch.setattr(rows_attention.grouping, "ok", False)
    q, keys, values = _attention_inputs(rows=6, cached=300, seed=6)
    seen = np.eye(6, dtype=bool)
    seen[1:, 0] = True
    seen[4, 2] = True
    chain = np.tril(np.ones((6, 6), bool))

    class Cache(TreeCache):
        def __init__(self, host, length):
            super().__init__(host)
            self.keys = mx.zeros((1, 2, length, 32))  # the pass's buffer: keys is a slice of it

    def layout(mask, host, length):
        got = rows_attention.rows_attention(_stock, q, keys, values, Cache(host, length), 32**-0.5, mask, None)
        assert mx.allclose(got, _masked(q, keys, values, host), atol=1e-5).item()
        return [None if idx is None else idx.size for idx, _ in rows_attention._local.last[1].keys]

    assert layout("causal", chain, 512) == [None] * 6  # the step's buffer: 512 for 301..306 keys
    assert layout("causal", chain, 768) == [512] * 6  # a longer one (a pass grew it): gathered into 512
    assert layout(mx.array(seen), seen, 512) == [None, None, 512, 512, 512, 512]
    rows_attention.set_cache_layout(False)
    try:
        assert layout("causal", chain, 768) == [None] * 6
        assert layout(mx.array(seen), seen, 512) == [None, None, 302, 302, 303, 302]
    finally:
        rows_attention.set_cache_layout(True)


def test_rows_attention_declines_what_it_cannot_split():
    seen = np.tril(np.ones((4, 4), bool))
    assert rows_attention.visible_rows(mx.array(seen), None, 4) is None  # an array mask, no layout
    windowed = TreeCache(seen)
    windowed.window = 8
    assert rows_attention.visible_rows(mx.array(seen), windowed, 4) is None
    tail = TreeCache(seen)
    tail.tree_pass.tail = mx.ones((4, 2), dtype=mx.bool_)
    assert rows_attention.visible_rows(mx.array(seen), tail, 4) is None
    assert rows_attention.visible_rows(mx.array(seen), TreeCache(np.ones((3, 3), bool)), 4) is None


def test_rows_of_a_product_mlx_runs_without_its_gemv_go_through_the_step_s_own_call(monkeypatch):
    """MLX's one-row product is its gemv only where K is a multiple of 32 (cuBLAS's elsewhere, whose
    bits the kernel does not give: tiny layers of 16 columns differed on an H200)."""
    monkeypatch.setattr(kernels, "usable", lambda dtype: True)
    calls = []
    monkeypatch.setattr(rows_matmul, "rows_matmul", lambda x, w: calls.append(w.shape) or x @ w.T)
    x16, w16 = mx.random.normal((1, 3, 16)), mx.random.normal((8, 16))
    x32, w32 = mx.random.normal((1, 3, 32)), mx.random.normal((8, 32))
    with kernels.rows_pass():
        got = kernels.exact_rows(x16, w16)
        assert calls == []
        assert mx.array_equal(got, mx.concatenate([x16[:, i : i + 1] @ w16.T for i in range(3)], axis=1)).item()
        kernels.exact_rows(x32, w32)
    assert calls == [(8, 32)]
    assert all(rows_matmul.gemv_applies(mx.zeros((1, k))) for _, k in rows_matmul.CHECK_SHAPES)


def test_timing_a_kernel_against_its_reference_measures_again_before_calling_it_slower():
    import time

    calls = {"fast": 0}

    def fast():  # slower than `slow` for its first 4 calls (a warm-up and a first round of 3)
        calls["fast"] += 1
        time.sleep(0.004 if calls["fast"] <= 4 else 0.0)
        return mx.array(0)

    def slow():
        time.sleep(0.002)
        return mx.array(0)

    ok, f, s = rows_matmul.faster(fast, slow, repeats=3, tries=2)
    assert ok and f < s and calls["fast"] == 7
    ok, f, s = rows_matmul.faster(slow, lambda: mx.array(0), repeats=3, tries=2)
    assert not ok and f > s


def test_reference_is_one_matmul_per_row():
    x, w = mx.random.normal((5, 24)), mx.random.normal((7, 24))
    assert mx.allclose(rows_matmul.reference(x, w), x @ w.T, atol=1e-5).item()
    assert [rows_matmul.lane_width(k) for k in (576, 1536, 200)] == [2, 4, 1]


def test_the_check_compiles_every_build_a_pass_can_use():
    """MLX compiles each build of a custom CUDA kernel in every process: a pass of any 2..MAX_ROWS
    rows must use a build the first-use check has compiled and compared, at every lane width, with
    its rows both filling the build and not."""
    builds = {rows_matmul.rmax(r) for r in range(2, rows_matmul.MAX_ROWS + 1)}
    assert builds == set(rows_matmul.RMAX_BUILDS)
    for b in builds:
        checked = [r for r in rows_matmul.CHECK_ROWS if rows_matmul.rmax(r) == b]
        assert b in checked and min(checked) < b
    assert {rows_matmul.lane_width(k) for _, k in rows_matmul.CHECK_SHAPES} == {1, 2, 4}
    assert any(n % rows_matmul.ROWS_PER_BLOCK for n, _ in rows_matmul.CHECK_SHAPES)  # a block's rows not all there
    with pytest.raises(StopIteration):
        rows_matmul.rmax(rows_matmul.MAX_ROWS + 1)


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rows_matmul_has_the_one_row_bits(dtype):
    ok, reason = rows_matmul.check(dtype)
    assert ok, reason


def test_padding_rows_are_not_attended_row_by_row():
    q, keys, values = _attention_inputs(rows=8, cached=10, seed=3)
    calls = []

    def counting(q1, k, v, **kw):
        calls.append(k.shape[2])
        return _stock(q1, k, v, **kw)

    out = rows_attention.rows_attention(counting, q, keys, values, None, 32**-0.5, "causal", None, real=5)
    want = _masked(q, keys, values, np.tril(np.ones((8, 8), bool)))
    assert calls == [11, 12, 13, 14, 15]  # the real rows only, each over the keys it sees
    assert mx.allclose(out[:, :, :5], want[:, :, :5], atol=1e-5).item()
    assert mx.all(out[:, :, 5:] == 0).item()


@cuda
@pytest.mark.parametrize("family,dtype,bits", [("llama", "float16", None), ("llama", "bfloat16", None),
                                               ("llama", "float16", 4), ("llama", "bfloat16", 8),
                                               ("qwen2", "float16", None), ("qwen2", "bfloat16", None)])
def test_verify_pass_rows_have_the_one_row_bits(family, dtype, bits):
    """On a CUDA GPU, a tree pass's logits (matmul kernels + row-by-row attention) equal, bit for
    bit, those of one-row decoding steps along each node's path; plain and quantized weights, and
    Qwen2's biased attention projections."""
    import importlib

    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    from mlx_lm.models.cache import make_prompt_cache

    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs(model_type=family, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300)
    mx.random.seed(1)
    model = module.Model(args)
    model.set_dtype(getattr(mx, dtype))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    kernels.attach(model)
    ids = [5, 17, 42, 7, 99, 3]
    # 12 rows: past the 8 from which MLX leaves its one-row quantized kernel, and past one block's 8
    parents = np.array([-1, 0, 1, -1, 3, 0, 5, 6, 2, -1, 9])
    tree = DraftTree(np.arange(11, 22), parents)
    paths = [[]]
    for node, parent in enumerate(parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [node])
    ours = ModelCache(model)
    prefill(model, ours, ids[:-1])
    got = verify_pass(model, ours, [ids[-1]], tree)
    assert got.shape[0] == 12
    for row, path in enumerate(paths):
        ref = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=ref)
        for t in [ids[-1]] + [int(tree.tokens[j]) for j in path]:
            last = model(mx.array([[t]]), cache=ref)[0, -1]
        assert mx.array_equal(last, got[row]).item(), f"row {row}"


def test_a_compiler_s_log_is_told_in_one_line():
    log = ("Failed to compile kernel: /site/cutlass/floating_point_nvrtc.h(50): error: expected an identifier\n"
           "      FP_NAN =\n      ^\n\n5 errors detected in the compilation of \"k.cu\".\n.")
    said = kernels.one_line(RuntimeError(log))
    assert "\n" not in said
    assert said.startswith("RuntimeError: Failed to compile kernel: /site/cutlass/floating_point_nvrtc.h(50): error")
    assert said.endswith("(and 4 more lines)")
    said = kernels.one_line(RuntimeError("Failed to compile kernel:\nk.cu(3): error: x\nmore"))
    assert said == "RuntimeError: Failed to compile kernel: k.cu(3): error: x (and 1 more lines)"
    assert kernels.one_line(ValueError("bad")) == "ValueError: bad"


def test_rows_seeing_as_many_keys_go_as_one_call(monkeypatch):
    monkeypatch.setattr(rows_attention, "grouping", rows_attention.Grouping())
    q, keys, values = _attention_inputs(rows=7, cached=12, seed=5)
    seen = np.eye(7, dtype=bool)  # the root; children 1, 2, 3 of the root; 4 under 1, 5 under 2, 6 under 3
    seen[1:, 0] = True
    seen[4, 1] = seen[5, 2] = seen[6, 3] = True
    calls = []

    def counting(q1, k, v, **kw):
        calls.append(q1.shape[0])
        return mx.fast.scaled_dot_product_attention(q1, k, v, scale=kw["scale"])

    want = _masked(q, keys, values, seen)
    first = rows_attention.rows_attention(counting, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen), None)
    assert mx.allclose(first, want, atol=1e-5).item()
    verdict = rows_attention.grouping.ok
    calls.clear()
    again = rows_attention.rows_attention(counting, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen), None)
    assert mx.allclose(again, want, atol=1e-5).item()
    if verdict is False:  # grouped rounded differently here: row by row from then on
        assert calls == [1] * 7
    else:  # the root alone, then the two depths of three rows as one call each (checked again while unsure)
        assert calls[:3] == [1, 3, 1] and 3 in calls


def test_rows_past_256_keys_go_one_call_each_with_the_step_s_query(monkeypatch):
    """Past STEP keys a step gets another kernel on CUDA (cuDNN over its cache buffer), which a call
    over gathered keys never gets: rows there go one by one, whatever Grouping found on shorter
    contexts; their queries are the step's layout of the same values."""
    monkeypatch.setattr(rows_attention, "grouping", rows_attention.Grouping())
    rows_attention.grouping.ok = True  # grouping trusted (as after checks on short contexts)
    seen = np.eye(7, dtype=bool)
    seen[1:, 0] = True
    seen[4, 1] = seen[5, 2] = seen[6, 3] = True
    for cached, want_calls in ((rows_attention.STEP - 4, [1, 3, 3]), (rows_attention.STEP - 1, [1] * 7)):
        q, keys, values = _attention_inputs(rows=7, cached=cached, seed=6)
        calls = []

        def counting(q1, k, v, **kw):
            calls.append(q1.shape[0])
            return mx.fast.scaled_dot_product_attention(q1, k, v, scale=kw["scale"])

        got = rows_attention.rows_attention(counting, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen),
                                            None)
        assert mx.allclose(got, _masked(q, keys, values, seen), atol=1e-5).item()
        assert sorted(calls) == sorted(want_calls), cached
    for row in range(7):
        step = rows_attention.step_query(q, row)
        assert step.shape == (1, 4, 1, 32) and mx.array_equal(step, q[:, :, row : row + 1]).item()


def test_all_rows_at_once_get_each_row_s_keys_in_the_step_s_order():
    """rows_attention hands a one-call kernel (all_rows) every row's keys as one index map, padding
    rows seeing none; where it declines, rows go one by one as before."""
    seen = np.eye(6, dtype=bool)
    seen[1:, 0] = True
    seen[3, 1] = seen[4, 2] = seen[4, 1] = True  # row 4 under 2 under 1 under the root
    seen[2, 1] = True
    q, keys, values = _attention_inputs(rows=6, cached=9, seed=8)
    asked = []

    def all_rows(queries, k, v, plan, scale):
        keymap, counts = plan.keymap(queries.shape[2])
        asked.append((np.array(keymap), np.array(counts), plan.most_keys))
        return rows_sdpa.reference(queries, k, v, keymap, counts, scale)

    got = rows_attention.rows_attention(_stock, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen), None,
                                        real=5, all_rows=all_rows)
    keymap, counts, most = asked[0]
    assert list(counts) == [10, 11, 12, 12, 13, 0] and most == 13  # the padding row (5) sees nothing
    assert list(keymap[4, :13]) == list(range(9)) + [9, 10, 11, 13]  # cached, then its path in order
    assert list(keymap[3, :12]) == list(range(9)) + [9, 10, 12]
    want = _masked(q, keys, values, seen)
    assert mx.allclose(got[:, :, :5], want[:, :, :5], atol=1e-5).item() and mx.all(got[:, :, 5] == 0).item()
    declined = rows_attention.rows_attention(_stock, q, keys, values, TreeCache(seen), 32**-0.5, mx.array(seen),
                                             None, real=5, all_rows=lambda *a: None)
    assert mx.allclose(declined[:, :, :5], want[:, :, :5], atol=1e-5).item()


def test_rows_sdpa_reference_and_tree_keymap():
    keymap, counts = rows_sdpa.tree_keymap(5, [-1, 0, 1, 0])
    assert list(counts) == [6, 7, 8, 7]
    assert list(keymap[2]) == [0, 1, 2, 3, 4, 5, 6, 7] and list(keymap[3, :7]) == [0, 1, 2, 3, 4, 5, 8]
    assert rows_sdpa.max_keys(mx.float16) == 255 and rows_sdpa.max_keys(mx.float32) == 1024
    q = mx.random.normal((1, 4, 9, 8), key=mx.random.key(1)).astype(mx.float16)
    assert not rows_sdpa.applies(q, q, None)  # head dim 8: not one the vector kernel has
    q = mx.random.normal((1, 4, 4, 64), key=mx.random.key(1))
    kv = mx.random.normal((2, 1, 2, 9, 64), key=mx.random.key(2))
    assert rows_sdpa.applies(q, kv[0], None) and not rows_sdpa.applies(q, kv[0], mx.zeros((4,)))
    seen = np.zeros((4, 4), bool)
    for i, path in enumerate([[0], [0, 1], [0, 1, 2], [0, 3]]):
        seen[i, path] = True
    got = rows_sdpa.reference(q, kv[0], kv[1], mx.array(keymap), mx.array(counts), 0.125)
    mask = mx.array(np.concatenate([np.ones((4, 5), bool), seen], axis=1))
    want = mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=0.125, mask=mask)
    assert mx.allclose(got, want, atol=1e-5).item()


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_sdpa_has_the_step_s_bits(dtype, head_dim):
    ok, reason = rows_sdpa.check(dtype, head_dim)
    assert ok, reason


def test_grouping_is_trusted_only_after_equal_bits():
    g = rows_attention.Grouping()
    a = mx.array([1.0, 2.0])
    for _ in range(g.CHECKS - 1):
        g.verdict(a, a)
        assert g.ok is None
    g.verdict(a, a)
    assert g.ok is True
    g = rows_attention.Grouping()
    g.verdict(a, a + 1e-7)
    assert g.ok is False


def test_doctor_says_in_which_dtypes_output_is_exact(monkeypatch):
    monkeypatch.setattr(kernels.mx, "default_device", lambda: mx.Device(mx.cpu))  # as on a CPU
    assert "float32, tested on the CPU" in kernels.exactness()
    monkeypatch.setattr(kernels.mx, "default_device", lambda: mx.Device(mx.gpu))  # as on a GPU
    monkeypatch.setattr(kernels, "on_cuda", lambda: False)  # Metal's
    assert "not checked on this GPU (Metal)" in kernels.exactness()
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(kernels, "usable", lambda dtype: True)
    monkeypatch.setattr(kernels, "enabled", True)
    monkeypatch.setattr(kernels, "attention_enabled", True)
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert ("float32 (TF32 off); float16/bfloat16 in plain, biased (row by row) and affine 4/8-bit quantized linear "
            "layers and attention" in kernels.exactness())
    monkeypatch.setattr(kernels, "attention_enabled", False)  # the matmul alone leaves half precision inexact
    assert "not float16/bfloat16 (without both kernels on" in kernels.exactness()
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    assert kernels.exactness().startswith("exact greedy output (equal to mlx-lm's plain decoding): not float32")


class TinyQuantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.proj = nn.Linear(128, 256, bias=False)
        self.biased = nn.Linear(256, 128)
        self.eight = nn.Linear(128, 128, bias=False)
        self.three = nn.Linear(128, 128, bias=False)

    def __call__(self, ids):
        h = self.biased(self.proj(self.embed(ids)))
        return self.embed.as_linear(self.eight(h) + self.three(h))


def test_convert_routes_quantized_layers_it_can_take():
    mx.random.seed(0)
    model = TinyQuantized()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p not in ("eight", "three"))
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: p == "eight")
    nn.quantize(model, group_size=64, bits=3, class_predicate=lambda p, m: p == "three")
    before = dict(tree_flatten(model.parameters()))
    ids = mx.array([[1, 2, 3, 4]])
    want = model(ids)
    kinds = linear.convert(model)
    assert sorted(kinds, key=str) == sorted([(mx.float16, 4, 64)] * 3 + [(mx.float16, 8, 32)], key=str)
    assert isinstance(model.embed, linear.RowsQuantizedEmbedding)
    assert all(isinstance(m, linear.RowsQuantizedLinear) for m in (model.proj, model.biased, model.eight))
    assert type(model.three) is nn.QuantizedLinear  # 3 bits: MLX's own
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    with kernels.rows_pass():
        got = model(ids)  # no CUDA here: MLX's own quantized matmul, the same bits
    assert mx.array_equal(want, got).item()
    assert linear.convert(model) == []


def test_the_quantized_kernel_takes_only_what_qmv_takes():
    w = mx.random.normal((256, 512)).astype(mx.float16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.ones((8, 512), dtype=mx.float16)
    assert rows_qmatmul.applies(x, wq, scales, biases, 4, 64, "affine")
    assert not rows_qmatmul.applies(x, wq, scales, None, 4, 64, "affine")  # no biases: not affine
    assert not rows_qmatmul.applies(x, wq, scales, biases, 4, 64, "mxfp4")
    assert not rows_qmatmul.applies(x.astype(mx.float32), wq, scales, biases, 4, 64, "affine")
    assert not rows_qmatmul.applies(x, wq, scales.astype(mx.bfloat16), biases, 4, 64, "affine")
    assert not rows_qmatmul.applies(mx.ones((8, 520), dtype=mx.float16), wq, scales, biases, 4, 64, "affine")
    w8, s8, b8 = mx.quantize(w, group_size=128, bits=8)
    assert rows_qmatmul.applies(x, w8, s8, b8, 8, 128, "affine")
    assert not rows_qmatmul.applies(x, w8, s8, b8, 4, 128, "affine")  # the layout says 8 bits


def test_quantized_reference_is_one_quantized_matmul_per_row():
    w = mx.random.normal((96, 256))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((5, 256))
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    assert mx.allclose(rows_qmatmul.reference(x, wq, scales, biases, 4, 64), want, atol=1e-4).item()


def test_the_quantized_check_covers_every_case_a_pass_meets():
    """A block takes a few of a pass's rows and a warp a few weight rows: the first-use check must
    see one block's rows filled and not, several blocks with the last one filled and not, and the
    most rows a pass has; weight rows that fill neither the last block nor its last warp; and K
    with and without a tail past the warp's last whole sweep, for both bit widths."""
    wr, pr = rows_qmatmul.LAYOUT
    rows = rows_qmatmul.CHECK_ROWS
    assert any(r < pr for r in rows) and pr in rows and rows_qmatmul.MAX_ROWS in rows
    assert any(r > pr and r % pr for r in rows) and any(r > pr and r % pr == 0 for r in rows)
    assert min(rows) >= 2 and max(rows) == rows_qmatmul.MAX_ROWS
    assert any(n % (rows_qmatmul.WARPS * wr) and n % wr for n, _ in rows_qmatmul.CHECK_SHAPES)
    for bits in rows_qmatmul.BITS:
        sweep = 32 * rows_qmatmul.elements(bits)
        tails = {k % sweep != 0 for _, k in rows_qmatmul.CHECK_SHAPES}
        assert tails == {True, False}, bits
        for group in rows_qmatmul.GROUPS:
            assert all(k % group == 0 for _, k in rows_qmatmul.CHECK_SHAPES)


def test_row_by_row_attention_follows_the_linear_layers_checks(monkeypatch):
    """The attention goes row by row where the pass's linear layers have the one-row bits: a
    quantized check passed for the dtype is enough, one failed is not, and without quantized ones
    the plain check decides."""
    asked = []
    monkeypatch.setattr(kernels, "usable", lambda dtype: asked.append(dtype) or True)
    monkeypatch.setattr(kernels, "_checked", {(mx.float16, 4, 64): (True, "")})
    assert kernels._exact_linear(mx.float16) and not asked
    monkeypatch.setattr(kernels, "_checked", {(mx.float16, 4, 64): (False, "")})
    assert not kernels._exact_linear(mx.float16) and not asked
    monkeypatch.setattr(kernels, "_checked", {})
    assert kernels._exact_linear(mx.bfloat16) and asked == [mx.bfloat16]


@cuda
@pytest.mark.parametrize("dtype,bits", [(mx.float16, 4), (mx.bfloat16, 4), (mx.float16, 8)])
def test_rows_qmatmul_has_the_one_row_bits(dtype, bits):
    ok, reason = rows_qmatmul.check(dtype, bits, 64)
    assert ok, reason


def test_subclasses_are_routed_only_where_they_say_the_kernels_may_wrap_them():
    class Declared(nn.Embedding):
        kernels_may_wrap = True

        def as_linear(self, x):
            return super().as_linear(x) + 1

    class Undeclared(nn.Linear):
        def __call__(self, x):
            return super().__call__(x) * 2

    class DeclaredLinear(nn.Linear):
        kernels_may_wrap = True

    model = nn.Sequential(Declared(32, 16), Undeclared(16, 16, bias=False), DeclaredLinear(16, 16, bias=False),
                          DeclaredLinear(16, 16))
    ids = mx.array([[1, 2, 3]])
    if mx.cuda.is_available():  # the kernels run there: a pass's rows get the one-row call's bits
        want = mx.concatenate([model.layers[0].as_linear(model(ids[:, i : i + 1])) for i in range(3)], axis=1)
    else:
        want = model.layers[0].as_linear(model(ids))
    assert linear.convert(model) == [mx.float32, mx.float32, ("biased", mx.float32)]
    assert isinstance(model.layers[2], linear.RowsLinear) and isinstance(model.layers[3], linear.RowsBiasedLinear)
    head = model.layers[0]
    assert isinstance(head, Declared) and isinstance(head, linear.RowsEmbedding)
    assert type(model.layers[1]) is Undeclared
    with kernels.rows_pass():
        assert mx.array_equal(head.as_linear(model(ids)), want).item()


def test_biased_rows_go_one_at_a_time_through_the_step_s_call(monkeypatch):
    """A biased layer's pass rows: each a [1, 1, K] addmm, as the step's (here on the CPU, with the
    check forced on: the values equal MLX's several-row call's)."""
    from cacheback_mlx.kernels import rows_addmm

    monkeypatch.setattr(kernels, "usable_biased", lambda dtype: True)
    calls = []
    real = mx.addmm
    monkeypatch.setattr(rows_addmm.mx, "addmm", lambda c, a, b: calls.append(a.shape) or real(c, a, b))
    layer = nn.Linear(64, 48)
    x = mx.random.normal((1, 5, 64))
    want = layer(x)
    linear.convert(layer_holder := nn.Sequential(layer))
    calls.clear()
    with kernels.rows_pass():
        got = layer_holder.layers[0](x)
    assert calls == [(1, 1, 64)] * 5
    assert got.shape == (1, 5, 48) and mx.allclose(got, want, atol=1e-5).item()
    assert rows_addmm.reference(x[0], layer.weight, layer.bias).shape == (5, 48)
    calls.clear()
    with kernels.rows_pass():
        layer_holder.layers[0](x[:, :1])  # one row: the layer's own call, once
    assert calls == [(1, 1, 64)]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_biased_rows_check_compares_each_dtype_s_own_bits(dtype):
    """Every dtype of rows_addmm.DTYPES (float32 too: a tiny float32 model's biased layers on CUDA) is
    checked bit for bit at its own width; here on the CPU rows taken in place equal rows copied out."""
    from cacheback_mlx.kernels import rows_addmm

    assert dtype in rows_addmm.DTYPES
    ok, reason = rows_addmm.check(dtype, rows=(2, 3), shapes=((24, 64),))
    assert ok, reason
    x = mx.random.normal((3, 64), key=mx.random.key(1)).astype(dtype)
    w, b = mx.ones((24, 64), dtype), mx.zeros((24,), dtype)
    assert rows_addmm.rows_addmm(x, w, b).dtype == dtype


def test_a_first_use_check_runs_once_and_a_broken_one_is_off_with_one_line(capsys):
    store, calls = {}, []
    assert not kernels._once(store, "k", lambda: calls.append(1) or (False, "bits differ"), "thing off")
    assert not kernels._once(store, "k", lambda: calls.append(1) or (True, ""), "thing off")
    assert calls == [1]
    assert not kernels._once(store, "e", lambda: 1 / 0, "other off")
    assert store["e"] == (False, "ZeroDivisionError: division by zero")
    assert capsys.readouterr().err.splitlines() == ["cacheback-mlx: thing off: bits differ",
                                                    "cacheback-mlx: other off: ZeroDivisionError: division by zero"]
    assert kernels._once(store, "ok", lambda: (True, "fine"), "never said") and "never" not in capsys.readouterr().err


def test_attach_checks_the_attention_rows_kernel_for_the_model_s_head_dim(monkeypatch):
    """At attach, not in the first pass: every first-use check compiles its builds (seconds)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=1, intermediate_size=512,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    asked = []
    monkeypatch.setattr(kernels, "usable_sdpa", lambda dtype, d: asked.append((dtype, d)) or False)
    assert kernels.attach(model) > 0
    assert asked == [(mx.float16, 128)]
    monkeypatch.setattr(kernels, "attention_enabled", False)
    asked.clear()
    kernels.attach(llama.Model(args))
    assert asked == []


@pytest.fixture
def emulated_kernels(monkeypatch):
    """The CUDA routing on this CPU, each kernel replaced by its plain-MLX definition (`reference`):
    what the engine sends the kernels, and what it does with their output, checked without a GPU.
    Returns the calls each kernel got."""
    from cacheback_mlx import activations
    from cacheback_mlx import attention as cpu_attention

    calls = {"matmul": 0, "sdpa": 0, "qmatmul": 0}
    monkeypatch.setattr(activations, "enabled", False)  # the engine's CPU kernels (passes only) off:
    monkeypatch.setattr(cpu_attention, "enabled", False)  # on a GPU the step's own ops run there
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(kernels, "enabled", True)
    monkeypatch.setattr(kernels, "attention_enabled", True)
    monkeypatch.setattr(kernels, "sdpa_enabled", True)
    monkeypatch.setattr(kernels, "_checked", {})
    monkeypatch.setattr(kernels, "_sdpa", {})
    for dtype in rows_sdpa.DTYPES:
        kernels._checked[dtype] = (True, "emulated")
        for d in rows_sdpa.HEAD_DIMS:
            kernels._sdpa[(dtype, d)] = (True, "emulated")

    def matmul(x, w):
        calls["matmul"] += 1
        return rows_matmul.reference(x, w)

    def sdpa(*args):
        calls["sdpa"] += 1
        return rows_sdpa.reference(*args)

    def qmatmul(x, w, scales, biases, bits, group_size, layout=None):
        calls["qmatmul"] += 1
        return rows_qmatmul.reference(x, w, scales, biases, bits, group_size)

    for dtype in rows_qmatmul.DTYPES:
        kernels._checked[(dtype, 4, 64)] = (True, "emulated")
    monkeypatch.setattr(rows_matmul, "rows_matmul", matmul)
    monkeypatch.setattr(rows_sdpa, "rows_sdpa", sdpa)
    monkeypatch.setattr(rows_qmatmul, "rows_qmatmul", qmatmul)
    return calls


@pytest.mark.parametrize("family,bits", [("llama", None), ("qwen3", None), ("llama", 4)])
def test_the_kernels_routing_gives_pass_rows_the_steps_bits_emulated(emulated_kernels, family, bits):
    """On the CPU, kernels emulated by their definitions: a tree pass whose lead has two tokens
    and which is padded gives every real row the logits of one-row steps along its path, bit for
    bit; the matmul and the one-call attention were asked (and the padding rows attended nothing)."""
    import importlib

    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    from mlx_lm.models.cache import make_prompt_cache

    module = importlib.import_module(f"mlx_lm.models.{family}")
    extra = ({"head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 512, "rope_theta": 1e4}
             if family == "qwen3" else {})
    args = module.ModelArgs(model_type=family, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
                            **extra)
    mx.random.seed(3)
    model = module.Model(args)
    if bits:  # mlx-lm's 4-bit layout, in float16 (the quantized kernel's activations)
        model.set_dtype(mx.float16)
        nn.quantize(model, group_size=64, bits=bits)
    kernels.attach(model)
    ids = [5, 17, 42, 7, 99, 3, 61]
    lead = ids[-2:]  # two tokens lead the pass (a new turn's tail)
    parents = np.array([-1, 0, 1, -1, 3, 0, 5])
    tree = DraftTree(np.arange(11, 18), parents)
    ours = ModelCache(model)
    prefill(model, ours, ids[:-2])
    got = verify_pass(model, ours, lead, tree, rows=16)  # padded to 16 rows
    assert got.shape[0] == 1 + len(tree)
    assert emulated_kernels["qmatmul" if bits else "matmul"] > 0
    assert emulated_kernels["sdpa"] == args.num_hidden_layers
    paths = [[]]
    for node, parent in enumerate(parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [node])
    for row, path in enumerate(paths):
        ref = make_prompt_cache(model)
        model(mx.array(ids[:-2])[None], cache=ref)
        for t in lead + [int(tree.tokens[j]) for j in path]:
            last = model(mx.array([[t]]), cache=ref)[0, -1]
        assert mx.array_equal(last, got[row]).item(), f"row {row}"


def test_greedy_output_with_the_kernels_routing_emulated_equals_mlx_lm(emulated_kernels):
    """End to end on the CPU in float16, kernels emulated by their definitions: adversarial drafters'
    trees padded to GPU buckets, rolled back and kept, over a context that crosses the keys the
    one-call attention takes (rows past them go one call each): mlx-lm's own greedy tokens."""
    import sys
    from pathlib import Path

    from cacheback_mlx.drafters.base import NoDrafter
    from cacheback_mlx.engine import GPU_BUCKETS, Engine

    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    sys.path.insert(0, str(Path(__file__).parent))
    from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=120)
    mx.random.seed(5)
    model = llama.Model(args)
    # weights scaled up (as tests/zoo.py's tiny models) so greedy decoding varies
    model.update(tree_map_with_path(lambda p, w: w * 3.0 if p.endswith("weight") else w, model.parameters()))
    model.set_dtype(mx.float16)
    prompt = [(7 * i + 3) % 100 + 10 for i in range(236)]  # + 40 tokens: past 255 keys midway
    n = 40
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    assert len(set(truth)) >= 4
    drafters = {"none": NoDrafter(), "oracle-tree": OracleDrafter(prompt, truth, extra_wrong_branches=2),
                "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(prompt)]),
                "random-0": RandomTreeDrafter(prompt, truth, seed=0, vocab=120),
                "random-1": RandomTreeDrafter(prompt, truth, seed=1, vocab=120)}
    for label, drafter in drafters.items():
        calls = dict(emulated_kernels)
        eng = Engine(model, eos_ids=[], drafter=drafter, context_length=1024, draft_budget=24, buckets=GPU_BUCKETS)
        out = [t for step in eng.generate(prompt, n) for t in step]
        assert out == truth, label
        if label in ("oracle-tree", "random-0"):
            assert emulated_kernels["sdpa"] > calls["sdpa"] and emulated_kernels["matmul"] > calls["matmul"], label


def test_every_family_s_greedy_output_with_the_kernels_routing_emulated_equals_mlx_lm(emulated_kernels):
    """The kernels' routing (emulated on the CPU, float32) on every architecture family the engine
    takes, with trees where the family takes them and an adversarial drafter: mlx-lm's own greedy
    tokens (sliding windows, shared KV, MoE and recurrent layers keep their own paths)."""
    import sys
    from pathlib import Path

    from cacheback_mlx.engine import GPU_BUCKETS, Engine

    from mlx_lm.generate import generate_step

    sys.path.insert(0, str(Path(__file__).parent))
    import zoo
    from adversarial import RandomTreeDrafter

    prompt = [(5 * i + 7) % 100 + 3 for i in range(24)]
    routed = 0
    for family in zoo.FAMILIES:
        model = zoo.tiny_model(family)
        truth = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
        before = emulated_kernels["matmul"]
        eng = Engine(model, eos_ids=[], drafter=RandomTreeDrafter(prompt, truth, seed=2, vocab=zoo.VOCAB),
                     context_length=512, draft_budget=16, buckets=GPU_BUCKETS)
        assert [t for step in eng.generate(prompt, 16) for t in step] == truth, family
        routed += emulated_kernels["matmul"] > before
    assert routed == len(zoo.FAMILIES)  # the matmul was asked in every family
