"""`roofline chat` in a real subprocess: thinking shown apart from the answer, /reset and /exit."""

import subprocess
import sys


def test_chat_shows_thinking_apart_and_resets():
    session = "What is 38 + 45?\n/reset\nHello!\n/exit\n"
    result = subprocess.run(
        [sys.executable, "-m", "roofline.cli", "chat", "--temperature", "0", "--max-tokens", "120"],
        input=session, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    first, _, second = out.partition("(conversation cleared)")
    assert "[thinking]" in first and "\033[" not in out  # no terminal codes when not on a terminal
    assert "= 83." in first.partition("[thinking]")[2], first  # the answer line follows the thinking
    assert second.strip(), "the model answers again after /reset"
