"""Linux x86_64: load OpenBLAS before MLX so its CPU matmuls stop using the reference BLAS.

MLX's Linux CPU wheel links a bundled reference BLAS (~4 GFLOP/s here). Loading OpenBLAS from the
`cmeel-openblas` wheel with RTLD_GLOBAL before `mlx.core` is first imported makes MLX's cblas_*
calls resolve to it (~140 GFLOP/s on a 2-core EPYC). This must run before any `import mlx.core`;
`cacheback_mlx/__init__.py` calls it first. Set CACHEBACK_MLX_OPENBLAS=0 to turn it off.

Two snags handled here:
- the wheel's OpenBLAS is built for one CPU family (0.3.29: ZEN = AVX2+FMA), so we check the CPU
  flags first; an unsupported CPU keeps the reference BLAS rather than crashing with SIGILL;
- it needs libgfortran.so.5, which a bare Linux lacks. MLX's and NumPy's wheels bundle one under
  a mangled soname; we copy it to a cache folder with the soname set back to libgfortran.so.5.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import platform
import re
import sys
import warnings
from pathlib import Path

# OpenBLAS core name (from its build config string) -> CPU flags it needs.
_CORE_FLAGS = {
    "HASWELL": {"avx2", "fma"},
    "ZEN": {"avx2", "fma"},
    "SKYLAKEX": {"avx512f", "avx512bw", "avx512vl"},
    "COOPERLAKE": {"avx512f", "avx512bw", "avx512_bf16"},
    "SAPPHIRERAPIDS": {"avx512f", "avx512bw", "amx_tile"},
}

status: str = "not attempted"
"""What happened, for `cacheback-mlx doctor` and the tests."""
library: ctypes.CDLL | None = None
"""The OpenBLAS loaded (its thread count is set through it: cores.py)."""


def _openblas_path() -> Path | None:
    try:
        files = importlib.metadata.files("cmeel-openblas") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libopenblas.so.0":
            path = Path(f.locate()).resolve()
            if path.exists():
                return path
    return None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _core_name(lib: Path) -> str | None:
    """The CPU family the library was built for, read from its embedded config string."""
    m = re.search(rb"OpenBLAS \d+\.\d+\.\d+ [A-Z_ ]*?\b(" + b"|".join(k.encode() for k in _CORE_FLAGS) + rb")\b",
                  lib.read_bytes())
    return m.group(1).decode() if m else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheback-mlx" / "blas"


def _load_gfortran() -> bool:
    """Make libgfortran.so.5 resolvable: the system's if present, else a bundled copy."""
    if ctypes.util.find_library("gfortran"):
        return True
    for dist in ("mlx-cpu", "numpy", "scipy"):
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name.startswith("libgfortran-") and ".so.5" in f.name:
                src = Path(f.locate()).resolve()
                if src.exists():
                    return _load_soname_copy(src, "libgfortran.so.5")
    return False


def _load_soname_copy(src: Path, soname: str) -> bool:
    folder = src.parent
    for dep in folder.iterdir():  # its own deps (libquadmath-*) keep their mangled sonames
        if dep.name.startswith("libquadmath"):
            ctypes.CDLL(str(dep), mode=os.RTLD_GLOBAL)
    data = bytearray(src.read_bytes())
    old = src.name.encode() + b"\0"
    at = data.find(old)
    if at < 0 or len(soname) + 1 > len(old):
        return False
    data[at : at + len(old)] = soname.encode().ljust(len(old), b"\0")
    dst = _cache_dir() / f"{src.stem}-{len(data)}" / soname
    if not dst.exists() or dst.read_bytes() != data:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    ctypes.CDLL(str(dst), mode=os.RTLD_GLOBAL)
    return True


def preload_openblas() -> str:
    """Load OpenBLAS globally if this is Linux x86_64 and the CPU can run it. Returns the status."""
    global status, library
    if os.environ.get("CACHEBACK_MLX_OPENBLAS", "1") == "0":
        status = "off (CACHEBACK_MLX_OPENBLAS=0)"
    elif sys.platform != "linux" or platform.machine() != "x86_64":
        status = f"not needed on {sys.platform}/{platform.machine()}"
    elif (lib := _openblas_path()) is None:
        status = "cmeel-openblas is not installed"
    else:
        core = _core_name(lib)
        missing = _CORE_FLAGS.get(core or "", {"?"}) - _cpu_flags()
        if missing:
            status = f"skipped: OpenBLAS built for {core} needs CPU flags {sorted(missing)}"
        elif "mlx.core" in sys.modules:  # too late: MLX's BLAS symbols are bound
            status = "skipped: mlx.core was imported first"
            warnings.warn("mlx.core was imported before cacheback_mlx, so MLX's CPU matmuls use its "
                          "slow reference BLAS (~10x slower here): import cacheback_mlx first "
                          "(CACHEBACK_MLX_OPENBLAS=0 silences this)", RuntimeWarning, stacklevel=3)
        elif not _load_gfortran():
            status = "skipped: no libgfortran.so.5 found"
        else:
            try:
                library = ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
                status = f"loaded {lib} ({core})"
            except OSError as e:
                status = f"failed: {e}"
    return status


def threads() -> int | None:
    """The threads OpenBLAS runs a product on (None: no OpenBLAS loaded)."""
    return int(library.openblas_get_num_threads()) if library is not None else None


def set_threads(n: int) -> None:
    """Run OpenBLAS's products on n threads from now on (call between passes, not during one)."""
    if library is not None:
        library.openblas_set_num_threads(int(n))


# The weights' layout in memory. MLX computes a linear layer as x @ W.T with W stored [out, in];
# it reaches OpenBLAS as an sgemm with B transposed, which for the few rows of a decoding pass is
# ~30% slower here than the same product with B stored [in, out] (docs/BENCHMARKS.md §1). Storing
# each weight as the transposed view of an [in, out] copy keeps its shape and values (code that reads
# `.weight` sees the same array) and turns W.T into a plain row-major matrix. The products are
# bitwise the same (tests/test_blas.py); only the speed changes.
LAYOUT_ENV = "CACHEBACK_MLX_WEIGHT_LAYOUT"


def weight_layout_wanted() -> bool:
    """Whether to store weights transposed: OpenBLAS loaded, MLX on the CPU, not turned off."""
    import mlx.core as mx

    return (os.environ.get(LAYOUT_ENV, "1") != "0" and status.startswith("loaded")
            and mx.default_device() == mx.cpu)


def transpose_weights(model) -> int:
    """Store every float32 Linear and Embedding weight of `model` as the transposed view of an
    [in, out] copy, one at a time (peak memory: one extra matrix); returns how many. Calling it
    again changes nothing (a weight already stored so is its own [in, out] copy's view)."""
    import mlx.core as mx
    import mlx.nn as nn

    done = 0
    for _, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or "weight" not in module:
            continue
        w = module.weight
        if w.ndim != 2 or w.dtype != mx.float32:
            continue
        t = mx.contiguous(w.T).T
        mx.eval(t)  # evaluated here: a lazy transpose would be evaluated on this thread's stream only
        module.weight = t
        done += 1
    return done
