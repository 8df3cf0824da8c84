"""Chunked prefill (engine.py): a step takes at most `max_num_batched_tokens` prompt tokens, so long prompts prefill
over several steps. The tokens, logprobs and seeded samples must be those of whole-prompt prefill; running sequences
keep decoding meanwhile; the MTP head is shown each chunk as it is prefilled."""

import os
import types

import pytest
import torch

from roofline.checkpoint import load_model
from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import SpeculativeConfig
from roofline.errors import UserError
from roofline.model.layers import GatedAttention
from tiny_checkpoints import write_random_checkpoint

PROMPTS = [list(range(3, 40)), [9, 8, 7], [100, 3, 4, 200, 201, 9, 9, 12, 40, 77, 5, 6, 31]]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("chunked") / "m", seed=13)


def engine_for(path, budget, k=None):
    model, _ = load_model(path, "cpu", torch.float32)
    return Engine(model, None, path, speculative=SpeculativeConfig(k) if k else None, max_num_batched_tokens=budget)


def run(engine, prompts, params):
    """All prompts added at once, stepped to the end: (outputs, logprobs, the step index of each first token)."""
    seqs = [engine.add(p, params) for p in prompts]
    logprobs, first = {s.request_id: [] for s in seqs}, {}
    steps = 0
    while engine.sequences:
        for seq, event in engine.step():
            logprobs[seq.request_id].append(event.logprob)
            first.setdefault(seq.request_id, steps)
        steps += 1
    return [s.output_ids for s in seqs], [logprobs[s.request_id] for s in seqs], [first[s.request_id] for s in seqs]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6),
                                    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=6)],
                         ids=["greedy", "seeded"])
def test_chunks_give_the_tokens_and_logprobs_of_whole_prompts(checkpoint, params):
    want, want_lp, want_first = run(engine_for(checkpoint, None), PROMPTS, params)
    assert want_first == [0, 0, 0], "without a budget every prompt prefills in the first step"
    for budget in (5, 16):
        got, got_lp, first = run(engine_for(checkpoint, budget), PROMPTS, params)
        assert got == want, f"budget {budget}"  # seeded: the chunks draw nothing from the sequences' generators
        for g, w in zip(got_lp, want_lp):
            assert g == pytest.approx(w, abs=1e-4)
        assert max(first) > 0, "some prompt needed more than one step"


def test_the_budget_is_shared_in_order_of_arrival(checkpoint):
    """Budget 6, prompts of 10 and 4 tokens: step 0 prefills 6 of the first; step 1 its last 4 (its first token)
    and 2 of the second; step 2 decodes the first and ends the second's prompt (its first token)."""
    engine = engine_for(checkpoint, 6)
    a = engine.add(list(range(10, 20)), SamplingParams(temperature=0.0, max_tokens=4))
    b = engine.add([7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=4))
    seen = []
    for _ in range(3):
        events = engine.step()
        seen.append(([e[0] is a for e in events].count(True), [e[0] is b for e in events].count(True),
                     a.cache.num_tokens, b.cache.num_tokens))
    assert seen == [(0, 0, 6, 0), (1, 0, 10, 2), (1, 1, 11, 4)]


def test_a_running_sequence_keeps_decoding_while_a_long_prompt_prefills(checkpoint):
    engine = engine_for(checkpoint, 8)
    running = engine.add([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    long = engine.add(list(range(30, 60)), SamplingParams(temperature=0.0, max_tokens=2))
    per_step = [[seq for seq, _ in engine.step()] for _ in range(4)]  # 30 prompt tokens: steps of 8, 8, 8, 6
    assert all(running in step for step in per_step), "a token for the running sequence every step"
    assert [long in step for step in per_step] == [False, False, False, True]


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_speculation_after_chunked_prefill_keeps_greedy_output(checkpoint, k):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want, _, _ = run(engine_for(checkpoint, None), PROMPTS, params)
    engine = engine_for(checkpoint, 5, k)
    got, _, _ = run(engine, PROMPTS, params)
    assert got == want and sum(engine.speculator.drafted) > 0
    # the head is shown each chunk as it is prefilled: no prompt's hidden states pile up until its first draft
    seq = engine.add(list(range(3, 20)), params)
    engine.step()
    assert seq.prefilling and seq.draft.pending_tokens == [] and seq.draft.cache.num_tokens == 5


def test_the_mtp_head_is_shown_each_prompt_position_with_the_token_after_it(checkpoint):
    """After a prompt prefilled in chunks of 5 and shown to the head chunk by chunk, the head's cache equals the one
    it gets from the whole prompt shown at once: the same (hidden, next token) pair at every position, across the
    chunks' seams too (random weights accept no drafts, so the output alone would not tell)."""
    heads = []
    for budget in (None, 5):
        engine = engine_for(checkpoint, budget, 2)
        seq = engine.add(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))
        while seq.prefilling or not seq.output_ids:
            engine.step()
        engine.speculator.catch_up([seq.draft])
        heads.append(seq.draft.cache)
    whole, chunked = heads
    assert whole.num_tokens == chunked.num_tokens == len(PROMPTS[0]) and whole.keys
    # fp32, but the chunks' matmuls have other row counts than the whole prompt's, and MKL (AVX-512) sums them in
    # another order: 2.6e-5 apart here; neighbouring positions of this cache differ by at least 2.5
    for layer in whole.keys:
        torch.testing.assert_close(chunked.keys[layer], whole.keys[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked.values[layer], whole.values[layer], rtol=1e-4, atol=1e-4)


def test_a_budget_below_one_is_refused_by_name(checkpoint):
    with pytest.raises(UserError, match="--max-num-batched-tokens must be at least 1, got 0"):
        engine_for(checkpoint, 0)


@pytest.mark.skipif(not INTERPRET, reason="the pooled step's kernels in Triton's interpreter (no CUDA)")
@pytest.mark.parametrize("k", [None, 2])
def test_pooled_decode_after_chunked_prefill_gives_the_reference_tokens(checkpoint, k):
    """Prompt chunks prefill eagerly into the pool's slots (the MTP head's too), decode runs the pooled step (async
    scheduling on without MTP; verify steps with it)."""
    pytest.importorskip("triton")
    params = SamplingParams(temperature=0.0, max_tokens=5)
    want, _, _ = run(engine_for(checkpoint, None), PROMPTS, params)
    pooled = Engine.from_pretrained(str(checkpoint), device="cpu", dtype="float32", cuda_graphs=True, max_num_seqs=4,
                                    max_num_batched_tokens=7, speculative=SpeculativeConfig(k) if k else None)
    got, _, first = run(pooled, PROMPTS, params)
    assert got == want and max(first) > 0
    assert pooled.steps_launched_ahead > 0 if k is None else sum(pooled.speculator.drafted) > 0


def masked_attention(q, keys, values, scale):
    """The formula, with the mask written out: query i at position T - t + i sees keys 0..T - t + i."""
    t, big_t = q.shape[0], keys.shape[0]
    mask = torch.arange(big_t)[None, :] <= torch.arange(big_t - t, big_t)[:, None]
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    return torch.einsum("hts,shd->thd", scores.masked_fill(~mask.to(q.device), float("-inf")).softmax(-1), v)


def test_attention_over_a_cached_prefix_is_causal_from_the_newest_positions():
    layer = types.SimpleNamespace(head_dim=16)
    q, keys, values = torch.randn(5, 8, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    torch.testing.assert_close(GatedAttention.attend(layer, q, keys, values), masked_attention(q, keys, values, 0.25))


@pytest.mark.gpu
def test_attention_over_a_cached_prefix_at_the_122b_shape_gpu():
    """bf16, 32 query / 2 KV heads of 256 dims: a 512-token chunk after 3000 cached tokens (SDPA's flash kernel with
    the lower-right causal bias), a whole 700-token prompt, and the memory of an 8K chunk after 24K tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer = types.SimpleNamespace(head_dim=256)
    for t, big_t in ((512, 3512), (700, 700)):
        q = torch.randn(t, 32, 256, device="cuda", dtype=torch.bfloat16)
        keys, values = (torch.randn(big_t, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        got = GatedAttention.attend(layer, q, keys, values)
        torch.testing.assert_close(got.float(), masked_attention(q, keys, values, 256**-0.5), rtol=2e-2, atol=2e-2)
    # an 8K chunk over 32K tokens (the 122B's prefill at its default --max-num-batched-tokens): SDPA's fallback
    # kernel would materialise [32, 8192, 32768] fp32 scores, 32 GiB, and ran out of memory on an H200
    q = torch.randn(8192, 32, 256, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(32768, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = GatedAttention.attend(layer, q, keys, values)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert extra < 2 << 30, f"attention over the prefix took {extra / 2**30:.1f} GiB beyond its inputs"
