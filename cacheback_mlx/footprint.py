"""How big a model is: its shape, its bytes in memory, the weight bytes one decode step reads, and
how much memory the machine has free.

Any mlx-lm model works (GGUF, folders, random ones): the numbers come from the model's own
parameters and its config (`model.args`, or its `text_config`). A decode step reads every weight
once, except the token embeddings (one row, unless the embedding is also the output head) and
the experts of a mixture-of-experts layer (only the `num_experts_per_tok` it routes to), which is
what bounds the speed of memory-bound decoding.
"""

from __future__ import annotations

import os
from dataclasses import asdict, is_dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def available_memory() -> int:
    """Bytes the machine can still give this process: psutil's `available` when installed, else
    MemAvailable from /proc/meminfo (Linux), else the physical memory (macOS without psutil)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_in_memory(nbytes: int) -> bool:
    """Whether `nbytes` of weights leave room for the rest (caches, activations, the OS): at most
    85% of the available memory."""
    return nbytes <= 0.85 * available_memory()


def config(model) -> dict:
    """The model's config fields (its ModelArgs), with a nested text_config merged over them."""
    args = getattr(model, "args", None)
    out = asdict(args) if is_dataclass(args) else dict(vars(args)) if args is not None else {}
    text = out.get("text_config")
    if isinstance(text, dict):
        out.update(text)
    elif is_dataclass(text):
        out.update(asdict(text))
    return out


def head_dim(model) -> int | None:
    """The model's attention head dim, from its config (None where it does not say)."""
    cfg = config(model)
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else None)
    return int(dim) if dim else None


def is_quantized(module) -> bool:
    """A quantized layer of any kind (linear, embedding, expert bank): packed weights and scales."""
    return "scales" in module and hasattr(module, "bits")


def _is_experts(module) -> bool:
    """An expert bank (mlx-lm's SwitchLinear / QuantizedSwitchLinear): weight [experts, out, in]."""
    return type(module).__name__ in ("SwitchLinear", "QuantizedSwitchLinear")


def _leaves(model):
    """(path, module) for every module without submodules: where the parameters live."""
    return tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))


def param_count(model) -> int:
    """Parameters, counting a quantized weight by the values it holds (as mlx-lm does)."""
    n = 0
    for _, m in _leaves(model):
        for name, a in tree_flatten(m.parameters()):
            if name == "weight" and is_quantized(m):
                n += a.size * 32 // m.bits
            elif name not in ("scales", "biases"):
                n += a.size
    return n


def param_bytes(model) -> int:
    """Bytes of all parameters as stored (quantized weights with their scales and biases)."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def compute_dtype(model) -> mx.Dtype:
    """The float dtype most of the model's parameter bytes are in (a quantized layer's scales
    for its weight): the dtype its products round in."""
    by: dict = {}
    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            by[a.dtype] = by.get(a.dtype, 0) + a.nbytes
    return max(by, key=by.get) if by else mx.float32


def dequantized_bytes(model, dtype: mx.Dtype) -> int:
    """Bytes of the model once its quantized layers are dequantized and every float parameter
    is cast to `dtype`."""
    size = dtype.size
    total = 0
    for _, m in _leaves(model):
        for name, a in tree_flatten(m.parameters()):
            if name == "weight" and is_quantized(m):
                total += a.size * 32 // m.bits * size
            elif name not in ("scales", "biases") or not is_quantized(m):
                total += a.size * (size if mx.issubdtype(a.dtype, mx.floating) else a.dtype.size)
    return total


def _head_is_embedding(model, vocab: int) -> bool:
    """True when no linear layer projects to the vocabulary: the embedding is the output head."""
    for _, m in _leaves(model):
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] == vocab:
            return False
    return True


def model_bytes_per_step(model) -> int:
    """Weight bytes one decode step (one token) reads: every parameter, but one row of each
    token embedding (all of it when it is the tied output head), and of each expert bank only
    the experts a token is routed to."""
    cfg = config(model)
    vocab = int(cfg.get("vocab_size") or 0)
    tied = _head_is_embedding(model, vocab)
    active = cfg.get("num_experts_per_tok")
    total = 0
    for _, m in _leaves(model):
        nbytes = sum(a.nbytes for _, a in tree_flatten(m.parameters()))
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            rows = m.weight.shape[0]
            if not (tied and rows == vocab):
                nbytes = -(-nbytes // rows)
        elif _is_experts(m) and active:
            nbytes = nbytes * min(int(active), m.weight.shape[0]) // m.weight.shape[0]
        total += nbytes
    return total


def model_shape(model) -> dict:
    """Family, hidden size, layers, heads, kv heads, experts (active/total), vocabulary and
    parameter count of any mlx-lm model."""
    cfg = config(model)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    layers = getattr(model, "layers", None)
    return {
        "family": type(model).__module__.rsplit(".", 1)[-1],
        "hidden": cfg.get("hidden_size"),
        "layers": len(layers) if layers is not None else cfg.get("num_hidden_layers"),
        "heads": cfg.get("num_attention_heads"),
        "kv heads": cfg.get("num_key_value_heads"),
        "experts": (int(cfg.get("num_experts_per_tok") or 0), int(experts)) if experts else None,
        "vocab": cfg.get("vocab_size"),
        "params": param_count(model),
        "quantized": sorted({(m.bits, m.group_size) for _, m in _leaves(model) if is_quantized(m)}),
    }
