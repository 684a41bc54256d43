"""Log-probabilities in the server's answers: each token's, and the most likely tokens at its
position, as OpenAI's (`logprobs`, `top_logprobs`; the completions route's `logprobs: N`),
llama.cpp's (`n_probs`) and Ollama's (`logprobs`, `top_logprobs`) protocols ask for them.

The values are mlx-lm's (logits - logsumexp(logits), after the penalties and biases), each from
the pass row that predicted its token (engine.Accepted): drafting changes none of them beyond a
pass's rounding. A token's entry goes out with the text it produced: once the text where it starts is shown;
tokens whose text a stop string or an editor's rule cut off are left out.
A token's `bytes` are the ones it adds to the text, read from the detokenizer's own table (a
SentencePiece or byte-level token's leading space included, part of a character as it is, as
llama.cpp's pieces and OpenAI's bytes are), and its string those bytes as text (a part of a
character reads as U+FFFD there); tokenizers without such a table give the token decoded alone.
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from ..sampling import top_tokens

TOP_MAX = 20  # the most alternatives a request may ask for (OpenAI's limit)


def token_entries(tokenizer, tokens: Sequence[int], top: int) -> list[dict]:
    """The entries of one step's tokens (engine.Accepted with logprobs), each with its `top` most
    likely tokens; call on the thread that runs the model. [] when they carry none."""
    logprobs = getattr(tokens, "logprobs", None)
    if not tokens or logprobs is None:
        return []
    chosen = tokens.own_logprobs().astype(mx.float32)
    k = min(top, logprobs.shape[-1])
    if k:
        best = top_tokens(logprobs, k)  # best first
        values = mx.take_along_axis(logprobs, best, axis=1).astype(mx.float32)
        tops = list(zip(best.tolist(), values.tolist()))
    else:
        tops = [([], [])] * len(tokens)

    piece = token_bytes(tokenizer)

    def entry(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"id": token, "token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return [entry(int(t), c) | {"top": [entry(i, v) for i, v in zip(*alts)]}
            for t, c, alts in zip(tokens, chosen.tolist(), tops)]


def token_bytes(tokenizer):
    """A function from a token id to the bytes it adds to the text (see the module's docstring)."""
    detok = tokenizer.detokenizer
    table = getattr(detok, "tokenmap", None)
    if isinstance(detok, SPMStreamingDetokenizer):  # bytes already, "\u2581" for a space
        return lambda t: table[t].replace(b"\xe2\x96\x81", b" ") if t < len(table) else tokenizer.decode([t]).encode()
    if isinstance(detok, BPEStreamingDetokenizer):  # one character a byte (GPT-2's map); added tokens as written
        to_byte = _byte_level()
        return lambda t: (b"".join(to_byte.get(c) or c.encode("utf-8") for c in table[t]) if t < len(table)
                          else tokenizer.decode([t]).encode())
    return lambda t: tokenizer.decode([t]).encode("utf-8")


@lru_cache(maxsize=1)
def _byte_level() -> dict[str, bytes]:
    """Byte-level BPE's characters and the bytes they stand for: printable bytes as themselves, the
    others shifted past 255 in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in kept]
    out = {chr(b): bytes([b]) for b in kept}
    out.update({chr(256 + i): bytes([b]) for i, b in enumerate(shifted)})
    return out


class TokenLog:
    """One answer's token entries, handed out as the text they produced is shown."""

    def __init__(self):
        self.pending: list[tuple[int, dict]] = []  # (where the token's text starts, its entry)
        self.shown: list[dict] = []  # entries whose text was shown, in order
        self.taken = 0  # of them, handed to a stream so far
        self.chars = 0  # where the next token's text starts, as far as the tokens' own bytes tell
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # a character's parts count once
        self.begun = False  # some text came (the detokenizers drop the answer's first space)

    def add(self, entries: list[dict], start: int, length: int) -> None:
        """A step's entries, whose text is (at most: a detokenizer holds back a token's text until
        the next) the `length` characters from `start` in the answer's text. Each token's text
        starts where the ones before it end, as far as the tokens' bytes tell (a character's parts
        all start where it does; an answer's first space is dropped, as the detokenizers do), never
        past the step's text."""
        end = start + max(length - 1, 0)
        self.chars = min(self.chars, end)
        for e in entries:
            self.pending.append((min(self.chars, end), e))
            text = self.utf8.decode(bytes(e["bytes"]))
            self.chars += len(text if self.begun else text.removeprefix(" "))
            self.begun = self.begun or bool(text)

    def show(self, upto: int) -> None:
        """The answer's text before `upto` is shown: every token whose text starts before it too."""
        while self.pending and self.pending[0][0] < upto:
            self.shown.append(self.pending.pop(0)[1])

    def take(self) -> list[dict]:
        """The entries shown since the last take (a stream's next chunk)."""
        new = self.shown[self.taken:]
        self.taken = len(self.shown)
        return new


def with_tops(entries: list[dict], ids: bool = False) -> list[dict]:
    """Entries as OpenAI's chat, llama.cpp's (`ids`: with the token ids) and Ollama's protocols
    list them: token, logprob, bytes, and the alternatives the same way in `top_logprobs`."""
    keys = ("id", "token", "logprob", "bytes") if ids else ("token", "logprob", "bytes")
    plain = lambda e: {k: e[k] for k in keys}  # noqa: E731
    return [plain(e) | {"top_logprobs": [plain(t) for t in e["top"]]} for e in entries]


def openai_chat(entries: list[dict]) -> dict:
    """OpenAI's chat choice `logprobs`."""
    return {"content": with_tops(entries)}


def openai_text(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's (legacy) completions choice `logprobs`; `offset`: where these tokens' text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}


def llama_cpp(entries: list[dict]) -> list[dict]:
    """llama.cpp's `completion_probabilities`."""
    return with_tops(entries, ids=True)


def ollama(entries: list[dict]) -> list[dict]:
    """Ollama's `logprobs`."""
    return with_tops(entries)
