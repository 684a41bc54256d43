"""Loader: tiny GGUF files written in the test, bad inputs, and the real default model."""

import json

from cacheback_mlx.errors import CachebackError
from cacheback_mlx.loader import default_model_path, load
from cacheback_mlx.replay import SHARED_STREAMS

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_tiny_gguf


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_tiny_gguf_loads_with_the_same_logits(tmp_path, dtype):
    ref = write_tiny_gguf(tmp_path / "tiny.gguf", dtype=dtype)
    loaded = load(tmp_path / "tiny.gguf", dtype="float32")
    x = mx.array([[5, 6, 7, 8, 9]])
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    ref.update(_cast(ref, dtype))  # the reference sees the same rounding as the file
    assert np.allclose(np.array(loaded.model(x)), np.array(ref(x)), atol=tol)
    assert loaded.context_length == 64 and loaded.dtype == "float32" and loaded.fim is None
    model, tokenizer = loaded
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert tokenizer.eos_token_ids == {0, 2}  # the metadata's EOS <|im_end|>; <|endoftext|> by its text, as llama.cpp


def _cast(model, dtype):
    from mlx.utils import tree_map

    return tree_map(lambda w: w.astype(dtype).astype(mx.float32), model.parameters())


def one_line_error(fn, *args, match=None):
    with pytest.raises(CachebackError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg and msg
    if match:
        assert match in msg, msg
    return msg


def test_missing_path(tmp_path):
    one_line_error(load, str(tmp_path / "nope.gguf"), match="not found")
    one_line_error(load, str(tmp_path / "no" / "such" / "folder"), match="not found")


def test_not_a_gguf_and_corrupt_and_truncated(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello world" * 100)
    one_line_error(load, str(junk), match="not a GGUF")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(5000))
    one_line_error(load, str(corrupt), match="cannot read GGUF")
    write_tiny_gguf(tmp_path / "ok.gguf")
    data = (tmp_path / "ok.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    one_line_error(load, str(cut), match="cannot read GGUF")


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    one_line_error(load, str(tmp_path / "gpt2.gguf"), match="unsupported architecture 'gpt2'")


def test_unknown_dtype_and_folder_without_config(tmp_path):
    one_line_error(load, None, "float8", match="unknown dtype")
    one_line_error(load, str(tmp_path), match="config.json")


def test_repo_id_offline_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    one_line_error(load, "nobody/no-such-model", match="offline")


@pytest.mark.slow
def test_truncated_real_gguf(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    one_line_error(load, str(cut), match="cannot read GGUF")


@pytest.mark.slow
def test_default_model_tokenizer_round_trips_recorded_prompts(default_model):
    if not SHARED_STREAMS.exists():
        pytest.skip("../shared/data/smollm2_greedy not present")
    tok = default_model.tokenizer
    prompts = json.loads((SHARED_STREAMS / "prompts_ids.json").read_text())
    for p in prompts:
        assert list(tok.encode(tok.decode(p["ids"]), add_special_tokens=False)) == p["ids"], p["id"]
    assert default_model.context_length == 8192 and default_model.dtype in ("float32", "float16")


def test_mlx_lm_model_folder(tmp_path):
    """An mlx-lm folder (config.json + safetensors + tokenizer files) loads with the same logits."""
    from cacheback_mlx.loader import load as load_any

    from mlx.utils import tree_flatten

    gguf = tmp_path / "t.gguf"
    ref = write_tiny_gguf(gguf)
    tok = load_any(gguf).tokenizer
    folder = tmp_path / "folder"
    folder.mkdir()
    tok._tokenizer.save_pretrained(folder)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(ref.parameters())))
    args = ref.args
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size, "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads, "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size, "rope_traditional": True, "tie_word_embeddings": False,
        "max_position_embeddings": 128}))
    loaded = load(str(folder))
    x = mx.array([[5, 6, 7, 8]])
    assert np.allclose(np.array(loaded.model(x)), np.array(ref(x)), atol=1e-5)
    assert loaded.context_length == 128 and loaded.tokenizer.decode(loaded.tokenizer.encode("héllo")) == "héllo"


@pytest.mark.parametrize("texts, meta, ends", [
    # Gemma 3: EOS <eos>, end of turn <end_of_turn> by its text
    (["<pad>", "<eos>", "<bos>", "<end_of_turn>", "a"], {"eos": 1}, ["<eos>", "<end_of_turn>"]),
    # Llama 3.1 Instruct: its end of turn and end of message named in the metadata too
    (["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "a"], {"eos": 3, "eot": 3, "eom": 2},
     ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    # gpt-oss's harmony format: <|end|> closes a message, not the reply
    (["<|endoftext|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>"], {"eos": 3},
     ["<|endoftext|>", "<|return|>", "<|call|>"]),
    # Gemma 4: </s> beside <|tool_response> is text
    (["<eos>", "</s>", "<|tool_response>", "<turn|>"], {"eos": 0}, ["<eos>", "<|tool_response>", "<turn|>"]),
    # Qwen2.5-Coder: FIM padding and file separators end an infill
    (["<|endoftext|>", "<|fim_prefix|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "a"], {"eos": 0},
     ["<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"]),
    # an id past the vocabulary is left out
    (["<s>", "a", "b"], {"eos": 0, "eot": 99}, ["<s>"]),
])
def test_a_gguf_s_replies_end_where_llama_cpp_s_do(texts, meta, ends):
    from cacheback_mlx.tokenizer import end_of_generation

    ids = end_of_generation({f"tokenizer.ggml.{k}_token_id": v for k, v in meta.items()}, texts)
    assert [texts[i] for i in ids] == ends


def test_a_gguf_s_end_of_turn_token_ends_a_reply(tmp_path):
    """A chat model whose GGUF names one EOS and whose turns end with another token stops there."""
    write_tiny_gguf(tmp_path / "t.gguf", specials=("<end_of_turn>",))
    tok = load(str(tmp_path / "t.gguf")).tokenizer
    assert tok.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids and 2 in tok.eos_token_ids
