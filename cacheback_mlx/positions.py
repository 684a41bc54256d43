"""Positions in a tree pass: every row's position is the cache offset + its depth, never its row.

A chain pass needs nothing: the model computes positions offset, offset+1, ... as in plain
decoding. A tree pass lays siblings out side by side, so anything a model computes from a row's
position must see offset + depth instead:

- RoPE modules (an attribute named `rope`, applied as `self.rope(x, offset=...)`): wrapped by
  TreeRoPE, which gives each row its own offset.
- Extra position-dependent terms some families compute (Ministral 3 / Llama 4 attention scaling
  `1 + beta * log(1 + floor(pos / original_max))`): a handler per family in HANDLERS.
- Anything else: `position_uses` reads the source of the mlx-lm modules a model runs and lists
  every line that touches positions and matches no known-safe form; a model with such a line gets
  chain drafts only (exact, as a chain needs no position fix). tests/test_positions.py fails when
  a family of the installed mlx-lm has lines nobody has classified.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn


class TreePass:
    """Per-pass tree layout shared by a model's RoPE wrappers and its caches (unset = a chain)."""

    active: "TreePass | None" = None  # the pass in flight (read by family handlers)

    def __init__(self):
        self.rel: mx.array | None = None  # [T] int32: row position - cache offset
        self.in_pass: mx.array | None = None  # [T, T] bool: row i may see row j of this pass
        self.tail: mx.array | None = None  # [T, t] bool: row i may see the j-th of the last t cached
        # slots (None: every cached slot); a draft tree kept in the cache (draft_model/runner.py)
        self.host = None  # in_pass as a numpy array, when the pass's attention goes row by row (kernels/)

    def set(self, rel: mx.array, in_pass: mx.array, tail: mx.array | None = None, host=None) -> None:
        self.rel, self.in_pass, self.tail, self.host = rel, in_pass, tail, host
        TreePass.active = self

    def clear(self) -> None:
        self.rel = self.in_pass = self.tail = self.host = None
        TreePass.active = None


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE so each tree row gets its own position (cache offset + depth).

    mx.fast.rope takes one offset per batch row, so the T rows of a pass are laid out as T batch
    rows of one token each: [1, H, T, D] -> [T, H, 1, D] -> rope with offsets -> back. A pass of B
    sequences side by side ([B, H, T, D], a batch's lanes: shared_pass.py) has B * T positions,
    sequence by sequence."""

    def __init__(self, inner: nn.Module, tree_pass: TreePass):
        super().__init__()
        self.inner = inner
        self.tree_pass = tree_pass

    def __call__(self, x, offset=0):
        rel = self.tree_pass.rel
        if rel is None:
            return self.inner(x, offset=offset)
        B, H, T, D = x.shape
        if B == 1:
            rows = x.transpose(2, 1, 0, 3)
            return self.inner(rows, offset=offset + rel).transpose(2, 1, 0, 3)
        rows = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
        return self.inner(rows, offset=offset + rel).reshape(B, T, H, D).transpose(0, 2, 1, 3)


def model_family(model: nn.Module) -> str:
    args = getattr(model, "args", None) or getattr(model, "config", None)
    name = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


def attach_tree_pass(model: nn.Module) -> TreePass:
    """Install TreeRoPE on every `rope` module of an mlx-lm model (once) and return its TreePass."""
    existing = getattr(model, "_cacheback_tree_pass", None)
    if existing is not None:
        return existing
    tree_pass = TreePass()
    owners = [m for _, m in model.named_modules() if isinstance(m.get("rope"), nn.Module)]
    for m in owners:
        if not isinstance(m["rope"], TreeRoPE):
            m.rope = TreeRoPE(m["rope"], tree_pass)
    object.__setattr__(model, "_cacheback_tree_pass", tree_pass)
    return tree_pass


# --- families with extra position-dependent terms --------------------------------------------

def _llama4_scale(original):
    """Ministral 3's attention scale from each row's position; the original for chains."""

    def scale(size, offset, beta, max_position_embeddings):
        tp = TreePass.active
        if tp is None or tp.rel is None or tp.rel.shape[0] != size:
            return original(size, offset, beta, max_position_embeddings)
        pos = (offset + tp.rel).astype(mx.float32)
        return (1 + beta * mx.log(1 + mx.floor(pos / max_position_embeddings)))[:, None]

    scale.cacheback_wrapped = True
    return scale


def _patch_ministral3() -> None:
    from mlx_lm.models import ministral3

    if not getattr(ministral3._get_llama_4_attn_scale, "cacheback_wrapped", False):
        ministral3._get_llama_4_attn_scale = _llama4_scale(ministral3._get_llama_4_attn_scale)


# module -> (the lines its handler makes right, the handler)
HANDLERS = {
    "ministral3": (("_get_llama_4_attn_scale", "mx.arange(size) + offset", "offset = offset[:, None]",
                    "isinstance(offset, mx.array) and offset.ndim > 0"), _patch_ministral3),
}

# --- finding position-dependent code -----------------------------------------------------------

# functions that never run in a forward pass
SKIP_FUNCTIONS = {"__init__", "sanitize", "make_cache", "quant_predicate", "cast_predicate", "shard",
                  "layers", "__post_init__", "from_dict"}
SKIP_MODULES = {"base", "cache", "activations", "switch_layers", "rope_utils"}
# statements that compute with a name of a position but not with a token's position: mlx-lm's
# recurrent mixers gather their conv window by the rows of the pass (`cache.lengths`, recurrent.py)
NOT_POSITIONS = ("(ends[:, None] + mx.arange(n_keep))", "cache[0] = mx.take_along_axis(")
NEUTRAL_CALLS = {"array", "rope"}  # mx.array(cache.offset) reads it; self.rope(x, offset=...) is TreeRoPE's


def _name(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _is_position(node) -> bool:
    return _name(node) in ("offset", "position_ids", "positions", "position")


class _Finder(ast.NodeVisitor):
    """Flags a statement that computes with a position: arithmetic, comparisons or indexing on
    an offset, an offset handed to a function by position, or any arange. Copying an offset
    (assignments, tuples, returns) and handing it on as `offset=` (the callee is read on its own)
    are not computations."""

    def __init__(self):
        self.found = False

    def visit_Call(self, node):
        if _name(node.func) == "arange":
            self.found = True
        neutral = _name(node.func) in NEUTRAL_CALLS
        if not neutral and any(_is_position(a) for a in node.args):
            self.found = True
        for k in node.keywords:
            if _is_position(k.value) and not (neutral or k.arg == "offset"):
                self.found = True
        self.generic_visit(node)

    def _operands(self, node, parts):
        if any(_is_position(p) for p in parts):
            self.found = True
        self.generic_visit(node)

    def visit_BinOp(self, node):
        self._operands(node, [node.left, node.right])

    def visit_Compare(self, node):
        self._operands(node, [node.left, *node.comparators])

    def visit_Subscript(self, node):
        self._operands(node, [node.value, node.slice])


def _forward_statements(source: str) -> list[ast.AST]:
    """The statements of a module that may run in a forward pass (not construction or weight
    loading); for compound statements only their header expression."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (
                node.name in SKIP_FUNCTIONS or node.name.endswith(("Args", "Config"))):
            skip.update(range(node.lineno, node.end_lineno + 1))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or node.lineno in skip:
            continue
        if isinstance(node, (ast.If, ast.While)):
            out.append(node.test)
        elif isinstance(node, ast.For):
            out.append(node.iter)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.Try,
                                   ast.Import, ast.ImportFrom)):
            out.append(node)
    return out


@lru_cache(maxsize=None)
def module_position_uses(module_name: str) -> tuple[str, ...]:
    """Statements of an mlx-lm model module that compute with positions and that no handler covers."""
    short = module_name.rsplit(".", 1)[-1]
    if short in SKIP_MODULES:
        return ()
    return source_position_uses(inspect.getsource(sys.modules[module_name]), HANDLERS.get(short, ((), None))[0])


def source_position_uses(source: str, handled: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The statements of a module's source that compute with positions, less those whose text
    holds one of the `handled` strings."""
    out = []
    lines = source_lines(source)
    for node in _forward_statements(source):
        finder = _Finder()
        finder.visit(node)
        text = " ".join(_segment(lines, node).split())
        if finder.found and not any(h in text for h in handled + NOT_POSITIONS):
            out.append(text)
    return tuple(out)


def source_lines(source: str) -> list[str]:
    """The source's lines with their ends, numbered as the parser numbers them (CRLF, CR or LF)."""
    return re.split(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)", source)


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) from source_lines(source) (its columns count UTF-8
    bytes): get_source_segment splits the whole module again for every node, a quarter of a
    second for a hybrid family's module."""
    first, last = node.lineno - 1, node.end_lineno - 1
    head = lines[first].encode()
    if first == last:
        return head[node.col_offset : node.end_col_offset].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head[node.col_offset :].decode(), *lines[first + 1 : last], tail])


def model_modules(model: nn.Module) -> list[str]:
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return sorted(n for n in names if n.startswith("mlx_lm.models."))


def position_uses(model: nn.Module) -> list[str]:
    """Every unhandled position-dependent line of the code the model runs ('module: line')."""
    return [f"{m.rsplit('.', 1)[-1]}: {line}" for m in model_modules(model) for line in module_position_uses(m)]


def prepare_positions(model: nn.Module) -> list[str]:
    """Install the handlers the model's families need; return the lines left unhandled (trees on
    such a model would be wrong, so it gets chains)."""
    for m in model_modules(model):
        handler = HANDLERS.get(m.rsplit(".", 1)[-1])
        if handler:
            handler[1]()
    return position_uses(model)
