"""Stop strings over streamed text: hold back what could still become a stop string."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add newly decoded text; return what is safe to emit. After a match, `stopped` is set and the
        text from the stop string on is dropped."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = 0  # longest suffix of buf that is a proper prefix of some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if stop.startswith(buf[-n:]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
