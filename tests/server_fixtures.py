"""Shared helpers for the server tests: a model to serve and a real server process.

The bundled model (roofline/models/tiny) is served when its weights exist; until then a
random tiny Qwen3.5-MoE checkpoint with the bundled tokenizer and chat template stands in
(random weights produce random text: tests check structure, not wording).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "roofline" / "models" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
STARTUP_TIMEOUT = 120


def bundled_model_ready() -> bool:
    return (BUNDLED / "config.json").is_file()


def build_test_model(path: Path) -> Path:
    """A random tiny checkpoint carrying the bundled tokenizer and chat template (built once per session)."""
    if (path / "config.json").is_file():
        return path
    missing = [f for f in TOKENIZER_FILES if not (BUNDLED / f).is_file()]
    if missing:
        pytest.skip(f"the bundled tokenizer files are missing from {BUNDLED}: {', '.join(missing)}")
    from roofline.engine.tokenizer import Tokenizer
    from tiny_checkpoints import reference_model, text_config, write_variant

    tokenizer = Tokenizer.from_dir(BUNDLED)
    eos = tokenizer.token_to_id("<|im_end|>")
    cfg = text_config(vocab_size=tokenizer.vocab_size, eos_token_id=eos)
    model, mtp = reference_model(cfg, seed=3)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_variant(model, mtp, tmp, cfg=cfg)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos, tokenizer.token_to_id("<|endoftext|>")],
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
    }))
    tmp.rename(path)
    return path


def model_args(tmp_path_factory) -> list[str]:
    """The MODEL argument for `roofline serve`: none (the bundled model) or the test checkpoint."""
    if bundled_model_ready():
        return []
    base = tmp_path_factory.getbasetemp()
    return [str(build_test_model(base / "server-model"))]


def model_dir(tmp_path_factory) -> Path:
    args = model_args(tmp_path_factory)
    return Path(args[0]) if args else BUNDLED


class ServerProcess:
    """`python -m roofline.cli serve ...` on a free loopback port, stopped for sure at the end."""

    def __init__(self, args: list[str], env: dict | None = None):
        command = [sys.executable, "-m", "roofline.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0", "--device", "cpu"]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=REPO, start_new_session=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(STARTUP_TIMEOUT) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.log)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.url is None and " ready at http://" in line:
                self.url = line.split(" ready at ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()  # exited before it was ready

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def get(self, path: str, headers: dict | None = None, timeout: float = 30) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(self, path: str, body: bytes | str | dict, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def metrics(self) -> dict[str, float]:
        """Unlabelled-enough samples: `name` -> value for single-series metrics (labels dropped)."""
        status, text = self.get("/metrics")
        assert status == 200, text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                values[name_labels] = float(value)
                values.setdefault(name_labels.split("{", 1)[0], float(value))
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._reader.join(timeout=5)


def wait_until(predicate, timeout: float = 30, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy (bounded); returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
