"""Editor completion prompts: /infill's pieces in, one token prompt out, with text rules for the reply.

Two layouts, both with llama.cpp's /infill pieces (extra context chunks, prefix, suffix, and the
cursor line's text before the cursor, `prompt`):
- FIM, for models with fill-in-the-middle tokens (llama.cpp's layout): extra chunks first (each
  after the file separator and its file name when the model has one), then
  <prefix>PREFIX<suffix>SUFFIX<middle>PROMPT.
- Prefix-only, for models without them (the embedded default): the extra chunks as plain text, then
  PREFIX + PROMPT, which the model simply continues. The reply is cut at the end of the block
  (`CompletionRules`), and where it starts to repeat the text below the cursor. On an empty cursor
  line the prompt stops before the prefix's last newline (token healing): BPE vocabularies merge a
  newline with the next line's indentation, so a prompt ending in a bare newline token reads like
  "the next line starts at column 0", and the model writes the newline itself instead.

Fitting the context (llama.cpp's order and ratios, batch B = 2048 by default): the suffix keeps at
most B/4 tokens from its start (never less than the cursor line's rest), the prefix at most 3B/4
from its end (never less than... nothing: its oldest lines go first), and the extra chunks fill
what is left, the oldest chunks dropped first. All cuts are whole lines or whole chunks.

Prefill reuse: the KV cache keeps the previous prompt, and only its common prefix with the next
one is reused (exact: no shifted or re-rotated entries). When the editor's prefix window slides
(a request every few lines, 256 lines above the cursor), a prefix cut at "the last N tokens" would
start at another line each time and nothing after the extra chunks would be reused. So the prefix
keeps the start line of the last prompt (found again by its text) for as long as the prefix from
there fits its budget, and a new start uses only 3/4 of the budget: one full prefill every
quarter budget of typed text instead of every request. The same text is sent to the model either
way; only which of the sent lines above the cursor are used changes. The start lines of the last
few prompts are kept, the latest first, so an editor that flips between files finds each file's
start again (and the engine's slots keep each file's cache: slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .errors import CachebackError

REANCHOR = 0.75  # a new prefix start uses this share of the prefix budget, leaving room to grow
ANCHOR_LINES = 3  # lines of text that find the last prompt's start line again
ANCHORS = 8  # start lines kept (one per file an editor flips between)


def fim_prompt(fim: dict | None, prefix: str, suffix: str, extra: list[dict] | None = None, prompt: str = "") -> str:
    """llama.cpp's /infill text layout (InfillBuilder trims the pieces first)."""
    if not fim:
        raise CachebackError("this model has no fill-in-the-middle tokens")
    return extra_text(fim, extra or []) + f"{fim['prefix']}{prefix}{fim['suffix']}{suffix}{fim['middle']}{prompt}"


def chunk_text(fim: dict | None, chunk: dict) -> str:
    text = str(chunk.get("text") or "")
    if fim and fim.get("file_sep"):
        return f"{fim['file_sep']}{chunk.get('filename') or ''}\n{text}"
    return text


def extra_text(fim: dict | None, extra: list[dict]) -> str:
    return "".join(chunk_text(fim, c) for c in extra)


@dataclass
class InfillPrompt:
    ids: list[int]
    fim: bool  # False: the prefix-only layout
    truncated: bool  # some of the text sent is not in the prompt
    rules: "CompletionRules"
    context: list[list[int]]  # prefix-only: the chunks left out, then the suffix, for the drafter
    # (learning.start_request)


@dataclass
class InfillBuilder:
    """Builds /infill prompts for one model and remembers where the last prefix started."""

    tokenizer: object
    fim: dict | None
    context_length: int
    batch: int = 2048
    stable_prefix: bool = True  # False: always the last lines that fit (to measure what it brings)
    # prefix-only layout: at most this many tokens of extra chunks, the oldest that fit (None: all
    # that fit, as FIM prompts always take). Glued before the prefix with no file markers, they made
    # the default model's completions no better and twice as slow (docs/BENCHMARKS.md §8), so none
    # by default; they are still given to the drafter to draft from.
    extra_budget: int | None = 0
    anchors: list[list[str]] = field(default_factory=list)  # first lines of the last prompts' prefixes, latest first
    last: tuple[str, str, str] | None = None  # the last request's prefix, suffix and cursor line

    def __post_init__(self):
        encode = self.tokenizer.encode
        self.count = lru_cache(maxsize=1 << 16)(lambda text: len(encode(text, add_special_tokens=False)))
        self.ids = lru_cache(maxsize=256)(lambda text: list(encode(text, add_special_tokens=False)))

    def build(self, prefix: str, suffix: str, extra: list[dict], prompt: str, n_predict: int,
              prefix_only: bool = False) -> InfillPrompt:
        if prefix or suffix or prompt:
            self.last = (prefix, suffix, prompt)
        elif self.last:  # a warm-up with extra chunks only: put them before the last request's text,
            prefix, suffix, prompt = self.last  # which the next request will share, so it reuses both
        use_fim = bool(self.fim) and not prefix_only
        fim = self.fim if use_fim else None
        room = self.context_length - 1 - min(max(n_predict, 1), self.context_length // 4)
        specials = 4 if use_fim else 0
        prompt_n = self.count(prompt) if prompt else 0
        # suffix: from its start, at most B/4 tokens (the cursor line's rest always stays)
        suffix_lines = suffix.splitlines(keepends=True)
        suffix_budget = min(self.batch // 4, room // 4) - 2 - prompt_n
        keep_s = fit_from_start([self.count(x) for x in suffix_lines], suffix_budget) if use_fim else 0
        keep_s = max(keep_s, 1 if use_fim and suffix_lines else 0)
        suffix_used = "".join(suffix_lines[:keep_s])
        suffix_n = self.count(suffix_used) if suffix_used else 0
        # prefix: from its end, at most 3B/4 tokens, from the last prompt's start line if it fits
        lines = prefix.splitlines(keepends=True)
        costs = [self.count(x) for x in lines]
        budget = min(3 * (self.batch // 4), room - specials - prompt_n - suffix_n)
        if budget < 0:
            raise CachebackError(f"the cursor line and suffix do not fit the context of {self.context_length} tokens")
        start = self._start(lines, costs, budget)
        # extra chunks fill what is left, the oldest dropped first
        left = room - specials - prompt_n - suffix_n - sum(costs[start:])
        sent = [c for c in extra if str(c.get("text") or "")]
        costs_e = [self.count(chunk_text(fim, c)) for c in sent]
        take = len(sent)
        if not use_fim and self.extra_budget is not None:
            # the oldest chunks that fit: the prompt's start stays put while new chunks come in
            take = fit_from_start(costs_e, min(left, self.extra_budget))
        chunks, costs_e = sent[:take], costs_e[:take]
        first = len(chunks) - fit_from_start(costs_e[::-1], left)

        # prefix-only on an empty cursor line: end the prompt before the last newline, which the
        # model then writes itself, merged with the new line's indentation as in its training text
        heal = "\n" + prompt if not fim and not prompt.strip() and prefix.endswith("\n") else ""

        def encode(start):
            used = "".join(lines[start:])
            text = fim_prompt(fim, used, suffix_used, chunks[first:], prompt) if fim else \
                extra_text(None, chunks[first:]) + (used[:-1] if heal else used + prompt)
            return list(self.tokenizer.encode(text))

        ids = encode(start)
        while len(ids) > room and start < len(lines):  # per-line counts can miss the joint count a little
            start += 1
            ids = encode(start)
        if not ids and n_predict:
            raise CachebackError("nothing to complete: input_prefix, input_suffix and prompt are empty")
        if len(ids) > room:
            raise CachebackError(f"infill prompt does not fit the context of {self.context_length} tokens")
        anchor = lines[start:start + ANCHOR_LINES]
        if anchor:
            self.anchors = [anchor] + [a for a in self.anchors if a != anchor][: ANCHORS - 1]
        truncated = start > 0 or first > 0 or (use_fim and keep_s < len(suffix_lines))
        rules = CompletionRules(block=not use_fim, cursor_line=prompt, suffix=suffix, heal=heal)
        context = []
        if not use_fim:  # the drafter drafts from the chunks left out and the code below the cursor
            left_out = sent[:first] + sent[take:]
            context = [self.ids(chunk_text(None, c)) for c in left_out] + [self.ids(suffix)[: self.batch // 4]]
        return InfillPrompt(ids, use_fim, truncated, rules, context)

    def _start(self, lines: list[str], costs: list[int], budget: int) -> int:
        """First prefix line to use: the start line of the latest prompt whose start is in this
        prefix, while the prefix from there fits."""
        total, n = 0, len(lines)
        if not self.stable_prefix:
            start = n
            while start > 0 and total + costs[start - 1] <= budget:
                start -= 1
                total += costs[start]
            return start
        for anchor in self.anchors:
            k = len(anchor)
            at = next((i for i in range(n - k + 1) if lines[i:i + k] == anchor), None)  # near the top
            if at is not None:
                if sum(costs[at:]) <= budget:
                    return at
                break
        target = int(REANCHOR * budget)  # room to grow before the next new start
        start = n
        while start > 0 and total + costs[start - 1] <= target:
            start -= 1
            total += costs[start]
        return start


def fit_from_start(costs: list[int], budget: int) -> int:
    """How many of the first items fit in the budget."""
    total = 0
    for i, c in enumerate(costs):
        total += c
        if total > budget:
            return i
    return len(costs)


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


@dataclass
class CompletionRules:
    """Where a code completion's text ends, beyond stop strings and the token limit.

    n_indent (llama.cpp's): a new line indented less than this ends the completion. In the
    prefix-only layout (block=True) the model does not see the text below the cursor, so the reply
    also ends at a blank line after some text, at a line indented less than the block it started in,
    at the end of the cursor line when text follows the cursor there, and before a line that repeats
    the first line below the cursor.
    """

    block: bool = False
    cursor_line: str = ""
    suffix: str = ""
    n_indent: int = 0
    heal: str = ""  # text the prompt left out for the model to write first (not shown)

    def __post_init__(self):
        first, _, rest = self.suffix.partition("\n")
        self.line_rest = first.strip()  # text after the cursor on its line
        self.next_line = next((x.strip() for x in rest.splitlines() if x.strip()), "")
        self.block_indent = indent_of(self.cursor_line) if self.cursor_line.strip() else None

    def visible(self, text: str) -> str:
        """The reply without the healed text; a reply that first goes on with the line above
        the cursor instead is shown from its first new line."""
        if not self.heal or text.startswith(self.heal):
            return text[len(self.heal):]
        if self.heal.startswith(text):
            return ""
        return text[text.index("\n") + 1:] if "\n" in text else ""

    def cut(self, text: str) -> int | None:
        """Where to cut text (the reply so far) if it has ended; None while it goes on."""
        lines = text.split("\n")
        pos = 0
        for i, line in enumerate(lines):
            done = i < len(lines) - 1  # a line is complete once its newline is there
            full = (self.cursor_line + line) if i == 0 else line
            if i > 0 and line.strip():
                if self.n_indent and indent_of(line) < self.n_indent:
                    return pos
                if self.block and self.block_indent is not None and indent_of(line) < self.block_indent:
                    return pos
            if self.block:
                if i == 0 and self.line_rest:  # text follows the cursor: finish this line only
                    end = line.find(self.line_rest) if line.strip() else -1
                    if end >= 0:
                        return pos + end
                    if done:
                        return pos + len(line)
                if done and full.strip() and self.block_indent is None:
                    self.block_indent = indent_of(full)
                if i > 0 and done and not line.strip() and text[:pos].strip():
                    return pos  # a blank line after some text ends the block
                if i > 0 and done and self.next_line and line.strip() == self.next_line:
                    return pos  # the text below the cursor starts here
            pos += len(line) + 1
        return None

    def holds_lines(self) -> bool:
        """Whether the last, unfinished line may still be cut (streaming holds it back)."""
        return self.block or bool(self.n_indent)
