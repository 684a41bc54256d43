"""Slots: several sequences' caches kept at once (an editor flipping between files), each request in
the slot that reuses most of its prompt, output unchanged."""

from cacheback_mlx.drafters.base import Drafter, NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.fim import InfillBuilder
from cacheback_mlx.slots import Sequence, Slots

import pytest

from adversarial import RandomTreeDrafter

A = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8, 11, 12, 13, 14, 15, 16]
B = [60, 61, 2, 9, 9, 70, 71, 72, 4, 4, 30, 31, 32, 33, 34, 35]
C = [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 1, 2, 3, 4, 5]


def gen(eng, prompt, n=8, **kw):
    return [t for step in eng.generate(prompt, n, **kw) for t in step]


def plain(model, prompt, n=8):
    return gen(Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096), prompt, n)


def test_choice_continues_a_sequence_takes_an_empty_slot_then_the_least_recent():
    s = Slots(2, Sequence(None))
    assert s.choose(A) == 0  # everything empty: the active slot
    s.slots[0].cached = list(A)
    # the active slot holds A: a continuation of A stays, another prompt takes the empty slot
    assert s.choose(A + [1, 2]) == 0
    assert s.choose(B) == 1
    assert s.choose(A[:1] + B) == 1  # one shared token (a BOS) is not a continuation
    assert s.choose(A + list(range(40))) == 0  # a long paste still continues its sequence
    assert s.choose(B, want=0) == 0
    with pytest.raises(CachebackError, match=r"^slot must be in \[0, 2\)"):
        s.choose(B, want=2)
    assert Slots(1, Sequence(None, cached=list(A))).choose(B) == 0


def test_interleaved_sequences_reuse_their_slot_and_stay_exact(tiny_model):
    """Two documents edited alternately: with two slots each request after the first of its
    document prefills only its new tokens; the output is the same as with one slot (and as plain
    decoding); a third document takes the least recently used slot."""
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096, slots=2)
    one = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    a1, b1 = gen(eng, A), gen(eng, B)
    assert (a1, b1) == (gen(one, A), gen(one, B))
    a2, b2 = A + a1 + [4, 5], B + b1 + [6]
    eng.set_drafter(RandomTreeDrafter(a2, plain(tiny_model, a2), seed=1))
    out_a = gen(eng, a2)
    assert eng.stats.prefill_tokens == 2 and eng.slots.active == 0
    assert out_a == plain(tiny_model, a2) == gen(one, a2)
    assert one.stats.prefill_tokens == len(a2) - 1  # one slot: B had replaced A's cache
    out_b = gen(eng, b2)
    assert eng.stats.prefill_tokens == 1 and eng.slots.active == 1 and out_b == plain(tiny_model, b2)
    gen(eng, C)  # no match, no empty slot: the least recently used (A's) is taken
    assert eng.slots.active == 0 and eng.stats.prefill_tokens == len(C) - 1
    gen(eng, b2 + out_b)
    assert eng.slots.active == 1 and eng.stats.prefill_tokens <= 1
    assert eng.cached and eng.slots.slots[0].cached  # both sequences kept


def test_slot_asked_for_is_used_and_a_bad_one_is_a_one_line_error(tiny_model):
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096, slots=3)
    assert gen(eng, A, slot=2) == plain(tiny_model, A) and eng.slots.active == 2
    gen(eng, A + [1], slot=0)
    assert eng.slots.active == 0 and eng.stats.prefill_tokens == len(A)  # slot 0 had nothing
    for bad in (3, 7):
        with pytest.raises(CachebackError) as e:
            gen(eng, A, slot=bad)
        assert "\n" not in str(e.value) and str(e.value).startswith("slot must be in [0, 3)")


def test_byte_cap_empties_idle_slots_and_resets_forget_them(tiny_model):
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096, slots=2, slot_bytes=0)
    gen(eng, A), gen(eng, B)
    assert eng.slots.slots[0] is None  # idle and over the cap: emptied
    gen(eng, A + [1])
    assert eng.stats.prefill_tokens == len(A)  # so A is prefilled again
    kept = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096, slots=2)
    gen(kept, A), gen(kept, B)
    kept.reset_drafter()  # caches stay, what the drafter saw of every slot goes
    assert kept.slots.slots[0].history == [] and kept.slots.slots[0].cached
    kept.reset()
    assert kept.slots.slots[0] is None and kept.cached == []
    kept.set_slots(1)
    assert kept.slots.n == 1 and gen(kept, A) == plain(tiny_model, A)


class Seen(Drafter):
    """Records what it observes and learns."""

    def __init__(self):
        self.observed, self.learned_n = [], 0

    def observe(self, tokens):
        self.observed.append(list(tokens))

    def learn(self, tokens):
        self.learned_n += 1


def test_each_slot_keeps_the_drafters_view_of_its_sequence(tiny_model):
    """Coming back to a document continues its history: the drafter is shown only the new tokens,
    and context segments it learned for that document are not learned again."""
    d = Seen()
    eng = Engine(tiny_model, eos_ids=[], drafter=d, context_length=4096, slots=2)
    chunk, below = [50, 51, 52], [53, 54]
    out_a = gen(eng, A, context=[chunk, below])
    gen(eng, B)
    d.observed.clear()
    d.learned_n = 0
    gen(eng, A + out_a + [7], context=[chunk, below])
    assert d.observed[0] == [out_a[-1], 7] or d.observed[0] == [7]  # the new prompt tokens only
    assert d.learned_n == 1  # the suffix; the chunk was learned for this document already


def test_infill_builder_keeps_each_files_start_line(default_model):
    """Two files edited alternately: each keeps its own prefix start (the latest few are kept), so
    both prompts keep extending their own earlier prompts."""
    builder = InfillBuilder(default_model.tokenizer, None, 8192)
    files = {f: [f"{f}_row_{i} = table[{i}] * scale + offset\n" for i in range(600)] for f in ("a", "b")}
    last: dict[str, list[int]] = {}
    shared = []
    for cursor in range(300, 345, 3):
        for f, lines in files.items():
            ids = builder.build("".join(lines[cursor - 256:cursor]), "", [], "", 32).ids
            if f in last:
                n = next((i for i, (x, y) in enumerate(zip(last[f], ids)) if x != y), min(len(ids), len(last[f])))
                shared.append(n / len(ids))
            last[f] = ids
    assert sorted(shared)[len(shared) // 2] > 0.8
