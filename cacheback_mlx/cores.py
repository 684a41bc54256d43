"""How many BLAS threads this process runs: every core when it is alone on the machine, a fair
share while other cacheback-mlx processes are busy too.

OpenBLAS's threads wait for work by spinning. Two processes that each run one thread per core
on the same cores take turns at every product, and each runs many times slower than alone (two
`generate`s at once on 2 cores: ~30x slower each, docs/BENCHMARKS.md §11), where one thread each
costs them ~1.4x. So each process says when it is busy (a generation, a prefill, a measurement)
by holding an exclusive lock on a file of its own in one folder per user for the whole machine
(in the temporary folder, whatever cache folder each process keeps its state in), and before each
pass counts the other files whose lock is held: with n processes busy, each runs cores // n threads
(at least one). A process that ends, however it ends, lets go of its lock; a file whose process is gone is
removed by the next one to look. OPENBLAS_NUM_THREADS, when set, stays the most a process runs.
Where no OpenBLAS is loaded (macOS: Accelerate, or MLX's own BLAS) nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

from . import blas

try:
    import fcntl
except ImportError:  # no flock (Windows): every process keeps its own count
    fcntl = None

CHECK_S = 0.25  # how often a busy process looks at the others again


def busy_dir() -> Path:
    """The folder where this user's processes say they are busy: one for the machine, not one per
    cache folder (a server and a script with different XDG_CACHE_HOMEs share the same cores). A
    folder of that name owned by someone else is not used: then the cache folder's, as before.
    CACHEBACK_MLX_BUSY_DIR, when set, is the folder instead (processes that should count only each
    other: a test session)."""
    if os.environ.get("CACHEBACK_MLX_BUSY_DIR"):
        return Path(os.environ["CACHEBACK_MLX_BUSY_DIR"])
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"cacheback-mlx-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.is_symlink() or folder.stat().st_uid != uid:
            raise PermissionError(folder)
    except OSError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "cacheback-mlx" / "busy"
    return folder / "busy"


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreShare:
    """This process's share of the machine's cores, for OpenBLAS."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder  # where the busy files are; None: busy_dir() at each look
        self.cores = machine_cores()
        env = os.environ.get("OPENBLAS_NUM_THREADS", "")
        self.limit = max(1, min(int(env), self.cores)) if env.isdigit() and int(env) > 0 else self.cores
        self.threads = blas.threads()
        self.others = 0  # other processes found busy at the last look
        self._file = None
        self._opened: Path | None = None
        self._depth = 0
        self._checked = 0.0

    def _mark(self, busy: bool) -> None:
        if fcntl is None:
            return
        folder = self.folder or busy_dir()
        if self._file is None or folder != self._opened:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self._file = open(folder / str(os.getpid()), "a+")
                self._opened = folder
            except OSError:
                self._file = None
                return
        fcntl.flock(self._file, fcntl.LOCK_EX if busy else fcntl.LOCK_UN)

    def others_busy(self) -> int:
        """How many other cacheback-mlx processes on this machine are busy now."""
        if fcntl is None:
            return 0
        busy = 0
        folder = self.folder or busy_dir()
        try:
            entries = list(folder.iterdir())
        except OSError:
            return 0
        for path in entries:
            if not path.name.isdigit() or int(path.name) == os.getpid():
                continue
            try:
                with open(path) as f:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                busy += 1
                continue
            except OSError:
                continue
            if not _alive(int(path.name)):
                with contextlib.suppress(OSError):
                    path.unlink()
        return busy

    def adjust(self, force: bool = False) -> None:
        """Set this process's threads to its share (looked up at most every CHECK_S seconds)."""
        if self.threads is None:
            return
        now = time.monotonic()
        if not force and now - self._checked < CHECK_S:
            return
        self._checked = now
        self.others = self.others_busy()
        want = max(1, min(self.limit, self.cores // (self.others + 1)))
        if want != self.threads:
            blas.set_threads(want)
            self.threads = want

    @contextlib.contextmanager
    def busy(self):
        """Mark this process busy for the block (nested blocks are one), at its share of threads."""
        self._depth += 1
        try:
            if self._depth == 1:
                self._mark(True)
                self.adjust(force=True)
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._mark(False)

    def describe(self) -> str:
        """What `doctor` prints."""
        if self.threads is None:
            return "BLAS threads: not set here (no OpenBLAS loaded)"
        self.adjust(force=True)
        whom = (f"{self.others} other cacheback-mlx process(es) busy" if self.others
                else "no other cacheback-mlx process busy")
        return (f"BLAS threads: {self.threads} of {self.cores} cores ({whom}; a busy process runs "
                f"cores / busy processes, at most {self.limit})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


share = CoreShare()
