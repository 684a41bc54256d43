"""llama.vim's and llama.vscode's completion clients, emulated from their source for tools/editor/typist.py.

Vim: ggml-org/llama.vim a1c8e6e, autoload/llama.vim (llama#fim, s:fim_ctx_local, s:fim_try_hint,
s:fim_render, s:fim_on_response, the client cache). VSCode: ggml-org/llama.vscode 3938fb3,
src/completion.ts (getCompletionItems, getCachedCompletion) and llama-server.ts's request body.
A client holds one buffer (`lines`, cursor at (y, x), 0-based) and a simulated clock (`now`);
`post(kind, body)` serves a request and says how many seconds it took, which the clock then
spends while the keys go on (`run_until`). The tests (tests/test_vim_typing.py) drive them with a
fake server.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict

from .replay import N_PREFIX, N_SUFFIX, OUR_FIELDS, RING_CHUNK, RING_SCOPE, VIM_FIELDS, Ring

DEBOUNCE = 0.1  # llama#fim: a call while a request is in flight retries this much later
MAX_CACHE, MAX_LINE_SUFFIX, LOOKBACK, PICK_MOVE = 250, 8, 128, 32  # llama.vim's defaults
BLANK = re.compile(r"\s*")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def indent(s: str) -> int:
    return len(s) - len(s.lstrip(" \t"))


class Vim:
    """llama.vim's completion client on one buffer (`lines`, cursor at (y, x), 0-based)."""

    def __init__(self, post, ring: Ring):
        self.post, self.ring = post, ring  # post(kind, body) -> (response or None, seconds)
        self.cache: OrderedDict[str, dict] = OrderedDict()
        self.job: tuple[float, list[str], dict | None] | None = None  # (ends at, hashes, response)
        self.timer: tuple[float, int | None, int | None, list[str]] | None = None  # (fires at, x, y, prev)
        self.shown: dict | None = None  # s:fim_data while a hint is shown
        self.indent_last, self.pos_y_pick, self.now = 0, -9999, 0.0
        self.lines: list[str] = []
        self.y = self.x = 0

    def get(self, y: int) -> str:  # getline(): "" past the end
        return self.lines[y] if 0 <= y < len(self.lines) else ""

    # -- the client's cache (s:cache_insert / s:cache_get) -----------------------------------
    def cache_get(self, key: str):
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        return None

    def cache_insert(self, key: str, value: dict) -> None:
        if key not in self.cache and len(self.cache) >= MAX_CACHE:
            self.cache.popitem(last=False)
        self.cache[key] = value
        self.cache.move_to_end(key)

    # -- s:fim_ctx_local -------------------------------------------------------------------
    def ctx(self, x: int, y: int, prev: list[str]) -> dict:
        if not prev:
            cur = self.get(y)
            pre, suf = cur[:x], cur[x:]
            before = self.lines[max(0, y - N_PREFIX):y]
            ind = 0 if BLANK.fullmatch(cur) else indent(cur)
            if BLANK.fullmatch(cur):
                pre = suf = ""
        else:
            cur = self.get(y) + prev[0] if len(prev) == 1 else prev[-1]
            pre, suf = cur, ""
            before = self.lines[max(0, y - N_PREFIX + len(prev) - 1):y]
            if len(prev) > 1:
                before = before + [self.get(y) + prev[0]] + prev[1:-1]
            ind = self.indent_last
        after = self.lines[y + 1:y + 1 + N_SUFFIX]
        return {"prefix": "\n".join(before) + "\n", "middle": pre, "suffix": suf + "\n" + "\n".join(after) + "\n",
                "indent": ind, "line_cur_suffix": suf}

    # -- llama#fim -------------------------------------------------------------------------
    def fim(self, x: int | None, y: int | None, prev: list[str]) -> None:
        if self.job is not None:  # avoid sending repeated requests too fast
            self.timer = (self.now + DEBOUNCE, x, y, prev)
            return
        x, y = (self.x, self.y) if x is None else (x, y)
        c = self.ctx(x, y, prev)
        if len(c["line_cur_suffix"]) > MAX_LINE_SUFFIX:
            return
        hashes, trim = [sha(c["prefix"] + c["middle"] + "Î" + c["suffix"])], c["prefix"]
        for _ in range(3):
            trim = re.sub(r"^[^\n]*\n", "", trim, count=1)
            if not trim:
                break
            hashes.append(sha(trim + c["middle"] + "Î" + c["suffix"]))
        if any(self.cache_get(h) is not None for h in hashes):
            return
        self.indent_last = c["indent"]
        body = {"id_slot": 0, "input_prefix": c["prefix"], "input_suffix": c["suffix"],
                "input_extra": self.ring.extra(),
                "prompt": c["middle"], "n_predict": 128, "stop": [], "n_indent": c["indent"], "top_k": 40,
                "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
                "t_max_prompt_ms": 500, "t_max_predict_ms": 1000 if prev else 250,
                "response_fields": VIM_FIELDS + OUR_FIELDS}
        resp, secs = self.post("follow-up" if prev else "fim", body)
        self.job = (self.now + secs, hashes, resp)
        self.pick(y)

    def pick(self, y: int) -> None:
        """Gather extra context when the cursor has moved a lot since the last pick."""
        if abs(y - self.pos_y_pick) > PICK_MOVE:
            y1, last = y + 1, len(self.lines)  # Vim's lines are 1-based
            self.ring.pick(self.lines[max(1, y1 - RING_SCOPE) - 1:max(1, y1 - N_PREFIX)], self.now)
            self.ring.pick(self.lines[min(last, y1 + N_SUFFIX) - 1:min(last, y1 + N_SUFFIX + RING_CHUNK)], self.now)
            self.pos_y_pick = y

    def on_response(self) -> None:  # s:fim_on_response, then s:fim_on_exit
        _, hashes, resp = self.job
        if resp is not None and isinstance(resp.get("content"), str):
            for h in hashes:
                self.cache_insert(h, resp)
            if self.shown is None or not self.shown["can_accept"]:
                self.try_hint(self.x, self.y)
        self.job = None

    def on_move(self) -> None:  # s:on_move, then llama#fim(-1, -1, ...)
        self.shown = None
        self.try_hint(self.x, self.y)
        self.fim(None, None, [])

    # -- s:fim_try_hint, s:fim_render ------------------------------------------------------
    def try_hint(self, x: int, y: int) -> None:
        c = self.ctx(x, y, [])
        raw = self.cache_get(sha(c["prefix"] + c["middle"] + "Î" + c["suffix"]))
        if raw is None:  # a completion cached a few characters back that starts with what was typed
            pm, best = c["prefix"] + c["middle"], 0
            for i in range(LOOKBACK):
                got = self.cache_get(sha(pm[:-(1 + i)] + "Î" + c["suffix"]))
                if not got or got["content"][:i + 1] != pm[-(1 + i):]:
                    continue
                rest = got["content"][i + 1:]
                if rest and (raw is None or len(rest) > best):
                    best = best if raw is None else len(rest)
                    raw = got | {"content": rest}
        if raw is not None:
            self.render(x, y, raw["content"])
            self.fim(x, y, self.shown["content"])  # the speculative follow-up for this position

    def render(self, x: int, y: int, reply: str) -> None:
        content, can_accept = reply.split("\n"), True
        while content and content[-1] == "":
            content.pop()
        if not content:
            content, can_accept = [""], False
        cur = self.get(y)
        if BLANK.fullmatch(cur):  # a blank line: its indentation is taken from the hint
            lead = min(indent(content[0]), len(cur))
            cur, content[0] = content[0][:lead], content[0][lead:]
        pre, suf = cur[:x], cur[x:]
        if len(content) > 1 and content[0] == "" and content[1:] == self.lines[y + 1:y + len(content)]:
            content = [""]
        if len(content) == 1 and content[0] == suf:
            content = [""]
        cmp = y + 1
        while cmp < len(self.lines) - 1 and BLANK.fullmatch(self.get(cmp)):
            cmp += 1
        if pre + content[0] == self.get(cmp):  # it repeats the lines below
            n, nxt = len(content), self.get(cmp + 1)
            if (n == 1 or (n == 2 and content[-1] == (nxt[:len(content[-1])] if content[-1] else nxt))
                    or (n > 2 and content[1:] == [self.get(cmp + 1 + i) for i in range(n - 1)])):
                content = [""]
        content[-1] += suf
        if BLANK.fullmatch("\n".join(content)):
            can_accept = False
        self.shown = {"x": x, "y": y, "line_cur": cur, "content": content, "can_accept": can_accept}

    # -- the clock -------------------------------------------------------------------------
    def run_until(self, t: float) -> None:
        """Deliver replies and fire the timer up to time t."""
        while True:
            due = [(self.job[0], 0)] if self.job else []
            due += [(self.timer[0], 1)] if self.timer else []
            if not due or min(due)[0] > t:
                break
            self.now, which = min(due)
            if which == 0:
                self.on_response()
            else:
                _, x, y, prev = self.timer
                self.timer = None
                self.fim(x, y, prev)
        self.now = t


class VSCode(Vim):
    """llama.vscode's inline completion provider (ggml-org/llama.vscode 3938fb3, src/completion.ts)
    on the same buffer: VS Code calls it at every key and cancels the call before; a call waits,
    polling every 150 ms, while a request is in flight (none is ever cancelled); it answers from
    the client cache (the context, or one with fewer characters of the cursor line whose
    completion starts with the rest), else sends one request: n_cmpl 3, top_p 0.99,
    t_max_predict_ms 500 (package.json's defaults). The reply is cached whatever happens and shown
    only when no key came since the call. No follow-ups; hints pass llama.vim's render rules here
    (its shouldDiscardSuggestion has the same ones, as near as matters)."""

    POLL = 0.15  # DELAY_BEFORE_COMPL_REQUEST

    def __init__(self, post, ring: Ring):
        super().__init__(post, ring)
        self.keys = 0  # calls made: a reply is shown only to the latest

    def on_move(self) -> None:  # a key: a new provider call, the one before cancelled
        self.shown, self.timer = None, None
        self.keys += 1
        self.fim(None, None, [])

    def fim(self, x, y, prev) -> None:  # the provider call (or its next poll)
        if self.job is not None:
            self.timer = (self.now + self.POLL, None, None, [])
            return
        c = self.ctx(self.x, self.y, [])
        key = c["prefix"] + "|" + c["suffix"] + "|"
        if (got := self.cached(key, c["middle"])) is not None:
            self.render(self.x, self.y, got)
            return
        ind = indent(self.get(self.y))
        body = {"id_slot": 0, "input_prefix": c["prefix"], "input_suffix": c["suffix"],
                "input_extra": self.ring.extra(),
                "prompt": c["middle"], "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
                "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
                "t_max_predict_ms": 500} | ({"n_indent": ind} if ind else {})
        resp, secs = self.post("fim", body)
        self.job = (self.now + secs, [sha(key + c["middle"]), self.keys], resp)
        self.pick(self.y)

    def cached(self, key: str, prompt: str) -> str | None:  # getCachedCompletion
        for i in range(len(prompt), -1, -1):
            got = self.cache_get(sha(key + prompt[:i]))
            if got is not None and got["content"].startswith(prompt[i:]):
                return got["content"][len(prompt) - i:]
        return None

    def on_response(self) -> None:
        _, (h, keys), resp = self.job
        self.job = None
        if resp is not None and isinstance(resp.get("content"), str):
            self.cache_insert(h, resp)
            if keys == self.keys:  # the call was not cancelled: its items are shown
                self.render(self.x, self.y, resp["content"])


CLIENTS = {"llama.vim": Vim, "llama.vscode": VSCode}
