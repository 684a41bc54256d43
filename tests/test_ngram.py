"""N-gram drafter: FNV-1a vectors, count tables, back-off, window, chain drafts."""

from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.ngram import FNV_OFFSET, NGramDrafter, fnv1a
from cacheback_mlx.replay import SHARED_STREAMS, load_streams, replay_all

import pytest

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers


def reference_fnv1a(tokens):
    """FNV-1a 64 written out: XOR the whole token in, multiply by the prime, keep 64 bits."""
    h = 14695981039346656037
    for t in tokens:
        h = ((h ^ t) * 1099511628211) % 2**64
    return h


def test_fnv1a_vectors():
    assert fnv1a([]) == FNV_OFFSET == 14695981039346656037 == 0xCBF29CE484222325
    # by hand: (0xcbf29ce484222325 ^ 1) * 0x100000001b3 mod 2^64
    assert fnv1a([1]) == reference_fnv1a([1]) == 0xAF63BC4C8601B62C
    assert fnv1a([1, 2, 3]) == reference_fnv1a([1, 2, 3]) == 0xD0AA6218672CF5AB
    # byte-valued tokens give the standard FNV-1a-64 of the bytes
    assert fnv1a(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a(b"foobar") == 0x85944171F73967E8
    # whole token ids (not their bytes) are XORed in before each multiply
    assert fnv1a([70000]) == reference_fnv1a([70000]) == ((FNV_OFFSET ^ 70000) * 1099511628211) % 2**64
    assert fnv1a([1, 2]) != fnv1a([2, 1])


def test_most_frequent_continuation_with_back_off():
    d = NGramDrafter(max_draft=1)
    d.observe([1, 2, 3, 1, 2, 4, 1, 2, 4, 9, 2, 5])
    assert d.predict_next([1, 2]) == 4  # 3-gram context (1,2): 4 seen twice, 3 once
    assert d.predict_next([9, 2]) == 5  # (9,2) -> 5
    assert d.predict_next([7, 2]) == 4  # unknown (7,2): back off to (2,) -> 4 (2 of 4... ties -> recent)
    assert d.predict_next([7, 8]) is None


def test_longest_context_wins():
    d = NGramDrafter()
    d.observe([5, 6, 7, 1, 9, 6, 7, 2, 9, 6, 7, 2])
    # order 2 (context 7): 1 once, 2 twice -> 2; order 4 (5,6,7) -> 1 wins
    assert d.predict_next([5, 6, 7]) == 1
    assert d.predict_next([3, 6, 7]) == 2


def test_ties_go_to_the_most_recent():
    d = NGramDrafter()
    d.observe([1, 2, 1, 3])
    assert d.predict_next([1]) == 3
    d.observe([1, 2])  # 2 leads, 2 to 1
    assert d.predict_next([1]) == 2
    d.observe([1, 3])  # tied again at 2 each: 3 was seen last
    assert d.predict_next([1]) == 3


def test_chain_drafts_and_budget():
    d = make_drafter("ngram")
    seq = [10, 11, 12, 13, 14, 15] * 3
    d.observe(seq)
    tree = d.propose(seq, budget=16)
    assert tree.is_chain() and list(tree.tokens) == [10, 11, 12, 13]  # max_draft=4 by default
    assert len(d.propose(seq, budget=2)) == 2
    assert len(d.propose(seq, budget=0)) == 0
    d8 = NGramDrafter(max_draft=8)
    d8.observe(seq)
    assert list(d8.propose(seq, 99).tokens) == [10, 11, 12, 13, 14, 15, 10, 11]


def test_window_limits_the_context_history_not_the_tables():
    d = NGramDrafter(window=4)
    d.observe([1, 2, 3, 4, 5, 6])
    assert list(d.history) == [3, 4, 5, 6]
    assert d.predict_next([1]) == 2  # counts from before the window are kept (as in the seed)
    d.observe([7])
    # contexts for new counts come from the window only: (4,5,6)->7 is counted
    assert d.predict_next([4, 5, 6]) == 7


def test_tables_are_bounded_and_keep_the_newest_contexts():
    d = NGramDrafter(max_contexts=100)
    d.observe(range(1000, 1400))  # 400 new contexts per order
    assert all(len(t) <= 100 for t in d.tables.values())
    assert d.predict_next([1397, 1398]) == 1399  # the newest counts survive
    assert d.predict_next([1001]) is None  # the oldest were dropped


def test_reset_forgets():
    d = NGramDrafter()
    d.observe([1, 2, 1, 2])
    d.reset()
    assert d.predict_next([1]) is None and len(d.propose([1], 4)) == 0


@pytest.mark.skipif(not SHARED_STREAMS.exists(), reason="../shared/data/smollm2_greedy not present")
def test_replay_mat_on_recorded_streams_matches_the_reference():
    r = replay_all(lambda: make_drafter("ngram"), load_streams())
    assert 1.8 <= r.mat <= 2.0, r.mat  # reference figure: 1.89
    assert r.draft_seconds / r.steps < 1e-3


def test_bad_table_bounds_are_one_line_errors(tmp_path):
    from cacheback_mlx.errors import CachebackError

    with pytest.raises(CachebackError, match="max_contexts must be >= 2"):
        make_drafter("ngram", max_contexts=0)
    with pytest.raises(CachebackError, match="capacity must be >= 1"):
        make_drafter("ssd", path=tmp_path / "ssd", capacity=0)
    with pytest.raises(CachebackError, match="capacity must be >= 1"):
        make_drafter("auto", ssd_path=tmp_path / "ssd", ssd_capacity=-5)
