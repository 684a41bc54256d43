"""Reasoning: a thinking model's text between its think markers (Qwen3's and DeepSeek-R1's
<think>...</think>, the ones mlx-lm knows for the vocabulary: `tokenizer.think_start`,
`think_end`) comes back apart from its answer, as OpenAI-style servers give it
(`reasoning_content`, llama.cpp's and DeepSeek's name, and `reasoning`, mlx-lm's) and as Ollama
does (`thinking`). A prompt that ends inside a think block (templates that open one for the
model) starts the answer in reasoning, as mlx-lm's server reads it. Decoding is not touched.
"""

from __future__ import annotations

from typing import Sequence


class Reasoning:
    """One answer's text split into reasoning and content, piece by piece as it streams."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end, self.inside = start, end, inside
        self._held = ""  # text not given out yet: it may begin a marker

    @classmethod
    def of(cls, tokenizer, prompt_ids: Sequence[int]) -> Reasoning | None:
        """The splitter for an answer to `prompt_ids`; None for a model without think markers."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        start, end = tokenizer.think_start, tokenizer.think_end
        tail = tokenizer.decode(list(prompt_ids[-64:]))
        return cls(start, end, inside=tail.rfind(start) > tail.rfind(end))

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """After `piece`: (reasoning, content) that can be shown now; `final`: the answer ended."""
        self._held += piece
        thought, said = [], []
        while True:
            marker = self.end if self.inside else self.start
            at = self._held.find(marker)
            out = thought if self.inside else said
            if at < 0:
                keep = 0 if final else marker_prefix(self._held, marker)
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            out.append(self._held[:at])
            self._held, self.inside = self._held[at + len(marker):], not self.inside
        return "".join(thought), "".join(said)


def marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back until it is known)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
