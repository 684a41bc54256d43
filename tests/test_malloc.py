"""malloc.py: MLX's buffer cache on the CPU is raised, never lowered, and that stops the page faults
of buffers that went back to malloc and were unmapped."""

import os
import subprocess
import sys
import textwrap

from cacheback_mlx import malloc

import mlx.core as mx
import pytest

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers


def cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


def test_raised_on_the_cpu_never_lowered_and_left_alone_when_turned_off(monkeypatch):
    before = cache_limit()
    try:
        mx.set_cache_limit(32 << 20)
        malloc.raise_mlx_cache_limit()
        assert cache_limit() == malloc.MLX_CACHE
        mx.set_cache_limit(1 << 30)
        malloc.raise_mlx_cache_limit()
        assert cache_limit() == 1 << 30  # a larger one (Metal's) is kept
        mx.set_cache_limit(32 << 20)
        monkeypatch.setenv("CACHEBACK_MLX_MALLOC", "0")
        malloc.raise_mlx_cache_limit()
        assert cache_limit() == 32 << 20
    finally:
        mx.set_cache_limit(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and Linux's page-fault counts")
def test_a_larger_cache_stops_the_page_faults_of_a_pass_sized_working_set():
    """~64 MB of 4 MB buffers made and freed per round, as a prefill chunk's layers do: with MLX's
    32 MB cache the rest goes back to malloc, which unmaps blocks of 1 MiB and more, and every
    round faults them in again; with the cache raised, the buffers are reused."""
    code = textwrap.dedent("""
        import resource, sys
        import cacheback_mlx, mlx.core as mx
        from cacheback_mlx import malloc
        mx.set_cache_limit(32 << 20)
        if sys.argv[1] == "raised":
            malloc.raise_mlx_cache_limit()
        x = mx.ones((1 << 20,))
        faults = []
        for _ in range(6):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ys = [x * float(i) for i in range(16)]
            mx.eval(ys)
            del ys
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        print(sum(faults[2:]) // 4, malloc.status)
    """)
    got = {}
    for mode in ("default", "raised"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", "/tmp")})
        assert out.returncode == 0, out.stderr
        got[mode] = out.stdout.split(maxsplit=1)
    if not got["default"][1].startswith("mmap threshold fixed"):
        pytest.skip(f"malloc not tuned here: {got['default'][1]}")
    default, raised = int(got["default"][0]), int(got["raised"][0])
    assert default > 4000  # ~32 MB faulted in again every round (4 KiB pages)
    assert raised < default / 10
