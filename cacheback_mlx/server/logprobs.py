"""Log-probabilities in the server's answers: each token's, and the most likely tokens at its
position, as OpenAI's (`logprobs`, `top_logprobs`; the completions route's `logprobs: N`),
llama.cpp's (`n_probs`) and Ollama's (`logprobs`, `top_logprobs`) protocols ask for them.

The values are mlx-lm's (logits - logsumexp(logits), after the penalties and biases), each from
the pass row that predicted its token (engine.Accepted): drafting changes none of them beyond a
pass's rounding. A token's entry goes out with the text it produced: once the text where it starts is shown;
tokens whose text a stop string or an editor's rule cut off are left out.
Token strings are the tokenizer's decoding of the token alone, and `bytes` their UTF-8 (a token
holding part of a character reads as U+FFFD there).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

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

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"id": token, "token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [entry(int(t), c) | {"top": [entry(i, v) for i, v in zip(*alts)]}
            for t, c, alts in zip(tokens, chosen.tolist(), tops)]


class TokenLog:
    """One answer's token entries, handed out as the text they produced is shown."""

    def __init__(self):
        self.pending: list[tuple[int, dict]] = []  # (where the token's text starts, its entry)
        self.shown: list[dict] = []  # entries whose text was shown, in order
        self.taken = 0  # of them, handed to a stream so far
        self.chars = 0  # where the next token's text starts, as far as the tokens' own texts tell

    def add(self, entries: list[dict], start: int, length: int) -> None:
        """A step's entries, whose text is (at most: a detokenizer holds back a token's text until
        the next) the `length` characters from `start` in the answer's text. Each token's text
        starts where the ones before it end, as far as each token's text alone tells (an answer's
        first space is dropped, as the detokenizers do), never past the step's text."""
        end = start + max(length - 1, 0)
        self.chars = min(self.chars, end)
        for e in entries:
            first = not (self.pending or self.shown)
            self.pending.append((min(self.chars, end), e))
            self.chars += len(e["token"].removeprefix(" ") if first else e["token"])

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
