"""Fine-tuned adapters on a loaded model, as mlx-lm applies them: a folder that `mlx_lm.lora`
wrote (adapter_config.json and adapters.safetensors: LoRA, DoRA or a full fine-tune), put on the
model by mlx-lm's own `load_adapters`, so the engine runs the same layers mlx-lm's generate does
with `--adapter-path`. LoRA's extra products run in every row of a pass as in a one-token step.

Where the loader changed the base weights' type (float32 on the CPU, dequantized), the adapter's
weights take that type too; with `--dtype native` they stay as saved, as in mlx-lm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import CachebackError

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"


def apply(loaded, adapter_path: str | Path):
    """`loaded` (loader.LoadedModel) with the adapters in `adapter_path` on its model: the same
    LoadedModel with `adapter` set and a note saying what was applied. Bad input is one line."""
    from mlx_lm.tuner.utils import load_adapters

    path = Path(adapter_path).expanduser()
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise CachebackError(f"not an adapter folder (no {name}): {path}")
    try:
        config = json.loads((path / CONFIG).read_text())
        kind = config.get("fine_tune_type", "lora")
        load_adapters(loaded.model, str(path))
    except Exception as e:  # a bad config, an adapter for another model: the user's input
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        detail = "; ".join(lines[:2]) if lines else type(e).__name__
        raise CachebackError(f"cannot apply the adapters in {path}: {detail}") from None
    loaded.model.eval()
    try:  # a family whose own code reads a layer's weight the adapters replaced (Gemma 3n's AltUp)
        mx.eval(loaded.model(mx.array([[0]])))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CachebackError(f"the adapters in {path} do not run on this model: {type(e).__name__}: {first}") from None
    if loaded.dtype != "native":
        dtype = getattr(mx, loaded.dtype)
        params = dict(tree_flatten(loaded.model.parameters()))
        names = mx.load(str(path / WEIGHTS)).keys()
        loaded.model.load_weights([(n, params[n].astype(dtype)) for n in names
                                   if n in params and mx.issubdtype(params[n].dtype, mx.floating)], strict=False)
    mx.eval(loaded.model.parameters())
    layers = config.get("num_layers")
    where = "" if kind == "full" or not isinstance(layers, int) else \
        f" (the last {layers} layers)" if layers > 0 else " (every layer)"
    what = f"{kind} adapters from {path}{where}"
    return dataclasses.replace(loaded, adapter=str(path), note="; ".join(x for x in (loaded.note, what) if x))
