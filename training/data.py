"""Tokenise generated conversations and pack them into fixed-length training rows.

Each conversation is rendered with the chat template; the tokens the assistant generates
(from after each generation prompt up to and including its <|im_end|>) get loss. The
tokenisation of every generation prompt must be a prefix of the whole conversation's
tokenisation (checked), so that training sees exactly what inference will.

Rows are `row_len` tokens: a long conversation (if any) and then short ones, separated by
<|endoftext|> (no loss), padded with <|endoftext|>. Attention is not reset between packed
conversations; the model learns to ignore what came before an <|im_start|>.
"""

from __future__ import annotations

import random
from multiprocessing import get_context

import numpy as np
from tokenizers import Tokenizer

from training.chat import load_template, render
from training.tasks import TaskGenerator

_TOK = None
_TEMPLATE = None


def _init_worker(tok_path: str, template: str):
    global _TOK, _TEMPLATE
    _TOK = Tokenizer.from_file(tok_path)
    _TEMPLATE = template


def encode_conversation(tok: Tokenizer, conv: dict, template: str | None = None):
    """Token ids and loss mask (np.uint16, np.bool_) of one conversation."""
    msgs, tools, think = conv["messages"], conv.get("tools"), conv.get("enable_thinking", True)
    full = render(msgs, tools, False, think, template)
    ids = tok.encode(full, add_special_tokens=False).ids
    im_end = tok.token_to_id("<|im_end|>")
    mask = np.zeros(len(ids), dtype=np.bool_)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        p = tok.encode(render(msgs[:i], tools, True, think, template), add_special_tokens=False).ids
        if ids[: len(p)] != p:
            raise ValueError("prompt tokens are not a prefix of the conversation's tokens")
        end = ids.index(im_end, len(p))
        mask[len(p): end + 1] = True
    return np.asarray(ids, dtype=np.uint16), mask


def _gen_chunk(args):
    seed, chunk, n, split, max_facts, max_len, mix = args
    gen = TaskGenerator(seed=seed * 1_000_003 + chunk, split=split, max_facts=max_facts, mix=mix)
    out = []
    while len(out) < n:
        conv = gen.sample()
        ids, mask = encode_conversation(_TOK, conv, _TEMPLATE)
        if len(ids) + 1 <= max_len:
            out.append((ids, mask))
    return out


def generate_docs(tok_path: str, seed: int, n_docs: int, split: str = "train", max_facts: int = 230,
                  max_len: int = 2560, workers: int = 8, chunk_size: int = 2000, mix: dict | None = None):
    """n_docs tokenised conversations; deterministic for a given seed and chunk_size
    (chunk i always uses generator seed*1000003+i, whatever the number of workers)."""
    template = load_template()
    n_chunks = (n_docs + chunk_size - 1) // chunk_size
    jobs = [(seed, c, min(chunk_size, n_docs - c * chunk_size), split, max_facts, max_len, mix) for c in range(n_chunks)]
    if workers <= 1:
        _init_worker(tok_path, template)
        parts = [_gen_chunk(j) for j in jobs]
    else:
        with get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok_path, template)) as pool:
            parts = pool.map(_gen_chunk, jobs)
    return [d for p in parts for d in p]


def pack(docs, row_len: int, sep_id: int, seed: int):
    """Pack docs into rows; returns (ids int32 [R, row_len], mask bool [R, row_len])."""
    rng = random.Random(seed)
    docs = list(docs)
    rng.shuffle(docs)
    long_docs = [d for d in docs if len(d[0]) > row_len // 4]
    short = [d for d in docs if len(d[0]) <= row_len // 4]
    rows_ids, rows_mask = [], []
    si = 0

    def fill(cur_ids, cur_mask):
        nonlocal si
        used = sum(len(x) for x in cur_ids)
        while si < len(short) and used + len(short[si][0]) + 1 <= row_len:
            ids, m = short[si]
            cur_ids += [ids, np.array([sep_id], np.uint16)]
            cur_mask += [m, np.zeros(1, np.bool_)]
            used += len(ids) + 1
            si += 1
        ids = np.concatenate(cur_ids) if cur_ids else np.zeros(0, np.uint16)
        m = np.concatenate(cur_mask) if cur_mask else np.zeros(0, np.bool_)
        pad = row_len - len(ids)
        rows_ids.append(np.concatenate([ids, np.full(pad, sep_id, np.uint16)]))
        rows_mask.append(np.concatenate([m, np.zeros(pad, np.bool_)]))

    for ids, m in long_docs:
        fill([ids, np.array([sep_id], np.uint16)], [m, np.zeros(1, np.bool_)])
    while si < len(short):
        fill([], [])
    order = list(range(len(rows_ids)))
    rng.shuffle(order)
    ids = np.stack([rows_ids[i] for i in order]).astype(np.int32)
    mask = np.stack([rows_mask[i] for i in order])
    return ids, mask
