"""What a drafter learns as a request starts, besides the tokens it then generates: the text an
editor sends beside the prompt (its other chunks, the code below the cursor) and, after an edit,
the lines before the edit again. The engine applies it at the start of every request
(Engine._start); replay.replay_requests applies it the same way offline."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from .drafters.base import Drafter
from .tree import common_prefix

LEARNED_MAX = 256  # context segments remembered as learned (start_request)
REFRESH = 512  # tokens before an edit that the drafter learns again (editors: the lines above the cursor)


def segments(context) -> list[list[int]]:
    """Text beside a prompt as segments: a flat list of ids is one; a list of lists is several."""
    if not context:
        return []
    if not hasattr(context[0], "__len__"):
        return [[int(t) for t in context]]
    return [[int(t) for t in seg] for seg in context if len(seg)]


def start_request(drafter: Drafter, history: Seq[int], prompt: Seq[int], context=(),
                  learned: set | None = None) -> list[int]:
    """What the drafter learns as a request starts (the engine's rule; replay.replay_requests and
    tools/editor/mat.py replay it): `context`, text beside the prompt, one segment or several (an
    editor's other chunks, then the code below the cursor): every segment but the last is learned
    once per drafter (`learned` holds what it has), the last every time, so it is among the most
    recent; after an edited prompt (not a continuation of `history`, the sequence it saw last) the
    REFRESH tokens before the edit again, for the same reason; then the prompt's new tokens.
    Returns the new history (the prompt)."""
    parts = segments(context)
    for i, seg in enumerate(parts):
        key = hash(tuple(seg))
        if learned is not None and i < len(parts) - 1:
            if key in learned:
                continue
            if len(learned) >= LEARNED_MAX:  # long gone from the drafter's tables: learn them again
                learned.clear()
            learned.add(key)
        drafter.learn(seg)
    seen = common_prefix(history, prompt)
    if seen < len(history):
        drafter.learn(prompt[max(0, seen - REFRESH):seen])
    drafter.observe(prompt[seen:])
    return list(prompt)
