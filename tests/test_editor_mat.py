"""replay.replay_requests and tools/editor/mat.py: an editor session's drafting replayed offline."""

import json
import random
import subprocess
import sys
from pathlib import Path

from cacheback_mlx.drafters import Drafter, make_drafter
from cacheback_mlx.replay import replay_requests

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, "-m", "tools.editor.mat"]


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
    r = subprocess.run([*TOOL, str(record), "--budget", "7"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
            for line in r.stdout.splitlines() if line.startswith("| ") and line.split("|")[2].strip()[:1].isdigit()}
    assert set(rows) == {"kept", "fresh", "none"}
    assert rows["none"][:5] == [1.0] * 5
    assert rows["kept"][3] > 2 * rows["fresh"][3]  # all completions: the repeated reply is learned
    assert "learning across requests, last third, completions:" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"meta": {}}')
    r = subprocess.run([*TOOL, str(bad)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("editor_mat: ")


class Seen(Drafter):
    """A drafter that records what it is shown (no drafting)."""

    name = "seen"

    def __init__(self):
        self.observed, self.learned = [], []

    def observe(self, tokens):
        self.observed.append(list(tokens))

    def learn(self, tokens):
        self.learned.append(list(tokens))

    def propose(self, history, budget, max_branching=None):
        from cacheback_mlx.tree import DraftTree

        return DraftTree.empty()

    def end_request(self):
        pass


def test_replay_requests_keeps_each_slots_history_and_learned_chunks():
    """Recorded with the server's slots (an editor flipping between two files): coming back to a
    slot continues its history (only the new prompt tokens are observed) and does not learn its
    chunks again, as the engine does."""
    a, b, chunk = list(range(100, 130)), list(range(300, 330)), [7, 8, 9]
    reqs = [{"prompt": a, "context": [chunk, [1]], "max_tokens": 2, "out": [5, 6], "slot": 0},
            {"prompt": b, "context": [[2]], "max_tokens": 2, "out": [5, 6], "slot": 1},
            {"prompt": a + [5, 6, 42], "context": [chunk, [1]], "max_tokens": 2, "out": [5, 6], "slot": 0}]
    d = Seen()
    replay_requests(lambda: d, reqs, 7)
    assert d.observed[-3] == [42] and d.learned.count(chunk) == 1
    d2 = Seen()
    replay_requests(lambda: d2, [{k: v for k, v in r.items() if k != "slot"} for r in reqs], 7)
    assert d2.observed[-3] == a + [5, 6, 42]  # one history: b's prompt came between


def test_editor_replay_interleaves_two_files_by_turns():
    """--flip: one completion of each file in turn, each with the warm-ups before it and the
    follow-up after it; the second file's blocks numbered after the first's."""
    from tools.editor import replay as mod

    ev = lambda kind, f, b, i: (kind, {"f": f, "i": i}, None if kind == "warm" else {"block": b, "i": i})
    a = [ev("warm", "a", 0, 0), ev("fim", "a", 1, 1), ev("fim", "a", 1, 2), ev("warm", "a", 0, 3), ev("fim", "a", 2, 4)]
    b = [ev("fim", "b", 1, 1), ev("warm", "b", 0, 2), ev("fim", "b", 1, 3), ev("fim", "b", 2, 4)]
    got = [(k, body["f"], body["i"], w and w["block"]) for k, body, w in mod.interleave(a, b, blocks=2)]
    assert got == [("warm", "a", 0, None), ("fim", "a", 1, 1), ("fim", "b", 1, 3), ("fim", "a", 2, 1),
                   ("warm", "b", 2, None), ("fim", "b", 3, 3), ("warm", "a", 3, None), ("fim", "a", 4, 2),
                   ("fim", "b", 4, 4)]
