"""`run`'s interactive chat: line editing, local commands, streamed answers with their thinking dimmed.

On a terminal the input comes from prompt_toolkit rather than readline: it edits multi-line messages,
works the same on Linux, macOS and Windows (no GNU readline needed), and its pipe input drives it in
tests. When stdin is not a terminal, each line (a trailing backslash continues it) is one message.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console

from freetoken.cli.session import RunOptions, sampling_params, stats_line
from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.runtime.engine import Engine
    from freetoken.runtime.sampling import SamplingParams
    from freetoken.runtime.sequence import GenerationStats

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HELP = """\
commands (never sent to the model):
  /help           this list
  /reset          a new conversation; the system prompt stays
  /system TEXT    set the system prompt and start a new conversation
  /save FILE      write the conversation as JSON messages
  /stats          the last answer's numbers
  /think on|off   show (dimmed) or hide the model's thinking
  /exit, /quit    quit; so do Ctrl-D and Ctrl-C twice at an empty prompt
keys: Enter sends · Esc+Enter or a trailing \\ starts a new line · Up/Down recall earlier lines ·
Ctrl-C stops an answer (what came so far stays in the conversation)"""
Reader = Callable[[], str]  # the next message; EOFError at the end, KeyboardInterrupt on Ctrl-C
_COMMAND = re.compile(r"/([A-Za-z]+)(?:\s+(.*))?", re.DOTALL)


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


def parse_command(line: str) -> Command | None:
    """`/word [argument]` is a command; anything else, a path such as `/usr/bin` included, is a message."""
    if (match := _COMMAND.fullmatch(line.strip())) is None:
        return None
    name = match.group(1).lower()
    return Command("exit" if name in ("quit", "bye") else name, (match.group(2) or "").strip())


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)  # user and assistant messages, alternating
    last: GenerationStats | None = None  # the last finished answer's
    show_thinking: bool = True

    def messages(self) -> list[dict[str, Any]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


def describe_stats(stats: GenerationStats | None) -> str:
    rows = {**stats.as_dict(), "total_s": round(stats.prefill_s + stats.decode_s, 6)} if stats else {}
    return "\n".join(f"{key:>17}  {value}" for key, value in rows.items()) or "no answer yet"


def run_command(command: Command, chat: Conversation, say: Callable[[str], None]) -> bool:
    """Apply a local command to `chat`; False when the chat ends."""
    name, arg = command.name, command.arg
    if name == "reset" or (name == "system" and arg):
        chat.system = arg if name == "system" else chat.system
        chat.turns.clear()
        say("system prompt set; history cleared" if name == "system" else "history cleared")
    elif name == "save" and arg:
        path, text = Path(arg).expanduser(), json.dumps(chat.messages(), ensure_ascii=False, indent=2)
        try:
            path.write_text(text + "\n", encoding="utf-8")
            say(f"{len(chat.messages())} messages written to {path}")
        except OSError as exc:
            say(f"error: cannot write {path}: {exc.strerror or exc}")
    elif name == "think" and arg.lower() in ("on", "off", ""):
        chat.show_thinking = arg.lower() == "on" if arg else not chat.show_thinking
        say(f"thinking {'shown' if chat.show_thinking else 'hidden'}")
    elif name != "exit":
        replies = {
            "help": HELP,
            "system": f"system prompt: {chat.system or '(none)'}; /system TEXT sets it",
            "stats": describe_stats(chat.last),
            "save": "usage: /save FILE",
            "think": "usage: /think on|off",
        }
        say(replies.get(name, f"unknown command /{name}; /help lists the commands"))
    return name != "exit"


def split_reasoning(text: str, thinking: bool = False) -> dict[str, str]:
    """An answer as a history message: what precedes `</think>` is reasoning, the rest content. An answer
    stopped before `</think>` is all reasoning; `thinking`: the prompt already opened the block."""
    head, sep, tail = text.partition(THINK_CLOSE)
    if not sep:
        if not thinking and THINK_OPEN not in text:
            return {"content": text.strip()}
        head, tail = text, ""
    return {"reasoning_content": head.replace(THINK_OPEN, "").strip(), "content": tail.strip()}


class AnswerView:
    """Prints a streamed answer cut at the think tags, which may come split over events: the thinking
    dimmed, or one dim note in its place when hidden. `text` is all of it, tags included."""

    def __init__(self, out: Console, show_thinking: bool, thinking: bool) -> None:
        self.out, self.show_thinking, self.thinking = out, show_thinking, thinking
        self.text, self._held, self._hid = "", "", False  # _held: a tail that may start the next tag

    def write(self, text: str, final: bool = False) -> None:
        self.text += text
        text, self._held = self._held + text, ""
        while text:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = text.find(tag)
            if at < 0 and not final:
                keep = next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)
                text, self._held = text[: len(text) - keep], text[len(text) - keep :]
            run, text = (text, "") if at < 0 else (text[:at], text[at + len(tag) :])
            self._show(run)
            self.thinking = self.thinking != (at >= 0)

    def _show(self, run: str) -> None:
        if self.thinking and run and self.show_thinking:
            self.out.print(run, style="dim", end="")
        elif self.thinking and run and not self._hid:
            self._hid = True  # the answer's leading newlines go too
            self.out.print("thinking… (hidden; /think on shows it)", style="dim")
        elif not self.thinking and (run := run.lstrip("\n") if self._hid else run):
            self._hid = False
            self.out.print(run, end="")


class StopOnSigint:
    """SIGINT while an answer streams. After the first token, Ctrl-C asks the stream to stop at the next
    one: the request leaves the scheduler at a turn boundary and its KV stays reusable as a prefix. During
    the prefill, or pressed again, it interrupts at once; the scheduler then drops what was in flight."""

    def __init__(self) -> None:
        self.stop, self.tokens, self._previous = False, 0, None  # _previous: the handler to restore

    def __call__(self, signum: int, frame: object) -> None:
        if self.stop or self.tokens == 0:
            raise KeyboardInterrupt
        self.stop = True

    def __enter__(self) -> StopOnSigint:
        if threading.current_thread() is threading.main_thread():  # only the main thread gets signals
            self._previous = signal.getsignal(signal.SIGINT) or signal.default_int_handler
            signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def answer(engine: Engine, chat: Conversation, params: SamplingParams, out: Console, err: Console) -> None:
    """Stream the answer to the conversation's last message, then add it to the conversation: all of it,
    or what came before Ctrl-C stopped it (an answer stopped before any text drops its question)."""
    prompt = engine.tokenizer.apply_chat_template(chat.messages(), add_generation_prompt=True)
    opened = prompt.rstrip().endswith(THINK_OPEN)  # templates that open the thinking block themselves
    view, last = AnswerView(out, chat.show_thinking, opened), None
    engine.moe_counters.reset()
    events = engine.generate(engine.tokenizer.encode(prompt), params)
    with StopOnSigint() as sigint:
        try:
            for last in events:
                view.write(last.text)
                sigint.tokens += 1
                if sigint.stop:
                    break
        except KeyboardInterrupt:
            pass  # a hard stop: the scheduler has dropped what was in flight
        finally:
            events.close()  # Engine.generate's `finally` aborts the request if it has not finished
    view.write("", final=True)
    out.print()
    if last is not None and last.stats is not None:
        chat.last, total = last.stats, last.stats.prefill_s + last.stats.decode_s
        err.print(f"{stats_line(last.stats, engine)} · {total:.2f} s", style="dim")
    else:
        err.print(f"answer stopped after {sigint.tokens} tokens", style="dim")
    if view.text:
        chat.turns.append({"role": "assistant", **split_reasoning(view.text, opened)})
    else:
        chat.turns.pop()


def terminal_reader(input: Any = None, output: Any = None) -> Reader:
    """Messages from a prompt_toolkit session, its history kept in the FreeToken home (`input`, `output`:
    prompt_toolkit's, for tests). Ctrl-C over typed text drops the text; at an empty prompt it is raised."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    from freetoken.env import chat_history_file

    path = chat_history_file()
    with suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
    history = FileHistory(str(path)) if os.access(path.parent, os.W_OK) else InMemoryHistory()
    keys = KeyBindings()
    keys.add("escape", "enter")(lambda event: event.current_buffer.insert_text("\n"))

    @Condition
    def continued() -> bool:
        document = session.default_buffer.document
        return document.is_cursor_at_the_end and document.text.endswith("\\")

    @keys.add("enter", filter=continued)
    def _continue(event: Any) -> None:
        event.current_buffer.delete_before_cursor(1)
        event.current_buffer.insert_text("\n")

    session: Any = PromptSession(
        history=history, key_bindings=keys, prompt_continuation="... ", input=input, output=output
    )

    def read() -> str:
        try:
            return str(session.prompt(">>> "))
        except KeyboardInterrupt:
            if session.default_buffer.text.strip():
                return ""
            raise

    return read


def plain_reader(stream: TextIO) -> Reader:
    def read() -> str:
        lines: list[str] = []
        while (line := stream.readline()) or lines:
            line = line.rstrip("\r\n")
            if not line.endswith("\\"):
                return "\n".join([*lines, line])
            lines.append(line[:-1])
        raise EOFError

    return read


def chat_loop(opts: RunOptions, engine: Engine, read: Reader | None = None) -> None:
    """Chat until /exit, Ctrl-D or two Ctrl-C in a row at an empty prompt."""
    if read is None:
        read = terminal_reader() if sys.stdin.isatty() else plain_reader(sys.stdin)
    console = partial(Console, highlight=False, markup=False, emoji=False, soft_wrap=True)
    out, err = console(), console(stderr=True)
    say = partial(err.print, style="dim")
    chat, params = Conversation(system=opts.system), sampling_params(opts, engine)
    say("chat: /help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops an answer")
    interrupted = False  # the last input was a Ctrl-C at an empty prompt
    while True:
        try:
            line = read()
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            if interrupted:
                return
            interrupted = True
            say("Ctrl-C again, /exit or Ctrl-D quits")
            continue
        interrupted = False
        command = parse_command(line)
        if command is not None and not run_command(command, chat, say):
            return
        if command is not None or not line.strip():
            continue
        chat.turns.append({"role": "user", "content": line})
        try:
            answer(engine, chat, params, out, err)
        except FreeTokenError as exc:  # e.g. a conversation past the context: the chat goes on
            chat.turns.pop()
            err.print(f"error: {exc}")
