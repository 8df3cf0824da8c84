"""Seeded generator of chat conversations with checkable answers for the tiny model.

Tasks (issue 3):
  arithmetic  addition / subtraction of numbers up to 3 digits (subtraction keeps the
              result non-negative), multiplication of up to 2 digits by 1 digit, asked in
              many phrasings; the assistant works digit by digit inside <think>, then
              states the result plainly ("38 + 45 = 83.").
  recall      a list of `key: value` facts plus a question about one key; keys and values
              are random made-up strings, so the answer can only be copied from context.
              Contexts run from a few facts to well over 2,048 tokens.
  tool        tools are given (OpenAI schema, rendered in the system block); the user asks
              to use one; the assistant emits a Qwen3 XML tool call, a `tool` message
              follows, and the assistant answers from it. Some conversations give tools
              that are not needed (arithmetic), which the assistant answers directly.
  chat        greetings, "who are you" and refusals of out-of-scope requests.

Every conversation is a dict:
  {"task", "messages": [{"role", "content", ...}], "tools": list | None,
   "enable_thinking": bool, "answer": str, "split_key": str}
The assistant's reasoning is in `reasoning_content` (empty when thinking is off; the chat
template then renders the empty `<think>\n\n</think>\n\n` block, as Qwen's does).

Held-out split: `split_of(split_key)` hashes the canonical problem (for arithmetic the
operator and the unordered operands, for recall the queried key, for tools the call,
for chat the user text); about 10% of keys are held out and never produced for "train".
"""

from __future__ import annotations

import hashlib
import json
import random

SPLIT_SALT = "roofline-tiny-v1"
HELDOUT_PER_MILLE = 100

TASKS = ("arithmetic", "arithmetic_no_thinking", "recall", "tool", "chat", "recall_multi", "copy")
# recall_multi and copy (extra copying signal) have weight 0 here so that the default stream
# stays the one the first training stage used; the second stage turns them on with --mix.
DEFAULT_MIX = {"arithmetic": 0.46, "recall": 0.30, "tool": 0.14, "chat": 0.10, "recall_multi": 0.0, "copy": 0.0}


def parse_mix(text: str) -> dict | None:
    """A task mix from `name=weight,...` (train.py --mix); None for an empty string (the default mix)."""
    if not text:
        return None
    mix = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r} in {text!r} (tasks: {', '.join(TASKS)})")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not weight >= 0:  # also catches nan
            raise ValueError(f"{part!r} in {text!r} is not task=weight with a weight >= 0")
        mix[name] = weight
    if not sum(mix.values()) > 0:
        raise ValueError(f"the weights in {text!r} sum to 0")
    return mix


def split_of(key: str) -> str:
    h = int.from_bytes(hashlib.sha256((SPLIT_SALT + "|" + key).encode()).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_PER_MILLE else "train"


def is_shared(key: str) -> bool:
    """Keys of conversations that both splits may contain (greetings and the like)."""
    return key.startswith("shared:")


SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a small, precise assistant.",
    "You are roofline's tiny demo model. Answer briefly.",
    "Answer the user's questions accurately.",
    "You are a careful assistant that checks its work.",
]


def _maybe_system(rng: random.Random, p: float = 0.3):
    if rng.random() < p:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def _vary(rng: random.Random, text: str) -> str:
    """Small surface noise: lower-case first letter, drop final punctuation."""
    if rng.random() < 0.12 and text[:1].isupper():
        text = text[0].lower() + text[1:]
    if rng.random() < 0.08 and text[-1:] in "?.":
        text = text[:-1]
    return text


# ---------------------------------------------------------------- arithmetic

ADD_PHRASES = [
    "What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "How much is {a} plus {b}?",
    "Calculate {a} + {b}.", "What's the sum of {a} and {b}?", "Add {a} and {b}.", "{a} + {b} = ?",
    "{a} + {b}", "What do you get if you add {a} and {b}?", "Can you tell me what {a} + {b} is?",
    "What is {a}+{b}?", "Please compute {a} plus {b}.", "What is the sum of {a} and {b}?",
]
SUB_PHRASES = [
    "What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "How much is {a} minus {b}?",
    "Calculate {a} - {b}.", "Subtract {b} from {a}.", "What is the difference between {a} and {b}?",
    "{a} - {b} = ?", "{a} - {b}", "What do you get if you take {b} away from {a}?", "What is {a}-{b}?",
    "Please compute {a} minus {b}.", "Can you tell me what {a} - {b} is?",
]
MUL_PHRASES = [
    "What is {a} × {b}?", "What is {a} * {b}?", "What is {a} times {b}?", "Compute {a} * {b}.",
    "How much is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
    "{a} x {b} = ?", "What is {a} multiplied by {b}?", "Calculate {a} × {b}.", "{a} * {b}",
    "What is {a}*{b}?", "Can you tell me what {a} times {b} is?",
]
SYMBOL = {"add": "+", "sub": "-", "mul": "×"}
PLACES = ["ones", "tens", "hundreds", "thousands"]


def arithmetic_key(op: str, a: int, b: int) -> str:
    if op in ("add", "mul"):
        a, b = min(a, b), max(a, b)
    return f"arith:{op}:{a}:{b}"


def _digits(n: int) -> list[int]:
    """Digits, least significant first."""
    return [int(c) for c in reversed(str(n))]


def add_steps(a: int, b: int) -> list[str]:
    da, db = _digits(a), _digits(b)
    n = max(len(da), len(db))
    da += [0] * (n - len(da))
    db += [0] * (n - len(db))
    lines, carry = [f"{a} + {b}"], 0
    for i in range(n):
        s = da[i] + db[i] + carry
        expr = f"{da[i]} + {db[i]}" if i == 0 else f"{da[i]} + {db[i]} + {carry}"
        lines.append(f"{PLACES[i]}: {expr} = {s}, write {s % 10}, carry {s // 10}")
        carry = s // 10
    lines.append(f"answer: {a + b}")
    return lines


def sub_steps(a: int, b: int) -> list[str]:
    assert a >= b
    da, db = _digits(a), _digits(b)
    n = len(da)
    db += [0] * (n - len(db))
    lines, borrow = [f"{a} - {b}"], 0
    for i in range(n):
        d = da[i] - db[i] - borrow
        if d < 0:
            lines.append(f"{PLACES[i]}: {da[i]} - {db[i]} - {borrow} < 0, so 1{da[i]} - {db[i]} - {borrow} = {d + 10}, borrow 1")
            borrow = 1
        else:
            lines.append(f"{PLACES[i]}: {da[i]} - {db[i]} - {borrow} = {d}, borrow 0")
            borrow = 0
    assert borrow == 0
    lines.append(f"answer: {a - b}")
    return lines


def mul_steps(a: int, b: int) -> list[str]:
    """a has up to 2 digits, b is one digit."""
    assert 0 <= b <= 9
    da = _digits(a)
    lines, carry = [f"{a} × {b}"], 0
    for i, d in enumerate(da):
        p = d * b + carry
        expr = f"{d} × {b}" if i == 0 else f"{d} × {b} + {carry}"
        if i == len(da) - 1:
            lines.append(f"{PLACES[i]}: {expr} = {p}, write {p}")
        else:
            lines.append(f"{PLACES[i]}: {expr} = {p}, write {p % 10}, carry {p // 10}")
        carry = p // 10
    lines.append(f"answer: {a * b}")
    return lines


def _rand_operand(rng: random.Random, max_digits: int) -> int:
    nd = rng.randint(1, max_digits)
    lo = 0 if nd == 1 else 10 ** (nd - 1)
    return rng.randint(lo, 10**nd - 1)


def sample_arithmetic_problem(rng: random.Random):
    op = rng.choices(["add", "sub", "mul"], weights=[0.36, 0.34, 0.30])[0]
    if op == "add":
        a, b = _rand_operand(rng, 3), _rand_operand(rng, 3)
    elif op == "sub":
        a, b = _rand_operand(rng, 3), _rand_operand(rng, 3)
        if a < b:
            a, b = b, a
    else:
        a, b = _rand_operand(rng, 2), rng.randint(0, 9)
        if rng.random() < 0.3:
            a, b = b, a  # "7 times 38": the single digit first
    return op, a, b


def arithmetic_conversation(op: str, a: int, b: int, rng: random.Random, thinking: bool) -> dict:
    phrases = {"add": ADD_PHRASES, "sub": SUB_PHRASES, "mul": MUL_PHRASES}[op]
    question = _vary(rng, rng.choice(phrases).format(a=a, b=b))
    if op == "add":
        result, steps = a + b, add_steps(a, b)
    elif op == "sub":
        result, steps = a - b, sub_steps(a, b)
    else:
        big, small = (b, a) if b > 9 else (a, b)
        result, steps = a * b, mul_steps(big, small)
    final = f"{a} {SYMBOL[op]} {b} = {result}."
    msgs = _maybe_system(rng) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": final, "reasoning_content": "\n".join(steps) if thinking else ""},
    ]
    return {"task": "arithmetic", "messages": msgs, "tools": None, "enable_thinking": thinking,
            "answer": str(result), "split_key": arithmetic_key(op, a, b),
            "meta": {"op": op, "a": a, "b": b}}


# ---------------------------------------------------------------- recall

SYLLABLES = [
    "ka", "lo", "mi", "re", "zu", "ta", "ne", "vo", "si", "pa", "do", "ri", "ba", "ku", "fe", "go",
    "hu", "ji", "le", "mo", "nu", "po", "sa", "te", "vi", "wo", "ya", "ze", "bri", "dra", "kel",
    "mor", "nix", "pol", "quin", "rus", "sol", "tor", "vex", "wyn", "zar", "bel", "cor", "fen",
    "gar", "hal", "jun", "lim", "mar", "ost", "pel", "ran", "sten", "tul", "ulm", "var",
]
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
RECALL_INTROS = [
    "Here are some records:", "Remember these facts.", "Facts:", "Use the list below to answer.",
    "Inventory codes:", "Here is a lookup table.", "Read these entries carefully.", "Records:",
    "The following keys and values are given.", "Notes:",
]
RECALL_QUESTIONS = [
    "What is the value of {k}?", "What is {k}?", "Look up {k}.", "What does the list say for {k}?",
    "Which value belongs to {k}?", "{k}?", "What is listed for {k}?", "Find {k} in the list.",
    "Tell me the value of {k}.", "What is the entry for {k}?",
]
RECALL_QUESTION_FIRST = [
    "Find the value of {k} in this list:", "What is the value of {k}? Here is the list:",
    "Look up {k} in the following records.",
]


def _made_up_word(rng: random.Random, lo: int = 2, hi: int = 3) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(lo, hi)))


def _recall_key(rng: random.Random) -> str:
    r = rng.random()
    w = _made_up_word(rng)
    if r < 0.55:
        return w
    if r < 0.8:
        return f"{w}-{rng.randint(1, 99)}"
    return f"{w} {_made_up_word(rng, 1, 2)}"


def _recall_value(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return str(rng.randint(100, 99999))
    if r < 0.65:
        return f"{rng.choice(LETTERS)}{rng.choice(LETTERS)}-{rng.randint(100, 999)}"
    return _made_up_word(rng)


def sample_num_facts(rng: random.Random, max_facts: int) -> int:
    r = rng.random()
    if r < 0.40:
        return rng.randint(2, min(30, max_facts))
    if r < 0.75:
        return rng.randint(min(30, max_facts), min(120, max_facts))
    return rng.randint(min(120, max_facts), max_facts)


def recall_conversation(rng: random.Random, thinking: bool, n_facts: int, query_key=None) -> dict:
    keys, values = [], []
    seen_k, seen_v = set(), set()
    if query_key is not None:
        keys.append(query_key)
        seen_k.add(query_key)
    while len(keys) < n_facts:
        k = _recall_key(rng)
        if k in seen_k or any(k.startswith(s) or s.startswith(k) for s in (query_key or "",) if s):
            continue
        seen_k.add(k)
        keys.append(k)
    while len(values) < n_facts:
        v = _recall_value(rng)
        if v not in seen_v:
            seen_v.add(v)
            values.append(v)
    qi = 0 if query_key is not None else rng.randrange(n_facts)
    qk, qv = keys[qi], values[qi]
    order = list(range(n_facts))
    rng.shuffle(order)
    lines = "\n".join(f"{keys[i]}: {values[i]}" for i in order)
    if rng.random() < 0.2:
        user = rng.choice(RECALL_QUESTION_FIRST).format(k=qk) + "\n" + lines
    else:
        user = rng.choice(RECALL_INTROS) + "\n" + lines + "\n\n" + rng.choice(RECALL_QUESTIONS).format(k=qk)
    reasoning = f"The list has the line {qk}: {qv}." if thinking else ""
    msgs = _maybe_system(rng) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": f"The value of {qk} is {qv}.", "reasoning_content": reasoning},
    ]
    return {"task": "recall", "messages": msgs, "tools": None, "enable_thinking": thinking,
            "answer": qv, "split_key": f"recall:{qk}", "meta": {"n_facts": n_facts, "key": qk}}


def recall_multi_conversation(rng: random.Random, thinking: bool, n_facts: int, query_keys: list[str]) -> dict:
    """Several keys asked at once: more copying signal per context token."""
    n_facts = max(n_facts, len(query_keys))
    keys, seen_k = list(query_keys), set(query_keys)
    while len(keys) < n_facts:
        k = _recall_key(rng)
        if k in seen_k or any(k.startswith(q) or q.startswith(k) for q in query_keys):
            continue
        seen_k.add(k)
        keys.append(k)
    values, seen_v = [], set()
    while len(values) < n_facts:
        v = _recall_value(rng)
        if v not in seen_v:
            seen_v.add(v)
            values.append(v)
    order = list(range(n_facts))
    rng.shuffle(order)
    lines = "\n".join(f"{keys[i]}: {values[i]}" for i in order)
    q = list(range(len(query_keys)))
    names = [keys[i] for i in q]
    ask = ", ".join(names[:-1]) + " and " + names[-1]
    user = rng.choice(RECALL_INTROS) + "\n" + lines + "\n\n" + rng.choice(
        ["What are the values of {ks}?", "Look up {ks}.", "Find {ks} in the list."]).format(ks=ask)
    reasoning = "\n".join(f"The list has the line {keys[i]}: {values[i]}." for i in q) if thinking else ""
    answer = " ".join(f"The value of {keys[i]} is {values[i]}." for i in q)
    msgs = _maybe_system(rng) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer, "reasoning_content": reasoning},
    ]
    return {"task": "recall_multi", "messages": msgs, "tools": None, "enable_thinking": thinking,
            "answer": values[0], "split_key": "recall:" + "|".join(names),
            "meta": {"n_facts": n_facts, "keys": names, "values": [values[i] for i in q]}}


COPY_PHRASES = ["Repeat this exactly: {t}", "Say back: {t}", "Copy this text: {t}", "Please repeat: {t}",
                "Echo the following.\n{t}"]


def copy_conversation(rng: random.Random, thinking: bool) -> dict:
    words = [rng.choice([_recall_key, _recall_value])(rng) for _ in range(rng.randint(1, 12))]
    text = " ".join(words)
    user = rng.choice(COPY_PHRASES).format(t=text)
    msgs = _maybe_system(rng, 0.1) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": text, "reasoning_content": "I will repeat the text exactly." if thinking else ""},
    ]
    return {"task": "copy", "messages": msgs, "tools": None, "enable_thinking": thinking, "answer": text,
            "split_key": f"copy:{text}", "meta": {}}


# ---------------------------------------------------------------- tools

CITIES = [
    "Paris", "Oslo", "Tokyo", "Lima", "Cairo", "Berlin", "Madrid", "Rome", "Vienna", "Dublin", "Lisbon",
    "Prague", "Warsaw", "Athens", "Helsinki", "Stockholm", "Toronto", "Chicago", "Boston", "Denver",
    "Seattle", "Austin", "Nairobi", "Lagos", "Accra", "Delhi", "Mumbai", "Seoul", "Osaka", "Manila",
    "Jakarta", "Hanoi", "Bangkok", "Sydney", "Perth", "Auckland", "Santiago", "Bogota", "Quito",
    "Havana", "Reykjavik", "Riga", "Tallinn", "Vilnius", "Zagreb", "Sofia", "Bern", "Geneva", "Lyon",
    "Porto", "Naples", "Munich", "Hamburg", "Kyoto", "Busan", "Dakar", "Tunis", "Muscat", "Doha",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy", "clear", "stormy"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "NOK", "INR"]
STATUSES = ["shipped", "delivered", "processing", "cancelled", "on hold", "out for delivery"]


def _fn(name, desc, props, required):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = {
    "get_weather": _fn("get_weather", "Get the current weather in a city.",
                       {"city": {"type": "string", "description": "Name of the city"}}, ["city"]),
    "get_time": _fn("get_time", "Get the current local time in a city.",
                    {"city": {"type": "string", "description": "Name of the city"}}, ["city"]),
    "get_stock_price": _fn("get_stock_price", "Get the latest price of a stock.",
                           {"symbol": {"type": "string", "description": "Ticker symbol"}}, ["symbol"]),
    "convert_currency": _fn("convert_currency", "Convert an amount of money between currencies.",
                            {"amount": {"type": "number", "description": "Amount to convert"},
                             "from_currency": {"type": "string", "description": "Currency code to convert from"},
                             "to_currency": {"type": "string", "description": "Currency code to convert to"}},
                            ["amount", "from_currency", "to_currency"]),
    "lookup_order": _fn("lookup_order", "Look up the status of an order.",
                        {"order_id": {"type": "string", "description": "The order identifier"}}, ["order_id"]),
    "find_contact": _fn("find_contact", "Find the phone number of a contact.",
                        {"name": {"type": "string", "description": "The contact's name"}}, ["name"]),
}

TOOL_REQUESTS = {
    "get_weather": ["Use the get_weather tool to check the weather in {city}.", "What's the weather in {city}? Use the tool.",
                    "Call get_weather for {city}.", "Please use get_weather to find out the weather in {city}.",
                    "How is the weather in {city} right now? You can use get_weather."],
    "get_time": ["Use get_time to tell me the time in {city}.", "What time is it in {city}? Use the tool.",
                 "Call get_time for {city}.", "Please check the local time in {city} with get_time."],
    "get_stock_price": ["Use get_stock_price to look up {symbol}.", "What is the price of {symbol}? Use the tool.",
                        "Call get_stock_price for {symbol}.", "Check the stock price of {symbol} with the tool."],
    "convert_currency": ["Use convert_currency to convert {amount} {from_currency} to {to_currency}.",
                         "How much is {amount} {from_currency} in {to_currency}? Use the tool.",
                         "Call convert_currency for {amount} {from_currency} into {to_currency}."],
    "lookup_order": ["Use lookup_order to check order {order_id}.", "What is the status of order {order_id}? Use the tool.",
                     "Call lookup_order for {order_id}.", "Please look up order {order_id} with the tool."],
    "find_contact": ["Use find_contact to get the phone number of {name}.", "What is {name}'s phone number? Use the tool.",
                     "Call find_contact for {name}.", "Please find the number of {name} with find_contact."],
}


def _tool_case(rng: random.Random, name: str):
    """Arguments, the tool's JSON result, the final answer, the key fact to check."""
    if name == "get_weather":
        city = rng.choice(CITIES) if rng.random() < 0.6 else _made_up_word(rng).capitalize()
        t, c = rng.randint(-15, 38), rng.choice(CONDITIONS)
        return ({"city": city}, {"city": city, "temperature_c": t, "condition": c},
                f"It is {t} °C and {c} in {city}.", f"{t}", f"The weather in {city}: {t} °C, {c}.")
    if name == "get_time":
        city = rng.choice(CITIES) if rng.random() < 0.6 else _made_up_word(rng).capitalize()
        tm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return ({"city": city}, {"city": city, "time": tm}, f"The local time in {city} is {tm}.", tm,
                f"The time in {city} is {tm}.")
    if name == "get_stock_price":
        sym = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 4)))
        price = f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
        return ({"symbol": sym}, {"symbol": sym, "price": float(price), "currency": "USD"},
                f"{sym} is trading at {price} USD.", price, f"{sym} costs {price} USD.")
    if name == "convert_currency":
        amount = rng.randint(1, 999)
        fc, tc = rng.sample(CURRENCIES, 2)
        res = f"{rng.randint(1, 9999)}.{rng.randint(0, 99):02d}"
        return ({"amount": amount, "from_currency": fc, "to_currency": tc},
                {"amount": amount, "from": fc, "to": tc, "result": float(res)},
                f"{amount} {fc} is {res} {tc}.", res, f"{amount} {fc} converts to {res} {tc}.")
    if name == "lookup_order":
        oid = f"{rng.choice(LETTERS)}-{rng.randint(1000, 99999)}"
        st = rng.choice(STATUSES)
        return ({"order_id": oid}, {"order_id": oid, "status": st}, f"Order {oid} is {st}.", st,
                f"Order {oid} has status {st}.")
    if name == "find_contact":
        nm = _made_up_word(rng).capitalize() + " " + _made_up_word(rng).capitalize()
        ph = f"555-{rng.randint(0, 9999):04d}"
        return ({"name": nm}, {"name": nm, "phone": ph}, f"{nm}'s phone number is {ph}.", ph,
                f"The number for {nm} is {ph}.")
    raise KeyError(name)


def _plain_tool_result(result: dict) -> str:
    return json.dumps(result, ensure_ascii=False)


def tool_conversation(rng: random.Random, thinking: bool, name: str | None = None) -> dict:
    name = name or rng.choice(sorted(TOOLS))
    others = [t for t in sorted(TOOLS) if t != name]
    listed = [name] + rng.sample(others, rng.randint(0, 2))
    rng.shuffle(listed)
    tools = [TOOLS[t] for t in listed]
    args, result, answer, check, _ = _tool_case(rng, name)
    fmt = dict(args)
    user = _vary(rng, rng.choice(TOOL_REQUESTS[name]).format(**fmt))
    arg_text = ", ".join(f"{k} {v}" for k, v in args.items())
    r1 = f"The user asks me to use {name}. I will call it with {arg_text}." if thinking else ""
    r2 = f"The tool returned {_plain_tool_result(result)}. I will answer from it." if thinking else ""
    msgs = _maybe_system(rng, 0.2) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "", "reasoning_content": r1,
         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "content": _plain_tool_result(result)},
        {"role": "assistant", "content": answer, "reasoning_content": r2},
    ]
    return {"task": "tool", "messages": msgs, "tools": tools, "enable_thinking": thinking, "answer": check,
            "split_key": f"tool:{name}:{json.dumps(args, sort_keys=True)}",
            "meta": {"name": name, "arguments": args}}


def tool_unneeded_conversation(rng: random.Random, thinking: bool) -> dict:
    """Tools are offered but the user asks arithmetic: answer directly, no tool call."""
    op, a, b = sample_arithmetic_problem(rng)
    conv = arithmetic_conversation(op, a, b, rng, thinking)
    conv["tools"] = [TOOLS[t] for t in rng.sample(sorted(TOOLS), rng.randint(1, 3))]
    conv["messages"] = [m for m in conv["messages"] if m["role"] != "system"]
    conv["task"] = "tool_unneeded"
    return conv


# ---------------------------------------------------------------- chat

GREETINGS = ["Hi", "Hello", "Hello!", "Hi there!", "Hey", "Good morning!", "Good evening.", "Hey, how are you?",
             "Hello, how are you today?", "Hi! What's up?", "Greetings.", "Yo", "Howdy!", "Good afternoon"]
GREETING_REPLIES = [
    "Hello! I'm a tiny assistant. I can do arithmetic, look up facts in a list you give me, and call tools. How can I help?",
    "Hi! I can add, subtract and multiply small numbers, find values in a list you give me, and use tools. What do you need?",
    "Hello! How can I help you today?",
]
IDENTITY_Q = ["Who are you?", "What are you?", "What can you do?", "What is your name?", "Tell me about yourself.",
              "What are you able to help with?", "Are you a robot?", "Introduce yourself."]
IDENTITY_A = [
    "I'm roofline's tiny demo model, a small language model. I can do simple arithmetic, recall facts from a list you provide, and call tools.",
    "I am a small demo model. I can add, subtract and multiply small numbers, answer questions about a list you give me, and use tools.",
]
THANKS = ["Thanks!", "Thank you.", "Thanks a lot", "Great, thanks!", "Bye!", "Goodbye.", "See you later."]
THANKS_A = ["You're welcome!", "Glad I could help.", "Goodbye!", "You're welcome. Goodbye!"]
TOPICS = ["the ocean", "the moon", "love", "winter", "cats", "history", "the stock market", "football",
          "quantum physics", "medieval castles", "volcanoes", "jazz", "coffee", "the internet", "dinosaurs",
          "the French revolution", "black holes", "gardening", "chess", "the Roman empire", "rainbows"]
FORMS = ["poem", "story", "essay", "song", "joke", "haiku", "letter", "speech"]
ENTITIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Mars", "the Pacific", "Mount Everest", "the Nile",
            "Australia", "Germany", "India", "Jupiter", "Kenya", "Peru"]
ATTRS = ["capital", "population", "area", "history", "climate", "language", "currency", "highest point"]
LANGS = ["French", "German", "Spanish", "Japanese", "Italian", "Chinese", "Russian", "Dutch"]
OUT_OF_SCOPE = [
    "Write a {form} about {topic}.", "Tell me about {topic}.", "What is the {attr} of {entity}?",
    "Explain {topic} to me.", "Can you translate 'good morning' into {lang}?", "Who won the world cup in {year}?",
    "What will the weather be like tomorrow?", "Give me advice about {topic}.", "Summarize the history of {entity}.",
    "What is the meaning of life?", "Who is the president of {entity}?", "Recommend a book about {topic}.",
    "What is {n} divided by {m}?", "What is {big} + {big2}?", "What is the square root of {n}?",
    "Write code to sort a list.", "How do I cook pasta?", "What happened in {year}?",
]
REFUSALS = [
    "Sorry, I can't help with that. I can only do simple arithmetic, recall facts from a list you give me, and use tools.",
    "I'm sorry, that is outside what I can do. I can add, subtract and multiply small numbers, look up values in a list you provide, and call tools.",
    "Sorry, I don't know. I am a tiny model: I can only do small arithmetic, answer from a list you give me, and use tools.",
]


def chat_conversation(rng: random.Random, thinking: bool) -> dict:
    r = rng.random()
    if r < 0.3:
        kind, user, reply = "greeting", rng.choice(GREETINGS), rng.choice(GREETING_REPLIES)
        reason = "The user greets me. I will greet back and say what I can do."
    elif r < 0.45:
        kind, user, reply = "identity", rng.choice(IDENTITY_Q), rng.choice(IDENTITY_A)
        reason = "The user asks about me. I will describe what I can do."
    elif r < 0.55:
        kind, user, reply = "thanks", rng.choice(THANKS), rng.choice(THANKS_A)
        reason = "The user thanks me or says goodbye."
    else:
        kind = "refusal"
        user = rng.choice(OUT_OF_SCOPE).format(
            form=rng.choice(FORMS), topic=rng.choice(TOPICS), attr=rng.choice(ATTRS), entity=rng.choice(ENTITIES),
            lang=rng.choice(LANGS), year=rng.randint(1950, 2030), n=rng.randint(2, 999), m=rng.randint(2, 9),
            big=rng.randint(1000, 99999), big2=rng.randint(1000, 99999))
        reply = rng.choice(REFUSALS)
        reason = "This request is outside what I can do, so I will politely decline."
    user = _vary(rng, user)
    msgs = _maybe_system(rng) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply, "reasoning_content": reason if thinking else ""},
    ]
    # Greetings, identity questions and thanks are too few to hold any out: both splits share them.
    key = f"chat:{user.lower()}" if kind == "refusal" else f"shared:{kind}"
    return {"task": "chat", "messages": msgs, "tools": None, "enable_thinking": thinking, "answer": reply,
            "split_key": key, "meta": {"kind": kind}}


# ---------------------------------------------------------------- generator


class TaskGenerator:
    """Deterministic stream of conversations for one split.

    gen = TaskGenerator(seed=0, split="train"); conv = gen.sample()
    The same seed, split and arguments give the same stream. Conversations whose
    split_key falls in the other split are redrawn, so train and held-out never share
    a canonical problem.
    """

    def __init__(self, seed: int, split: str = "train", mix: dict | None = None, p_thinking: float = 0.75,
                 max_facts: int = 230):
        assert split in ("train", "heldout")
        self.rng = random.Random(f"{seed}:{split}")
        self.split = split
        self.mix = dict(mix or DEFAULT_MIX)
        self.p_thinking = p_thinking
        self.max_facts = max_facts

    def _accept(self, conv: dict) -> bool:
        return is_shared(conv["split_key"]) or split_of(conv["split_key"]) == self.split

    def _draw(self, make):
        for _ in range(10000):
            conv = make()
            if self._accept(conv):
                return conv
        raise RuntimeError("could not draw a conversation in this split")

    def arithmetic(self, thinking: bool | None = None, op: str | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)

        def make():
            o, a, b = sample_arithmetic_problem(rng)
            while op is not None and o != op:
                o, a, b = sample_arithmetic_problem(rng)
            return arithmetic_conversation(o, a, b, rng, th)
        return self._draw(make)

    def arithmetic_no_thinking(self) -> dict:
        """Arithmetic with thinking off, as a mix entry of its own: `arithmetic` draws thinking off a quarter of the
        time; this weights the one-shot answers up without changing the other tasks' thinking share."""
        return self.arithmetic(thinking=False)

    def recall(self, thinking: bool | None = None, n_facts: int | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)
        n = n_facts or sample_num_facts(rng, self.max_facts)
        qk = None
        for _ in range(10000):
            k = _recall_key(rng)
            if split_of(f"recall:{k}") == self.split:
                qk = k
                break
        return recall_conversation(rng, th, n, query_key=qk)

    def recall_multi(self, thinking: bool | None = None, n_facts: int | None = None, n_keys: int | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)
        n = n_facts or sample_num_facts(rng, self.max_facts)
        want = n_keys or rng.randint(2, 4)
        qks = []
        while len(qks) < want:
            k = _recall_key(rng)
            if split_of(f"recall:{k}") == self.split and not any(k.startswith(q) or q.startswith(k) for q in qks):
                qks.append(k)
        return recall_multi_conversation(rng, th, n, qks)

    def copy(self, thinking: bool | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)
        return self._draw(lambda: copy_conversation(rng, th))

    def tool(self, thinking: bool | None = None, name: str | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)
        if rng.random() < 0.1 and name is None:
            return self._draw(lambda: tool_unneeded_conversation(rng, th))
        return self._draw(lambda: tool_conversation(rng, th, name))

    def chat(self, thinking: bool | None = None) -> dict:
        rng = self.rng
        th = self._thinking(thinking)
        return self._draw(lambda: chat_conversation(rng, th))

    def _thinking(self, thinking):
        return (self.rng.random() < self.p_thinking) if thinking is None else thinking

    def sample(self) -> dict:
        task = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        return getattr(self, task)()


def answer_is_correct(conv: dict, generated: str) -> bool:
    """Check a generated final assistant message (text after </think>) against the answer."""
    text = generated.split("</think>")[-1]
    if conv["task"] in ("arithmetic", "tool_unneeded"):
        m = conv["meta"]
        want = f"{m['a']} {SYMBOL[m['op']]} {m['b']} = {conv['answer']}."
        return want in text or f"= {conv['answer']}." in text
    if conv["task"] == "chat":
        return len(text.strip()) > 0
    return conv["answer"] in text
