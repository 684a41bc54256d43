"""`random:NAME[:OPTION...]`: a popular model's real shape with seeded random weights, built in
memory with no download, to see speed and memory at sizes the embedded model cannot show.

NAME is a config shipped in data/random/ (the published config.json's fields mlx-lm's ModelArgs
reads), built with mlx-lm's own Model class. Options: q4 / q8 (nn.quantize, group size 64, on what
mlx-lm's quantize_model quantizes, as mlx-community's models are), f32 / f16 / bf16 (the float
dtype; it wins over the loader's dtype argument), layers=N (the first N layers; per-layer kind
lists are cut so that N layers still hold one layer of each kind), seed=S, vocab=N (a smaller
output head, for quick tests).

Weights (random_weights.py): a matrix has std GAIN/sqrt(fan_in) (at 1.0 deep stacks collapse
onto one token, at 1.5 greedy streams vary at any depth); embeddings 1/sqrt(hidden), unit-norm rows
as trained ones roughly have (larger ones make a tied head repeat its input; Gemma, which scales
them by sqrt(hidden), 1/hidden); experts' down projections sqrt(k) times more, as a token's k
experts are averaged; norm gains and other vectors as mlx-lm initialises them; biases zero. The
model is built lazily, then a layer at a time, each evaluated (already quantized) before
the next: peak memory stays near the final size, and a model that would not fit is refused first.

Tokens go through the embedded default model's tokenizer (SmolLM2's, 49,152 ids). The model keeps
its own vocabulary size (its embedding and head cost what they cost), but the rows of ids the
tokenizer lacks are zero and the head adds MASKED_LOGIT to their logits, so neither greedy nor
sampled decoding can produce an id the tokenizer cannot decode.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import blas, footprint
from .errors import CachebackError
from .random_weights import fill, own_arrays

PREFIX = "random:"
CONFIGS = Path(__file__).parent / "data" / "random"
FLOATS = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
BITS = {"q4": 4, "q8": 8}
GROUP_SIZE = 64
MAX_CONTEXT = 32768  # context_length: the config's max_position_embeddings, at most this
MASKED_LOGIT = -1e4  # added to the logits of ids the tokenizer lacks (finite in float16 too)
OPTIONS = "q4, q8, f32, f16, bf16, layers=N, seed=S, vocab=N"
PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern's codes
GAIN = 1.5  # std of a weight matrix: GAIN / sqrt(fan_in)
HEAD_GAIN = 4.0  # an untied output head: logits of std ~4, a peaked next-token distribution


@dataclass(frozen=True)
class Spec:
    name: str
    bits: int | None = None
    dtype: str | None = None  # float32 / float16 / bfloat16 when the spec names one
    layers: int | None = None  # None: all of them
    seed: int = 0
    vocab: int | None = None

    def __str__(self) -> str:  # the normalized spec: options in one order, defaults left out
        options = [f"q{self.bits}" if self.bits else "", {v: k for k, v in FLOATS.items()}.get(self.dtype, ""),
                   "" if self.layers is None else f"layers={self.layers}",
                   "" if self.vocab is None else f"vocab={self.vocab}", f"seed={self.seed}" if self.seed else ""]
        return ":".join([PREFIX + self.name] + [o for o in options if o])


def known_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def shipped_config(name: str) -> dict:
    """A fresh copy of NAME's shipped config."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def layer_kinds(text: dict) -> list[str]:
    """Each layer's kind, from the config's per-layer list or pattern."""
    n = int(text["num_hidden_layers"])
    if text.get("layer_types"):
        return list(text["layer_types"][:n])
    if text.get("hybrid_override_pattern"):  # Nemotron-H: a character a layer
        return [PATTERN_KINDS[c] for c in text["hybrid_override_pattern"][:n]]
    if "full_attention_interval" in text:
        k = int(text["full_attention_interval"])
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    if "sliding_window_pattern" in text:
        p = int(text["sliding_window_pattern"])
        return ["full_attention" if i % p == p - 1 else "sliding_attention" for i in range(n)]
    return ["attention"] * n


def total_layers(text: str) -> int:
    """How many layers the full model of a `random:` spec has."""
    return len(layer_kinds(_text(shipped_config(parse_spec(text).name))))


def parse_spec(text: str) -> Spec:
    """`random:NAME[:OPTION...]` -> Spec; a bad name or option is a one-line CachebackError."""
    body = text[len(PREFIX):] if text.lower().startswith(PREFIX) else text
    name, *options = body.split(":")
    name = name.strip().lower()
    if name not in known_names():
        raise CachebackError(f"unknown random model {name!r} in {text!r} (known: {', '.join(known_names())})")
    kinds = layer_kinds(_text(shipped_config(name)))
    fields: dict = {}
    for option in options:
        o = option.strip().lower()
        key, eq, value = o.partition("=")
        slot = ("bits" if o in BITS else "dtype" if o in FLOATS
                else key if eq and key in ("layers", "seed", "vocab") else None)
        if slot is None:
            raise CachebackError(f"unknown option {option!r} in {text!r} (options: {OPTIONS})")
        if slot in fields:
            raise CachebackError(f"{text!r} gives {slot} twice (options: {OPTIONS})")
        if slot in ("bits", "dtype"):
            fields[slot] = BITS.get(o) or FLOATS[o]
            continue
        if not value.isdigit():
            raise CachebackError(f"{option!r} in {text!r}: {key} takes a whole number, e.g. {key}=2")
        fields[slot] = int(value)
    layers = fields.get("layers")
    need = len(set(kinds))
    if layers is not None and not need <= layers <= len(kinds):
        which = f" (one of each kind: {', '.join(dict.fromkeys(kinds))})" if need > 1 else ""
        raise CachebackError(f"{text!r}: layers=N takes N from {need}{which} to {len(kinds)}")
    if layers == len(kinds):
        fields["layers"] = None
    return Spec(name, **fields)


def model_config(spec: Spec) -> dict:
    """The config the model is built from: the shipped one, cut to spec.layers layers (with its
    per-layer kinds kept consistent) and with spec.vocab rows."""
    config = shipped_config(spec.name)
    text = _text(config)
    if spec.vocab is not None:
        text["vocab_size"] = spec.vocab
    n = spec.layers
    if n is not None:
        kinds = layer_kinds(text)
        text["num_hidden_layers"] = n
        kept = kinds[:n]
        missing = [k for k in dict.fromkeys(kinds) if k not in kept]
        if text.get("layer_types"):
            text["layer_types"] = kept[:n - len(missing)] + missing
        if text.get("hybrid_override_pattern"):
            codes = {kind: c for c, kind in PATTERN_KINDS.items()}
            text["hybrid_override_pattern"] = "".join(codes[k] for k in kept[:n - len(missing)] + missing)
        for key in ("full_attention_interval", "sliding_window_pattern"):
            if key in text:  # the last kept layer is the full-attention one
                text[key] = min(int(text[key]), n)
        if "mlp_only_layers" in text:
            text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < n]
    return config


class _HeadBias:
    kernels_may_wrap = True  # as_linear adds to the embedding's own: the GPU kernels may route that (kernels/linear.py)

    def as_linear(self, x):
        return super().as_linear(x) + self["head_bias"]


class MaskedEmbedding(_HeadBias, nn.Embedding):
    """A tied embedding whose use as the output head adds `head_bias` (MASKED_LOGIT on the ids
    the tokenizer lacks)."""


class MaskedQuantizedEmbedding(_HeadBias, nn.QuantizedEmbedding):
    """MaskedEmbedding, quantized."""


def _quant_predicate(model):
    """What mlx-lm's quantize_model quantizes: layers with to_quantized whose input size the
    group size divides, as the model's own quant_predicate says (e.g. routers at 8 bits)."""
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % GROUP_SIZE:
            return False
        return own(path, module) if own else True

    return predicate


def _owners(model) -> list[tuple[str, nn.Module]]:
    """(path, module) for every module holding arrays of its own, in parameter order."""
    modules = dict(model.named_modules())
    out: dict[str, nn.Module] = {}
    for path, _ in tree_flatten(model.parameters()):
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        if owner in modules:
            out.setdefault(owner, modules[owner])
    return list(out.items())


def _in_layer(path: str):
    return re.search(r"(^|\.)layers\.\d+\.", path + ".")


def _keeps_float32(model, path: str) -> bool:
    cast = getattr(model, "cast_predicate", None)  # e.g. Qwen3.5's A_log stays float32
    return cast is not None and not cast(path)


def estimate_bytes(model, dtype: mx.Dtype, bits: int | None, layers_only: bool = False) -> int:
    """The bytes `model` (built, unevaluated, in float) will take in `dtype`, quantized to `bits`
    (only its layers' with `layers_only`)."""
    predicate = _quant_predicate(model)
    total = 0
    for path, m in _owners(model):
        if layers_only and not _in_layer(path):
            continue
        q = bits and predicate(path, m)
        for name, a in own_arrays(m):
            if q and name == "weight":
                b = q.get("bits", bits) if isinstance(q, dict) else bits
                total += a.size * b // 8 + 2 * (a.size // GROUP_SIZE) * dtype.size
            elif mx.issubdtype(a.dtype, mx.floating):
                total += a.size * (4 if _keeps_float32(model, f"{path}.{name}") else dtype.size)
            else:
                total += a.nbytes
    return total


def build_model(spec: Spec, dtype: str, tokenizer_vocab: int) -> nn.Module:
    """The mlx-lm model for `spec` in `dtype`, built layer by layer; refused with a one-line
    error when it would not fit in memory."""
    from mlx_lm.utils import _get_classes

    config = model_config(spec)
    model_class, args_class = _get_classes(config)
    old = np.array(mx.random.state[0])
    mx.random.seed(spec.seed)  # the constructor's own random vectors (e.g. A_log) follow the seed
    model = model_class(args_class.from_dict(config))
    mx.random.seed(int(old.view(np.uint64)[0]))  # the caller's generator goes on from its own state
    if hasattr(model, "sanitize"):
        model.sanitize({})  # as a checkpoint without lm_head.weight: gemma3_text ties its head
    dt = getattr(mx, dtype)
    need = estimate_bytes(model, dt, spec.bits)
    if not footprint.fits_in_memory(need):
        per_layer = estimate_bytes(model, dt, spec.bits, layers_only=True) / len(model.layers)
        tries = [] if spec.bits == 4 else [f"q4 ({estimate_bytes(model, dt, 4) / 1e9:.1f} GB)"]
        tries.append(f"layers=N ({per_layer / 1e9:.2f} GB a layer)")
        raise CachebackError(f"{spec} would take {need / 1e9:.1f} GB of memory, more than this machine can "
                             f"hold ({footprint.available_memory() / 1e9:.1f} GB available): try {' or '.join(tries)}")
    if spec.bits:
        nn.quantize(model, GROUP_SIZE, spec.bits, class_predicate=_quant_predicate(model))
    cfg = _text(config)
    vocab = int(cfg["vocab_size"])
    masked = vocab > tokenizer_vocab
    owners = _owners(model)
    head = next((p for p, m in owners
                 if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] == vocab), None)
    embed = next(p for p, m in owners
                 if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) and m.weight.shape[0] == vocab)
    if masked and head is None:  # tied: the embedding is the head and takes the mask
        m = dict(owners)[embed]
        masked_embedding = (MaskedQuantizedEmbedding(m.weight.shape[0], m.dims, m.group_size, m.bits)
                            if isinstance(m, nn.QuantizedEmbedding) else MaskedEmbedding(*m.weight.shape))
        model.update_modules(tree_unflatten([(embed, masked_embedding)]))
        owners = _owners(model)
    hidden = cfg["hidden_size"]
    embed_std = 1 / hidden if cfg["model_type"].startswith("gemma") else hidden ** -0.5
    mask = mx.array(np.where(np.arange(vocab) < tokenizer_vocab, 0.0, MASKED_LOGIT).astype(np.float32)).astype(dt)
    layout = blas.weight_layout_wanted()
    groups: dict[str, list] = {}
    for path, m in owners:  # one group per layer, one per other module; in order
        layer = _in_layer(path)
        groups.setdefault(path[:layer.end()] if layer else path, []).append((path, m))
    for group in groups.values():
        for path, m in group:
            std, rows = embed_std, (tokenizer_vocab if masked and path in (embed, head) else None)
            if path != embed and "weight" in m and m.weight.ndim >= 2:
                fan_in = m.weight.shape[-1] * (32 // m.bits if "scales" in m else 1)
                fan_in *= m.weight.shape[1] if isinstance(m, nn.Conv1d) else 1
                std = (HEAD_GAIN if path == head else GAIN) / fan_in ** 0.5
                if m.weight.ndim == 3 and path.endswith("down_proj"):  # a token's k experts are
                    std *= cfg.get("num_experts_per_tok", 1) ** 0.5  # averaged: as one dense MLP
            new = fill(m, path, spec.seed, dt, std, rows, layout, lambda name: _keeps_float32(model, f"{path}.{name}"))
            if masked and path == head:
                new["bias"] = mask
            elif masked and path == embed and head is None:
                new["head_bias"] = mask
            for name, value in new.items():
                m[name] = value
        mx.eval([a for _, m in group for _, a in own_arrays(m)])
    model.eval()
    return model


@functools.lru_cache(maxsize=1)
def _tokenizer_metadata() -> dict:
    from .gguf import read_gguf
    from .loader import default_model_path

    return read_gguf(default_model_path())[1]


def tokenizer():
    """The embedded default model's tokenizer (its GGUF's metadata is read once a process)."""
    from .tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(_tokenizer_metadata())


def load_random(text: str, dtype: str | None = None):
    """loader.load for `random:...` specs: a LoadedModel named by the normalized spec, source
    "random", dtype the float dtype built (the spec's, else `dtype`, where "native" means the
    checkpoints' bfloat16, else the backend's default), no FIM tokens."""
    from .loader import LoadedModel, default_dtype

    spec = parse_spec(text)
    dtype = spec.dtype or ("bfloat16" if dtype == "native" else dtype) or default_dtype()
    tok = tokenizer()
    tokenizer_vocab = max(tok.get_vocab().values()) + 1
    if spec.vocab is not None and spec.vocab < tokenizer_vocab:
        raise CachebackError(f"{text!r}: vocab=N takes N of at least {tokenizer_vocab} (the tokenizer's ids)")
    model = build_model(spec, dtype, tokenizer_vocab)
    config = _text(model_config(spec))
    total = total_layers(str(spec))
    context = min(int(config.get("max_position_embeddings") or 4096), MAX_CONTEXT)
    note = f"random weights, seed {spec.seed}, {len(model.layers)} of {total} layers"
    if spec.bits:
        note += f", {spec.bits}-bit (group {GROUP_SIZE})"
    return LoadedModel(model, tok, str(spec), "random", context, dtype, None, note=note)
