"""What a request may carry on every protocol: unknown fields ignored anywhere, no lone surrogates,
and the sampling fields each protocol names its own way: temperature and the samplers, stop strings,
penalties and logit biases (mlx-lm's logits processors), log-probabilities (logprobs.py) and
structured output (constrained.py). Each protocol's request models extend these (llama_cpp.py,
openai.py, ollama.py).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..constrained import grammar_of
from ..errors import CachebackError
from ..sampling import SamplingParams, penalties
from .logprobs import TOP_MAX

# The most tokens a request may ask for (a 32-bit int, as clients send): any limit is taken and the
# reply stops where the context ends, as llama.cpp's, Ollama's and mlx-lm's servers do; clients ask
# for 8,192 or more (agents, long answers) on models whose context holds that.
TOKEN_LIMIT = 2**31 - 1


def no_lone_surrogates(value: Any) -> None:
    """JSON can carry UTF-16 halves (\\ud800) that are no text at all: refuse them anywhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("invalid Unicode: a lone surrogate in a text field") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            no_lone_surrogates(k)
            no_lone_surrogates(v)
    elif isinstance(value, list):
        for v in value:
            no_lone_surrogates(v)


class Lenient(BaseModel):
    """Clients send many fields we do not use (samplers, cache_prompt, id_slot, time, ...):
    unknown keys anywhere are ignored, never a 400."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data):
        no_lone_surrogates(data)
        return data


class Sampling(Lenient):
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, lt=1 << 64)  # negative: random, as llama.cpp's -1
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)  # XTC, as mlx-lm's server and llama.cpp name it
    xtc_threshold: float = Field(0.1, ge=0.0, le=0.5)
    stop: str | list[str] | None = None
    stream: bool = False
    # penalties over the last tokens (the prompt's too), as mlx-lm's logits processors apply them
    repeat_penalty: float | None = Field(None, ge=0.0, le=100.0)  # llama.cpp's and Ollama's name (1: none)
    repetition_penalty: float | None = Field(None, ge=0.0, le=100.0)  # mlx-lm's server's name
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # (null, as some clients send: none)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=1 << 20)  # tokens looked back over (-1: all, 0: none)
    repetition_context_size: int | None = Field(None, ge=0, le=1 << 20)  # mlx-lm's name
    logit_bias: dict[int, float] | None = None  # token id -> bias (_biases: as clients send them)
    # log-probabilities (logprobs.py): OpenAI's chat and Ollama's `logprobs: true` with `top_logprobs`
    # alternatives; OpenAI's completions' `logprobs: N` (N alternatives); llama.cpp's `n_probs: N`
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_MAX)
    n_probs: int = Field(0, ge=0, le=TOP_MAX)
    # structured output (constrained.py): OpenAI's (and llama.cpp's) response_format, llama.cpp's
    # json_schema and grammar (GBNF); Ollama's `format` comes here too (ollama.py)
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    WINDOW: ClassVar[int] = 64  # llama.cpp's and Ollama's repeat_last_n by default

    def params(self, offset: int = 0, constraint=None, xtc_special: tuple = ()) -> SamplingParams:
        """The engine's sampling; `constraint`: the structured output's processor (constrained.py),
        applied after the penalties and biases; `xtc_special`: the ids XTC keeps (sampling.xtc_special)."""
        seed = None if self.seed is None or self.seed < 0 else (self.seed + offset) % (1 << 64)
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=seed, xtc_probability=self.xtc_probability,
                              xtc_threshold=self.xtc_threshold, xtc_special=xtc_special,
                              logits_processors=self.processors() + ((constraint,) if constraint else ()),
                              logprobs=self.alternatives() is not None)

    def structure(self) -> str | None:
        """The llguidance grammar the answer keeps to (None: free text)."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise CachebackError(f"response_format type {kind!r}: give text, json_object or json_schema")
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else fmt.get("schema")
            if schema is None:
                raise CachebackError("response_format json_schema: give {\"json_schema\": {\"schema\": {...}}}")
            return grammar_of(json_schema=schema)
        if kind == "json_object":  # (llama.cpp takes a schema here too)
            return grammar_of(json_schema=fmt["schema"]) if fmt.get("schema") else grammar_of(any_json=True)
        if self.json_schema is not None:
            return grammar_of(json_schema=self.json_schema)
        if self.grammar:
            return grammar_of(gbnf=self.grammar)
        return None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if not isinstance(value, bool) and isinstance(value, int) and not 0 <= value <= TOP_MAX:
            raise ValueError(f"give true/false, or how many alternatives per token (0 to {TOP_MAX})")
        return value

    def alternatives(self) -> int | None:
        """How many of the likeliest tokens each token's entry lists; None: no log-probabilities."""
        if self.n_probs:
            return self.n_probs
        if self.logprobs is None or self.logprobs is False:
            return None
        return (self.top_logprobs or 0) if self.logprobs is True else self.logprobs

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases(cls, value):
        """OpenAI's {"id": bias} or llama.cpp's [[id, bias], ...]; a bias of false: never that token."""
        if value is None:
            return None
        pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
        if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise ValueError('give {"token id": bias, ...} or [[token id, bias], ...]')
        out = {}
        for token, bias in pairs:
            whole = isinstance(token, int) or (isinstance(token, str) and token.lstrip("-").isdigit())
            if isinstance(token, bool) or not whole:
                raise ValueError(f"token ids must be integers (got {token!r})")
            if bias is True:  # (llama.cpp: true leaves a token as it is)
                continue
            if bias is not False and not (isinstance(bias, (int, float)) and abs(bias) <= 1e4):
                raise ValueError(f"a bias must be a number from -10000 to 10000, or false (got {bias!r})")
            out[int(token)] = -math.inf if bias is False else float(bias)
        return out

    def biases(self) -> dict[int, float]:
        return dict(self.logit_bias or {})

    def processors(self) -> tuple:
        window = next((w for w in (self.repetition_context_size, self.repeat_last_n) if w is not None), self.WINDOW)
        repetition = self.repetition_penalty if self.repetition_penalty is not None else self.repeat_penalty
        return penalties(repetition, self.presence_penalty or 0.0, self.frequency_penalty or 0.0, window,
                         self.biases())

    def check_biases(self, vocab: int) -> None:
        wrong = sorted(t for t in self.biases() if not 0 <= t < vocab)
        if wrong:
            raise CachebackError(f"logit_bias: token ids must be in [0, {vocab}); got {wrong[0]}")

    def stops(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return [s for s in self.stop or [] if s]
