"""The chat REPL: commands and save/load with no model, then the real REPL in a pseudo-terminal."""

import json
import sys
import time

from cacheback_mlx.chat import ChatState, handle_command, load_conversation, save_conversation
from cacheback_mlx.errors import CachebackError

import pytest

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers


class FakeSession:
    drafter_name = "ngram"

    def __init__(self):
        self.resets = 0

    def set_drafter(self, name):
        if name not in ("ngram", "cacheback"):
            raise CachebackError(f"unknown drafter {name!r}; known drafters: ngram, cacheback")
        self.drafter_name = name

    def reset(self):
        self.resets += 1


def test_commands():
    s, st = FakeSession(), ChatState(messages=[{"role": "user", "content": "hi"}])
    assert handle_command("/drafter", s, st) == "drafter: ngram"
    assert handle_command("/drafter cacheback", s, st) == "drafter: cacheback" and s.drafter_name == "cacheback"
    assert handle_command("/drafter bogus", s, st).startswith("error: unknown drafter")
    assert handle_command("/stats", s, st) == "no reply yet"
    assert "/drafter" in handle_command("/help", s, st)
    assert handle_command("/system be brief", s, st).startswith("system prompt set")
    assert st.system == "be brief" and st.messages == [] and s.resets == 1
    assert handle_command("/nope", s, st).startswith("unknown command")
    assert handle_command("/quit", s, st) is None and handle_command("/exit", s, st) is None


def test_save_load_round_trip_and_bad_files(tmp_path):
    st = ChatState(system="sys", messages=[{"role": "user", "content": "héllo"},
                                           {"role": "assistant", "content": "hi"}])
    path = tmp_path / "conv.json"
    save_conversation(path, st, "ngram")
    data = load_conversation(path)
    assert data["messages"] == st.messages and data["system"] == "sys" and data["drafter"] == "ngram"
    s, other = FakeSession(), ChatState(messages=[{"role": "user", "content": "keep me"}])
    (tmp_path / "bad.json").write_text("{not json")
    assert handle_command(f"/load {tmp_path / 'bad.json'}", s, other).startswith("error:")
    assert handle_command(f"/load {tmp_path / 'missing.json'}", s, other).startswith("error: no such file")
    (tmp_path / "wrong.json").write_text(json.dumps({"messages": [{"role": "robot"}]}))
    assert handle_command(f"/load {tmp_path / 'wrong.json'}", s, other).startswith("error:")
    assert other.messages == [{"role": "user", "content": "keep me"}]  # unchanged after failed loads
    # saving over an existing file replaces it whole (atomic), never leaves a half-written file
    save_conversation(path, other, "ngram")
    assert load_conversation(path)["messages"] == other.messages
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
def test_real_repl_in_a_pseudo_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "cacheback_mlx.cli", "chat", "--max-tokens", "400"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(50, 200))
    try:
        child.expect(">>> ", timeout=300)  # the first start measures the pass cost (budget.py)
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect(r"\[(\d+) tok.*?prefill (\d+) new \+ (\d+) reused")
        child.expect(">>> ")
        child.sendline("And what is the capital of Italy?")
        child.expect(r"prefill (\d+) new \+ (\d+) reused")
        new, reused = int(child.match.group(1)), int(child.match.group(2))
        assert reused > new  # the second turn reuses the first turn's KV cache
        child.expect(">>> ")
        child.sendline("/drafter bogus")
        child.expect("error: unknown drafter 'bogus'")
        child.sendline("/drafter ngram")
        child.expect("drafter: ngram")
        child.sendline("/stats")
        child.expect("MAT")
        child.expect(">>> ")
        child.sendline("Write a long story about a dragon who learns to bake bread.")
        time.sleep(5)  # the reply is streaming (400 tokens take ~20 s here)
        child.sendintr()  # Ctrl-C stops it
        child.expect(r"\[stopped\]")
        child.expect(">>> ")
        child.sendline("Thanks. Now answer in one word: is the sky blue?")  # a short reply (asked to say hello,
        # the model went on with the dragon to the 400-token limit)
        child.expect(r"\[\d+ tok")
        child.expect(">>> ")
        time.sleep(0.5)  # let prompt_toolkit take the terminal
        child.sendcontrol("d")  # Ctrl-D quits
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_a_long_chat_on_a_small_context_keeps_answering_exactly(tmp_path):
    """40 turns on a model with a 256-token context: the oldest turns are dropped (never the
    system prompt), every turn is answered, and each reply is what a fresh generation over the
    kept turns gives."""
    from cacheback_mlx.api import Session
    from cacheback_mlx.chat import reply
    from cacheback_mlx.sampling import SamplingParams

    from conftest import write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", context=256)
    session = Session(str(tmp_path / "t.gguf"), "auto", ssd_path=str(tmp_path / "ssd"))
    state = ChatState(system="Be brief.")
    notes = []
    for i in range(40):
        state.messages.append({"role": "user", "content": f"turn {i}: say something"})
        out = []
        reply(session, state, 16, SamplingParams(), out.append, note=notes.append)
        kept_from = state.start  # what the reply saw
        assert state.messages[-1]["role"] == "assistant"
        if i in (5, 39):  # the same kept turns, from scratch, with plain decoding
            fresh = Session(str(tmp_path / "t.gguf"), "none")
            msgs = [{"role": "system", "content": "Be brief."}] + state.messages[kept_from:-1]
            assert fresh.generate(msgs, 16) == state.messages[-1]["content"]
    assert notes and "dropped" in notes[0] and "system prompt stays" in notes[0]
    assert state.start > 0 and len(state.messages) == 80  # /save still has the whole conversation
    ids = session.encode([{"role": "system", "content": "Be brief."}] + state.messages[state.start:], chat=True)
    assert "Be brief." in session.tokenizer.decode(ids) and len(ids) <= 256


def test_a_thinking_model_s_reasoning_is_shown_apart_and_kept_beside_its_answer(tmp_path):
    from cacheback_mlx.chat import reply
    from cacheback_mlx.sampling import SamplingParams

    from conftest import write_tiny_gguf
    from test_reasoning import TEMPLATE, Thinks
    write_tiny_gguf(tmp_path / "t.gguf", context=512, chat_template=TEMPLATE, specials=("<think>", "</think>"))
    session = Thinks(str(tmp_path / "t.gguf"), "none")
    answer = {"role": "assistant", "content": "Red, blue and green.", "reasoning_content": "first, the colors"}
    for think in (None, []):  # a script's output (as written), the REPL's (reasoning apart, dimmed)
        state, out = ChatState(), []
        state.messages.append({"role": "user", "content": "Three colors?"})
        reply(session, state, 32, SamplingParams(), out.append, think=None if think is None else think.append)
        assert state.messages[-1] == answer
        if think is None:
            assert "".join(out) == Thinks.answer + "\n"
        else:
            assert "".join(think) == "first, the colors" and "".join(out) == "Red, blue and green.\n"
    state.messages.append({"role": "user", "content": "More?"})
    reply(session, state, 32, SamplingParams(), out.append)  # the kept turn goes through the template
    assert "Red, blue and green." in session.tokenizer.decode(session.prompts[-1])
