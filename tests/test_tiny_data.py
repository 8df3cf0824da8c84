"""Fast CPU checks of the tiny model's task generator, tokenizer, template and shipped files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from training import tasks  # noqa: E402
from training.chat import TEMPLATE_PATH, prompt_text, render, render_with_targets  # noqa: E402
from training.tasks import TaskGenerator, is_shared, split_of  # noqa: E402

TINY = REPO / "roofline" / "models" / "tiny"


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


def _strip(conv):
    return json.dumps({k: conv[k] for k in ("task", "messages", "tools", "enable_thinking", "answer", "split_key")},
                      sort_keys=True)


# ------------------------------------------------------------------ generator


def test_same_seed_same_stream():
    a = [_strip(TaskGenerator(seed=7).sample()) for _ in range(1)]
    g1, g2 = TaskGenerator(seed=7), TaskGenerator(seed=7)
    s1 = [_strip(g1.sample()) for _ in range(80)]
    s2 = [_strip(g2.sample()) for _ in range(80)]
    assert s1 == s2 and s1[0] == a[0]
    s3 = [_strip(TaskGenerator(seed=8).sample()) for _ in range(80)]
    assert s1 != s3


def test_all_tasks_and_both_thinking_modes_appear():
    g = TaskGenerator(seed=3)
    convs = [g.sample() for _ in range(400)]
    assert {c["task"] for c in convs} >= {"arithmetic", "recall", "tool", "chat"}
    assert {c["enable_thinking"] for c in convs} == {True, False}


def test_mix_names_tasks_and_weights():
    """train.py --mix: known task names with weights >= 0, told apart from typos before any training starts."""
    assert tasks.parse_mix("") is None
    assert tasks.parse_mix("arithmetic=0.3,arithmetic_no_thinking=0.1") == {"arithmetic": 0.3, "arithmetic_no_thinking": 0.1}
    for bad, says in [("arithmetic=0.3,bogus=1", "unknown task 'bogus'"), ("recall", "not task=weight"),
                      ("recall=-1", "not task=weight"), ("recall=x", "not task=weight"), ("recall=0", "sum to 0")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            tasks.parse_mix(bad)
    gen = TaskGenerator(seed=3, mix=tasks.parse_mix("arithmetic_no_thinking=1"))
    convs = [gen.sample() for _ in range(30)]
    assert all(c["task"] == "arithmetic" and not c["enable_thinking"] and not c["messages"][-1]["reasoning_content"]
               for c in convs)


def test_heldout_is_disjoint_from_train():
    train = [TaskGenerator(seed=1, split="train").sample() for _ in range(1)]
    g_tr, g_ho = TaskGenerator(seed=1, split="train"), TaskGenerator(seed=1, split="heldout")
    train += [g_tr.sample() for _ in range(1500)]
    held = [g_ho.sample() for _ in range(400)]
    for c in train:
        assert is_shared(c["split_key"]) or split_of(c["split_key"]) == "train"
    for c in held:
        assert is_shared(c["split_key"]) or split_of(c["split_key"]) == "heldout"
    k_tr = {c["split_key"] for c in train if not is_shared(c["split_key"])}
    k_ho = {c["split_key"] for c in held if not is_shared(c["split_key"])}
    assert k_ho and not (k_tr & k_ho)
    # the canonical arithmetic key ignores operand order and phrasing
    assert tasks.arithmetic_key("add", 45, 38) == tasks.arithmetic_key("add", 38, 45)
    assert tasks.arithmetic_key("mul", 6, 37) == tasks.arithmetic_key("mul", 37, 6)
    assert tasks.arithmetic_key("sub", 71, 29) != tasks.arithmetic_key("sub", 29, 71)
    # about 10% of problems are held out
    frac = sum(split_of(tasks.arithmetic_key("add", a, b)) == "heldout" for a in range(60) for b in range(a, 60)) / 1830
    assert 0.06 < frac < 0.14


def _written_result(lines, op):
    """Rebuild the result from the digit-by-digit steps."""
    steps = [ln for ln in lines if re.match(r"^(ones|tens|hundreds|thousands):", ln)]
    digits = []
    if op == "add":
        for ln in steps:
            digits.append(re.search(r"write (\d), carry (\d)", ln).group(1))
        carry = re.search(r"carry (\d)$", steps[-1]).group(1)
        return int(carry + "".join(reversed(digits)))
    if op == "sub":
        for ln in steps:
            digits.append(re.search(r"= (\d+), borrow", ln).group(1))
        return int("".join(reversed(digits)))
    for ln in steps[:-1]:
        digits.append(re.search(r"write (\d), carry", ln).group(1))
    last = re.search(r"write (\d+)$", steps[-1]).group(1)
    return int(last + "".join(reversed(digits)))


def test_arithmetic_steps_are_right_exhaustively_on_small_numbers():
    for a in range(0, 1000, 7):
        for b in range(0, 1000, 13):
            assert _written_result(tasks.add_steps(a, b), "add") == a + b
            hi, lo = max(a, b), min(a, b)
            assert _written_result(tasks.sub_steps(hi, lo), "sub") == hi - lo
    for a in range(100):
        for b in range(10):
            assert _written_result(tasks.mul_steps(a, b), "mul") == a * b


def test_arithmetic_conversations_state_the_right_answer():
    g = TaskGenerator(seed=11)
    for _ in range(300):
        c = g.arithmetic()
        m = c["meta"]
        op, a, b = m["op"], m["a"], m["b"]
        want = {"add": a + b, "sub": a - b, "mul": a * b}[op]
        assert c["answer"] == str(want) and want >= 0
        assert a <= 999 and b <= 999 and (op != "mul" or min(a, b) <= 9 and max(a, b) <= 99)
        final = c["messages"][-1]
        assert final["content"] == f"{a} {tasks.SYMBOL[op]} {b} = {want}."
        if c["enable_thinking"]:
            lines = final["reasoning_content"].split("\n")
            assert lines[-1] == f"answer: {want}"
            assert _written_result(lines, op) == want
        else:
            assert final["reasoning_content"] == ""
        assert tasks.answer_is_correct(c, final["content"])
        assert not tasks.answer_is_correct(c, final["content"].replace(f"= {want}.", f"= {want + 1}."))


def test_recall_answer_must_be_copied_from_context():
    g = TaskGenerator(seed=5)
    for _ in range(60):
        c = g.recall()
        user = [m for m in c["messages"] if m["role"] == "user"][0]["content"]
        key, value = c["meta"]["key"], c["answer"]
        lines = [ln for ln in user.split("\n") if ": " in ln]
        pairs = [ln.split(": ", 1) for ln in lines]
        assert [k for k, _ in pairs].count(key) == 1
        assert dict(pairs)[key] == value
        assert [v for _, v in pairs].count(value) == 1  # values are unique too
        assert value in c["messages"][-1]["content"]


def test_tool_conversations(tok):
    g = TaskGenerator(seed=9)
    seen = set()
    for _ in range(60):
        c = g.tool()
        if c["task"] != "tool":
            assert not any(m.get("tool_calls") for m in c["messages"])
            continue
        name, args = c["meta"]["name"], c["meta"]["arguments"]
        seen.add(name)
        assert name in [t["function"]["name"] for t in c["tools"]]
        roles = [m["role"] for m in c["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant", "tool", "assistant"]
        result = json.loads(c["messages"][-2]["content"])
        assert c["answer"] in c["messages"][-1]["content"]
        # the answer is copied from the tool result (prices are written with two decimals)
        assert c["answer"] in [str(v) for v in result.values()] or float(c["answer"]) in result.values()
        text = render(c["messages"], c["tools"], False, c["enable_thinking"])
        call = "<tool_call>\n<function=" + name + ">\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call><|im_end|>"
        assert call in text
        assert "<|im_start|>user\n<tool_response>\n" + c["messages"][-2]["content"] + "\n</tool_response><|im_end|>\n" in text
        assert text.startswith("<|im_start|>system\n# Tools\n")
        for t in c["tools"]:
            assert json.dumps(t, ensure_ascii=False) in text
    assert len(seen) >= 4


def test_template_thinking_modes_and_generation_prompt():
    g = TaskGenerator(seed=2)
    c_on = g.arithmetic(thinking=True)
    c_off = g.arithmetic(thinking=False)
    assert prompt_text(c_on).endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_text(c_off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    full_off, spans = render_with_targets(c_off)
    assert full_off[spans[0][0]:spans[0][1]] == c_off["messages"][-1]["content"] + "<|im_end|>"
    full_on, spans = render_with_targets(c_on)
    gen = full_on[spans[0][0]:spans[0][1]]
    assert gen == c_on["messages"][-1]["reasoning_content"] + "\n</think>\n\n" + c_on["messages"][-1]["content"] + "<|im_end|>"
    assert (TINY / "chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()


def test_transformers_renders_the_shipped_template_identically():
    transformers = pytest.importorskip("transformers")
    t = transformers.AutoTokenizer.from_pretrained(str(TINY))
    g = TaskGenerator(seed=4)
    for _ in range(40):
        c = g.sample()
        kw = dict(tools=c["tools"], enable_thinking=c["enable_thinking"], tokenize=False)
        assert t.apply_chat_template(c["messages"], **kw) == render(c["messages"], c["tools"], False, c["enable_thinking"])
        assert t.apply_chat_template(c["messages"][:-1], add_generation_prompt=True, **kw) == prompt_text(c)


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_digits_specials_and_prefix_property(tok):
    from training.data import encode_conversation

    for s in ["0123456789", "38 + 45 = 83.", "x 999 - 1000"]:
        enc = tok.encode(s)
        for t, (a, b) in zip(enc.tokens, enc.offsets):
            if any(ch.isdigit() for ch in s[a:b]):
                assert b - a == 1, (s, enc.tokens)
    for name in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>"]:
        i = tok.token_to_id(name)
        assert i is not None and tok.encode(name).ids == [i]
    assert 1024 <= tok.get_vocab_size() <= 4096
    g = TaskGenerator(seed=6)
    for _ in range(60):  # encode_conversation checks every prompt is a token prefix
        ids, mask = encode_conversation(tok, g.sample())
        assert mask.any() and ids[mask][-1] == tok.token_to_id("<|im_end|>")


def test_recall_contexts_reach_2048_tokens(tok):
    g = TaskGenerator(seed=12)
    lengths = [len(tok.encode(prompt_text(g.recall(n_facts=g.max_facts))).ids) for _ in range(5)]
    assert min(lengths) >= 2048, lengths
    n_max = max(tasks.sample_num_facts(g.rng, g.max_facts) for _ in range(2000))
    assert n_max >= g.max_facts - 5
    short = len(tok.encode(prompt_text(g.recall(n_facts=3))).ids)
    assert short < 100


def test_answer_focus_classes_and_dense_packing(tok):
    """Streaming training data: loss classes (2 on the looked-up values inside the assistant's turns)
    and first-fit packing that keeps every conversation whole."""
    import numpy as np

    from training.data import encode_conversation, pack_dense

    g = TaskGenerator(seed=9)
    docs = []
    for conv in [g.recall(n_facts=12, thinking=True), g.recall_multi(n_facts=8), g.arithmetic(), g.tool()] * 3:
        ids, cls = encode_conversation(tok, conv, focus=True)
        ids0, mask = encode_conversation(tok, conv)
        assert (ids == ids0).all() and ((cls > 0) == mask).all()
        focus = tok.decode([int(i) for i, c in zip(ids, cls) if c == 2])
        if conv["task"].startswith("recall"):
            assert conv["answer"] in focus
        else:
            assert not (cls == 2).any()
        docs.append((ids, cls))
    sep = tok.token_to_id("<|endoftext|>")
    rows, rcls = pack_dense(docs, 512, sep, 0)
    assert rows.shape[1] == 512 and rcls.dtype == np.uint8
    assert int((rcls > 0).sum()) == sum(int((c > 0).sum()) for _, c in docs)
    assert int((rows != sep).sum()) == sum(len(d) for d, _ in docs)


# ------------------------------------------------------------------ shipped files


def test_shipped_files_size_and_layout():
    files = [p for p in TINY.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "model.safetensors.index.json"} <= names
    assert sum(p.stat().st_size for p in files) <= 32 * 1024 * 1024
    index = json.loads((TINY / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    for s in shards:
        assert (TINY / s).stat().st_size <= 15 * 1000 * 1000
    names = set(index["weight_map"])
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert all(n.startswith(("model.", "lm_head.", "mtp.")) for n in names)
    for n in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight",
              "mtp.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
              "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.3.self_attn.o_proj.weight"):
        assert n in names, n
    from safetensors import safe_open

    for s in shards:
        with safe_open(str(TINY / s), "pt") as f:
            for k in list(f.keys())[:5]:
                assert str(f.get_slice(k).get_dtype()) in ("BF16", "bfloat16")
    gen = json.loads((TINY / "generation_config.json").read_text())
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert set(gen["eos_token_id"]) == {t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")}


def test_config_is_the_real_architecture_in_miniature():
    cfg = json.loads((TINY / "config.json").read_text())
    from training.model import quantisable_input_dims

    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert set(cfg["layer_types"]) == {"linear_attention", "full_attention"}
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"]
    assert cfg["num_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2 and cfg["shared_expert_intermediate_size"] > 0
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["max_position_embeddings"] >= 8192
    assert cfg["tie_word_embeddings"] is False
    for what, dim in quantisable_input_dims(cfg).items():
        assert dim % 128 == 0, what
    t_vocab = json.loads((TINY / "tokenizer.json").read_text())
    assert cfg["vocab_size"] >= len(t_vocab["model"]["vocab"]) + len(t_vocab["added_tokens"])


def test_quant_compare_pairs_the_same_prompts():
    from training.quant_compare import paired

    got = paired([True, True, False, False, True], [True, False, True, False, False])
    assert got == {"bf16": 0.6, "quantised": 0.4, "n": 5, "both": 1, "bf16_only": 2, "quantised_only": 1}
