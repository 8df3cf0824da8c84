"""Errors about the user's input (a flag, a file, a model): shown as one clear line, no traceback."""

from __future__ import annotations

import json
from pathlib import Path


class UserError(ValueError):
    pass


def read_json_file(path: Path, what: str, error: type[UserError] = UserError):
    """Parse a JSON file the user pointed at; a missing or malformed file is one clear error."""
    if not path.is_file():
        raise error(f"{what} {path}: not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
