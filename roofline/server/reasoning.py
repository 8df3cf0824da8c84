"""Qwen3 reasoning parser: splits streamed text into thinking and answer.

Qwen3.5's template opens `<think>` in the prompt when thinking is on, so output often starts
inside reasoning with no opening tag. Reasoning ends at `</think>`, or at a `<tool_call>`
that starts inside an unclosed `<think>` (a real agent failure: the call must not be
swallowed as thinking).
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE, TOOL_OPEN = "<think>", "</think>", "<tool_call>"


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self.seen_any = False
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """New text -> [(kind, chunk)] with kind "reasoning" or "content"; partial tags are held back."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        while self.buffer:
            if self.in_reasoning:
                cut = _first(self.buffer, (THINK_CLOSE, TOOL_OPEN))
                if cut is None:
                    keep = _partial_suffix(self.buffer, (THINK_CLOSE, TOOL_OPEN))
                    self._emit(out, "reasoning", self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                index, tag = cut
                self._emit(out, "reasoning", self.buffer[:index])
                self.in_reasoning = False
                # `</think>` is consumed; a tool call stays in the content for the tool parser
                self.buffer = self.buffer[index + len(tag) :] if tag == THINK_CLOSE else self.buffer[index:]
                self.buffer = self.buffer.lstrip("\n") if tag == THINK_CLOSE else self.buffer
            else:
                stripped = self.buffer.lstrip() if not self.seen_any else self.buffer
                if not self.seen_any and THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN:
                    break  # could still become an opening <think>
                if not self.seen_any and stripped.startswith(THINK_OPEN):
                    self.in_reasoning, self.seen_any = True, True
                    self.buffer = stripped[len(THINK_OPEN) :].lstrip("\n")
                    continue
                self._emit(out, "content", self.buffer)
                self.buffer = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, "reasoning" if self.in_reasoning else "content", self.buffer)
        self.buffer = ""
        return out

    def _emit(self, out: list, kind: str, chunk: str) -> None:
        if chunk:
            self.seen_any = True
            out.append((kind, chunk))


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(hits) if hits else None


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Non-streaming: (reasoning or None, content)."""
    splitter = ReasoningSplitter(starts_in_reasoning)
    parts = splitter.feed(text) + splitter.flush()
    reasoning = "".join(c for k, c in parts if k == "reasoning")
    content = "".join(c for k, c in parts if k == "content")
    return (reasoning.strip() or None), content.strip() if reasoning else content
