"""The engine and the drafters give, bit for bit, what they gave before the code was reorganised
(the reference: tests/data/golden_outputs.json, written by tests/golden_outputs.py at commit
c9ae993; `auto`'s passes and drafts again when it began drafting the model's own picks,
Drafter.recycle, and again with their next-best tokens: its outputs the same): greedy outputs
with every drafter at a fixed budget, their pass and acceptance counts, and the offline replay's
passes on the recorded streams.
Live, plain decoding and the default drafter run always, every drafter with -m long (each is
lossless on this model in test_default_model.py)."""

import json
from pathlib import Path

import pytest
from tests import golden_outputs

REFERENCE = Path(__file__).parent / "data" / "golden_outputs.json"
SHORT = ("none", "auto")


def check(names, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = json.loads(REFERENCE.read_text())
    assert set(names) <= set(want["live"]) and "none" in names
    got = golden_outputs.live(names)
    for name in names:
        assert got[name] == want["live"][name], name
        # every drafter's output is plain decoding's
        assert [r["tokens"] for r in got[name]] == [r["tokens"] for r in want["live"]["none"]], name
    return want


def test_outputs_and_acceptance_are_unchanged(tmp_path, monkeypatch):
    want = check(SHORT, tmp_path, monkeypatch)
    assert golden_outputs.offline() == want["offline"]


@pytest.mark.long
def test_every_drafter_s_live_outputs_and_acceptance_are_unchanged(tmp_path, monkeypatch):
    check(list(golden_outputs.DRAFTERS), tmp_path, monkeypatch)
