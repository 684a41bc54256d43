"""Linear layers whose verify passes may run the exact-rows kernel (kernels/__init__.py).

`convert(model)` gives each plain `nn.Linear` without a bias, and each `nn.Embedding` (a tied
output head runs `as_linear`), a subclass that asks `exact_rows` first and otherwise runs MLX's
own matmul. The parameters, their names and everything outside a verify pass stay as they were.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from . import exact_rows, in_rows_pass  # (kernels/__init__ imports this file only in attach())


class RowsLinear(nn.Linear):
    """nn.Linear without a bias. Outside a verify pass (a plain step: every linear layer of every
    step) it costs one call more than nn.Linear: on a GPU a small model's step is bound by the host
    (building its graph, launching its kernels), so every Python call there counts."""

    def __call__(self, x: mx.array) -> mx.array:
        if in_rows_pass():
            out = exact_rows(x, self["weight"])
            if out is not None:
                return out
        return x @ self["weight"].T  # nn.Linear's, without a bias


class RowsEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        out = exact_rows(x, self["weight"]) if in_rows_pass() else None
        return x @ self["weight"].T if out is None else out


def _as(cls, module: nn.Module) -> nn.Module:
    """The same module (its parameters and state, by the same names) as an instance of cls."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    dict.update(new, module)
    new.__dict__.update(module.__dict__)
    return new


def convert(model: nn.Module) -> list[mx.Dtype]:
    """Route the model's plain linear layers and embeddings through exact_rows; returns their
    weights' dtypes (one entry per layer converted)."""
    dtypes = []

    def convert(_path, m):
        if type(m) is nn.Linear and "bias" not in m:
            dtypes.append(m["weight"].dtype)
            return _as(RowsLinear, m)
        if type(m) is nn.Embedding:
            dtypes.append(m["weight"].dtype)
            return _as(RowsEmbedding, m)
        return m

    leaves = tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return dtypes
