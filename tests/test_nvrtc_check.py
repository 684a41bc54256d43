"""tools/nvrtc_check.py: the kernels' sources as MLX writes them, compiled with NVRTC where its
wheels were fetched (`python -m tools.nvrtc_check --fetch`; nothing is downloaded here)."""

import os
from pathlib import Path

from cacheback_mlx.kernels import rows_matmul, rows_qmatmul, rows_sdpa

import pytest
from tools import nvrtc_check

FETCHED = Path(os.environ.get("CACHEBACK_MLX_NVRTC_DIR", nvrtc_check.ROOT / ".nvrtc"))
fetched = pytest.mark.skipif(not (FETCHED / "site").is_dir(),
                             reason="NVRTC and MLX's CUDA wheel not fetched (python -m tools.nvrtc_check --fetch)")


def test_every_build_the_engine_asks_for_is_listed():
    labels = [b.label() for b in nvrtc_check.builds()]
    assert len(labels) == len(set(labels))
    assert len(labels) == 3 * len(rows_matmul.RMAX_BUILDS) + (
        len(rows_qmatmul.DTYPES) * len(rows_qmatmul.BITS) * len(rows_qmatmul.GROUPS)) + (
        len(rows_sdpa.DTYPES) * len(rows_sdpa.HEAD_DIMS))
    assert "cacheback_rows_qmv(T=bfloat16, BITS=4, GROUP=64, WR=2, PR=4)" in labels


def test_the_source_is_laid_out_as_mlx_lays_out_a_custom_kernel():
    b = next(b for b in nvrtc_check.builds() if b.name == "cacheback_rows_qmv")
    src = nvrtc_check.kernel_source(b)
    # MLX's default header first, then the kernel's own, then the function
    assert src.index('#include "mlx/backend/cuda/device/utils.cuh"') < src.index("#include <cutlass/array.h>")
    assert src.index("#include <cutlass/array.h>") < src.index("__global__ void cacheback_rows_qmv(")
    # inputs in order, with the shape arrays the source reads; the output last
    start = src.index("__global__")
    sig = src[start: src.index(") {", start)]
    for name in ("const __half* x", "const __grid_constant__ Shape x_shape", "const uint32_t* w",
                 "const __grid_constant__ Shape w_shape", "const __half* scales", "const __half* biases",
                 "__half* out"):
        assert name in sig, name
    assert "scales_shape" not in sig  # the source never reads it
    assert sig.index("x_shape") < sig.index("uint32_t* w") < sig.index("out")
    assert "  using T = __half;\n  constexpr int BITS = 4;" in src


@fetched
@pytest.mark.parametrize("only", ["cacheback_rows_gemv(T=float16, RMAX=64)",
                                  "cacheback_rows_qmv(T=bfloat16, BITS=4, GROUP=64",
                                  "cacheback_rows_sdpa(T=float16, D=64)"])
def test_kernels_compile_with_nvrtc(only, capsys):
    """One build of each kernel (all of them: python -m tools.nvrtc_check)."""
    assert nvrtc_check.main(["--dir", str(FETCHED), "--only", only]) == 0
    assert "ok      " + only in capsys.readouterr().out


@fetched
def test_a_build_that_does_not_compile_is_reported(monkeypatch, capsys):
    """CUTLASS under NVRTC without the FP_* macros undefined: the error a GPU host gave."""
    header = rows_qmatmul.HEADER
    start, end = header.index("#if defined(__CUDACC_RTC__)"), header.index("#endif") + len("#endif")
    monkeypatch.setattr(rows_qmatmul, "HEADER", header[:start] + header[end:])
    assert nvrtc_check.main(["--dir", str(FETCHED), "--only", "BITS=4, GROUP=64"]) == 1
    out = capsys.readouterr().out
    assert "FAILED  cacheback_rows_qmv(T=float16, BITS=4, GROUP=64" in out
    assert "floating_point_nvrtc.h" in out and "2 of the builds failed to compile" in out


def test_nothing_fetched_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        nvrtc_check.main(["--dir", str(tmp_path)])
    said = str(e.value)
    assert "\n" not in said and said.startswith("nvrtc_check: ") and "run with --fetch" in said
