"""tools/editor/clients.py's emulation of llama.vim's (a1c8e6e) and llama.vscode's (3938fb3) clients, and
tools/editor/typist.py's typist, with a fake server: no model."""

import random

from tools.editor import clients as ec
from tools.editor import typist as vt
from tools.editor.replay import Ring


class Server:
    """Answers every request with `reply(body)` after `secs` seconds of the simulated clock."""

    def __init__(self, reply, secs: float = 0.5):
        self.reply, self.secs, self.sent = reply, secs, []

    def __call__(self, kind, body):
        self.sent.append((kind, body))
        return {"content": self.reply(body)}, self.secs


def editor(server, lines, y=1, x=0):
    vim = ec.Vim(server, Ring(random.Random(0), "f.py"))
    vim.lines, vim.y, vim.x = list(lines), y, x
    vim.pos_y_pick = y  # no chunk picking in these tests
    return vim


def test_keys_while_a_request_is_in_flight_wait_for_it_then_one_request_for_the_cursor_then():
    server = Server(lambda body: "", secs=0.5)
    vim = editor(server, ["top", "", "bottom"])
    vim.on_move()
    assert len(server.sent) == 1 and server.sent[0][1]["prompt"] == ""
    for i, ch in enumerate("abc"):  # keys at 0.1, 0.2, 0.3 s: the request is still running
        vim.run_until(0.1 * (i + 1))
        vim.lines[1] += ch
        vim.x += 1
        vim.on_move()
    assert len(server.sent) == 1 and vim.timer is not None
    vim.run_until(0.45)
    assert len(server.sent) == 1  # the timer fired at 0.4 and found the request still running
    vim.run_until(0.7)  # the reply lands at 0.5; the next request goes on a timer tick after it
    assert len(server.sent) == 2
    kind, body = server.sent[1]
    assert body["prompt"] == "abc" and body["input_prefix"] == "top\n" and body["input_suffix"] == "\nbottom\n"
    assert body["t_max_predict_ms"] == (1000 if kind == "follow-up" else 250)


def test_a_cached_reply_whose_start_was_typed_is_shown_and_a_follow_up_asked_for():
    server = Server(lambda body: "llo world\n" if body["prompt"] == "he" else "", secs=0.2)
    vim = editor(server, ["top", "he", "bottom"], x=2)
    vim.on_move()  # asks for "he"
    vim.run_until(0.2)  # reply cached and shown; its follow-up waits for the request to end
    assert vim.shown["content"] == ["llo world"] and vim.shown["can_accept"]
    vim.run_until(0.35)  # the follow-up: the line as if the hint were accepted, 1 s to predict
    kind, body = server.sent[-1]
    assert kind == "follow-up" and body["prompt"] == "hello world" and body["t_max_predict_ms"] == 1000
    vim.run_until(0.6)
    vim.lines[1], vim.x = "hel", 3  # the user types "l": the cached reply shows on, one character shorter
    n = len(server.sent)
    vim.on_move()
    assert vim.shown["content"] == ["lo world"]
    assert server.sent[n][1]["prompt"] == "hel"  # llama#fim still asks for the new context
    vim.run_until(1.0)
    vim.lines[1], vim.x = "hex", 3  # a character the reply does not start with: nothing to show
    server.reply = lambda body: ""
    vim.on_move()
    assert vim.shown is None


def test_the_client_cache_answers_a_context_asked_before_without_a_request():
    server = Server(lambda body: "pass\n", secs=0.1)
    vim = editor(server, ["def f():", "    ", "x = 1"], x=4)
    vim.on_move()
    vim.run_until(1.0)
    n = len(server.sent)
    vim.on_move()  # the same context again: shown from the cache, no new request
    assert len(server.sent) == n and vim.shown["content"] == ["pass"]


def test_a_hint_that_repeats_the_line_below_is_not_shown():
    vim = editor(Server(lambda body: ""), ["a", "", "    return x", "z"], x=0)
    vim.render(0, 1, "    return x\n")
    assert vim.shown["content"] == [""] and not vim.shown["can_accept"]
    vim.lines[1] = "    "  # autoindented: the hint's indentation is taken off it
    vim.render(4, 1, "    return x\n")
    assert vim.shown["content"] == [""]
    vim.render(4, 1, "    return y\n")
    assert vim.shown["content"] == ["return y"] and vim.shown["line_cur"] == "    "


def test_the_typist_accepts_a_hint_exactly_right_in_one_key_and_types_the_rest():
    block = ["x = compute(1)", "y = x"]
    replies = {"x = comp": "ute(1)\ny = x\n"}
    server = Server(lambda body: replies.get(body["prompt"], ""), secs=0.05)
    vim = editor(server, ["top", "bottom"], y=1)
    typist = vt.Typist(vim, block, 1, cps=10)
    typist.run()
    assert vim.lines == ["top"] + block + ["bottom"]
    assert typist.accepts == 1 and typist.accepted == len("ute(1)\ny = x")  # Tab: both lines
    assert typist.typed == len("x = comp")  # 8 characters typed, the rest accepted


def test_vscode_waits_by_polls_answers_from_a_reply_whose_start_was_typed_and_shows_only_the_latest_call():
    server = Server(lambda body: "llo world\n" if body["prompt"] == "he" else "", secs=0.2)
    vs = ec.VSCode(server, Ring(random.Random(0), "f.py"))
    vs.lines, vs.y, vs.x, vs.pos_y_pick = ["top", "he", "bottom"], 1, 2, 1
    vs.on_move()  # the call for "he" sends a request at once
    assert len(server.sent) == 1 and server.sent[0][1]["n_cmpl"] == 3 and server.sent[0][1]["t_max_predict_ms"] == 500
    vs.run_until(0.1)
    vs.lines[1], vs.x = "hel", 3  # a key while the request runs: the new call polls, the old one is cancelled
    vs.on_move()
    assert len(server.sent) == 1 and abs(vs.timer[0] - 0.25) < 1e-9
    vs.run_until(0.2)
    assert vs.shown is None  # the reply came for a cancelled call: cached, not shown
    vs.run_until(0.3)  # the poll at 0.25 finds "hel" answered by the reply cached for "he"
    assert len(server.sent) == 1 and vs.shown["content"] == ["lo world"]


def test_a_file_that_cannot_be_read_is_a_one_line_error(tmp_path):
    import pytest

    with pytest.raises(SystemExit) as e:
        vt.main(["--file", str(tmp_path / "missing.py")])
    assert str(e.value).startswith("vim_typing: cannot read ") and "\n" not in str(e.value)


def _seen_before_typed(later_blocks: str) -> int:
    """Lines of a block that the replay's requests showed before the block was typed."""
    import argparse

    from tools.editor import replay as er

    # a file of unique lines, blocks close together: a block's suffix and chunks reach the next one
    lines = [f"line_{i} = {i}" for i in range(400)]
    args = argparse.Namespace(seed=3, blocks=8, block_lines=6, every=3, no_extra=False, follow_ups=True,
                              later_blocks=later_blocks)
    seen, early = set(), 0
    for kind, body, where in er.plan(lines, "f.py", args):
        if kind == "fim" and where["typed"] == 0:  # a block's first request: the cursor at its start
            early += len(seen & set(lines[where["y"]:where["y"] + 6]))
        seen |= set((body["input_prefix"] + body["input_suffix"]
                     + "".join(c["text"] for c in body["input_extra"])).split("\n"))
    return early


def test_the_replay_shows_no_line_before_it_is_typed_unless_later_blocks_are_kept():
    assert _seen_before_typed("cut") == 0
    assert _seen_before_typed("kept") > 0  # the earlier protocol (later blocks kept in the file) did
