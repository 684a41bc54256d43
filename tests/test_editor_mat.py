"""replay.replay_requests and tools/editor_mat.py: an editor session's drafting replayed offline."""

import json
import random
import subprocess
import sys
from pathlib import Path

from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.replay import replay_requests

TOOL = Path(__file__).resolve().parents[1] / "tools" / "editor_mat.py"


def session(seed: int = 0) -> list[dict]:
    """A warm-up, then completions whose prompts differ but whose outputs repeat what an earlier
    request produced (as an editor's follow-up continues a reply): what a kept drafter can learn."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(100, 5000) for _ in range(n)]
    reply = words(40)
    reqs = [{"kind": "warm", "prompt": words(30), "context": [words(20)], "max_tokens": 0, "out": []}]
    for i in range(6):
        reqs.append({"kind": "fim", "block": 1, "typed": 3 * i, "first": i == 0, "prompt": words(50),
                     "context": [words(10), words(12)], "max_tokens": 64, "out": reply})
        reqs.append({"kind": "follow-up", "block": 1, "typed": 3 * i, "first": i == 0, "prompt": words(50),
                     "context": [], "max_tokens": 64, "out": words(8)})
    return reqs


def test_replay_requests_kept_drafter_learns_across_requests_and_warm_ups_only_start():
    reqs = session()
    make = lambda: make_drafter("pld", max_draft=7)
    kept = replay_requests(make, reqs, 7)
    fresh = replay_requests(make, reqs, 7, fresh=True)
    assert kept[0] is None and fresh[0] is None  # the warm-up prefills, decodes nothing
    comp = lambda res: [r for r, q in zip(res, reqs) if q["kind"] == "fim"]
    assert all(r.tokens == 40 for r in comp(kept) + comp(fresh))
    assert comp(fresh)[0].steps == comp(kept)[0].steps == 40  # nothing seen yet: one token a pass
    assert all(r.steps == 40 for r in comp(fresh))  # a fresh drafter never saw the reply
    assert all(r.steps <= 8 for r in comp(kept)[1:])  # the kept one drafts it from the first time


def test_editor_mat_prints_kept_fresh_and_none_and_refuses_a_foreign_file(tmp_path):
    record = tmp_path / "session.json"
    record.write_text(json.dumps({"command": "--blocks 1", "state": "kept", "requests": session()}))
    r = subprocess.run([sys.executable, str(TOOL), str(record), "--budget", "7"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
            for line in r.stdout.splitlines() if line.startswith("| ") and line.split("|")[2].strip()[:1].isdigit()}
    assert set(rows) == {"kept", "fresh", "none"}
    assert rows["none"][:5] == [1.0] * 5
    assert rows["kept"][3] > 2 * rows["fresh"][3]  # all completions: the repeated reply is learned
    assert "learning across requests, last third, completions:" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"meta": {}}')
    r = subprocess.run([sys.executable, str(TOOL), str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("editor_mat: ")
