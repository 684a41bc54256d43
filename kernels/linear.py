"""Linear layers whose verify passes may run the exact-rows kernels (kernels/__init__.py).

`convert(model)` gives each plain `nn.Linear` without a bias, and each `nn.Embedding` (a tied
output head runs `as_linear`), a subclass that asks `exact_rows` first and otherwise runs MLX's
own matmul; each `nn.Linear` with a bias one that asks `exact_rows_biased`; each
`nn.QuantizedLinear` and `nn.QuantizedEmbedding` of a layout rows_qmatmul takes one that asks
`exact_rows_quantized`. The parameters, their names and everything outside a verify pass stay as
they were.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from . import exact_rows, exact_rows_biased, exact_rows_quantized, in_rows_pass  # (kernels/__init__: attach())
from .rows_qmatmul import BITS, GROUPS


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


class RowsBiasedLinear(nn.Linear):
    """nn.Linear with a bias: in a verify pass, each row through the one-row step's own call."""

    def __call__(self, x: mx.array) -> mx.array:
        out = exact_rows_biased(x, self["weight"], self["bias"]) if in_rows_pass() else None
        return super().__call__(x) if out is None else out


class RowsEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        out = exact_rows(x, self["weight"]) if in_rows_pass() else None
        return x @ self["weight"].T if out is None else out


class RowsQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = exact_rows_quantized(x, self) if in_rows_pass() else None
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out  # as nn.QuantizedLinear adds it: apart


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        out = exact_rows_quantized(x, self) if in_rows_pass() else None
        return super().as_linear(x) if out is None else out


def _quantized_kind(m: nn.Module):
    """(dtype, bits, group size) of a quantized layer rows_qmatmul may take, else None."""
    if getattr(m, "mode", "affine") != "affine" or m.bits not in BITS or m.group_size not in GROUPS:
        return None
    return (m["scales"].dtype, m.bits, m.group_size)


_ROUTED = (RowsLinear, RowsBiasedLinear, RowsEmbedding, RowsQuantizedLinear, RowsQuantizedEmbedding)
_derived: dict = {}


def _rows_class(m: nn.Module, base: type, rows: type):
    """The class m becomes: `rows` for a plain `base`; for a subclass of `base` that declares
    `kernels_may_wrap` (its methods add to what the base class's return, as random_models' masked
    heads do), a class of both; else None (MLX's own ops, as the subclass wrote them)."""
    cls = type(m)
    if cls is base:
        return rows
    if issubclass(cls, base) and getattr(cls, "kernels_may_wrap", False):
        if (cls, rows) not in _derived:
            _derived[cls, rows] = type("Rows" + cls.__name__, (cls, rows), {})
        return _derived[cls, rows]
    return None


def as_class(cls, module: nn.Module) -> nn.Module:
    """The same module (its parameters and state, by the same names) as an instance of cls."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    dict.update(new, module)
    new.__dict__.update(module.__dict__)
    return new


def convert(model: nn.Module) -> list:
    """Route the model's plain linear layers and embeddings through exact_rows, its biased ones
    through exact_rows_biased and its quantized ones of a layout the kernel takes through
    exact_rows_quantized; returns, per layer converted, its weight's dtype (plain), ("biased",
    dtype) or (dtype, bits, group size) (quantized)."""
    kinds = []

    def convert(_path, m):
        if isinstance(m, _ROUTED):
            return m
        if _rows_class(m, nn.Linear, RowsLinear) and "bias" not in m:
            kinds.append(m["weight"].dtype)
            return as_class(_rows_class(m, nn.Linear, RowsLinear), m)
        if _rows_class(m, nn.Linear, RowsBiasedLinear):
            kinds.append(("biased", m["weight"].dtype))
            return as_class(_rows_class(m, nn.Linear, RowsBiasedLinear), m)
        if _rows_class(m, nn.Embedding, RowsEmbedding):
            kinds.append(m["weight"].dtype)
            return as_class(_rows_class(m, nn.Embedding, RowsEmbedding), m)
        for base, rows in ((nn.QuantizedLinear, RowsQuantizedLinear), (nn.QuantizedEmbedding, RowsQuantizedEmbedding)):
            if _rows_class(m, base, rows) and _quantized_kind(m) is not None:
                kinds.append(_quantized_kind(m))
                return as_class(_rows_class(m, base, rows), m)
        return m

    leaves = tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return kinds
