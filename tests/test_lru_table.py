"""LRU semantics of the dynamic table, exactly as the design asks, plus a model-based property test."""

from collections import OrderedDict

from cacheback_mlx.drafters.lru_table import LruTable

from hypothesis import given, settings
from hypothesis import strategies as st


def test_followers_come_most_recent_first_and_lookup_does_not_touch_them():
    t = LruTable(ll=1, fl=2, lc=4, fc=3)
    t.put((1,), (2, 3))
    t.put((1,), (4, 5))
    t.put((1,), (6, 7))
    assert t.get((1,)) == [(6, 7), (4, 5), (2, 3)]
    t.get((1,))  # lookup refreshes the leader only
    t.put((1,), (8, 9))  # evicts the LRU follower (2, 3)
    assert t.get((1,)) == [(8, 9), (6, 7), (4, 5)]
    t.put((1,), (4, 5))  # re-insertion refreshes a follower
    t.put((1,), (10, 11))  # so (6, 7) is now the LRU one
    assert t.get((1,)) == [(10, 11), (4, 5), (8, 9)]
    assert t.get((1,), 2) == [(10, 11), (4, 5)] and t.get((1,), 5) == t.get((1,)) and t.get((2,), 2) == []


def test_leader_eviction_order_and_refresh_by_get_and_put():
    t = LruTable(ll=1, fl=1, lc=3, fc=2)
    for leader in (1, 2, 3):
        t.put((leader,), (0,))
    t.get((1,))  # 1 becomes MRU: order 2, 3, 1
    t.put((2,), (5,))  # 2 becomes MRU: order 3, 1, 2
    t.put((4,), (0,))  # evicts 3
    assert t.leaders() == [(1,), (2,), (4,)]
    assert t.get((3,)) == []
    t.get((9,))  # a miss changes nothing
    assert t.leaders() == [(1,), (2,), (4,)]


def test_follower_recency_is_per_leader():
    t = LruTable(ll=1, fl=1, lc=4, fc=2)
    t.put((1,), (7,))
    t.put((2,), (8,))
    t.put((1,), (9,))
    t.put((2,), (7,))  # same follower under another leader: no effect on leader 1's order
    t.put((1,), (5,))  # leader 1 evicts its own LRU follower, (7,)
    assert t.get((1,)) == [(5,), (9,)]
    assert t.get((2,)) == [(7,), (8,)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 6), st.integers(0, 6)), max_size=200),
       st.integers(1, 4), st.integers(1, 4))
def test_matches_a_reference_model_and_stays_bounded(ops, lc, fc):
    t = LruTable(ll=1, fl=1, lc=lc, fc=fc)
    ref: OrderedDict = OrderedDict()
    for op, a, b in ops:
        if op == "put":
            if (a,) in ref:
                ref.move_to_end((a,))
            else:
                ref[(a,)] = OrderedDict()
                if len(ref) > lc:
                    ref.popitem(last=False)
            fol = ref[(a,)]
            if (b,) in fol:
                fol.move_to_end((b,))
            else:
                fol[(b,)] = None
                if len(fol) > fc:
                    fol.popitem(last=False)
            t.put((a,), (b,))
        else:
            expected = list(reversed(ref[(a,)])) if (a,) in ref else []
            if (a,) in ref:
                ref.move_to_end((a,))
            assert t.get((a,)) == expected
        assert len(t) <= lc
        assert t.token_count() <= 1 * lc + 1 * lc * fc
    assert t.leaders() == list(ref)
