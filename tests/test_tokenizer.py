"""Tokenizer, chat templates (checked against transformers) and incremental detokenisation,
on a small byte-level BPE tokenizer trained here."""

import json
from datetime import datetime

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from roofline.engine.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special in Qwen: skip_special_tokens keeps them.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "Café, naïve, résumé and façade keep their accents.",
    "你好，世界。今天天气很好。我们去公园散步吧。",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]
MULTIBYTE_TEXT = "Héllo wörld 🦙🚀 你好，世界 👩‍👩‍👧 naïve café 日本語テキスト ✓"

# The Qwen3 chat template (thinking switch, tools, tool responses, reasoning_content).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle d'une ville (°C)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "ville, e.g. Zürich"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "system_and_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
    ],
    "multi_turn_with_reasoning": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add three."},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich and 東京?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI clients send it; dropped before rendering
            "reasoning": "Two cities, two calls.",  # aliased to reasoning_content
            "tool_calls": [
                {"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                {"type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 12}'},
        {"role": "tool", "content": '{"temp": 18}'},
    ],
}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(TRAINING_TEXT, trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "bos_token": None,
        "chat_template": QWEN3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return Tokenizer.from_dir(checkpoint_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint_dir))


def test_encode_decode_match_transformers(tokenizer, hf_tokenizer):
    text = "<|im_start|>user\n" + MULTIBYTE_TEXT + "<think>x</think><|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )
    assert "<think>" in tokenizer.decode(ids, skip_special_tokens=True)


def test_vocabulary_and_eos(tokenizer, hf_tokenizer):
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.id_to_token(im_end) == "<|im_end|>"
    assert tokenizer.token_to_id("not a token") is None
    assert tokenizer.vocab_size == len(hf_tokenizer)
    # generation_config's [2, 0] first, then the tokenizer's eos, without duplicates.
    assert tokenizer.eos_token_ids == [2, 0]
    assert {im_end, endoftext} <= set(tokenizer.eos_token_ids)


def test_eos_from_a_single_int(checkpoint_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [7, 2, 0]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer, hf_tokenizer, name, with_tools, thinking, add_generation_prompt
):
    messages = CONVERSATIONS[name]
    tools = WEATHER_TOOLS if with_tools else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ours = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    assert ours == theirs


def test_template_details_match_transformers(tokenizer, hf_tokenizer):
    spots = (
        "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ documents is none }}\n"
        "{{ messages[0] | tojson(indent=2) }}\n{{ tools | tojson(separators=(',', ':')) }}\n"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }}{% endfor %}\n"
        "{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
        "{{ extra | default('none') }}"
    )
    messages = [{"role": "user", "content": "«ça» <b>&</b> 🦙"}]
    tokenizer.chat_template = spots
    try:
        ours = tokenizer.apply_chat_template(messages, tools=WEATHER_TOOLS, extra=[1, 2])
    finally:
        tokenizer.chat_template = QWEN3_TEMPLATE
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=WEATHER_TOOLS, tokenize=False, add_generation_prompt=True,
        chat_template=spots, extra=[1, 2],
    )
    assert ours == theirs
    assert "«ça» <b>&</b> 🦙" in ours and str(datetime.now().year) in ours


def test_chat_template_jinja_file_is_preferred(checkpoint_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(messages)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False
    )
    assert ours == theirs == "[hi]"


def test_named_templates_pick_tool_use_when_tools_given(tokenizer):
    named = Tokenizer(tokenizer.backend, {"default": "plain", "tool_use": "with tools"})
    assert named.apply_chat_template([]) == "plain"
    assert named.apply_chat_template([], tools=WEATHER_TOOLS) == "with tools"


def test_template_errors_become_value_errors(tokenizer):
    raising = Tokenizer(tokenizer.backend, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ValueError, match="^Conversation roles must alternate$"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="syntax"):
        Tokenizer(tokenizer.backend, "{% if %}").apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tokenizer.backend).apply_chat_template([])


def stream(tokenizer, ids, skip_special_tokens=False):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    chunks = [detokenizer.add(i) for i in ids]
    return chunks, detokenizer.flush()


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_never_splits_characters(tokenizer, skip_special_tokens):
    text = f"<|im_start|>assistant\n<think>{MULTIBYTE_TEXT}</think>{MULTIBYTE_TEXT}<|im_end|>"
    ids = tokenizer.encode(text)
    chunks, tail = stream(tokenizer, ids, skip_special_tokens)
    assert "".join(chunks) + tail == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tail == ""
    assert all("\ufffd" not in chunk for chunk in chunks)
    # The text really does split characters across tokens, so holding back was exercised.
    assert any(chunk == "" for chunk in chunks)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_incremental_detokenizer_flushes_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok 🦙")[:-1]  # drop the emoji's last byte
    chunks, tail = stream(tokenizer, ids)
    assert "".join(chunks) == "ok "
    assert "".join(chunks) + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


def test_incremental_detokenizer_decodes_a_bounded_window(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token_id in tokenizer.encode("the quick brown fox " * 50):
        detokenizer.add(token_id)
        assert len(detokenizer.ids) - detokenizer.prefix_offset <= 2
