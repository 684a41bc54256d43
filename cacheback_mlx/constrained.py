"""Structured output: text that keeps to a grammar (a JSON schema, any JSON, a Lark grammar or
llama.cpp's GBNF), matched by llguidance.

The constraint is one of mlx-lm's logits processors, (tokens, logits) -> logits: it masks every
token the grammar does not allow after `tokens`. So it runs like the penalties, at every row of a
pass with the tokens before that row's position (sampling.processed_rows), and greedy output with
it equals mlx-lm's generate_step with the same processor, whatever is drafted. Rows are processed
root first, then each node after its parent, so the matcher moves along the tree by rolling back
to the common prefix and consuming the rest; a row after a draft token the grammar forbids cannot
be reached (its parent's row masks that token) and is left as it is.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import CachebackError
from .tree import common_prefix

_TOKENIZERS: dict[int, Any] = {}  # id(tokenizer) -> (tokenizer, llguidance's view of it): ~1 s to build
# JSON's whitespace: any, as models pretty-print, but at most 20 characters at a time (as llama.cpp's
# schemas do): unbounded, a model can keep writing spaces and never end; a schema's "x-guidance" wins
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n]{0,20}"}


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise CachebackError("structured output needs llguidance (pip install llguidance)") from None
    return llguidance


def grammar_of(json_schema: Any = None, any_json: bool = False, lark: str | None = None,
               gbnf: str | None = None) -> str:
    """The llguidance grammar for one of: a JSON schema (a dict, or its text), any JSON object, a
    Lark grammar, llama.cpp's GBNF; a bad one is a one-line error."""
    llg = _llg()
    try:
        if json_schema is not None:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
            if not isinstance(schema, dict):
                raise CachebackError("a JSON schema must be an object")
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if any_json:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if gbnf is not None:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(gbnf)
            except Exception as e:  # noqa: BLE001 (the converter raises plain Exceptions on bad grammars)
                raise ValueError(f"GBNF: {e}") from None
            return llg.LLMatcher.grammar_from_lark(lark)
        return llg.LLMatcher.grammar_from_lark(lark or "")
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise CachebackError(f"grammar: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def llg_tokenizer(tokenizer, eos_ids) -> Any:
    """llguidance's view of an mlx-lm TokenizerWrapper's Hugging Face tokenizer (kept per tokenizer)."""
    key = id(tokenizer)
    kept = _TOKENIZERS.get(key)
    if kept is None or kept[0] is not tokenizer:
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        try:
            view = llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos_ids) or None)
        except Exception as e:  # noqa: BLE001 (only fast tokenizers have what it reads)
            raise CachebackError(f"structured output: this model's tokenizer cannot be read ({e})") from None
        kept = _TOKENIZERS[key] = (tokenizer, view)
    return kept[1]


def check(grammar: str, tokenizer, eos_ids) -> None:
    """A one-line error for a grammar llguidance refuses."""
    error = _llg().LLMatcher.validate_grammar(grammar, llg_tokenizer(tokenizer, eos_ids))
    if error and not error.startswith("WARNING"):
        raise CachebackError(f"grammar: {error.splitlines()[0]}")


class Constrained:
    """A logits processor keeping a generation to `grammar` from position `start` on (the prompt's
    length: mlx-lm hands processors the prompt and the tokens after it)."""

    def __init__(self, grammar: str, tokenizer, eos_ids, start: int):
        llg = _llg()
        self.view = llg_tokenizer(tokenizer, eos_ids)
        self.matcher = llg.LLMatcher(self.view, grammar, log_level=0)
        if self.matcher.is_error():
            raise CachebackError(f"grammar: {self.matcher.get_error().splitlines()[0]}")
        self.start = start
        self.fed: list[int] = []  # the tokens the matcher has consumed

    def _move_to(self, out: list[int]) -> bool:
        """Bring the matcher to just after `out`; False when the grammar forbids a token of it."""
        k = common_prefix(self.fed, out)
        if k < len(self.fed):
            self.matcher.rollback(len(self.fed) - k)
            del self.fed[k:]
        rest = out[k:]
        ok = self.matcher.validate_tokens(rest) if rest else 0
        if ok and self.matcher.consume_tokens(rest[:ok]):
            self.fed += rest[:ok]
        return ok == len(rest)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        out = tokens[self.start:].tolist()
        if not self._move_to(out):
            return logits  # a row no accepted path reaches
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        vocab = logits.shape[-1]
        allowed = np.zeros(vocab, bool)
        n = min(vocab, len(bits))
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, logits.dtype))
