"""Stop strings over streamed text: emit what can no longer become part of a stop string,
cut the output just before the first stop string found."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]  # "" would stop at once
        self.held = ""  # tail that may be the start of a stop string
        self.stopped = False

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was found). After a stop, the
        emitted text ends just before the stop string and later calls emit nothing."""
        if self.stopped:
            return "", True
        text = self.held + new_text
        # Earlier emitted text never needs searching: any stop string starting there
        # would have kept its start in `held`.
        found = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)], True
        keep = self._partial_match_length(text)
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of a sequence that did not stop: the text still held back."""
        text, self.held = self.held, ""
        return text

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop_strings), default=1) - 1
        for length in range(min(longest, len(text)), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self.stop_strings):
                return length
        return 0
