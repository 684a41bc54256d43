"""random:NAME models: every shipped config builds (at 1-2 layers, most with a small output head),
decodes a varied greedy stream that the engine reproduces token for token with adversarial and
`auto` drafters, and its spec, seeds, memory refusal and doctor lines behave."""

import functools

from cacheback_mlx import footprint, loader, random_models, random_weights
from cacheback_mlx.cli import main
from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.sampling import SamplingParams
from cacheback_mlx.tokenizer import vocab_fingerprint

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step

from adversarial import OracleDrafter, RandomTreeDrafter

TOKENIZER_VOCAB = 49152
N = 16
# vocab=49280: 128 ids past the tokenizer's, so the masked rows are exercised at a test's cost;
# f32 everywhere (scales too), where greedy decoding is exact on a GPU as well
CASES = {
    "smollm2-135m": "random:smollm2-135m:f32:layers=2",
    "llama-3.2-1b": "random:llama-3.2-1b:q4:f32:layers=1:vocab=49280",
    "llama-3.2-3b": "random:llama-3.2-3b:f32:layers=1:vocab=49280",
    "llama-3.1-8b": "random:llama-3.1-8b:q4:f32:layers=1:vocab=49280",
    "qwen3-1.7b": "random:qwen3-1.7b:q8:f32:layers=1:vocab=49280",
    "qwen3-8b": "random:qwen3-8b:q4:f32:layers=1:vocab=49280",
    "qwen2.5-coder-1.5b": "random:qwen2.5-coder-1.5b:f32:layers=1:vocab=49280",
    "gemma-2-2b": "random:gemma-2-2b:q8:f32:layers=1:vocab=49280",
    "gemma-3-12b": "random:gemma-3-12b:q4:f32:layers=2:vocab=49280",
    "qwen3.5-9b": "random:qwen3.5-9b:q4:f32:layers=2:vocab=49280",
    "nemotron-h-8b": "random:nemotron-h-8b:q4:f32:layers=3:vocab=49280",
    "qwen3-30b-a3b": "random:qwen3-30b-a3b:q4:f32:layers=1:vocab=49280",
    "gpt-oss-20b": "random:gpt-oss-20b:q4:f32:layers=2:vocab=49280",
}


def test_every_shipped_config_has_a_case():
    assert sorted(CASES) == random_models.known_names()


# MLX's CPU quantized matmul costs per row and these layers are wide, so every model gets chains of
# right drafts with a wrong sibling at each level (trees, compaction, rollback) in passes of at most
# 5 rows, over the first 6 tokens; the cheapest all 16, and random trees and `auto` drafts too (the
# MoE shape so too with -m long; test_families.py runs tiny MoE instances so always).
MORE = ("smollm2-135m",)


@functools.lru_cache(maxsize=3)
def load(spec, _load=loader.load):
    return _load(spec)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, load(CASES[request.param])


def reference(model, prompt, n=N):
    """mlx-lm's own greedy decoding, with the model's own caches."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.fixture(scope="module")
def auto():
    """One `auto` drafter for all models (they share the tokenizer its tables are built for)."""
    drafter = make_drafter("auto", fingerprint=vocab_fingerprint(random_models.tokenizer()), persist=False)
    yield drafter
    drafter.close()


def run(loaded, drafter, prompt, budget, n=N):
    eng = Engine(loaded.model, eos_ids=[], drafter=drafter, context_length=loaded.context_length, draft_budget=budget)
    return [t for step in eng.generate(prompt, n) for t in step]


def test_greedy_stream_varies_and_the_engine_reproduces_it(case, auto):
    reproduced(*case, auto, more=case[0] in MORE)


@pytest.mark.long
def test_the_moe_shape_s_longer_stream_with_random_trees_and_auto(auto):
    reproduced("qwen3-30b-a3b", load(CASES["qwen3-30b-a3b"]), auto, more=True)


def reproduced(name, loaded, auto, more):
    prompt = loaded.tokenizer.encode("def fib(n):", add_special_tokens=False)
    n = N if more else 6  # (a one-row step: ~0.5 s on q4 shapes)
    truth = reference(loaded.model, prompt, n)
    assert len(set(truth)) > (6 if n == N else 4), (name, truth)  # not one token repeated
    assert max(truth) < TOKENIZER_VOCAB, name  # never an id the tokenizer lacks
    loaded.tokenizer.decode(truth)
    if CASES[name].split(":")[2] in ("q4", "q8") and mx.default_device().type == mx.DeviceType.gpu:
        return  # a GPU's quantized kernels round a pass of several rows differently from one row
    assert run(loaded, OracleDrafter(prompt, truth, extra_wrong_branches=1),
               prompt, 4, n) == truth, (name, "oracle")
    if more:
        assert run(loaded, RandomTreeDrafter(prompt, truth, seed=1), prompt, 6) == truth, (name, "random trees")
        auto.reset()
        assert run(loaded, auto, prompt, 4) == truth, (name, "auto")


def test_loaded_model_fields(case):
    name, loaded = case
    spec = random_models.parse_spec(CASES[name])
    assert loaded.name == CASES[name] and loaded.source == "random" and loaded.fim is None
    assert loaded.dtype == "float32" and 0 < loaded.context_length <= random_models.MAX_CONTEXT
    shape = footprint.model_shape(loaded.model)
    assert shape["layers"] == spec.layers and shape["vocab"] == (spec.vocab or TOKENIZER_VOCAB)
    assert (spec.bits, 64) in shape["quantized"] if spec.bits else shape["quantized"] == []
    assert 0 < footprint.model_bytes_per_step(loaded.model) <= footprint.param_bytes(loaded.model)


def test_sampling_never_yields_an_id_the_tokenizer_lacks():
    from cacheback_mlx.api import Session

    loaded = loader.load("random:smollm2-135m:layers=2:vocab=60000")  # a tied head
    prompt = loaded.tokenizer.encode("Hello", add_special_tokens=False)
    for model in (loaded.model, load(CASES["qwen3-8b"]).model):  # and an untied, quantized one
        logits = model(mx.array([prompt]))[0, -1].astype(mx.float32)
        assert float(logits[TOKENIZER_VOCAB:].max()) <= random_models.MASKED_LOGIT / 2
        for temperature in (1.0, 2.0, 10.0):  # the masked ids' probability is exactly zero
            assert float(mx.softmax(logits / temperature)[TOKENIZER_VOCAB:].sum()) == 0.0
    s = Session(loaded, "ngram", fixed_budget=True)
    ids = [t for _, step in s.stream_ids(s.encode("Hello", chat=False), 48, SamplingParams(temperature=1.5, seed=3))
           for t in step]
    assert 0 < len(ids) <= 48 and max(ids) < TOKENIZER_VOCAB
    s.engine.drafter.close()


def test_same_seed_same_weights_and_quantized_precisions_agree():
    a = loader.load("random:smollm2-135m:f32:layers=2").model
    b = loader.load("random:smollm2-135m:layers=2:f32").model
    c = loader.load("random:smollm2-135m:f32:layers=2:seed=1").model
    q8 = loader.load("random:smollm2-135m:q8:f32:layers=2").model
    q4 = loader.load("random:smollm2-135m:q4:f32:layers=2").model
    w = [np.array(m.model.layers[1].mlp.down_proj.weight) for m in (a, b, c)]
    assert np.array_equal(w[0], w[1]) and not np.array_equal(w[0], w[2])
    step = random_models.GAIN / 1536 ** 0.5 / random_weights.BYTE_STD  # a byte's step in down_proj
    assert np.abs(w[0]).max() == pytest.approx(127.5 * step)
    for q, error in ((q8, 1e-4), (q4, 7.5 + 1e-4)):  # q8: the same values; q4: the nearest of 16
        lin = q.model.layers[1].mlp.down_proj
        deq = np.array(mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits))
        assert np.abs(deq - w[0]).max() <= error * step
    one = loader.load("random:smollm2-135m:f32:layers=1").model  # a layer's weights do not depend on the count
    assert np.array_equal(np.array(one.model.layers[0].self_attn.q_proj.weight),
                          np.array(a.model.layers[0].self_attn.q_proj.weight))


def test_the_spec_dtype_wins_over_the_dtype_argument():
    assert loader.load("random:smollm2-135m:layers=1").dtype == loader.default_dtype()
    assert loader.load("random:smollm2-135m:layers=1", dtype="bfloat16").dtype == "bfloat16"
    assert loader.load("random:smollm2-135m:layers=1", dtype="native").dtype == "bfloat16"  # the checkpoints'
    f16 = loader.load("random:smollm2-135m:f16:layers=1", dtype="bfloat16")
    assert f16.dtype == "float16" and f16.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float16


@pytest.mark.parametrize("spec, needles", [
    ("random:llama-9b", ["unknown random model 'llama-9b'", "qwen3-8b", "gpt-oss-20b"]),
    ("random:", ["unknown random model ''", "smollm2-135m"]),
    ("random:qwen3-8b:q3", ["unknown option 'q3'", "q4, q8", "layers=N"]),
    ("random:qwen3-8b:q4:q8", ["bits twice"]),
    ("random:qwen3-8b:layers=x", ["layers takes a whole number"]),
    ("random:qwen3-8b:layers=0", ["from 1", "to 36"]),
    ("random:gpt-oss-20b:layers=1", ["from 2", "sliding_attention, full_attention"]),
    ("random:nemotron-h-8b:layers=2", ["from 3", "mamba, mlp, attention"]),
    ("random:qwen3-8b:vocab=100", ["at least 49152"]),
])
def test_bad_specs_are_one_line_errors(spec, needles):
    with pytest.raises(CachebackError) as e:
        loader.load(spec)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_layers_keep_one_layer_of_each_kind():
    kinds = random_models.layer_kinds
    cut = lambda spec: random_models._text(random_models.model_config(random_models.parse_spec(spec)))  # noqa: E731
    assert kinds(cut("random:gemma-3-12b:layers=2")) == ["sliding_attention", "full_attention"]
    assert kinds(cut("random:qwen3.5-9b:layers=3")) == ["linear_attention"] * 2 + ["full_attention"]
    assert kinds(cut("random:qwen3.5-9b:layers=6")) == (["linear_attention"] * 3 + ["full_attention"]
                                                        + ["linear_attention"] * 2)
    assert cut("random:gpt-oss-20b:layers=3")["layer_types"] == ["sliding_attention", "full_attention",
                                                                 "sliding_attention"]
    assert cut("random:nemotron-h-8b:layers=3")["hybrid_override_pattern"] == "M-*"  # mamba, mlp, attention
    assert cut("random:nemotron-h-8b:layers=9")["hybrid_override_pattern"] == "M-M-M-M*-"
    assert random_models.parse_spec("random:qwen3-8b:layers=36").layers is None  # all: normalized away


def test_too_big_for_memory_is_refused(monkeypatch):
    monkeypatch.setattr(footprint, "available_memory", lambda: 8 * 10**9)
    with pytest.raises(CachebackError) as e:
        loader.load("random:llama-3.1-8b:f32")
    msg = str(e.value)
    assert "\n" not in msg and "32.1 GB" in msg and "8.0 GB available" in msg and "q4" in msg and "layers=N" in msg, msg
    with pytest.raises(CachebackError, match="layers=N"):  # q4 at 8B still over 85% of 5 GB
        monkeypatch.setattr(footprint, "available_memory", lambda: 5 * 10**9)
        loader.load("random:llama-3.1-8b:q4")


def test_quantized_folder_that_would_not_fit_dequantized_stays_quantized(tmp_path, monkeypatch, capsys):
    src = loader.load("random:smollm2-135m:q4:layers=1")
    loader.save_folder(src, tmp_path)
    assert loader.load(str(tmp_path), dtype="float32").dtype == "float32"  # fits: dequantized, as before
    monkeypatch.setattr(footprint, "available_memory", lambda: 100 * 10**6)
    kept = loader.load(str(tmp_path), dtype="float32")
    assert kept.dtype == "native" and "kept quantized" in kept.note
    assert isinstance(kept.model.model.layers[0].mlp.down_proj, type(src.model.model.layers[0].mlp.down_proj))
    assert "kept quantized" in capsys.readouterr().err


def test_doctor_shows_shape_bytes_and_caches(monkeypatch):
    from cacheback_mlx import sharing

    monkeypatch.setattr(loader, "load", lambda spec, adapter_path=None: load(spec))  # the model the other tests built
    # (its line on shared passes runs passes of 7-12 rows: ~15 s for this shape on MLX's CPU
    # 4-bit path; test_batch.py checks that line's answers)
    monkeypatch.setattr(sharing, "check_sharing", lambda engine: sharing.Sharing("not checked here"))
    r = CliRunner().invoke(main, ["doctor", "--model", CASES["gpt-oss-20b"]])
    assert r.exit_code == 0, r.output
    out = r.output
    assert f"model: {CASES['gpt-oss-20b']} (random), family gpt_oss" in out
    assert "hidden 2880, layers 2 of 24, heads 64, kv heads 8, experts 4 of 32 active, vocab 49280" in out
    assert "4-bit (group 64), 8-bit (group 64)" in out and "read per decode step" in out  # routers at 8 bits
    assert "RotatingKVCache" in out or "window=128" in out, out
    assert "prompt: the engine's layout" in out  # float32 on the CPU (half precision on a GPU: mlx-lm's)
    assert "a reply ends at: <|endoftext|> (0), <|im_end|> (2), <reponame> (4)" in out  # the default tokenizer's
    r = CliRunner().invoke(main, ["doctor", "--model", "random:nope"])
    assert r.exit_code == 1 and "unknown random model 'nope'" in r.output


def test_the_compute_dtype_of_a_quantized_model_is_its_scales():
    """What the engine's prompt layout goes by (engine.prompt_as_mlx_lm_default): a quantized
    model rounds its products in its scales' dtype, whatever its packed weights hold."""
    model = load(CASES["llama-3.1-8b"]).model
    assert footprint.compute_dtype(model) == mx.float32
    half = nn.QuantizedLinear(64, 64, group_size=64, bits=4)
    half.set_dtype(mx.bfloat16)
    assert half.weight.dtype == mx.uint32 and footprint.compute_dtype(half) == mx.bfloat16


def test_bytes_per_step_counts_active_experts_and_one_embedding_row():
    model = load(CASES["qwen3-30b-a3b"]).model
    experts = model.model.layers[0].mlp.switch_mlp
    bank = sum(footprint.param_bytes(getattr(experts, p)) for p in ("gate_proj", "up_proj", "down_proj"))
    embed = footprint.param_bytes(model.model.embed_tokens)
    assert footprint.model_bytes_per_step(model) == pytest.approx(
        footprint.param_bytes(model) - bank * 120 / 128 - embed + embed / 49280, abs=64)
