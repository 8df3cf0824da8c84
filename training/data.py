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


def focus_strings(conv: dict) -> list[str]:
    """The strings whose tokens get the extra answer weight (--w-answer): the looked-up values of
    recall conversations (they can only be copied from the list, which is the skill to learn)."""
    if conv["task"] == "recall":
        return [conv["answer"]]
    if conv["task"] == "recall_multi":
        return list(conv["meta"].get("values", [conv["answer"]]))
    return []


def encode_conversation(tok: Tokenizer, conv: dict, template: str | None = None, focus: bool = False):
    """Token ids and loss mask (np.uint16, np.bool_) of one conversation.

    With focus=True the mask is np.uint8 classes instead: 0 no loss, 1 loss, 2 loss on a token
    of an answer value (focus_strings) inside the assistant's turns."""
    msgs, tools, think = conv["messages"], conv.get("tools"), conv.get("enable_thinking", True)
    full = render(msgs, tools, False, think, template)
    enc = tok.encode(full, add_special_tokens=False)
    ids = enc.ids
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
    if focus:
        cls = mask.astype(np.uint8)
        spans = []
        for v in focus_strings(conv):
            i = full.find(v)
            while i >= 0:
                spans.append((i, i + len(v)))
                i = full.find(v, i + 1)
        if spans:
            for j, (a, b) in enumerate(enc.offsets):
                if mask[j] and any(a < e and b > s0 for s0, e in spans):
                    cls[j] = 2
        return np.asarray(ids, dtype=np.uint16), cls
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
            cur_mask += [m, np.zeros(1, m.dtype)]
            used += len(ids) + 1
            si += 1
        ids = np.concatenate(cur_ids) if cur_ids else np.zeros(0, np.uint16)
        m = np.concatenate(cur_mask) if cur_mask else np.zeros(0, mdt)
        pad = row_len - len(ids)
        rows_ids.append(np.concatenate([ids, np.full(pad, sep_id, np.uint16)]))
        rows_mask.append(np.concatenate([m, np.zeros(pad, mdt)]))

    mdt = docs[0][1].dtype if docs else np.bool_
    for ids, m in long_docs:
        fill([ids, np.array([sep_id], np.uint16)], [m, np.zeros(1, m.dtype)])
    while si < len(short):
        fill([], [])
    order = list(range(len(rows_ids)))
    rng.shuffle(order)
    ids = np.stack([rows_ids[i] for i in order]).astype(np.int32)
    mask = np.stack([rows_mask[i] for i in order])
    return ids, mask


def pack_dense(docs, row_len: int, sep_id: int, seed: int):
    """Pack docs into as few rows as fit (first fit, longest first), each doc followed by
    <|endoftext|>, docs in random order within a row; returns (ids int32, mask/classes)."""
    rng = random.Random(seed)
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i][0]))
    cap = np.zeros(0, np.int64)
    members: list[list[int]] = []
    for i in order:
        need = len(docs[i][0]) + 1
        fit = np.nonzero(cap >= need)[0]
        if len(fit):
            j = int(fit[0])
        else:
            cap = np.append(cap, row_len)
            members.append([])
            j = len(members) - 1
        cap[j] -= need
        members[j].append(i)
    mdt = docs[0][1].dtype if docs else np.bool_
    rows_ids, rows_mask = [], []
    for mem in members:
        rng.shuffle(mem)
        ids = np.concatenate([np.concatenate([docs[i][0], np.array([sep_id], np.uint16)]) for i in mem])
        m = np.concatenate([np.concatenate([docs[i][1], np.zeros(1, mdt)]) for i in mem])
        pad = row_len - len(ids)
        rows_ids.append(np.concatenate([ids, np.full(pad, sep_id, np.uint16)]))
        rows_mask.append(np.concatenate([m, np.zeros(pad, mdt)]))
    perm = list(range(len(rows_ids)))
    rng.shuffle(perm)
    return np.stack([rows_ids[i] for i in perm]).astype(np.int32), np.stack([rows_mask[i] for i in perm])


# ------------------------------------------------------------------ streaming


def _gen_rows(args):
    """One chunk for the streaming trainer: generate, tokenise (with focus classes) and pack
    into rows of row_len. Returns (kind, ids int32 [R, row_len], classes uint8 [R, row_len])."""
    kind, seed, chunk, n, split, max_facts, row_len, mix = args
    gen = TaskGenerator(seed=seed * 1_000_003 + chunk, split=split, max_facts=max_facts, mix=mix)
    docs = []
    while len(docs) < n:
        conv = gen.sample()
        ids, cls = encode_conversation(_TOK, conv, _TEMPLATE, focus=True)
        if len(ids) + 1 <= row_len:
            docs.append((ids, cls))
    ids, cls = pack_dense(docs, row_len, _TOK.token_to_id("<|endoftext|>"), seed * 7919 + chunk)
    return kind, ids, cls


class RowStream:
    """Training rows generated in the background while the GPU trains.

    kinds: {name: (row_len, max_facts, mix)}; chunk jobs are submitted round-robin in the
    proportions `shares` ({name: share}); `take(kind, n)` returns n fresh rows of that kind,
    reusing already seen rows (at random) only when generation falls behind."""

    def __init__(self, tok_path: str, seed: int, kinds: dict, shares: dict, workers: int, chunk_size: int = 1000,
                 n_chunks: int = 10000, split: str = "train", max_fresh_rows: int = 3000, ramps: dict | None = None):
        import threading

        self.kinds = kinds
        self.rows = {k: [] for k in kinds}  # list of (ids, cls) numpy chunks
        self.fresh = {k: [] for k in kinds}
        self.used = {k: 0 for k in kinds}
        self.reused = {k: 0 for k in kinds}
        self.lock = threading.Lock()
        self.rng = np.random.default_rng(seed + 99)
        order, acc = [], {k: 0.0 for k in kinds}
        tot = sum(shares.values())
        for c in range(n_chunks):  # deterministic interleaving by share (largest deficit first)
            for k in kinds:
                acc[k] += shares.get(k, 0.0) / tot
            k = max(acc, key=acc.get)
            acc[k] -= 1.0
            order.append(k)
        self.jobs, seen = [], {k: 0 for k in kinds}
        for c, k in enumerate(order):
            max_facts = kinds[k][1]
            if k in (ramps or {}):  # curriculum: max_facts grows linearly from `start` over `n` chunks of this kind
                start, n = ramps[k]
                max_facts = int(round(start + (max_facts - start) * min(1.0, seen[k] / max(1, n))))
            seen[k] += 1
            self.jobs.append((k, seed, c, chunk_size, split, max_facts, kinds[k][0], kinds[k][2]))
        template = load_template()
        self.sync = workers <= 1
        if self.sync:
            _init_worker(tok_path, template)
            self.next_job = 0
        else:
            self.pool = get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok_path, template))
            self.in_flight = 2 * workers
            self.max_fresh = max_fresh_rows
            self.closed = False
            self.thread = threading.Thread(target=self._collect, daemon=True)
            self.thread.start()

    def _add(self, kind, ids, cls):
        with self.lock:
            self.fresh[kind].append((ids, cls))

    def _fresh_rows(self):
        with self.lock:
            return sum(len(x[0]) for v in self.fresh.values() for x in v)

    def _collect(self):
        """Keep a few jobs in flight, in order, while fewer than max_fresh rows wait unused."""
        import time

        pending, nxt = [], 0
        try:
            while not self.closed:
                while (nxt < len(self.jobs) and len(pending) < self.in_flight
                       and self._fresh_rows() < self.max_fresh):
                    pending.append(self.pool.apply_async(_gen_rows, (self.jobs[nxt],)))
                    nxt += 1
                if pending and pending[0].ready():
                    self._add(*pending.pop(0).get())
                else:
                    time.sleep(0.02)
        except Exception as e:  # the pool is closed at the end of training
            if not self.closed:
                print(f"row stream stopped: {e!r}", flush=True)

    def available(self, kind):
        with self.lock:
            return sum(len(x[0]) for x in self.fresh[kind]) + sum(len(x[0]) for x in self.rows[kind])

    def wait_for(self, min_rows: dict, timeout: float = 600.0):
        import time

        t0 = time.time()
        while any(self.available(k) < n for k, n in min_rows.items()):
            if self.sync:
                self._add(*_gen_rows(self.jobs[self.next_job]))
                self.next_job += 1
            elif time.time() - t0 > timeout:
                raise TimeoutError("row generation is too slow")
            else:
                time.sleep(0.2)

    def take(self, kind: str, n: int):
        """n rows: fresh ones first, else random already-used ones."""
        if self.sync and sum(len(x[0]) for x in self.fresh[kind]) < n:
            self.wait_for({kind: self.available(kind) + n})
        out_i, out_c, need = [], [], n
        with self.lock:
            while need and self.fresh[kind]:
                ids, cls = self.fresh[kind][0]
                take = min(need, len(ids))
                out_i.append(ids[:take])
                out_c.append(cls[:take])
                self.rows[kind].append((ids[:take], cls[:take]))
                if take == len(ids):
                    self.fresh[kind].pop(0)
                else:
                    self.fresh[kind][0] = (ids[take:], cls[take:])
                need -= take
            self.used[kind] += n - need
            if need:
                pool = self.rows[kind]
                sizes = np.array([len(x[0]) for x in pool])
                cum = np.cumsum(sizes)
                picks = self.rng.integers(0, cum[-1], size=need)
                for p in picks:
                    j = int(np.searchsorted(cum, p, side="right"))
                    r = int(p - (cum[j - 1] if j else 0))
                    out_i.append(pool[j][0][r: r + 1])
                    out_c.append(pool[j][1][r: r + 1])
                self.reused[kind] += need
        return np.concatenate(out_i), np.concatenate(out_c)

    def close(self):
        if not self.sync:
            self.closed = True
            self.pool.terminate()
