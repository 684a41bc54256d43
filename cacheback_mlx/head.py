"""The output head over only the rows whose logits a pass reads.

A batch's shared pass may carry a prompt chunk riding beside the lanes' rows (batch.py): the
chunk needs only its keys and values, yet the model's output head runs on every row it is given
(on a 2-core CPU, the default model's head over a 128-token chunk is ~40 ms of a ~430 ms pass, and
a vocabulary of 128k-262k tokens costs more; docs/BENCHMARKS.md §10). `prepare_head(model)` gives
the head a class that, inside `keep_rows(index)`, runs on those rows only: the logits then hold
them, in that order. The head is a linear layer named `lm_head` (the model's, or its language
model's), or, tied, an embedding's `as_linear` (every embedding's: one used only for lookups never
runs it); a model whose head is neither runs it on every row, as before. Parameters and their
names stay as they were. A head is row by row (a matrix product, then per-row soft-capping or
scaling), so each kept row gets the logits it would have had.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .kernels.linear import as_class

_local = threading.local()


@contextmanager
def keep_rows(index: mx.array):
    """While the model's graph is built on this thread: its head runs on these rows of its input
    ([1, rows, hidden]) only."""
    before = getattr(_local, "rows", None)
    _local.rows = index
    try:
        yield
    finally:
        _local.rows = before


def _kept(x: mx.array) -> mx.array:
    rows = getattr(_local, "rows", None)
    return x if rows is None or x.ndim != 3 or x.shape[0] != 1 else x[:, rows]


class KeptRowsLinear:
    """A head that is a linear layer (mixed in before the layer's own class)."""

    kernels_may_wrap = True  # kernels/linear.py may route what this one's base class computes

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(_kept(x))


class KeptRowsEmbedding:
    """A tied head: the embedding's as_linear (its lookups unchanged)."""

    kernels_may_wrap = True

    def as_linear(self, x: mx.array) -> mx.array:
        return super().as_linear(_kept(x))


_derived: dict = {}


def _with(mixin: type, cls: type) -> type:
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _derived:
        _derived[mixin, cls] = type("KeptRows" + cls.__name__, (mixin, cls), {})
    return _derived[mixin, cls]


def prepare_head(model: nn.Module) -> int:
    """Give the model's head (see the module's docstring) its kept-rows class; how many modules
    now have one (0: no head found, every pass runs the head on all its rows)."""
    done = 0

    def convert(path: str, m):
        nonlocal done
        if path.rsplit(".", 1)[-1] == "lm_head" and isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            done += 1
            return as_class(_with(KeptRowsLinear, type(m)), m)
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            done += 1
            return as_class(_with(KeptRowsEmbedding, type(m)), m)
        return m

    leaves = tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return done
