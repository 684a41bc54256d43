"""OpenBLAS preload: in effect on Linux x86_64 (fast matmul), a no-op elsewhere."""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
