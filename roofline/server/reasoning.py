"""Qwen3 reasoning parser: splits streamed text into thinking and answer.

Qwen3.5's template opens `<think>` in the prompt when thinking is on, so output often starts
inside reasoning with no opening tag. Reasoning ends at `</think>`, or at a `<tool_call>`
that starts inside an unclosed `<think>` (a real agent failure: the call must not be
swallowed as thinking).

Whitespace rules, the same whether the text arrives in one piece or token by token (so a
streamed answer concatenates to exactly the non-streamed one): reasoning loses its leading
and trailing whitespace, the answer after `</think>` loses its leading whitespace.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE, TOOL_OPEN = "<think>", "</think>", "<tool_call>"
_REASONING_ENDS = (THINK_CLOSE, TOOL_OPEN)


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self.may_open = not starts_in_reasoning  # the output may still begin with `<think>`
        self.skip_space = starts_in_reasoning  # drop whitespace at the start of this part
        self.buffer = ""
        self.reasoning_space = ""  # reasoning's trailing whitespace: emitted only if reasoning goes on

    def feed(self, text: str) -> list[tuple[str, str]]:
        """New text -> [(kind, chunk)] with kind "reasoning" or "content"; partial tags are held back."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        while self.buffer:
            if self.skip_space:
                stripped = self.buffer.lstrip()
                if not stripped:
                    self.buffer = ""
                    break
                self.buffer, self.skip_space = stripped, False
            if self.in_reasoning:
                cut = _first(self.buffer, _REASONING_ENDS)
                if cut is None:
                    keep = _partial_suffix(self.buffer, _REASONING_ENDS)
                    self._reasoning(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                index, tag = cut
                self._reasoning(out, self.buffer[:index])
                self.in_reasoning, self.reasoning_space = False, ""
                if tag == THINK_CLOSE:  # consumed; a tool call stays in the content for the tool parser
                    self.buffer, self.skip_space = self.buffer[index + len(tag) :], True
                else:
                    self.buffer = self.buffer[index:]
            elif self.may_open:
                stripped = self.buffer.lstrip()
                if not stripped or (THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN):
                    break  # could still become an opening <think>
                self.may_open = False
                if stripped.startswith(THINK_OPEN):
                    self.in_reasoning, self.skip_space = True, True
                    self.buffer = stripped[len(THINK_OPEN) :]
            else:
                out.append(("content", self.buffer))
                self.buffer = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.in_reasoning:
            self._reasoning(out, self.buffer)
        elif self.buffer and not self.skip_space:
            out.append(("content", self.buffer))
        self.buffer, self.reasoning_space = "", ""
        return out

    def _reasoning(self, out: list, chunk: str) -> None:
        body = chunk.rstrip()
        if body:
            out.append(("reasoning", self.reasoning_space + body))
            self.reasoning_space = chunk[len(body) :]
        else:
            self.reasoning_space += chunk


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(hits) if hits else None


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Non-streaming: (reasoning or None, content), identical to joining the streamed parts."""
    splitter = ReasoningSplitter(starts_in_reasoning)
    parts = splitter.feed(text) + splitter.flush()
    reasoning = "".join(c for k, c in parts if k == "reasoning")
    content = "".join(c for k, c in parts if k == "content")
    return (reasoning or None), content
