"""Compile the package's CUDA kernels here, with NVRTC, as MLX's CUDA backend compiles them on a GPU.

MLX builds a custom CUDA kernel (`mx.fast.cuda_kernel`) when it is first called, with NVRTC, from
its own device headers (kept inside libmlx.so), the CUTLASS and CCCL headers its CUDA wheel ships,
and CUDA's runtime headers. A kernel that does not compile is found only there, on a machine that
is seldom at hand, and the engine then runs without it. This writes each build the engine can ask
for (kernels/: every dtype, bound on rows, bit width, group size) the way MLX writes a custom
kernel's source, and compiles it with the same NVRTC flags and headers, on any Linux x86_64 host:
no GPU needed.

    .venv/bin/python -m tools.nvrtc_check [--dir .nvrtc] [--fetch] [--arch compute_90a]

--fetch downloads what it needs into --dir (gitignored by default: .nvrtc): MLX's CUDA wheel at the
installed MLX's version, NVIDIA's NVRTC and CUDA runtime wheels (CUDA 13, as mlx-cuda-13 asks);
~200 MB from the package index. Without it, it uses what --dir holds. `nm` (binutils) reads the
device headers out of libmlx.so. Exit status 1 when a build does not compile (its log is printed).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cacheback_mlx.kernels import rows_matmul, rows_qmatmul, rows_sdpa

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent

CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.uint32: "uint32_t",
              mx.int32: "int32_t"}
WHEELS = ("mlx-cuda-13=={mlx}", "nvidia-cuda-nvrtc==13.*", "nvidia-cuda-runtime==13.*")


@dataclass
class Build:
    """One template instance of one custom kernel, as the engine may ask MLX for it."""

    module: object  # the kernels/ module that holds its HEADER and SOURCE
    name: str
    inputs: list[tuple[str, object]]  # (name, dtype)
    output: object  # dtype of the one output
    template: list[tuple[str, object]]  # (name, int or dtype)

    def label(self) -> str:
        args = ", ".join(f"{k}={str(v).replace('mlx.core.', '')}" for k, v in self.template)
        return f"{self.name}({args})"


def builds() -> list[Build]:
    """Every build kernels/ compiles: what their first-use checks and a pass can ask for."""
    out = []
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for rmax in rows_matmul.RMAX_BUILDS:
            out.append(Build(rows_matmul, "cacheback_rows_gemv", [("x", dtype), ("w", dtype)], dtype,
                             [("T", dtype), ("RMAX", rmax)]))
    wr, pr = rows_qmatmul.LAYOUT
    for dtype in rows_qmatmul.DTYPES:
        for bits in rows_qmatmul.BITS:
            for group in rows_qmatmul.GROUPS:
                out.append(Build(rows_qmatmul, "cacheback_rows_qmv",
                                 [("x", dtype), ("w", mx.uint32), ("scales", dtype), ("biases", dtype)], dtype,
                                 [("T", dtype), ("BITS", bits), ("GROUP", group), ("WR", wr), ("PR", pr)]))
    for dtype in rows_sdpa.DTYPES:
        for d in rows_sdpa.HEAD_DIMS:
            out.append(Build(rows_sdpa, "cacheback_rows_sdpa",
                             [("q", dtype), ("k", dtype), ("v", dtype), ("keymap", mx.int32), ("counts", mx.int32),
                              ("scale", mx.float32)], dtype, [("T", dtype), ("D", d)]))
    return out


def kernel_source(b: Build) -> str:
    """The translation unit MLX's CUDA custom_kernel writes for a build (MLX 0.32): its default
    header, the kernel's header, then one __global__ function taking each input (with its shape,
    strides and ndim where the source names them) and the output, the template arguments as
    constants at the top of the body."""
    source = b.module.SOURCE
    params = []
    for name, dtype in b.inputs:
        params.append(f"    const {CUDA_TYPES[dtype]}* {name}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if name + suffix in source:
                params.append(f"    const __grid_constant__ {kind} {name}{suffix}")
    params.append(f"    {CUDA_TYPES[b.output]}* out")
    consts = []
    for name, value in b.template:
        consts.append(f"  using {name} = {CUDA_TYPES[value]};" if value in CUDA_TYPES
                      else f"  constexpr int {name} = {int(value)};")
    return ('#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            + b.module.HEADER
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {b.name}(\n" + ",\n".join(params) + ") {\n" + "\n".join(consts) + "\n"
            + source + "}\n\n}  // namespace mlx::core::cu\n")


def device_headers(libmlx: Path) -> dict[str, bytes]:
    """MLX's device headers, as NVRTC gets them: libmlx.so keeps each as a char array named
    mlx::core::jit_source_NAME (read here with nm), included as mlx/backend/cuda/device/NAME.cuh
    (config.h)."""
    try:
        listing = subprocess.run(["nm", "-S", "-C", str(libmlx)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"nvrtc_check: cannot list the symbols of {libmlx} with nm: {e}")
    headers: dict[str, bytes] = {}
    with open(libmlx, "rb") as f:
        for line in listing.splitlines():
            parts = line.split(None, 3)
            if len(parts) != 4 or not parts[3].startswith("mlx::core::jit_source_"):
                continue
            name = parts[3].removeprefix("mlx::core::jit_source_")
            path = "mlx/backend/cuda/device/" + name + (".h" if name == "config" else ".cuh")
            if path in headers:
                continue
            f.seek(int(parts[0], 16))  # .rodata: file offset = address in this library
            headers[path] = f.read(int(parts[1], 16)).rstrip(b"\0")
    if "mlx/backend/cuda/device/utils.cuh" not in headers:
        raise SystemExit(f"nvrtc_check: no device headers found in {libmlx}")
    return headers


class Nvrtc:
    def __init__(self, lib: Path, headers: dict[str, bytes], include: list[Path], arch: str):
        self.lib = ctypes.CDLL(str(lib))
        self.names = list(headers)
        self.texts = [headers[n] for n in self.names]
        # MLX's flags: CUTLASS needs device code by default; the device's architecture (compute_
        # here: there is no device to take SASS for)
        self.args = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode()]
        self.args += [f"--include-path={p}".encode() for p in include]

    def compile(self, source: str, name: str) -> tuple[bool, str]:
        lib = self.lib
        prog = ctypes.c_void_p()
        n = len(self.names)
        texts = (ctypes.c_char_p * n)(*self.texts)
        names = (ctypes.c_char_p * n)(*[x.encode() for x in self.names])
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), n, texts, names):
            return False, "nvrtcCreateProgram failed"
        try:
            args = (ctypes.c_char_p * len(self.args))(*self.args)
            rc = lib.nvrtcCompileProgram(prog, len(self.args), args)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(max(size.value, 1))
            lib.nvrtcGetProgramLog(prog, log)
            return rc == 0, log.value.decode(errors="replace").strip()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def fetch(dest: Path) -> None:
    """Download and unpack the wheels into dest (MLX's CUDA wheel at the installed MLX's version)."""
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [s.format(mlx=mx.__version__) for s in WHEELS]
    for spec in specs:  # one at a time: pip's resolver would ask for one platform tag for all
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(wheels), spec], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"nvrtc_check: pip could not download {spec}: "
                             + (r.stderr.strip().splitlines() or ["no message"])[-1])
    for whl in wheels.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            z.extractall(dest / "site")


def locate(dest: Path) -> tuple[Path, Path, list[Path]]:
    """(libnvrtc, libmlx, include paths in MLX's order) under dest/site."""
    site = dest / "site"
    nvrtc = sorted(glob.glob(str(site / "nvidia/cu*/lib/libnvrtc.so*")))
    libmlx = site / "mlx/lib/libmlx.so"
    runtime = sorted(glob.glob(str(site / "nvidia/cu*/include/cuda_fp16.h")))
    found = (("libnvrtc (nvidia-cuda-nvrtc)", nvrtc), ("libmlx.so (mlx-cuda-13)", libmlx.is_file()),
             ("CUDA runtime headers (nvidia-cuda-runtime)", runtime))
    missing = [what for what, ok in found if not ok]
    if missing:
        raise SystemExit(f"nvrtc_check: {', '.join(missing)} not found under {site} (run with --fetch)")
    include = [site / "mlx/include", site / "mlx/include/cccl", Path(runtime[0]).parent]
    return Path(nvrtc[0]), libmlx, include


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / ".nvrtc"), help="where the wheels are kept (default .nvrtc)")
    ap.add_argument("--fetch", action="store_true", help="download the wheels first")
    ap.add_argument("--arch", default="compute_90a", help="NVRTC's --gpu-architecture (default: H100/H200's)")
    ap.add_argument("--only", default=None, help="only builds whose label contains this")
    a = ap.parse_args(argv)
    dest = Path(a.dir)
    if a.fetch:
        fetch(dest)
    lib, libmlx, include = locate(dest)
    nvrtc = Nvrtc(lib, device_headers(libmlx), include, a.arch)
    failed = 0
    for b in builds():
        if a.only and a.only not in b.label():
            continue
        ok, log = nvrtc.compile(kernel_source(b), b.name)
        print(("ok      " if ok else "FAILED  ") + b.label(), flush=True)
        if not ok:
            failed += 1
            print("    " + log.replace("\n", "\n    "))
    print(f"{failed} of the builds failed to compile" if failed else "every build compiles")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
