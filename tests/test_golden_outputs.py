"""The engine and the drafters give, bit for bit, what they gave before the code was reorganised
(the reference: tests/data/golden_outputs.json, written by tests/golden_outputs.py at commit
c9ae993): greedy outputs with every drafter at a fixed budget, their pass and acceptance counts,
and the offline replay's passes on the recorded streams."""

import json
from pathlib import Path

from tests import golden_outputs

REFERENCE = Path(__file__).parent / "data" / "golden_outputs.json"


def test_outputs_and_acceptance_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = json.loads(REFERENCE.read_text())
    got = golden_outputs.compute()
    assert got["offline"] == want["offline"]
    for name, rows in want["live"].items():
        assert got["live"][name] == rows, name
    plain = want["live"]["none"]
    for name, rows in want["live"].items():  # every drafter's output is plain decoding's
        assert [r["tokens"] for r in rows] == [r["tokens"] for r in plain], name
