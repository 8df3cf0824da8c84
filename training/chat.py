"""Render conversations with the tiny model's chat template, as transformers does.

The environment matches `transformers.utils.chat_template_utils`: a sandboxed jinja2
environment with trim_blocks/lstrip_blocks, `raise_exception` and a `tojson` filter that
keeps key order and non-ASCII characters (jinja2's own `tojson` sorts keys and escapes
HTML characters, which would change the rendered tool schemas).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compiled(template_text: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template_text)


def load_template(path: str | Path | None = None) -> str:
    return Path(path or TEMPLATE_PATH).read_text()


def render(messages, tools=None, add_generation_prompt=False, enable_thinking=True, template: str | None = None) -> str:
    tpl = _compiled(template if template is not None else load_template())
    return tpl.render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def render_with_targets(conv: dict, template: str | None = None):
    """Render a whole conversation; return (text, spans) where spans are the character
    ranges [start, end) that the assistant generates (from after the generation prompt up
    to and including its <|im_end|>). Each span is checked against the generation prompt
    that inference would use, so training and inference see the same prefix."""
    msgs = conv["messages"]
    tools = conv.get("tools")
    think = conv.get("enable_thinking", True)
    full = render(msgs, tools, False, think, template)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(msgs[:i], tools, True, think, template)
        if not full.startswith(prompt):
            raise ValueError(f"generation prompt is not a prefix of the rendered conversation at message {i}")
        end = full.index("<|im_end|>", len(prompt)) + len("<|im_end|>")
        spans.append((len(prompt), end))
    return full, spans


def prompt_text(conv: dict, template: str | None = None) -> str:
    """The inference prompt for the conversation's final assistant message."""
    msgs = conv["messages"]
    assert msgs[-1]["role"] == "assistant"
    return render(msgs[:-1], conv.get("tools"), True, conv.get("enable_thinking", True), template)
