"""The pooled decode step (what the CUDA-graph runner captures) against the reference path.

Without CUDA the fused kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1)
and the step runs eagerly; with CUDA the `gpu` tests capture it as graphs. Either way the
pooled caches, the slot steps and the verify rollback must give the reference path's tokens.
"""

import os

import pytest
import torch

from roofline.config import ModelConfig
from roofline.engine.cache import CachePool, SequenceCache
from roofline.engine import graphs as graphs_module
from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import SpeculativeConfig
from tiny_checkpoints import INT4_PLAN, text_config, write_random_checkpoint

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, no CUDA)")

# the dense model's MLPs in INT4 too, as the 27B's synthetic layout (`bench synthetic`'s default) stores them
DENSE_INT4_PLAN = {**INT4_PLAN, "dense_mlp": "int4"}
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [9, 8, 7], [100, 3, 4, 200, 201, 9, 9, 12, 40]]


# The interpreter runs the INT4 kernels too slowly for CI's two cores: INT4 is checked on the GPU.
FORMATS = ["bf16", "int4"] if torch.cuda.is_available() else ["bf16"]


@pytest.fixture(scope="module", params=FORMATS)
def checkpoint(request, tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("pooled") / request.param, seed=7,
                                   plan=INT4_PLAN if request.param == "int4" else None)


def greedy(engine, prompts, n=8):
    seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=n)) for p in prompts]
    while engine.sequences:
        engine.step()
    return [s.output_ids for s in seqs]


def engines(path, device, dtype, k=None):
    spec = SpeculativeConfig(k) if k else None
    reference = Engine.from_pretrained(str(path), device=device, dtype=dtype, fast_path=False, speculative=spec)
    pooled = Engine.from_pretrained(str(path), device=device, dtype=dtype, cuda_graphs=True, speculative=spec, max_num_seqs=4)
    assert pooled.pooled_decode and not reference.pooled_decode
    pooled.ensure_pools()
    return reference, pooled


@cpu
@pytest.mark.parametrize("k", [None, 2])
def test_pooled_greedy_tokens_equal_reference(checkpoint, k):
    reference, pooled = engines(checkpoint, "cpu", "float32", k)
    want = greedy(reference, PROMPTS)
    assert greedy(pooled, PROMPTS) == want  # batched: the slots and the rollback are per sequence
    assert pooled.pool.free == list(range(4)) or sorted(pooled.pool.free) == list(range(4)), "slots go back"
    if k:
        assert sum(pooled.speculator.drafted) > 0


@cpu
def test_verify_rollback_equals_never_seeing_rejected_tokens(checkpoint):
    """A verify of 4 tokens that keeps 2 leaves the caches of two plain steps: the GDN state rebuilt in the spare
    buffer (gdn_replay), the state before the step untouched until then, and in the conv rings the rows the next step
    reads (the kept tokens' and older) as two plain steps left them, with nothing restored."""
    _, pooled = engines(checkpoint, "cpu", "float32", 2)  # with MTP: two GDN state buffers per slot
    model, graphs = pooled.model, pooled.graphs
    prefix, extra = PROMPTS[2][:5], PROMPTS[2][5:9]
    clean, spec = pooled.pool.acquire(), pooled.pool.acquire()
    for cache in (clean, spec):
        model(torch.tensor(prefix), [len(prefix)], [cache])
    for token in extra[:2]:  # the two tokens that are "accepted", one plain step each
        graphs.keep(graphs.run([token], [clean], 1), 0, clean, 1, 1)
    before = {layer: state.clone() for layer, state in spec.recurrent.items()}
    row = spec.state_row
    buf = graphs.run(extra, [spec], 4, rollback=True)  # verify 4 tokens in one step, keep 2
    pool = pooled.pool
    assert all(torch.equal(pool.recurrent[layer][row], state) for layer, state in before.items()), "read, not written"
    graphs.keep(buf, 0, spec, 4, 2)
    assert spec.state_row == pool.state_row(spec.slot, 1) and spec.num_tokens == clean.num_tokens == 7
    for layer in pool.recurrent:
        assert spec.recurrent[layer].data_ptr() == pool.recurrent[layer][spec.state_row].data_ptr()
        assert torch.allclose(spec.recurrent[layer], clean.recurrent[layer], rtol=1e-4, atol=1e-5)
        # every position's input before 7 (the next step reads the last K-1); the projections' roundings differ
        # between a 4-row and a 1-row step, hence the tolerance
        assert torch.allclose(spec.conv_window(layer, 7), clean.conv_window(layer, 7), rtol=1e-4, atol=1e-5)
    for layer in pool.keys:
        assert torch.allclose(pool.keys[layer][spec.slot, :7], pool.keys[layer][clean.slot, :7], rtol=1e-4, atol=1e-5)
    a = graphs.run([11], [spec], 1).logits[0].clone()
    b = graphs.run([11], [clean], 1).logits[0]
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@cpu
def test_rollback_reads_the_records_of_its_own_bucket_after_the_storage_grew(checkpoint):
    """Without a reservation the saves' storage grows with the largest verify step; a bucket made before keeps its
    views of the older storage, and its rollback must replay from those records, not the newer storage's."""
    from roofline.engine.graphs import DecodeGraphs

    _, pooled = engines(checkpoint, "cpu", "float32", 2)
    model, pool = pooled.model, pooled.pool
    graphs = DecodeGraphs(model, pool, 4, use_graphs=False)  # no rollback_rows: the storage starts at the first verify
    prefix, extra = PROMPTS[2][:5], PROMPTS[2][5:9]
    clean, spec, other = pool.acquire(), pool.acquire(), pool.acquire()
    for cache in (clean, spec, other):
        model(torch.tensor(prefix), [len(prefix)], [cache])
    small, _, _ = graphs.buffers_for(1, 4, 9, rollback=True)
    graphs.buffers_for(4, 4, 9, rollback=True)  # grows the storage
    assert small.records is not graphs.records and small.records.shape[1] < graphs.records.shape[1]
    for token in extra[:2]:
        graphs.keep(graphs.run([token], [clean], 1), 0, clean, 1, 1)
    buf = graphs.run(extra, [spec], 4, rollback=True)
    assert buf is small
    graphs.keep(buf, 0, spec, 4, 2)
    for layer in pool.recurrent:
        assert torch.allclose(spec.recurrent[layer], clean.recurrent[layer], rtol=1e-4, atol=1e-5)


@cpu
def test_verify_buckets_share_one_reserved_storage_of_rollback_saves(checkpoint):
    """The engine reserves the verify steps' GDN saves at start (sequences x drafts positions of step records, in
    its memory log), and every verify bucket, whatever its batch or attention span, views that one storage instead
    of allocating its own (one set per bucket grew with every span a conversation reached)."""
    from roofline.engine.cache import step_record_size

    _, pooled = engines(checkpoint, "cpu", "float32", 2)
    graphs, pool, cfg = pooled.graphs, pooled.pool, pooled.model.config
    layer = next(iter(pool.recurrent))
    record = step_record_size(cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                              cfg.linear_value_head_dim) * 4
    per_row = record * len(pool.recurrent)
    assert graphs.saves_nbytes == 4 * 2 * per_row  # max_num_seqs 4 x 2 drafts
    assert pool.recurrent_all.shape[1] == 2 * (4 + 1), "two state buffers a slot, the padding slot's too"
    views = []
    for batch, longest in [(1, 10), (3, 10), (1, 1500), (4, 1500)]:
        buf, b, span = graphs.buffers_for(batch, 3, longest, rollback=True)
        records = buf.rollback[layer]
        assert records.shape[:2] == (b, 2) and records.is_contiguous()
        assert records.data_ptr() == graphs.records[0].data_ptr()
        views.append(span)
    assert len(set(views)) == 2 and graphs.saves_nbytes == 4 * 2 * per_row, "no bucket allocated saves of its own"


@cpu
def test_capture_graphs_makes_every_bucket_a_run_meets(checkpoint, monkeypatch):
    """`capture_graphs` (serve and chat call it at start) makes every bucket up front, so no step waits for a
    capture mid-answer: batched sequences, MTP verify and head steps, and contexts crossing span buckets (from 8
    tokens here, for a short run)."""
    monkeypatch.setattr(graphs_module, "MIN_SPAN", 8)
    engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True,
                                    speculative=SpeculativeConfig(2), max_num_seqs=4, max_model_len=20)
    engine.capture_graphs()
    main, head = set(engine.graphs.buffers), set(engine.speculator.draft_graphs.buffers)
    spans = [8, 16, 25]  # the pool holds max_model_len + 5 positions (a verify may run past the limit)
    assert main == {(b, m, s) for b in (1, 2, 4) for m in (1, 3) for s in spans}
    assert head == {(b, m, s) for b in (1, 2, 4) for m in (1, 2, 3) for s in spans}
    assert all(engine.graphs.buffers[key].rollback for key in main if key[1] > 1), "verify buckets save for the rollback"
    seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in PROMPTS[1:]]  # 3 and 9 tokens
    while engine.sequences:
        engine.step()
    assert max(len(s.prompt_ids) + len(s.output_ids) for s in seqs) > 16, "the run reaches the last span bucket"
    assert set(engine.graphs.buffers) == main and set(engine.speculator.draft_graphs.buffers) == head
    assert sum(engine.speculator.drafted) > 0


@cpu
def test_capture_graphs_out_of_memory_names_the_flags(checkpoint, monkeypatch):
    from roofline.errors import UserError

    engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True, max_model_len=64)
    engine.ensure_pools()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(engine.graphs, "prepare", out_of_memory)
    with pytest.raises(UserError, match="--max-model-len.*--lazy-capture"):
        engine.capture_graphs()


@cpu
def test_capture_graphs_covers_every_draft_length_auto_may_choose(checkpoint):
    spec = SpeculativeConfig(3, auto=True)
    engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True, speculative=spec,
                                    max_num_seqs=1, max_model_len=1000)
    engine.capture_graphs()
    assert set(engine.graphs.buffers) == {(1, m, 1005) for m in (1, 2, 3, 4)}
    assert set(engine.speculator.draft_graphs.buffers) == {(1, m, 1005) for m in (1, 2, 3, 4)}


@cpu
@pytest.mark.parametrize("k", [None, 2])
def test_serve_sizes_the_pool_by_what_the_engine_allocates(checkpoint, k):
    """`serve` picks --max-num-seqs for the CUDA-graph path from CacheMemory.pooled_bytes: it must be what
    ensure_pools allocates, MTP's head KV and rollback saves included (they were left out: a tight budget passed the
    check and ran out of memory at the first request)."""
    from roofline.server.scheduler import CacheMemory

    _, pooled = engines(checkpoint, "cpu", "float32", k)
    allocated = pooled.pool.nbytes + (pooled.mtp_pool.nbytes if k else 0) + pooled.graphs.saves_nbytes
    memory = CacheMemory.for_model(pooled.model.config, pooled.model.dtype)
    assert memory.pooled_bytes(pooled.max_model_len, 4, k or 0) == allocated
    if k:
        assert memory.pooled_bytes(pooled.max_model_len, 4, k) > memory.pooled_bytes(pooled.max_model_len, 4)
    from roofline.commands.serve import pooled_max_num_seqs
    from roofline.errors import UserError

    length = pooled.max_model_len
    assert pooled_max_num_seqs(memory, length, k or 0, allocated, 8) == 4  # exactly four slots' worth
    assert pooled_max_num_seqs(memory, length, k or 0, allocated - 1, 8) == 3
    assert pooled_max_num_seqs(memory, length, k or 0, allocated, 2) == 2
    with pytest.raises(UserError, match="--max-model-len" + (".*speculative" if k else "")):
        pooled_max_num_seqs(memory, length, k or 0, memory.pooled_bytes(length, 1, k or 0) - 1, 8)


@cpu
def test_padding_rows_write_only_the_scratch_places(checkpoint):
    """Three sequences run in a bucket of four: the padding row's keys land in slot 0's reserved tail and its
    GDN state in the scratch slot; the free slot is untouched."""
    _, pooled = engines(checkpoint, "cpu", "float32")
    pool, graphs = pooled.pool, pooled.graphs
    caches = [pool.acquire() for _ in range(3)]
    free = pool.free[0]
    graphs.run([5, 6, 7], caches, 1)
    layer = next(iter(pool.keys))
    assert pool.keys[layer][0, pool.max_len].abs().sum() > 0, "the padding row's keys go to the reserved tail"
    assert pool.keys[layer][free].abs().sum() == 0 and pool.values[layer][free].abs().sum() == 0
    gdn = next(iter(pool.recurrent))
    assert pool.recurrent[gdn][pool.pad_slot].abs().sum() > 0 and pool.recurrent[gdn][free].abs().sum() == 0
    assert all(pool.keys[layer][c.slot, 0].abs().sum() > 0 for c in caches)


@cpu
def test_slots_are_released_once(checkpoint):
    """A sequence that finished gives its slot back; cancelling it later must not free the slot again
    (another sequence may hold it by then)."""
    _, pooled = engines(checkpoint, "cpu", "float32", 2)
    first = pooled.add(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1))
    while pooled.sequences:
        pooled.step()
    second = pooled.add(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))
    pooled.cancel(first)
    assert second.cache.slot not in pooled.pool.free and second.draft.cache.slot not in pooled.mtp_pool.free
    assert len(pooled.pool.free) == 3


def test_slot_cache_prefill_equals_growing_cache(checkpoint):
    """Eager steps on a pool slot (how prompts are prefilled) give the reference cache's logits."""
    engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", fast_path=False)
    model, cfg = engine.model, engine.model.config
    pool = CachePool(cfg, cfg.layer_types, 2, 64, "cpu", torch.float32)
    slot, plain = pool.acquire(), SequenceCache()
    ids = torch.tensor(PROMPTS[0])
    for cache in (slot, plain):
        model(ids, [len(ids)], [cache])
    nxt = torch.tensor([11])
    assert torch.allclose(model.logits(model(nxt, [1], [slot])), model.logits(model(nxt, [1], [plain])), atol=1e-5)
    with pytest.raises(ValueError, match="holds 64 tokens"):
        model(torch.zeros(60, dtype=torch.long), [60], [slot])


def test_slot_cache_views_follow_its_length():
    """A slot's KV views (cut when read) and its byte count follow advance(), as a growing cache's would."""
    cfg = ModelConfig.from_dict(text_config())
    pool = CachePool(cfg, cfg.layer_types, 2, 64, "cpu", torch.float32)
    pool.acquire()
    cache = pool.acquire()
    for step in (3, 1, 4):
        cache.advance(step)
        views = [*cache.keys.values(), *cache.values.values()]
        assert views and all(v.shape[0] == cache.num_tokens for v in views)
        assert all(v.data_ptr() == pool.keys[layer][1].data_ptr() for layer, v in cache.keys.items())
        assert cache.kv_nbytes == sum(v.numel() * v.element_size() for v in views) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("k", [None, 2])
def test_cuda_graph_greedy_tokens_equal_reference(checkpoint, k):
    reference, pooled = engines(checkpoint, "cuda", "float32", k)
    pooled.capture_graphs()  # as serve does: every bucket before the first request

    def captures():
        return len(pooled.graphs.captures) + (len(pooled.speculator.draft_graphs.captures) if k else 0)

    made = captures()
    prompts = PROMPTS + [list(range(3, 60))]  # a prompt long enough for the chunked (fla) GDN prefill
    want = greedy(reference, prompts, n=24)
    assert greedy(pooled, prompts, n=24) == want
    assert pooled.graphs.replays > 0, "decode steps replay captured graphs"
    assert captures() == made > 0, "no step waited for a capture"


def spy_gdn_decode(monkeypatch) -> list:
    """Record (defer_norm, tokens_per_seq) of every mixers.gdn_decode call, which still runs."""
    from roofline.kernels import mixers

    calls, run_gdn = [], mixers.gdn_decode
    monkeypatch.setattr(mixers, "gdn_decode", lambda *a, **kw: calls.append(
        (kw["defer_norm"], kw["tokens_per_seq"])) or run_gdn(*a, **kw))
    return calls


def greedy_events(engine, prompt, max_tokens: int) -> list:
    """One greedy sequence's token events (with 5 top log-probabilities each), stepped to its end."""
    engine.add(list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5))
    events = []
    while engine.sequences:
        events += [event for _, event in engine.step()]
    return events


def assert_same_logprobs(got: list, want: list, tol: float) -> None:
    """The first decoded token's (after the prefill's) top-5 log-probabilities agree within `tol`, and so does each
    later token's log-probability while both runs chose the same tokens."""
    top_got, top_want = dict(got[1].top_logprobs), dict(want[1].top_logprobs)
    assert set(top_got) == set(top_want)  # the top 5 of a random model's flat distribution: their order may flip on a tie
    assert [top_got[t] for t in top_want] == pytest.approx(list(top_want.values()), abs=tol)
    for g, w in zip(got[1:], want[1:]):
        if g.token_id != w.token_id:
            break
        assert g.logprob == pytest.approx(w.logprob, abs=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [None, 2])
def test_gdn_norm_in_out_proj_keeps_the_tokens_logprobs_gpu(tmp_path, monkeypatch, k):
    """bf16, INT4, GDN heads of 128 values (the published models'): with the GDN step leaving its gated norm's rms
    to the out projection (mixers.GDN_NORM_IN_OUT_PROJ, taken here; with MTP-2 also by the 3-row verify steps) the
    first decoded token (after the prefill's) and its top log-probabilities are those of the step with the norm in
    the GDN kernel, within bf16's roundings, and so is each later token's log-probability while both agree."""
    from roofline.kernels import mixers

    path = write_random_checkpoint(tmp_path / "dv128", seed=3, plan=INT4_PLAN, linear_value_head_dim=128)
    calls = spy_gdn_decode(monkeypatch)
    events = {}
    for defer in (True, False):
        monkeypatch.setattr(mixers, "GDN_NORM_IN_OUT_PROJ", defer)
        engine = Engine.from_pretrained(str(path), device="cuda", dtype="bfloat16", cuda_graphs=True, max_num_seqs=1,
                                        speculative=SpeculativeConfig(k) if k else None)
        events[defer] = greedy_events(engine, PROMPTS[0], 8)
        deferred_rows = {rows for deferred, rows in calls if deferred}
        assert (k or 0) + 1 in deferred_rows if defer else not deferred_rows, \
            "the deferred norm runs exactly when switched on, in the verify steps too"
        calls.clear()
        del engine
    assert events[True][0] == events[False][0], "the prefill's token: the same path"
    assert_same_logprobs(events[True], events[False], 0.06)


def run_schedule(engine, schedule):
    """Steps `engine` to the end, adding or cancelling sequences before given step() calls: schedule maps a call
    index to ("add", prompt, params) or ("cancel", index of an added sequence). Returns the sequences and each
    one's (token, logprob, top logprobs) events in order; a cancelled sequence gets none after its cancel."""
    seqs, events, calls, cancelled = [], {}, 0, {}
    while engine.sequences or calls in schedule or calls < max(schedule, default=0):
        action = schedule.get(calls)
        if action and action[0] == "add":
            seqs.append(engine.add(action[1], action[2]))
        elif action:
            engine.cancel(seqs[action[1]])
            cancelled[action[1]] = len(events.get(seqs[action[1]].request_id, []))
        for seq, event in engine.step():
            events.setdefault(seq.request_id, []).append((event.token_id, event.logprob, event.top_logprobs, event.finish_reason))
        calls += 1
    for index, count in cancelled.items():
        assert len(events.get(seqs[index].request_id, [])) == count == len(seqs[index].output_ids)
    return seqs, [events.get(s.request_id, []) for s in seqs]


def assert_same_events(got, want):
    assert [[e[0] for e in seq] for seq in got] == [[e[0] for e in seq] for seq in want]
    assert [[e[3] for e in seq] for seq in got] == [[e[3] for e in seq] for seq in want]
    for g_seq, w_seq in zip(got, want):
        for g, w in zip(g_seq, w_seq):
            assert g[1] == pytest.approx(w[1], abs=1e-4)
            assert (g[2] is None) == (w[2] is None)
            if g[2] is not None:
                assert [t for t, _ in g[2]] == [t for t, _ in w[2]]
                assert [v for _, v in g[2]] == pytest.approx([v for _, v in w[2]], abs=1e-4)


@cpu
def test_async_scheduling_keeps_every_token_logprob_and_stop(checkpoint):
    """Steps launched ahead from the device's tokens give what one-at-a-time steps give: greedy and seeded
    sampling, top logprobs, sequences of different lengths, one joining mid-way, one cancelled mid-way."""
    def params(**kw):
        return SamplingParams(**{"temperature": 0.0, "max_tokens": 5, **kw})

    schedule = {0: ("add", PROMPTS[0], params(logprobs=2)),
                1: ("add", PROMPTS[1], params(temperature=0.9, top_k=20, seed=3, max_tokens=7)),
                2: ("add", PROMPTS[2], params(max_tokens=3)),
                4: ("add", PROMPTS[0][:4], params(temperature=0.7, top_p=0.9, seed=5, max_tokens=9)),
                8: ("cancel", 3)}  # while a step launched ahead holds its row
    results = {}
    for on in (False, True):
        engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True,
                                        max_num_seqs=4, async_scheduling=on)
        seqs, events = run_schedule(engine, schedule)
        results[on] = events
        assert (engine.steps_launched_ahead > 0) == on
        assert sorted(engine.pool.free) == list(range(4)), "every slot goes back, the cancelled one too"
        assert 0 < len(seqs[3].output_ids) < 9, "cancelled before its end"
    # The cancel lands after a given number of step() calls, which yield tokens on different schedules: the
    # cancelled sequence's tokens only have to agree as far as both got.
    cut = min(len(results[True][3]), len(results[False][3]))
    for on in results:
        results[on][3] = results[on][3][:cut]
    assert_same_events(results[True], results[False])


@cpu
def test_async_scheduling_drops_the_row_after_a_stop_token(checkpoint, caplog):
    """A sequence that stops on the token read drops its row of the step launched ahead; its slot, zeroed for the
    next sequence, gives that sequence the tokens a fresh engine gives. A penalised sequence runs one step at a time."""
    engine = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True, max_num_seqs=1)
    free_run = greedy(engine, PROMPTS[:1], n=6)[0]
    stop_at = free_run[2]
    seq = engine.add(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at]))
    while engine.sequences:
        engine.step()
    stopped = free_run[: free_run.index(stop_at) + 1]
    assert seq.output_ids == stopped and seq.finish_reason == "stop"
    assert engine.steps_launched_ahead > 0
    assert greedy(engine, PROMPTS[1:2], n=4) == greedy(
        Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True, max_num_seqs=1), PROMPTS[1:2], n=4)
    assert seq.output_ids == stopped, "the row launched ahead after the stop was dropped, not appended"
    before = engine.steps_launched_ahead
    with caplog.at_level("INFO", logger="roofline.engine"):
        penalised = engine.add(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.2))
        while engine.sequences:
            engine.step()
    assert len(penalised.output_ids) == 3 and engine.steps_launched_ahead == before
    assert "async scheduling off for steps where a repetition, presence or frequency penalty" in caplog.text


@pytest.mark.gpu
def test_decode_batches_past_16_rows_are_captured_with_the_int4_gemm_gpu(checkpoint, monkeypatch):
    """ROOFLINE_INT4_GEMM=triton: 6 sequences with MTP-2 verify steps (18 rows, bucket 8 x 3) replay captured graphs
    whose routed experts take the grouped kernel and whose dense INT4 weights the GEMM, with the reference's tokens."""
    if checkpoint.name != "int4":
        pytest.skip("the INT4 checkpoint's kernels")
    monkeypatch.setenv("ROOFLINE_INT4_GEMM", "triton")
    spec = SpeculativeConfig(2)
    reference = Engine.from_pretrained(str(checkpoint), device="cuda", dtype="float32", fast_path=False, speculative=spec)
    pooled = Engine.from_pretrained(str(checkpoint), device="cuda", dtype="float32", cuda_graphs=True, speculative=spec,
                                    max_num_seqs=8)
    prompts = [PROMPTS[i % 3][: 3 + i] for i in range(6)]
    assert greedy(pooled, prompts, n=12) == greedy(reference, prompts, n=12)
    assert any(b * m > 16 and buf.graph is not None for (b, m, _), buf in pooled.graphs.buffers.items())


def test_freeze_startup_heap_puts_what_start_built_out_of_the_collectors_reach():
    """serve, chat and generate call it once started (as vLLM does): later full collections skip the startup heap."""
    import gc

    from roofline.engine.engine import freeze_startup_heap

    startup = [[i] for i in range(1000)]  # tracked objects alive at "start"
    try:
        before = gc.get_freeze_count()
        freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(startup)
        oldest = {id(o) for o in gc.get_objects(generation=2)}  # what a full collection walks
        assert not any(id(x) in oldest for x in startup)
    finally:
        gc.unfreeze()


def check_dense_residuals(path, monkeypatch, device, dtype, tol, k=None, prompt=(5,), max_tokens=2, pooled=True):
    """With blocks.DENSE_RESIDUAL_IN_GEMVS the dense model's down projections add h in their epilogues, and on the
    pooled step (`pooled`: the engine with CUDA graphs) its out projections add the layer's input (finishing the GDN's
    gated norm), in every step (the verify's too); switched off, add_rms_norm and a separate add run. The prefill's
    token is the same, and the next tokens' log-probabilities (the first decoded token's top 5 too) agree within `tol`
    while both runs choose the same tokens."""
    from roofline.kernels import blocks, dispatch

    residual_calls, run_residual = [], dispatch._int4_residual
    monkeypatch.setattr(dispatch, "_int4_residual", lambda weight, *a, **kw: residual_calls.append(
        weight.in_features) or run_residual(weight, *a, **kw))  # bound per weight at install: patched before it
    deferred = spy_gdn_decode(monkeypatch)
    events = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "DENSE_RESIDUAL_IN_GEMVS", on)
        engine = Engine.from_pretrained(str(path), device=device, dtype=dtype, cuda_graphs=pooled, max_num_seqs=1,
                                        speculative=SpeculativeConfig(k) if k else None)
        cfg = engine.model.config
        events[on] = greedy_events(engine, prompt, max_tokens)
        if on and pooled:  # each step: each layer's out projection (K = its mixer's width) and down projection (K = I)
            widths = {cfg.num_attention_heads * cfg.head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim}
            assert set(residual_calls) == widths | {cfg.intermediate_size}
            gdn_layers = sum(t == "linear_attention" for t in cfg.layer_types)
            assert residual_calls.count(cfg.intermediate_size) * gdn_layers == len(deferred) * cfg.num_hidden_layers > 0
            assert all(d for d, _ in deferred), "the GDN kernel leaves its norm's rms to out_proj"
            assert not k or (k + 1) in {rows for _, rows in deferred}, "the verify steps take it too"
        elif on:  # eager decode (no pool): the layer's add_rms_norm, then the down projection adds h
            assert set(residual_calls) == {cfg.intermediate_size} and not deferred
        else:
            assert not residual_calls and not any(d for d, _ in deferred), "off: add_rms_norm and the add"
            assert bool(deferred) == pooled
        residual_calls.clear()
        deferred.clear()
        del engine
    assert events[True][0].token_id == events[False][0].token_id, "the prefill's token"
    assert_same_logprobs(events[True], events[False], tol)


@cpu
def test_dense_layers_add_their_residuals_in_the_int4_gemvs(tmp_path, monkeypatch):
    """fp16 in the interpreter, one GDN layer (heads of 128 values) and one attention layer with INT4 linears (the
    27B's layers, small): see check_dense_residuals. A one-token prompt and two tokens: the interpreter's INT4 GEMVs
    take ~10 s a step."""
    path = write_random_checkpoint(tmp_path / "dense", seed=5, plan=DENSE_INT4_PLAN, moe=False, layers=2,
                                   layer_types=["linear_attention", "full_attention"], linear_value_head_dim=128,
                                   linear_num_key_heads=1, linear_num_value_heads=2, intermediate_size=384)
    check_dense_residuals(path, monkeypatch, "cpu", "float16", 0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("k,pooled", [(None, True), (2, True), (None, False)])
def test_dense_layers_add_their_residuals_in_the_int4_gemvs_gpu(tmp_path, monkeypatch, k, pooled):
    """bf16, the tiny dense model's four layers with INT4 linears and GDN heads of 128 values, on the pooled step in
    CUDA graphs (with MTP-2 the 3-row verify steps too) and in eager decode: see check_dense_residuals."""
    path = write_random_checkpoint(tmp_path / "dense", seed=5, plan=DENSE_INT4_PLAN, moe=False,
                                   linear_value_head_dim=128, intermediate_size=384)
    check_dense_residuals(path, monkeypatch, "cuda", "bfloat16", 0.06, k, prompt=PROMPTS[0], max_tokens=8,
                          pooled=pooled)
