"""A dependency-free progress bar on stderr: bytes done, rate and time left.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line every 10%.
"""

from __future__ import annotations

import sys
import time


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(self, total: int, label: str = "writing", stream=None, enabled: bool = True, width: int = 30):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.last_decile = -1

    def line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        eta = f"{_duration(left)} left" if frac < 1 else f"done in {_duration(elapsed)}"
        return f"{self.label} [{bar}] {frac:4.0%} {_size(self.done)}/{_size(self.total)} {_size(rate)}/s {eta}"

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self.last_draw >= 0.1 or self.done >= self.total:
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
                self.last_draw = now
        elif now - self.start >= 2.0 or self.last_decile >= 0:  # logs: only for runs that take a while
            decile = int(10 * self.done / self.total)
            if decile > self.last_decile:
                self.last_decile = decile
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()
