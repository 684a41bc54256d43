"""Whether a model's lanes may share a pass (batch.py asks once per model): from its structure
(sharing_reason), then by running one (check_sharing): a shared pass (shared_pass.batch_pass)
against each lane's pass of its own, on fresh caches."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .engine import Engine
from .kvcache import KVStack, ModelCache, TreeKVCache, cache_leaves
from .recurrent import RecurrentCache
from .shared_pass import NotShared, batch_pass
from .tree import DraftTree
from .verify import prefill, verify_pass

TOLERANCE = 1e-3  # check_sharing: largest difference of a logit, relative to the largest logit


class Sharing(NamedTuple):
    """Whether lanes of a model share a pass (check_sharing's answer)."""

    reason: str | None  # why its lanes take turns (None: they share each pass)
    undo_padded: bool = False  # lanes side by side: a lane padded to the widest is undone after the
    # pass (the mixers, Mamba 1's and Jamba's, run the padding into its states) and feeds its
    # accepted tokens again; a lane as wide as the pass keeps what it accepted
    packed: bool = False  # the model attends over the keys its caches return: every lane's keys end
    # to end, each lane's rows masked to its own (shared_pass.PassPlan.packed_mask)


def sharing_reason(engine: Engine) -> str | None:
    """Why lanes of this engine's model cannot share a pass (None: they can), from its structure;
    check_sharing then tries one."""
    cache = engine.seq.cache
    if cache.recurrent:  # lanes side by side, as chains
        if engine.position_code:
            return f"position-dependent code: {engine.position_code}"
        if not all(isinstance(c, (TreeKVCache, RecurrentCache)) for c in cache_leaves(cache.layers)):
            return "layer caches that are neither key/value caches nor recurrent states"
    elif engine.chain_reason:
        return engine.chain_reason
    elif not all(isinstance(c, TreeKVCache) for c in cache.layers):
        return "layer caches that are not plain key/value caches"
    if engine.peers is not None:
        return "a model sharded over processes"
    return None


_checked: dict[int, tuple] = {}  # id(model) -> (model, check_sharing's answer)


def sharing(engine: Engine) -> Sharing:
    """check_sharing's answer for the engine's model, checked once per model."""
    model = engine.model
    seen = _checked.get(id(model))
    if seen is None or seen[0] is not model:
        seen = _checked[id(model)] = (model, check_sharing(engine))
    return seen[1]


def check_sharing(engine: Engine) -> Sharing:
    """Run two small lanes (a chain and a tree, 7 and 12 rows; two chains, 7 and 11, on a model
    with recurrent layers) in one shared pass and each in a pass of its own, on fresh caches: they
    share passes when their logits and the recurrent states they leave agree. They agree to
    rounding, not bits: a matmul's rows round differently with the number of rows (BLAS blocks
    them), as a verify pass's rows already do against one-row steps; a wrong position, mask or
    state is far off. Side by side, the 7-row lane is padded to 11: where only its states differ
    (mixers that run the padding into them), lanes still share passes, a padded lane undone after
    each (Sharing.undo_padded). A model whose attention does not take the lanes' masks is tried
    again with every lane's keys end to end (Sharing.packed)."""
    reason = sharing_reason(engine)
    if reason:
        return Sharing(reason)
    try:
        return _try_sharing(engine, packed=False)
    except (NotShared, TypeError, AttributeError, ValueError) as e:
        failed = f"its attention cannot be shared ({type(e).__name__}: {e})"
    if engine.seq.cache.recurrent:
        return Sharing(failed)
    try:  # a model that attends over the keys its caches return
        answer = _try_sharing(engine, packed=True)
    except (NotShared, TypeError, AttributeError, ValueError):
        return Sharing(failed)
    return answer if answer.reason else answer._replace(packed=True)


def _try_sharing(engine: Engine, packed: bool) -> Sharing:
    model, vocab = engine.model, engine.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(20)], [(5 * i + 1) % vocab for i in range(9)]]
    second = [-1, 0, 1, 2, 3, 4, 5, 6] if engine.seq.cache.recurrent else [-1, -1, 0, 0, 1, 3, 3, 5]
    trees = [DraftTree([(i + 2) % vocab for i in range(4)], [-1, 0, 1, 2]),
             DraftTree([(3 * i + 1) % vocab for i in range(8)], second)]
    leads = [p[-3:] for p in prompts]
    runs = []
    for shared in (False, True):
        stacks = [KVStack(len(prompts)) for _ in ModelCache(model).layers] if shared else None
        caches = [ModelCache(model, stacks, row) for row in range(len(prompts))]
        for c, p in zip(caches, prompts):
            prefill(model, c, p[:-3])
        passes = [(c, lead, t, len(lead) + len(t)) for c, lead, t in zip(caches, leads, trees)]
        logits = (batch_pass(model, passes, packed) if shared else
                  [verify_pass(model, c, lead, t, rows=r) for c, lead, t, r in passes])
        states = [[a for r in c.recurrent for a in r.cache if a is not None] for c in caches]
        mx.eval(logits, states)
        runs.append((logits, states))
    (solo, solo_states), (shared, shared_states) = runs
    if not all(_close(a, b) and mx.array_equal(a.argmax(-1), b.argmax(-1)).item() for a, b in zip(solo, shared)):
        return Sharing("a shared pass differs from passes of its own beyond rounding")
    agree = [all(_close(a, b) for a, b in zip(x, y)) for x, y in zip(solo_states, shared_states)]
    if not agree[1]:  # the lane as wide as the pass
        return Sharing("a shared pass leaves recurrent states other than passes of their own")
    return Sharing(None, undo_padded=not agree[0])


def describe(answer: Sharing, recurrent: bool) -> str:
    """How several requests at once run on a model (`doctor --model`)."""
    if answer.reason:
        return f"in turns, a pass each ({answer.reason})"
    how = "side by side, chains padded to the widest" if recurrent else "rows end to end"
    if answer.packed:
        how += ", every lane's keys end to end"
    if answer.undo_padded:
        how += ", a lane narrower than the pass undone after it"
    return f"one shared pass, {how}"


def _close(a: mx.array, b: mx.array) -> bool:
    scale = max(1.0, mx.abs(a).max().item())
    return a.shape == b.shape and mx.abs(a - b).max().item() <= TOLERANCE * scale
