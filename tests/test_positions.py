"""Positions in tree passes: the detector of position-dependent code, its classification of every
mlx-lm family, and the Ministral 3 attention-scaling handler across a position threshold."""

import ast
import importlib
import inspect
import pkgutil

from cacheback_mlx import positions
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.positions import HANDLERS, module_position_uses, source_position_uses
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
import mlx_lm.models

import zoo

# Families of mlx-lm 0.32 whose forward pass computes with positions in ways a tree pass cannot
# place (they get chain drafts), reviewed by hand. A new family or a changed one makes
# test_every_family_is_classified fail: handle it in positions.HANDLERS, or review it and add it.
CHAIN_ONLY = {
    "bailing_hybrid": "recurrent", "bailing_moe_v3": "recurrent", "deepseek_v2": "YaRN mscale ramp",
    "deepseek_v41": "indexer positions", "gear": "own causal mask",
    "gpt2": "learned positions", "gpt_bigcode": "learned positions",
    "internlm3": "dynamic NTK from length", "iquestloopcoder": "loop positions", "kimi_linear": "recurrent",
    "llama4": "chunked attention, temperature",
    "minimax_m3_vl": "own masks", "mistral4": "llama 4 scaling (own copy)",
    "muse_spark": "vision grid", "nanochat": "own rotary",
    "phi3small": "blocksparse positions", "plamo2": "recurrent", "plamo3": "own masks",
    "talkie": "own positions",
}


def test_every_family_is_classified():
    unclassified = {}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        name = f"mlx_lm.models.{info.name}"
        try:
            importlib.import_module(name)
        except BaseException:  # a family needing an extra package (olmo exits when it is missing)
            continue
        uses = module_position_uses(name)
        if uses and info.name not in CHAIN_ONLY:
            unclassified[info.name] = uses
    assert not unclassified, f"position-dependent code nobody has classified: {unclassified}"


def test_statements_are_read_as_the_parser_places_them():
    """The detector reads each statement's text from the module's lines split once: the same text
    as ast.get_source_segment, on real modules and on non-ASCII text, CRLF and CR line ends and
    statements over several lines."""
    odd = ("x = 1\r\ny = 'é' + 'ü' ; z = (y +\r\n     'ß')\rw = [1,\n  2]\n"
           "def f(self, cache):\n    s = 'π' * cache.offset\n    return s\n")
    sources = [odd] + [inspect.getsource(importlib.import_module(f"mlx_lm.models.{m}"))
                       for m in ("llama", "ministral3", "gemma3n", "qwen3_next")]
    for source in sources:
        lines = positions.source_lines(source)
        statements = positions._forward_statements(source)
        assert len(statements) > 3
        for node in statements:
            assert positions._segment(lines, node) == ast.get_source_segment(source, node)
    assert source_position_uses(odd) == ("s = 'π' * cache.offset",)


def test_the_detector_sees_position_code():
    flagged = source_position_uses(
        "def f(self, x, cache):\n"
        "    q = self.rope(x, offset=cache.offset)\n"  # TreeRoPE: fine
        "    offset = cache.offset\n"  # a copy: fine
        "    y = self.layer(x, offset=offset)\n"  # handed on: fine
        "    pos = mx.arange(offset, offset + x.shape[1])\n"  # computed: flagged
        "    s = 1 + mx.log(1 + mx.floor(offset / 8))\n"  # computed: flagged
        "    return q * s + self.wpe(pos)\n")
    assert flagged == ("pos = mx.arange(offset, offset + x.shape[1])", "s = 1 + mx.log(1 + mx.floor(offset / 8))")
    # without its handler, Ministral 3's attention scaling is flagged
    assert module_position_uses("mlx_lm.models.ministral3") == ()
    raw = inspect.getsource(importlib.import_module("mlx_lm.models.ministral3"))
    assert any("_get_llama_4_attn_scale" in s for s in source_position_uses(raw))
    assert "ministral3" in HANDLERS


def test_tree_rows_use_their_depth_across_a_position_threshold():
    """Ministral 3 scales attention by floor(position / 16) here. A wide tree after 28 cached
    tokens has rows 28..35 but positions 28..30: a scale taken from the row index would cross 32."""
    from mlx_lm.models import ministral3

    model = zoo.tiny_model("ministral3")
    model.set_dtype(mx.float64)  # no float32 noise: a wrong scale shows at once
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert eng.chain_reason is None  # the handler makes trees exact, so trees are allowed
    prompt = [(5 * i + 2) % 97 + 1 for i in range(29)]
    tree = DraftTree([3, 4, 5, 6, 7, 8, 9], [-1, -1, -1, 0, 0, 1, 1])
    assert zoo.tree_logits_error(model, tree, prompt) <= 1e-9
    patched = ministral3._get_llama_4_attn_scale
    ministral3._get_llama_4_attn_scale = patched.__closure__[0].cell_contents  # the original
    try:
        assert zoo.tree_logits_error(model, tree, prompt) > 1e-3  # the test can see the bug
    finally:
        ministral3._get_llama_4_attn_scale = patched
