"""Train the tiny model's byte-level BPE tokenizer on generated conversations.

    python -m training.train_tokenizer [--out roofline/models/tiny] [--vocab 2048] [--seed 0]

Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into --out.
Pre-tokenisation is Qwen2's regex (digits are split one by one, so every number is a
sequence of single-digit tokens) followed by byte-level mapping. The special tokens
follow Qwen: <|endoftext|>, <|im_start|>, <|im_end|> are special (skipped when decoding
with skip_special_tokens); <think>, </think>, <tool_call>, </tool_call>,
<tool_response>, </tool_response> are added tokens that stay visible in decoded text.
They take the last ids of the vocabulary, as in Qwen's tokenizers.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from training.chat import TEMPLATE_PATH, render
from training.tasks import TaskGenerator

# Qwen2's pre-tokenizer pattern: \p{N} matches a single digit.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONTROL = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "roofline" / "models" / "tiny"


def corpus(seed: int, n: int):
    gen = TaskGenerator(seed=seed, split="train", max_facts=60)
    for _ in range(n):
        c = gen.sample()
        yield render(c["messages"], c["tools"], False, c["enable_thinking"])


def build(seed: int = 0, vocab: int = 2048, n_docs: int = 20000) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # The added tokens are matched before pre-tokenisation; keep them out of the BPE corpus.
    texts = []
    for t in corpus(seed, n_docs):
        for s in SPECIAL + CONTROL:
            t = t.replace(s, "\n")
        texts.append(t)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIAL) - len(CONTROL),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in CONTROL])
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    return tok


def tokenizer_config(tok: Tokenizer, max_len: int) -> dict:
    added = {}
    for s in SPECIAL + CONTROL:
        added[str(tok.token_to_id(s))] = {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": s in SPECIAL,
        }
    return {
        "tokenizer_class": "TokenizersBackend",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_len,
        "split_special_tokens": False,
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--max-len", type=int, default=8192)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build(args.seed, args.vocab, args.docs)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, args.max_len), indent=2) + "\n")
    shutil.copyfile(TEMPLATE_PATH, out / "chat_template.jinja")
    enc = tok.encode("What is 38 + 45?")
    print(f"vocab {tok.get_vocab_size()}; 'What is 38 + 45?' -> {enc.tokens}")
    print("ids:", {s: tok.token_to_id(s) for s in SPECIAL + CONTROL})


if __name__ == "__main__":
    main()
