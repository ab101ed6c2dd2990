"""Stop strings over streamed text."""

from __future__ import annotations

from freetoken.runtime.text.stopping import StopStrings


def stream(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    s = StopStrings(stops)
    out = "".join(s.push(p) for p in pieces)
    return out + s.flush(), s.stopped


def test_stop_split_across_pieces() -> None:
    assert stream(("STOP",), ["hello S", "T", "OP and more"]) == ("hello ", True)


def test_near_miss_is_released() -> None:
    assert stream(("STOP",), ["a ST", "ART b"]) == ("a START b", False)
    assert stream(("STOP",), ["tail ST"]) == ("tail ST", False)  # flush releases the held prefix


def test_earliest_of_several_stops() -> None:
    assert stream(("world", "lo w"), ["hel", "lo world"]) == ("hel", True)


def test_holds_back_only_possible_prefixes() -> None:
    s = StopStrings(("</answer>",))
    assert s.push("x </ans") == "x "
    assert s.push("wer> y") == ""
    assert s.stopped
    assert s.push("more") == ""


def test_no_stops_pass_through() -> None:
    assert stream((), ["a", "b"]) == ("ab", False)
