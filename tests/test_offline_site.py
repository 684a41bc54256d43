"""tools/offline_site.sh: wheels packed in parts, copied over one part at a time, put together there.

A small wheel stands in for MLX's CUDA build (WHEELS=DIR: no package index is asked)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_wheel(folder: Path, blob: bytes) -> Path:
    """A py3-none-any wheel of a package `packed` holding VALUE and an incompressible blob."""
    info = "packed-0.1.dist-info"
    files = {"packed/__init__.py": b"VALUE = 42\n", "packed/blob.bin": blob,
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: packed\nVersion: 0.1\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "packed-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def stage(tree: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tree / ".offline/meta/stage.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(sys.platform != "linux", reason="the packing uses GNU split and sha256sum")
def test_parts_copied_one_at_a_time_unpack_into_a_site_that_imports(tmp_path):
    blob = os.urandom(2_500_000)  # xz keeps it at ~2.5 MB: three parts of 1 MiB
    make_wheel(tmp_path / "wheels", blob)
    out = tmp_path / "bundle"
    env = os.environ | {"WHEELS": str(tmp_path / "wheels"), "PYTHON": sys.executable, "PART_MB": "1"}
    r = subprocess.run(["bash", str(ROOT / "tools/offline_site.sh"), "build", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    parts = sorted(p.name for p in out.iterdir() if p.name != "meta")
    assert parts == ["p0", "p1", "p2"] and (out / "meta/WHEELS").read_text().split() == [
        "packed-0.1-py3-none-any.whl"]

    nvidia = tmp_path / "host/nvidia/cublas"  # the host's CUDA libraries, as a namespace package
    nvidia.mkdir(parents=True)
    site, staged = tmp_path / "site", tmp_path / "staged"
    env = os.environ | {"STAGE": str(staged), "SITE": str(site), "PYTHONPATH": str(tmp_path / "host")}
    for k, part in enumerate(parts):  # each copy of the checkout brings the sums and one part
        tree = tmp_path / f"copy{k}"
        (tree / ".offline").mkdir(parents=True)
        for name in ("meta", part):
            subprocess.run(["cp", "-r", str(out / name), str(tree / ".offline/")], check=True)
        r = stage(tree, env)
        assert r.returncode == 0, r.stdout + r.stderr
        if k < len(parts) - 1:
            assert f"staged {k + 1} of 3 parts" in r.stdout and not site.exists()
    assert "site ready" in r.stdout and (site / "nvidia").resolve() == nvidia.parent.resolve()
    check = subprocess.run([sys.executable, "-c", "import packed; print(packed.VALUE)"], capture_output=True,
                           env=os.environ | {"PYTHONPATH": str(site)}, text=True, timeout=60)
    assert check.stdout.strip() == "42", check.stderr
    assert (site / "packed/blob.bin").read_bytes() == blob

    # a part damaged on the way: refused, nothing unpacked
    bad = staged / "part.01"
    data = bad.read_bytes()
    bad.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a different first byte
    r = stage(tmp_path / "copy2", env | {"SITE": str(tmp_path / "site2")})
    assert r.returncode == 1 and "does not match its sum" in r.stdout
    assert not (tmp_path / "site2").exists()
