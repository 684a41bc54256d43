"""CARD's draft process: the draft model grows its token tree while the target verifies.

MLX is not safe to drive from two threads of one process, so the draft model runs in a process
of its own: `python -m cacheback_mlx.draft_model.worker FD`, started with subprocess (not
multiprocessing: its 'spawn' re-imports the user's main script, and 'fork' copies MLX's and
OpenBLAS's threads). The two ends talk over a socketpair wrapped in multiprocessing's Connection:

  parent -> child   ("sync", epoch, keep, tail)   the verified sequence is now seq[:keep] + tail
                    ("close",)
  child -> parent   ("ready", info) | ("error", one line)   once, after loading the draft model
                    ("tree", epoch, seq_len, TokenTree, passes, hits, misses)   after each layer

The child never waits for the parent while it has a layer to grow; it reads every message between
layers. It exits when told, when the socket closes (the parent exited or was killed: EOF) or when
its parent process is gone (polled), and it ignores Ctrl-C (it runs in its own session, so a
terminal's SIGINT reaches only the parent, which then closes it).

DraftProcess is the parent's handle: start-up (waits for "ready", a load error becomes a
CachebackError), non-blocking send/receive, and a clean close (close message, then terminate,
then kill, each with a bounded wait).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import CachebackError

READY_TIMEOUT = 600.0  # seconds to load the draft model (a first download can be slow)


def _serve(conn: Connection, spec: dict) -> None:
    import mlx.core as mx

    from .runner import DraftRunner, load_draft

    if spec.get("device"):
        mx.set_default_device(mx.cpu if spec["device"] == "cpu" else mx.gpu)
    model = load_draft(spec["draft"], spec.get("target"), spec.get("dtype"), spec.get("fingerprint"))
    runner = DraftRunner(model, **spec["tree"])
    conn.send(("ready", {"pid": os.getpid(), "chain": runner.chain}))
    parent, epoch = os.getppid(), 0
    while True:
        idle = not runner.seq or runner.tree.full()
        while conn.poll(0.05 if idle else 0):
            msg = conn.recv()
            if msg[0] == "close":
                return
            _, epoch, keep, tail = msg
            runner.sync(keep, tail)
            idle = False
        if os.getppid() != parent:
            return
        if runner.expand():
            conn.send(("tree", epoch, len(runner.seq), runner.tree, runner.passes, runner.hits, runner.misses))


def main(argv: list[str]) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes us
    conn = Connection(int(argv[0]))
    try:
        spec = conn.recv()
        _serve(conn, spec)
    except (EOFError, ConnectionError, KeyboardInterrupt):
        return 0  # the parent is gone (or closed the socket)
    except Exception as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            conn.send(("error", line if isinstance(e, CachebackError) else f"{type(e).__name__}: {line}"))
        except OSError:
            pass
        return 1
    return 0


class DraftProcess:
    """The parent's handle on one draft process."""

    def __init__(self, spec: dict, threads: int | None = None):
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        if threads:  # BLAS threads of the draft process (the cores are shared with the target)
            env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the cacheback_mlx package
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        debug = bool(os.environ.get("CACHEBACK_MLX_DEBUG"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cacheback_mlx.draft_model.worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None if debug else subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.info: dict = {}
        try:
            self.conn.send(spec)
            if not self.conn.poll(READY_TIMEOUT):
                raise CachebackError(f"the CARD draft process did not start within {READY_TIMEOUT:.0f}s")
            kind, payload = self.conn.recv()
            if kind == "error":
                raise CachebackError(payload)
            self.info = payload
        except (EOFError, OSError):
            self.close()
            raise CachebackError("the CARD draft process exited while starting "
                                 "(set CACHEBACK_MLX_DEBUG=1 to see why)") from None
        except BaseException:  # a load error, Ctrl-C while waiting: no orphan
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.conn.closed

    def send(self, msg) -> None:
        """Raises OSError/EOFError when the child is gone."""
        self.conn.send(msg)

    def receive(self, wait: float = 0.0) -> list:
        """Every message waiting now (after waiting up to `wait` seconds for the first)."""
        out = []
        while self.conn.poll(wait if not out else 0):
            out.append(self.conn.recv())
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Stop the child: ask, then terminate, then kill; never waits unboundedly."""
        if not self.conn.closed:
            try:
                self.conn.send(("close",))
            except (OSError, EOFError):
                pass
            self.conn.close()
        for stop in (None, self.proc.terminate, self.proc.kill):
            if stop is not None:
                try:
                    stop()
                except OSError:
                    pass
            try:
                self.proc.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                continue


if __name__ == "__main__":
    import cacheback_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

    sys.exit(main(sys.argv[1:]))
