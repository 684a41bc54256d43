"""OpenBLAS preload: in effect on Linux x86_64 (fast matmul), a no-op elsewhere."""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

BLAS_PY = Path(__file__).resolve().parents[1] / "cacheback_mlx" / "blas.py"


def run_py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64" or not avx2(),
                    reason="OpenBLAS preload applies to Linux x86_64 with AVX2 only")
def test_openblas_is_loaded_and_matmul_is_fast():
    out = run_py("""
        import time, cacheback_mlx
        from cacheback_mlx import blas
        import mlx.core as mx
        a = mx.random.normal((512, 576)); b = mx.random.normal((576, 1536)); mx.eval(a, b)
        for _ in range(3): mx.eval(a @ b)
        t = time.perf_counter(); n = 20
        for _ in range(n): mx.eval(a @ b)
        gflops = 2 * 512 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9
        maps = open('/proc/self/maps').read()
        print(blas.status); print('libopenblas' in maps); print(gflops)
    """).split("\n")
    status, mapped, gflops = out[0], out[1], float(out[2])
    assert status.startswith("loaded"), status
    assert mapped == "True"
    assert gflops > 20, f"{gflops:.1f} GFLOP/s: the reference BLAS is still in use"


def test_preload_is_a_no_op_on_macos():
    out = run_py(f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location('blas_only', {str(BLAS_PY)!r})
        blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
        sys.platform = 'darwin'
        print(blas.preload_openblas())
        maps = '/proc/self/maps'
        print(os.path.exists(maps) and 'libopenblas' in open(maps).read())
    """).split("\n")
    assert out[0].startswith("not needed on darwin"), out
    assert out[1] == "False"


def test_preload_can_be_turned_off():
    out = run_py("""
        import os; os.environ['CACHEBACK_MLX_OPENBLAS'] = '0'
        from cacheback_mlx import blas
        print(blas.status)
    """)
    assert out.startswith("off"), out


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64" or not avx2(),
                    reason="the preload is for Linux x86_64 with AVX2 only")
def test_preload_after_mlx_is_reported_not_attempted():
    out = run_py(f"""
        import importlib.util, mlx.core
        spec = importlib.util.spec_from_file_location('blas_only', {str(BLAS_PY)!r})
        blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
        print(blas.preload_openblas())
    """)
    assert out.startswith("skipped: mlx.core was imported first"), out


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64" or not avx2(),
                    reason="the preload (and so the warning) is for Linux x86_64 with AVX2 only")
def test_importing_mlx_first_warns_that_matmuls_will_be_slow():
    out = run_py("""
        import warnings; warnings.simplefilter('always')
        with warnings.catch_warnings(record=True) as seen:
            import mlx.core
            import cacheback_mlx
        print([str(w.message) for w in seen if w.category is RuntimeWarning])
    """)
    assert "reference BLAS" in out and "import cacheback_mlx first" in out, out


@pytest.mark.parametrize("given, expected", [(None, "0"), ("1", "1")])
def test_tf32_is_off_unless_the_user_turns_it_on(given, expected):
    """MLX's CUDA backend would run several-row float32 matmuls in TF32 and one-row ones in full
    float32 (verify passes and plain decoding rounding differently): the package turns it off
    before MLX loads, and leaves a user's own setting alone."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if given is not None:
        env["MLX_ENABLE_TF32"] = given
    code = "import os, cacheback_mlx, mlx.core; print(os.environ['MLX_ENABLE_TF32'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr


def _column_major(w) -> bool:
    strides = memoryview(w).strides  # no copy: the array's own layout
    return strides[0] < strides[1]


@pytest.mark.parametrize("tied", [True, False])
def test_weights_stored_transposed_give_bitwise_the_same_passes(tied):
    """blas.transpose_weights stores each float32 Linear / Embedding weight as the transposed view
    of an [in, out] copy (OpenBLAS multiplies x @ W.T faster so): the same shapes and values,
    bitwise the same logits for passes of 1 to 40 rows over a cache, and a second call changes
    nothing."""
    from cacheback_mlx import blas
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    def build():
        mx.random.seed(3)
        args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=160,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
                               tie_word_embeddings=tied)
        model = llama.Model(args)
        model.update(tree_map(lambda w: w * 3.0, model.parameters()))
        mx.eval(model.parameters())
        return model

    stock, moved = build(), build()
    n = blas.transpose_weights(moved)
    assert n == 2 * 7 + 1 + (0 if tied else 1)  # 7 linears a layer, the embedding, an untied head
    # the weights are evaluated arrays: another thread (a server's worker) can use them (an array
    # still to be evaluated belongs to the stream of the thread that made it)
    import threading

    seen = []
    worker = threading.Thread(target=lambda: seen.append(np.array(moved(mx.array([[1, 2, 3]])))))
    worker.start()
    worker.join()
    assert seen and np.array_equal(seen[0], np.array(stock(mx.array([[1, 2, 3]]))))
    assert blas.transpose_weights(moved) == n
    pairs = zip(tree_flatten(stock.parameters()), tree_flatten(moved.parameters()))
    for (name, a), (_, b) in pairs:
        assert a.shape == b.shape and np.array_equal(np.array(a), np.array(b)), name
    assert _column_major(moved.model.layers[0].mlp.up_proj.weight)
    assert not _column_major(stock.model.layers[0].mlp.up_proj.weight)

    rng = np.random.default_rng(0)
    caches = [ModelCache(m) for m in (stock, moved)]
    context = rng.integers(0, 300, 70).tolist()
    for m, c in zip((stock, moved), caches):
        prefill(m, c, context)
    for rows in (1, 2, 8, 17, 40):
        lead = rng.integers(0, 300, rows).tolist()
        out = [np.array(verify_pass(m, c, lead, DraftTree.empty())) for m, c in zip((stock, moved), caches)]
        assert np.array_equal(out[0], out[1]), rows
        for c in caches:
            c.trim(len(context))


def test_the_loader_stores_weights_transposed_on_the_cpu_unless_turned_off(tmp_path):
    from conftest import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    code = f"""
        import cacheback_mlx, mlx.core as mx
        from cacheback_mlx import blas
        from cacheback_mlx.loader import load
        m = load({str(path)!r}).model
        w = m.model.layers[0].self_attn.q_proj.weight
        s = memoryview(w).strides
        print(blas.weight_layout_wanted(), s[0] < s[1])
        print(mx.set_cache_limit(0) >> 20)  # MLX's buffer cache (malloc.raise_mlx_cache_limit)
    """
    on = run_py(code).split()
    assert int(on.pop()) >= 256  # the loader raised it (test_malloc.py: why)
    off = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "CACHEBACK_MLX_WEIGHT_LAYOUT": "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split()[:2] == ["False", "False"]
    import cacheback_mlx.blas as blas
    if blas.status.startswith("loaded"):  # Linux x86_64 with OpenBLAS: the layout is used
        assert on == ["True", "True"]
    else:
        assert on == ["False", "False"]


def test_layout_ab_refuses_a_file_that_is_not_a_record_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"kind": "fim"}]}')
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tools.ab.layout", "--record", str(bad)],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"Error: {bad}: not a record"), out.stderr
