"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat templates rendered
exactly as transformers renders them, and streaming detokenisation."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Named special tokens that transformers hands to every chat template (`special_tokens_map`).
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)
# Chat-format end markers: a chat model must stop on them whatever generation_config says.
_CHAT_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Names a message's reasoning arrives under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
        generation_eos_ids: list[int] | tuple[int, ...] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids = self._collect_eos_ids(generation_eos_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special_tokens = {
            name: _token_content(config[name])
            for name in _NAMED_SPECIAL_TOKENS
            if config.get(name) is not None
        }
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            chat_template = jinja_file.read_text(encoding="utf-8")
        else:
            chat_template = config.get("chat_template")
            if isinstance(chat_template, list):  # named templates: [{"name", "template"}]
                chat_template = {t["name"]: t["template"] for t in chat_template}
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(backend, chat_template, special_tokens, eos_ids)

    def _collect_eos_ids(self, generation_eos_ids) -> list[int]:
        candidates = [self.special_tokens.get("eos_token"), *_CHAT_END_TOKENS]
        ids = list(generation_eos_ids) + [self.token_to_id(t) for t in candidates if t]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def added_token_ids(self) -> list[int]:
        """Ids of the added (special and control) tokens: <|im_end|>, <think>, <tool_call>, ..."""
        return sorted(self.backend.get_added_tokens_decoder())

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS/EOS: the chat template writes every special token itself.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text. `template_kwargs` (e.g. `enable_thinking=False`)
        become template variables. Template errors raise `ValueError`."""
        template = compile_chat_template(self._select_template(tools))
        # As transformers: None-valued message keys are dropped (templates test for absence),
        # and reasoning given under any of its names is visible under all of them.
        chat = [
            _alias_reasoning({k: v for k, v in _plain(m).items() if v is not None})
            for m in messages
        ]
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as error:
            raise ValueError(error.message or str(error)) from error

    def _select_template(self, tools) -> str:
        template = self.chat_template
        if isinstance(template, dict):  # same choice as transformers' get_chat_template
            use_tools = tools is not None and "tool_use" in template
            template = template["tool_use"] if use_tools else template.get("default")
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one token at a time.

    Keeps two offsets into the ids (the vLLM/TGI scheme): text is decoded only from
    `prefix_offset`, a few tokens back, so each step costs O(window) rather than
    O(output). A byte-level token can end inside a UTF-8 character, which decodes to
    U+FFFD; such text is held back until a later token completes the character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window: context for the pending tokens
        self.read_offset = 0  # ids before this have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text, full_text = self._decode_window()
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            return self._advance(full_text[len(prefix_text):])
        return ""

    def flush(self) -> str:
        prefix_text, full_text = self._decode_window()
        return self._advance(full_text[len(prefix_text):])

    def _decode_window(self) -> tuple[str, str]:
        decode = functools.partial(
            self.tokenizer.decode, skip_special_tokens=self.skip_special_tokens
        )
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        return prefix_text, decode(self.ids[self.prefix_offset:])

    def _advance(self, text: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text


# --- chat templates, as transformers.utils.chat_template_utils builds them --------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering it is a call block that outputs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Replaces Jinja's own tojson, which HTML-escapes and would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    # Templates come from checkpoints, so they run sandboxed and cannot mutate their inputs.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template syntax error: {error}") from error


def _plain(value: Any) -> Any:
    """Plain JSON-like data for the template: dicts, lists, scalars (pydantic models dumped)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return value


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _token_content(token: str | dict) -> str:
    return token["content"] if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
