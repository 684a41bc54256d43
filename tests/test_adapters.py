"""Fine-tuned adapters (adapters.py): the folders mlx_lm.lora writes, put on a model as mlx-lm's
--adapter-path puts them. Greedy output with adversarial drafters equals mlx-lm's plain decoding
of the adapted model on families of every layer kind (sliding windows, MoE experts, a hybrid);
a folder through the command equals mlx-lm's own load(adapter_path=...); bad folders are one line."""

import json
import shutil
from pathlib import Path

from cacheback_mlx import adapters, lm
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.loader import LoadedModel, load

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter
from test_cli import assert_one_line_error, cli, cli_here

PROMPT = [(7 * i + 3) % 97 + 1 for i in range(24)]
N = 16
LEAVES = ("lora_a", "lora_b", "m")


def write_adapters(folder, family, kind="lora", num_layers=-1, std=0.05, dtype=mx.float32):
    """What mlx_lm.lora leaves in `folder` for a `family` model of the zoo: its config and the
    adapters' weights (random here, lora_b too, so they move the logits)."""
    model = zoo.tiny_model(family)
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    mx.random.seed(7)
    weights = {k: (mx.random.normal(v.shape) * std + (1.0 if k.endswith(".m") else 0.0)).astype(dtype)
               for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in LEAVES}
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / adapters.WEIGHTS), weights)
    (folder / adapters.CONFIG).write_text(json.dumps({"fine_tune_type": kind, "num_layers": num_layers,
                                                      "lora_parameters": params}))
    return folder


def reference(model, prompt=PROMPT, n=N):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def on_zoo(family):
    return LoadedModel(zoo.tiny_model(family), None, family, "zoo", 4096, "float32", None)


# every family of the zoo (sliding windows, shared KV, MoE, hybrids) but Gemma 3n, whose AltUp reads
# a weight that LoRA replaces (mlx-lm's own decoding fails there too: below)
RUNS = [f for f in zoo.FAMILIES if f != "gemma3n"]


@pytest.mark.parametrize("family,kind", [(f, "lora") for f in RUNS] + [("llama", "dora")])
def test_adapted_greedy_output_equals_mlx_lm_s_with_any_drafts(family, kind, tmp_path):
    path = write_adapters(tmp_path / "adapters", family, kind)
    adapted = adapters.apply(on_zoo(family), path)
    assert adapted.adapter == str(path) and f"{kind} adapters from {path}" in adapted.note
    theirs = zoo.tiny_model(family)  # mlx-lm's own load_adapters on the same weights
    load_adapters(theirs, str(path)).eval()
    x = mx.array([PROMPT])
    assert mx.array_equal(adapted.model(x), theirs(x))
    truth = reference(adapted.model)
    assert truth != reference(zoo.tiny_model(family)) and len(set(truth)) > 3, (family, truth)
    for drafter in (OracleDrafter(PROMPT, truth, extra_wrong_branches=1), RandomTreeDrafter(PROMPT, truth, seed=1)):
        eng = Engine(adapted.model, [], drafter, 4096)
        assert [t for step in eng.generate(PROMPT, N) for t in step] == truth, (family, kind, type(drafter).__name__)


def test_adapters_a_family_cannot_run_are_one_line_errors_at_load(tmp_path):
    theirs = zoo.tiny_model("gemma3n")
    linear_to_lora_layers(theirs, -1, {"rank": 4, "scale": 4.0, "dropout": 0.0})
    with pytest.raises(AttributeError):  # mlx-lm's own model code, with LoRA on every linear layer
        theirs(mx.array([PROMPT]))
    path = write_adapters(tmp_path / "g", "gemma3n")
    with pytest.raises(CachebackError, match="do not run on this model") as e:
        adapters.apply(on_zoo("gemma3n"), path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_adapters_on_the_default_model_are_lossless_with_auto(default_model, tmp_path):
    """Random LoRA adapters on the last 4 layers of the real default model (their shapes read off
    the loaded one): auto's greedy output equals mlx-lm's on the adapted model, and differs from
    the base's."""
    from cacheback_mlx.drafters import make_drafter

    import mlx.nn as nn

    layers = default_model.model.layers
    mx.random.seed(5)
    weights = {}
    for i in range(len(layers) - 4, len(layers)):
        for name, m in layers[i].named_modules():
            if isinstance(m, nn.Linear):
                out, into = m.weight.shape
                weights[f"model.layers.{i}.{name}.lora_a"] = mx.random.normal((into, 8)) * 0.02
                weights[f"model.layers.{i}.{name}.lora_b"] = mx.random.normal((8, out)) * 0.02
    (tmp_path / "a").mkdir()
    mx.save_safetensors(str(tmp_path / "a" / adapters.WEIGHTS), weights)
    (tmp_path / "a" / adapters.CONFIG).write_text(json.dumps(
        {"num_layers": 4, "lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0}}))
    adapted = load(None, adapter_path=tmp_path / "a")
    prompt = adapted.tokenizer.encode("def bubble_sort(items):\n", add_special_tokens=False)
    truth = reference(adapted.model, prompt, 32)
    assert truth != reference(default_model.model, prompt, 32)
    eng = Engine(adapted.model, [], make_drafter("auto", persist=False), adapted.context_length)
    assert [t for step in eng.generate(prompt, 32) for t in step] == truth
    assert eng.stats.passes < 32


def test_adapters_saved_in_bfloat16_run_in_the_model_s_type(tmp_path):
    path = write_adapters(tmp_path / "a", "llama", dtype=mx.bfloat16)
    adapted = adapters.apply(on_zoo("llama"), path)
    lora = {k: v.dtype for k, v in tree_flatten(adapted.model.parameters()) if k.rsplit(".", 1)[-1] in LEAVES}
    assert lora and set(lora.values()) == {mx.float32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama as an mlx-lm folder (float32), and adapters for it."""
    from conftest import write_tiny_gguf

    d = tmp_path_factory.mktemp("adapted")
    write_tiny_gguf(d / "t.gguf")
    load(d / "t.gguf").tokenizer._tokenizer.save_pretrained(d / "model")
    model = zoo.tiny_model("llama")
    mx.save_safetensors(str(d / "model" / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "model" / "config.json").write_text(json.dumps(zoo.FAMILIES["llama"] | {"vocab_size": zoo.VOCAB}))
    write_adapters(d / "adapters", "llama", num_layers=1, std=0.1)
    return d


def test_the_command_s_adapted_output_is_mlx_lm_s_load_with_adapter_path(folder):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder / "model"), adapter_path=str(folder / "adapters"))
    assert any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    prompt = "the cat sat"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    want = tokenizer.decode(reference(model, ids, 12))
    r = cli("generate", prompt, "--model", str(folder / "model"), "--adapter-path", str(folder / "adapters"),
            "--raw", "-n", "12", "--drafter", "ngram")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want
    plain = cli_here("generate", prompt, "--model", str(folder / "model"), "--raw", "-n", "12")
    assert plain.returncode == 0 and plain.stdout.rstrip("\n") != want  # the adapters change the answer
    # the mlx-lm-shaped API takes mlx-lm's keyword
    model, tokenizer = lm.load(str(folder / "model"), adapter_path=str(folder / "adapters"))
    assert lm.generate(model, tokenizer, ids, max_tokens=12) == want


def test_bad_adapter_folders_are_one_line_errors(folder, tmp_path):
    model = str(folder / "model")
    assert_one_line_error(cli_here("generate", "hi", "--model", model, "--adapter-path", str(tmp_path / "absent")),
                          "not an adapter folder", "no adapter_config.json")

    def changed(name, change):  # the folder's adapters with their config changed
        shutil.copytree(folder / "adapters", tmp_path / name)
        config = json.loads((tmp_path / name / adapters.CONFIG).read_text())
        change(config["lora_parameters"])
        (tmp_path / name / adapters.CONFIG).write_text(json.dumps(config))
        return str(tmp_path / name)

    # weights of another shape than the config makes (an adapter for another model), a config without its scale
    for path, words in [(changed("rank", lambda p: p.update(rank=8)), "incompatible tensors"),
                        (changed("no-scale", lambda p: p.pop("scale")), "scale")]:
        assert_one_line_error(cli_here("generate", "hi", "--model", model, "--adapter-path", path),
                              "cannot apply", words)
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / adapters.CONFIG).write_text("{}")
    with pytest.raises(CachebackError, match="no adapters.safetensors"):
        load(model, adapter_path=tmp_path / "no-weights")
    assert_one_line_error(cli_here("serve", "--model", model, "--adapter-path", str(folder / "adapters"),
                                   "--distributed", "tensor"), "--distributed")


def test_doctor_and_bench_take_the_adapters(folder):
    model, path = str(folder / "model"), str(folder / "adapters")
    r = cli_here("doctor", "--model", model, "--adapter-path", path)
    assert r.returncode == 0, r.stderr
    assert f"lora adapters from {Path(path).resolve()}" in r.stdout, r.stdout
    r = cli_here("bench", "--model", model, "--adapter-path", path, "--prompts", "humaneval", "--per-category", "1",
                 "-n", "8", "--drafters", "none,ngram", "--warmup", "0")
    assert r.returncode == 0 and "LOSSLESS" not in r.stderr and "differ from mlx-lm" not in r.stderr, r.stderr
    assert f"adapters={Path(path).resolve()}" in r.stdout, r.stdout
    r = cli_here("doctor", "--model", model, "--adapter-path", str(folder / "absent"))
    assert_one_line_error(r, "not an adapter folder")
