"""Tokenizers from GGUF metadata, wrapped the way mlx-lm expects (TokenizerWrapper).

GGUF files carry their vocabulary: `tokenizer.ggml.model` "gpt2" is byte-level BPE (tokens +
merges), "llama" is a SentencePiece-style model (tokens + scores). We rebuild them with the
`tokenizers` library, hand them to transformers' PreTrainedTokenizerFast (chat templates), and wrap
that in mlx-lm's TokenizerWrapper, which adds streaming detokenization.
"""

from __future__ import annotations

import importlib

import numpy as np
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .errors import CachebackError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are special (never split, not text)

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (the GPT-2 pattern unless listed).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPLIT_DIGITS = {"smollm", "starcoder", "refact", "deepseek-coder"}


def _value(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if isinstance(v, np.ndarray) or hasattr(v, "item") and not isinstance(v, (list, str)):
        try:
            return v.item()
        except (AttributeError, ValueError):
            return v
    return v


def _bpe(meta: dict, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    steps = []
    if meta.get("tokenizer.ggml.pre") in SPLIT_DIGITS:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm(meta: dict, tokens: list[str]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    scores = [0.0] * len(tokens) if scores is None else [float(s) for s in np.asarray(scores)]
    unk = int(_value(meta, "tokenizer.ggml.unknown_token_id", 0))
    tok = Tokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=unk, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def tokenizer_from_gguf(meta: dict) -> TokenizerWrapper:
    """The GGUF file's own tokenizer, with its special tokens and chat template."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CachebackError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    tokens = list(tokens)
    if kind == "gpt2":
        tok, detok = _bpe(meta, tokens), BPEStreamingDetokenizer
    elif kind == "llama":
        tok, detok = _spm(meta, tokens), SPMStreamingDetokenizer
    else:
        raise CachebackError(f"unsupported GGUF tokenizer {kind!r} (supported: gpt2, llama)")
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED))])

    def special(name):
        i = _value(meta, f"tokenizer.ggml.{name}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"),
                                 unk_token=special("unknown"), pad_token=special("padding"))
    hf.chat_template = meta.get("tokenizer.chat_template")
    if kind == "llama" and bool(_value(meta, "tokenizer.ggml.add_bos_token", True)):
        hf.add_bos_token = True
    return TokenizerWrapper(hf, detokenizer_class=detok, eos_token_ids=end_of_generation(meta, tokens),
                            **tool_markup(hf))


# Tokens that end a reply by their text, as llama.cpp's vocabulary sets them (llama-vocab.cpp's
# end-of-generation tokens): a chat model's end of turn where its GGUF's EOS is another token
# (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>), and FIM's padding and file separators.
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",  # FIM padding
             "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")  # FIM repo, file


def end_of_generation(meta: dict, tokens: list[str]) -> list[int]:
    """The ids that end a reply: the GGUF's EOS, end-of-turn and end-of-message ids and the tokens
    of END_TEXTS, less llama.cpp's two exceptions (<|end|> where <|return|> and <|call|> or
    <|calls|> and <|flush|> end replies, as in gpt-oss's harmony format; </s> beside Gemma 4's
    <|tool_response>)."""
    index = {t: i for i, t in enumerate(tokens)}
    ids = {index[t] for t in END_TEXTS if t in index}
    ids |= {int(i) for k in ("eos", "eot", "eom") if 0 <= int(i := _value(meta, f"tokenizer.ggml.{k}_token_id", -1))
            < len(tokens)}
    texts = {tokens[i] for i in ids}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        ids.discard(index["<|end|>"])
    if "<|tool_response>" in texts and "</s>" in texts:
        ids.discard(index["</s>"])
    return sorted(ids)


def tool_markup(hf) -> dict:
    """mlx-lm's tool-call parser for a chat template (the one mlx_lm.tokenizer_utils.load infers for
    a folder's tokenizer), as TokenizerWrapper's arguments; {} when the template has none."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = _infer_tool_parser(hf)
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}") if name else None
    except (ImportError, AttributeError):  # an mlx-lm without it: no tool calls
        return {}
    if module is None:
        return {}
    return {"tool_parser": module.parse_tool_call, "tool_call_start": module.tool_call_start,
            "tool_call_end": module.tool_call_end}


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, to tie tables built offline to one tokenizer."""
    import hashlib

    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else tokenizer._tokenizer.get_vocab()
    h = hashlib.sha256()
    for piece, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{piece}\n".encode())
    return h.hexdigest()[:16]
