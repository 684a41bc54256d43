"""Shared fixtures: tiny random llama models (fast), and the real default model (slow)."""

import signal

import cacheback_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core, as the package does)
from cacheback_mlx import activations

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

# A shell starts background jobs with SIGINT ignored, and children inherit that: the tests that
# press Ctrl-C on a subprocess would then wait for a KeyboardInterrupt that never comes. With a
# handler here, the processes the tests start get SIGINT's default back.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def fast_swiglu_on_every_pass(monkeypatch):
    """The tiny models' MLPs are below activations.MIN_SIZE: take the threshold away, so every
    engine pass of every family in these tests goes through activations.cpu_swiglu where the
    family uses mlx-lm's SwiGLU (what the real model gets on passes of 4 rows or more)."""
    monkeypatch.setattr(activations, "MIN_SIZE", 1)


def tiny_llama(seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, traditional: bool = True):
    """A randomly initialised mlx-lm llama; GQA when kv_heads < heads."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=vocab,
                           rope_traditional=traditional, tie_word_embeddings=False)
    model = llama.Model(args)
    # larger weights than the default init give peaked, varied next-token distributions
    model.update(tree_map(lambda w: w * 3.0, model.parameters()))
    mx.eval(model.parameters())
    return model


TINY_CONFIGS = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "mqa-wide": dict(hidden=96, heads=6, kv_heads=1, layers=3, vocab=150, traditional=False),
}


@pytest.fixture(params=list(TINY_CONFIGS))
def tiny_model(request):
    return tiny_llama(seed=list(TINY_CONFIGS).index(request.param), **TINY_CONFIGS[request.param])


@pytest.fixture(scope="session")
def default_model():
    from cacheback_mlx.loader import load

    return load()


def byte_level_symbols() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for raw bytes."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tiny_gguf(path, arch: str = "llama", context: int = 64, dtype=None, seed: int = 0,
                    hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, fim: bool = False,
                    chat_template: str | None = None, specials: tuple[str, ...] = ()):
    """A tiny llama GGUF (random weights, byte-level tokenizer with no merges) for loader tests,
    with `specials` as special tokens beside its own. Returns the mlx-lm model holding the same
    weights."""
    dtype = dtype or mx.float32
    symbols = byte_level_symbols()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials]
    if fim:
        specials += ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"]
    tokens = specials + symbols
    model = tiny_llama(seed=seed, vocab=len(tokens), hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    from mlx.utils import tree_flatten

    arrays = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            mod = rest.rsplit(".", 1)[0]
            arrays[f"blk.{i}.{names[mod]}.weight"] = v.astype(dtype)
        elif k == "model.embed_tokens.weight":
            arrays["token_embd.weight"] = v.astype(dtype)
        elif k == "model.norm.weight":
            arrays["output_norm.weight"] = v.astype(dtype)
        elif k == "lm_head.weight":
            arrays["output.weight"] = v.astype(dtype)
    u32 = lambda x: mx.array(x, dtype=mx.uint32)
    meta = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.context_length": u32(context),
        f"{arch}.embedding_length": u32(hidden),
        f"{arch}.block_count": u32(layers),
        f"{arch}.feed_forward_length": u32(2 * hidden),
        f"{arch}.attention.head_count": u32(heads),
        f"{arch}.attention.head_count_kv": u32(kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": mx.array([3] * len(specials) + [1] * 256, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.chat_template": chat_template or (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    }
    mx.save_gguf(str(path), arrays, meta)
    return model


@pytest.fixture(autouse=True, scope="session")
def private_cache_home(tmp_path_factory):
    """State the runtime keeps on disk (SSD buffers, measured pass costs) goes to a temporary
    folder, never the user's ~/.cache; one per test session, so costs are measured once. The
    session's processes count only each other as busy (cores.py), not the user's other ones."""
    import os

    folders = {"XDG_CACHE_HOME": tmp_path_factory.mktemp("xdg-cache"),
               "CACHEBACK_MLX_BUSY_DIR": tmp_path_factory.mktemp("busy")}
    old = {k: os.environ.get(k) for k in folders}
    os.environ.update({k: str(v) for k, v in folders.items()})
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    """Soak tests (10 minutes) and the long versions of checks that have a short one run only when
    asked for (-m soak, -m long), whatever else -m says."""
    expr = config.getoption("markexpr") or ""
    for mark, reason in (("soak", "soak test: run with -m soak"),
                         ("long", "the long version (a short one runs always): run with -m long")):
        if mark in expr and f"not {mark}" not in expr:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if mark in item.keywords:
                item.add_marker(skip)


# Servers on tiny chat models for the protocol tests (test_reasoning, test_anthropic, test_responses)


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """A model whose every answer writes a tool call (test_tool_calls.WritesACall), behind the API
    key "sekrit": (session, url)."""
    from test_server import serving
    from test_tool_calls import TOOLS_TEMPLATE, WritesACall

    path = tmp_path_factory.mktemp("tools") / "tools.gguf"
    write_tiny_gguf(path, context=512, chat_template=TOOLS_TEMPLATE)
    session = WritesACall(str(path), "ngram")
    with serving(session, api_key="sekrit") as url:
        yield session, url


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A model that thinks, then answers (test_reasoning.Thinks): (session, url)."""
    from test_reasoning import TEMPLATE, Thinks
    from test_server import serving

    path = tmp_path_factory.mktemp("think") / "think.gguf"
    write_tiny_gguf(path, context=512, chat_template=TEMPLATE, specials=("<think>", "</think>"))
    session = Thinks(str(path), "ngram")
    with serving(session) as url:
        yield session, url


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "parallel-4"])
def plain_server(tmp_path_factory, request):
    """A random tiny chat model of 256 tokens' context, one request at a time and as lanes: its url."""
    from cacheback_mlx.api import Session

    from test_reasoning import TEMPLATE
    from test_server import serving

    path = tmp_path_factory.mktemp("plain") / "plain.gguf"
    write_tiny_gguf(path, context=256, chat_template=TEMPLATE.replace("<think>\n", ""))
    session = Session(str(path), "ngram")
    session.engine.set_eos([2])  # <|im_end|> only: the random model says <|endoftext|> before its context is full
    with serving(session, parallel=request.param) as url:
        yield url
