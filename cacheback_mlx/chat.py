"""`cacheback-mlx chat`: a multi-turn REPL with streaming output.

The Session keeps the KV cache and the drafter across turns, so each turn prefills only its new
tokens and the drafter keeps what it learned: later turns get faster, and the footer shows it.
Ctrl-C stops a reply (the part shown stays in the conversation), Ctrl-D quits. A thinking
model's reasoning (reasoning.py) is shown dimmed and kept beside its answer in the conversation
(`reasoning_content`, which chat templates leave out of earlier turns).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .drafters import drafter_names
from .errors import CachebackError
from .reasoning import Reasoning
from .sampling import SamplingParams

HELP = """commands:
  /drafter [NAME]   show or switch the drafter ({names})
  /stats            speed of the last reply
  /reset            clear the conversation, KV cache and drafter state
  /system TEXT      set the system prompt (and reset)
  /save FILE        save the conversation as JSON      /load FILE   load one
  /help             this help                          /quit        leave (or Ctrl-D)
A line ending in \\ continues on the next line. Ctrl-C stops a reply."""


@dataclass
class ChatState:
    system: str | None = None
    messages: list[dict] = field(default_factory=list)  # the whole conversation (what /save writes)
    last_stats: dict | None = None
    start: int = 0  # messages[start:] is what the model still sees (older ones no longer fit)

    def reset(self) -> None:
        self.messages.clear()
        self.start = 0


def fit_context(session, state: ChatState, reserve: int) -> tuple[list[int], int]:
    """Prompt ids for the conversation: the system prompt and the latest turns that fit the
    model's context with `reserve` tokens left for the reply. Older turns are dropped, whole
    exchanges at a time, never the system prompt nor the message being answered. Returns the ids
    and how many more messages were dropped; if even the last message alone does not fit, the
    engine's one-line error says so."""
    system = [{"role": "system", "content": state.system}] if state.system else []
    room = session.loaded.context_length - reserve
    before = state.start
    while True:
        ids = session.encode(system + state.messages[state.start:], chat=True)
        if len(ids) <= room or state.start >= len(state.messages) - 1:
            return ids, state.start - before
        state.start += 1
        while state.start < len(state.messages) - 1 and state.messages[state.start]["role"] != "user":
            state.start += 1


def save_conversation(path: str | Path, state: ChatState, drafter: str) -> None:
    """Write atomically: a crash mid-write never destroys an earlier save."""
    path = Path(path).expanduser()
    data = {"system": state.system, "messages": state.messages, "drafter": drafter}
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
    os.replace(tmp, path)


def load_conversation(path: str | Path) -> dict:
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CachebackError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CachebackError(f"cannot read conversation {path}: {e}") from None
    msgs = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
            and isinstance(m.get("content"), str)
            for m in msgs):
        raise CachebackError(f"{path} is not a saved conversation")
    return data


def handle_command(line: str, session, state: ChatState) -> str | None:
    """Run a slash command; returns text to show, or None to quit."""
    cmd, _, arg = line[1:].strip().partition(" ")
    arg = arg.strip()
    if cmd in ("quit", "exit", "q"):
        return None
    if cmd == "help":
        return HELP.format(names=", ".join(drafter_names()))
    if cmd == "drafter":
        if not arg:
            return f"drafter: {session.drafter_name}"
        try:
            session.set_drafter(arg)
        except CachebackError as e:
            return f"error: {e}"
        return f"drafter: {arg}"
    if cmd == "stats":
        s = state.last_stats
        if not s:
            return "no reply yet"
        return (f"{s['tokens']} tokens in {s['passes']} passes, {s['tokens_per_s']:.1f} tok/s, "
                f"MAT {s['mat']:.2f} (speedup over plain decoding is at most ~MAT: each pass also costs a "
                f"little more than a one-token step), drafting {1e3 * s['draft_s']:.1f} ms "
                f"({s['draft_us_per_pass']:.0f} us/pass), prefill {s['prefill_tokens']} new / "
                f"{max(s['prompt_tokens'] - 1 - s['prefill_tokens'], 0)} reused tokens")
    if cmd == "reset":
        state.reset()
        session.reset()
        return "conversation cleared"
    if cmd == "system":
        state.system = arg or None
        state.reset()
        session.reset()
        return f"system prompt {'set' if arg else 'cleared'}; conversation cleared"
    if cmd == "save":
        if not arg:
            return "usage: /save FILE"
        try:
            save_conversation(arg, state, session.drafter_name)
        except OSError as e:
            return f"error: cannot save {arg}: {e}"
        return f"saved {len(state.messages)} messages to {arg}"
    if cmd == "load":
        if not arg:
            return "usage: /load FILE"
        try:
            data = load_conversation(arg)
        except CachebackError as e:
            return f"error: {e}"
        state.system, state.messages, state.start = data.get("system"), list(data["messages"]), 0
        return f"loaded {len(state.messages)} messages from {arg}"
    return f"unknown command /{cmd} (try /help)"


def reply(session, state: ChatState, max_tokens: int, sampling: SamplingParams, write, note=None,
          think=None) -> None:
    """Stream one assistant reply; on Ctrl-C keep what was shown. When the conversation outgrows
    the context, its oldest turns are dropped and `note` says so in one line. A thinking model's
    reasoning goes to `think` (default: written as the model wrote it, markers and all) and into
    the message's `reasoning_content`, its answer into `content`."""
    reserve = min(max_tokens, session.loaded.context_length // 4)
    ids, dropped = fit_context(session, state, reserve)
    if dropped:
        (note or write)(f"[context full: the {dropped} oldest message{'s' if dropped > 1 else ''} no longer "
                        f"fit and {'were' if dropped > 1 else 'was'} dropped; the system prompt stays]\n")
    mind = Reasoning.of(session.tokenizer, ids)
    text, thought = [], []

    def show(piece: str, final: bool = False) -> None:
        if mind is None:
            text.append(piece)
            return write(piece)
        t, said = mind.feed(piece, final)
        thought.append(t)
        text.append(said)
        if think is None:
            return write(piece)  # as the model wrote it
        think(t)
        write(said)

    stopped = False
    try:
        for piece, _ in session.stream_ids(ids, max_tokens, sampling):
            show(piece)
    except KeyboardInterrupt:
        stopped = True
    finally:
        show("", final=True)  # what a marker's first characters held back
        if stopped:
            write(" [stopped]")
        message = {"role": "assistant", "content": "".join(text)}
        state.messages.append(message | ({"reasoning_content": "".join(thought)} if "".join(thought) else {}))
        state.last_stats = session.stats.as_dict()
    write("\n")


def footer(stats: dict, drafter: str) -> str:
    reused = max(stats["prompt_tokens"] - 1 - stats["prefill_tokens"], 0)  # the last prompt token is never cached
    return (f"[{stats['tokens']} tok, {stats['tokens_per_s']:.1f} tok/s, MAT {stats['mat']:.2f}, "
            f"prefill {stats['prefill_tokens']} new + {reused} reused, {drafter}]")


def read_input(prompt_session, interactive: bool) -> str:
    """One user message; a trailing backslash continues the line."""
    lines = []
    while True:
        prompt = ">>> " if not lines else "... "
        if interactive:
            line = prompt_session.prompt(prompt)
        else:
            sys.stdout.write(prompt)
            sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def run_chat(session, system: str | None, max_tokens: int, sampling: SamplingParams) -> None:
    # Ctrl-C must stop a reply even when we were started with SIGINT ignored (nohup, `cmd &`).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    state = ChatState(system=system)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    prompt_session = None
    if interactive:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory

        hist = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cacheback-mlx" / "chat_history"
        hist.parent.mkdir(parents=True, exist_ok=True)
        prompt_session = PromptSession(history=FileHistory(str(hist)))

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    write(f"cacheback-mlx chat: {session.loaded.name} ({session.loaded.dtype}), drafter {session.drafter_name}. "
          "/help for commands.\n")
    while True:
        try:
            line = read_input(prompt_session, interactive)
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line
        except EOFError:
            write("\n")
            return
        if not line.strip():
            continue
        if line.startswith("/"):
            out = handle_command(line, session, state)
            if out is None:
                return
            write(out + "\n")
            continue
        state.messages.append({"role": "user", "content": line})
        start = state.start
        try:
            reply(session, state, max_tokens, sampling, write,
                  note=(lambda t: write(f"\033[2m{t.rstrip()}\033[0m\n")) if interactive else None,
                  think=(lambda t: t and write(f"\033[2m{t}\033[0m")) if interactive else None)
        except CachebackError as e:
            state.messages.pop()
            state.start = start  # an over-long message drops nothing
            write(f"error: {e}\n")
            continue
        write(f"\033[2m{footer(state.last_stats, session.drafter_name)}\033[0m\n" if interactive
              else footer(state.last_stats, session.drafter_name) + "\n")
