"""SSD's store shared by several processes: nothing lost, a killed writer loses only its record."""

import subprocess
import sys
import textwrap

from cacheback_mlx.drafters.ssd_store import HEADER, SsdStore
from cacheback_mlx.drafters.suffix import SEP

import numpy as np
import pytest

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

WRITER = textwrap.dedent("""
    import sys
    from cacheback_mlx.drafters.ssd import SsdDrafter
    folder, who, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    d = SsdDrafter(path=folder, capacity=1_000_000)
    d.store.compact_bytes = int(sys.argv[4])
    for i in range(n):
        d.observe([who, i, 7, 7, who, i])  # a request the test can find again
        d.end_request()
        print("ok", i, flush=True)
""")


def requests_in(buffer: np.ndarray) -> set[tuple]:
    out, cur = set(), []
    for t in buffer.tolist():
        if t == SEP:
            out.add(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return out


def writer(folder, who, n, compact=1 << 20):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(who), str(n), str(compact)],
                            stdout=subprocess.PIPE, text=True)


def test_two_processes_serving_at_once_lose_no_request(tmp_path):
    procs = [writer(tmp_path, who, 60, compact=3000) for who in (1000, 2000)]  # compactions too
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    got = requests_in(SsdStore(tmp_path, 1_000_000).load())
    want = {(who, i, 7, 7, who, i) for who in (1000, 2000) for i in range(60)}
    assert want <= got
    assert len(list(tmp_path.glob("log-*.bin"))) <= 1


def test_a_writer_killed_mid_record_loses_only_that_record(tmp_path):
    store = SsdStore(tmp_path, 1000)
    buf = np.zeros(0, np.int32)
    for i in range(5):
        buf = store.append(np.array([i, i, SEP], np.int32), buf)
    log = next(tmp_path.glob("log-*.bin"))
    whole = log.read_bytes()
    log.write_bytes(whole + HEADER.pack(0x53534431, 3, 0) + b"\x01\x00")  # killed mid-write
    again = SsdStore(tmp_path, 1000)
    assert requests_in(again.load()) == {(i, i) for i in range(5)}
    assert log.read_bytes() == whole  # the torn record is cut off, so appends go on after it
    buf = again.append(np.array([9, 9, SEP], np.int32), again.load())
    assert requests_in(SsdStore(tmp_path, 1000).load()) == {(i, i) for i in range(5)} | {(9, 9)}


def test_kill_9_during_saves_keeps_everything_acknowledged(tmp_path):
    p = writer(tmp_path, 5000, 100_000, compact=4000)
    acked = []
    for line in p.stdout:
        acked.append(int(line.split()[1]))
        if len(acked) >= 40:
            break
    p.kill()  # SIGKILL: no cleanup, possibly in the middle of an append or a compaction
    p.wait()
    got = requests_in(SsdStore(tmp_path, 1_000_000).load())
    assert {(5000, i, 7, 7, 5000, i) for i in acked} <= got
