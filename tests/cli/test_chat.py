"""`run`'s interactive chat: commands stay local, multi-line input, history, Ctrl-C, the non-TTY fallback.

The chat runs against a tiny model; prompt_toolkit reads keys from its pipe input, and a spy on
`Engine.generate` records every prompt the model receives.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from freetoken.cli import chat as chat_module
from freetoken.cli.chat import (
    AnswerView,
    Command,
    Conversation,
    chat_loop,
    parse_command,
    run_command,
    split_reasoning,
    terminal_reader,
)
from freetoken.cli.session import RunOptions, load_engine
from freetoken.env import chat_history_file
from freetoken.runtime.config import MoeConfig


@pytest.fixture(scope="module")
def engine(tiny_model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as env:  # the per-test home is not set up yet at module scope
        env.setenv("FREETOKEN_HOME", str(tmp_path_factory.getbasetemp() / "freetoken-home"))
        return load_engine(str(tiny_model[0]), "cpu", "auto", MoeConfig(reprofile=False), quiet=True)


@pytest.fixture
def prompts(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every prompt the model receives, decoded; EOS is ignored so answers run to max_tokens."""
    seen: list[str] = []
    real = engine.generate

    def spy(ids: list[int], params: Any) -> Iterator[Any]:
        seen.append(engine.tokenizer.decode(ids))
        return real(ids, dataclasses.replace(params, ignore_eos=True))

    monkeypatch.setattr(engine, "generate", spy)
    return seen


def options(**overrides: Any) -> RunOptions:
    base = dict(model="tiny", raw=False, system=None, max_tokens=4, temperature=0.0, top_p=None, top_k=None)
    base |= dict(seed=0, stop=(), device="cpu", dtype="auto", moe=MoeConfig(), verify=False)
    return RunOptions(**(base | dict(max_prefill_tokens=8192, as_json=False) | overrides))


def type_keys(engine: Any, keys: str, **opts: Any) -> None:
    """Chat through prompt_toolkit with `keys` typed; Ctrl-D at the end so a missed exit cannot hang."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    with create_pipe_input() as pipe:
        pipe.send_text(keys + "\x04")
        chat_loop(options(**opts), engine, terminal_reader(pipe, DummyOutput()))


# -- pure parts ----------------------------------------------------------------------------------------------


def test_parse_command() -> None:
    assert parse_command("/help") == Command("help")
    assert parse_command("  /Stats  ") == Command("stats")
    assert parse_command("/system Be terse.\nVery.") == Command("system", "Be terse.\nVery.")
    assert parse_command("/quit") == parse_command("/exit") == Command("exit")
    assert parse_command("/usr/bin/env is a path") is None
    assert parse_command("hello /help") is None
    assert parse_command("") is None


def test_run_command_usage_and_think_toggle() -> None:
    said: list[str] = []
    chat = Conversation()
    assert run_command(Command("think", "off"), chat, said.append) and not chat.show_thinking
    assert run_command(Command("think"), chat, said.append) and chat.show_thinking
    assert run_command(Command("save"), chat, said.append)
    assert run_command(Command("nope"), chat, said.append)
    assert not run_command(Command("exit"), chat, said.append)
    assert said == ["thinking hidden", "thinking shown", "usage: /save FILE", said[3]]
    assert said[3].startswith("unknown command /nope") and "\n" not in said[3]


@pytest.mark.parametrize("show", [True, False])
def test_thinking_is_dimmed_or_hidden(show: bool) -> None:
    buffer = io.StringIO()
    view = AnswerView(
        Console(file=buffer, force_terminal=True, color_system="standard", highlight=False), show, False
    )
    for piece in ["<th", "ink>\nweighing", " it</thi", "nk>\n\nThe answer."]:  # tags split over events
        view.write(piece)
    view.write("", final=True)
    shown = buffer.getvalue()
    assert "The answer." in shown and "think>" not in shown
    if show:
        assert "\x1b[2mweighing" in shown and "\x1b[2m it" in shown  # dim
    else:
        assert "weighing" not in shown and "thinking… (hidden" in shown
    assert split_reasoning(view.text) == {"reasoning_content": "weighing it", "content": "The answer."}
    assert split_reasoning("<think>cut off") == {"reasoning_content": "cut off", "content": ""}
    assert split_reasoning("plain") == {"content": "plain"}


# -- through prompt_toolkit ----------------------------------------------------------------------------------


def test_commands_never_reach_the_model(
    engine: Any, prompts: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "chat.json"
    keys = "/help\r/stats\r/bogus\r/system You are terse.\rhi\r/stats\r"
    type_keys(engine, keys + f"/save {saved}\r/reset\ragain\r/exit\rnever sent\r")
    err = capsys.readouterr().err
    assert len(prompts) == 2
    assert "You are terse." in prompts[0] and "hi" in prompts[0]
    assert "You are terse." in prompts[1] and "again" in prompts[1] and "hi" not in prompts[1]  # /reset
    for text in ("/help", "/stats", "/bogus", "/system", "/save", "/reset", "/exit", "never sent"):
        assert all(text not in prompt for prompt in prompts)
    assert "/save FILE" in err and "no answer yet" in err and "completion_tokens" in err
    assert "unknown command /bogus; /help lists the commands" in err and "history cleared" in err
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "You are terse." and messages[1]["content"] == "hi"
    assert sum("generated · prefill" in line for line in err.splitlines()) == 2


def test_multi_line_input_is_one_message(engine: Any, prompts: list[str]) -> None:
    type_keys(engine, "first\x1b\rsecond\\\rthird\r")  # Esc+Enter, then a trailing backslash
    assert len(prompts) == 1 and "first\nsecond\nthird" in prompts[0]


def test_history_is_kept_across_sessions(engine: Any, prompts: list[str]) -> None:
    history = chat_history_file()
    assert history.parent == Path(os.environ["FREETOKEN_HOME"])
    history.unlink(missing_ok=True)
    type_keys(engine, "remember me\r")
    assert history.is_file() and "+remember me" in history.read_text()
    type_keys(engine, "\x1b[A\r")  # a new session: Up recalls the last line, Enter sends it
    assert len(prompts) == 2 and "remember me" in prompts[1]


def test_ctrl_c_at_the_prompt(engine: Any, prompts: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    type_keys(engine, "typed\x03\x03hi\r\x03\x03never sent\r")  # Ctrl-C over text only drops the text
    assert len(prompts) == 1 and "hi" in prompts[0] and "typed" not in prompts[0]
    assert capsys.readouterr().err.count("Ctrl-C again") == 2


def interrupting(engine: Any, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Press Ctrl-C (a real SIGINT) once `after` tokens have streamed."""
    spy = engine.generate

    def generate(ids: list[int], params: Any) -> Iterator[Any]:
        events = spy(ids, dataclasses.replace(params, max_tokens=12))
        try:
            for count, event in enumerate(events):
                if count == after:
                    signal.raise_signal(signal.SIGINT)
                yield event
        finally:
            events.close()

    monkeypatch.setattr(engine, "generate", generate)


def test_ctrl_c_stops_the_answer_and_keeps_it(
    engine: Any, prompts: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    cancelled = engine.scheduler.stats.cancelled
    interrupting(engine, monkeypatch, after=2)
    saved = tmp_path / "chat.json"
    type_keys(engine, f"tell me\r/save {saved}\r")
    err = capsys.readouterr().err
    assert "answer stopped after 3 tokens" in err and "generated · prefill" not in err
    assert not engine.scheduler.has_work() and engine.scheduler.stats.cancelled == cancelled + 1
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"]  # what came so far stays


def test_ctrl_c_in_the_prefill_drops_the_question(
    engine: Any, prompts: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """Before the first token Ctrl-C interrupts at once, inside the scheduler's turn; the engine goes on."""
    cancelled, prefill = engine.scheduler.stats.cancelled, engine.prefill

    def interrupted_prefill(*args: Any) -> Any:
        monkeypatch.setattr(engine, "prefill", prefill)
        signal.raise_signal(signal.SIGINT)
        return prefill(*args)

    monkeypatch.setattr(engine, "prefill", interrupted_prefill)
    saved = tmp_path / "chat.json"
    type_keys(engine, f"tell me\r/save {saved}\ragain\r")
    err = capsys.readouterr().err
    assert "answer stopped after 0 tokens" in err and json.loads(saved.read_text()) == []
    assert engine.scheduler.stats.cancelled == cancelled + 1 and not engine.scheduler.has_work()
    assert len(prompts) == 2 and "tell me" not in prompts[1] and "generated · prefill" in err


# -- without a terminal --------------------------------------------------------------------------------------


def test_piped_lines_get_plain_reading(
    engine: Any, prompts: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_terminal(*args: Any) -> Callable[[], str]:
        raise AssertionError("prompt_toolkit started without a terminal")

    monkeypatch.setattr(chat_module, "terminal_reader", no_terminal)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/help\nsplit \\\nline\n"))
    chat_loop(options(), engine)
    captured = capsys.readouterr()
    assert len(prompts) == 2 and "hello" in prompts[0] and "split \nline" in prompts[1]
    assert "/help" not in prompts[1] and captured.out.strip()
    assert sum("generated · prefill" in line for line in captured.err.splitlines()) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_real_terminal(tiny_model: tuple[Path, Any], tmp_path: Path) -> None:
    """`ft run` on a pseudo-terminal opens the prompt_toolkit chat and writes its history."""
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "FREETOKEN_HOME": str(tmp_path), "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    cmd = [
        sys.executable,
        "-m",
        "freetoken",
        "run",
        str(tiny_model[0]),
        "-n",
        "3",
        "-t",
        "0",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    seen = b""

    def until(marker: bytes, timeout: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # the child has gone
                    break
        assert marker in seen, seen.decode(errors="replace")

    try:
        until(b">>>")
        os.write(leader, b"/bogus\r")
        until(b"unknown command /bogus")
        os.write(leader, b"hello\r")
        until(b"generated")
        os.write(leader, b"/exit\r")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(leader)
    assert "+hello" in (tmp_path / "chat_history").read_text()
