"""MTP speculative decoding: identical greedy output, exact sampling distribution, exact rollback."""

import argparse
from collections import Counter

import pytest
import torch

from roofline.checkpoint import load_model
from roofline.commands.flags import parse_speculative_config
from roofline.engine.cache import SequenceCache
from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import DraftLengthChooser, SpeculativeConfig
from roofline.errors import UserError
from tiny_checkpoints import write_random_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [9, 8, 7], [100, 3, 4, 200, 201, 9, 9, 12, 40]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("spec") / "m", seed=31)


def engine_for(path, k=None, draft_vocab=None):
    model, _ = load_model(path, "cpu", torch.float32)
    return Engine(model, None, path, speculative=SpeculativeConfig(k, draft_vocab_size=draft_vocab) if k else None)


def run_all(engine, prompts, params):
    seqs = [engine.add(p, params) for p in prompts]
    steps = 0
    while engine.sequences:
        engine.step()
        steps += 1
    return [s.output_ids for s in seqs], steps


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_output_identical_with_speculation(checkpoint, k):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    want, plain_steps = run_all(engine_for(checkpoint), PROMPTS, params)
    engine = engine_for(checkpoint, k)
    got, spec_steps = run_all(engine, PROMPTS, params)  # batched: sequences accept different counts
    assert got == want
    single = [run_all(engine_for(checkpoint, k), [p], params)[0][0] for p in PROMPTS[:1]]
    assert single == want[:1]
    assert sum(engine.speculator.drafted) > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_draft_head_keeps_the_whole_history(checkpoint, k):
    """After every step the MTP head's cache holds a pair for every true position it has been shown, and the pending
    pairs cover the rest: together, one per position but the newest (whose token is not known yet); after a verify
    nothing is pending, since the head runs on the verified pairs before the step ends. Until 2026-12-04
    each draft step cut the head's cache back to where it began, dropping the pairs it had just been shown, so the
    head drafted from the last few tokens alone (bundled model, k=2: acceptance 0.905 / 0.78 against 1.00 / 0.99)."""
    engine = engine_for(checkpoint, k)
    seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in PROMPTS]
    steps = 0
    while engine.sequences:
        engine.step()
        steps += 1
        for seq in engine.sequences:
            shown, pending = seq.draft.cache.num_tokens, len(seq.draft.pending_tokens)
            assert shown + pending == len(seq.prompt_ids) + len(seq.output_ids) - 1, (steps, shown, pending)
            assert steps == 1 or shown >= len(seq.prompt_ids)
            # after a verify the head has run on its new pairs at once, holding its output for the next draft
            assert steps == 1 or (pending == 0 and seq.draft.head_logits is not None), (steps, pending)
    assert all(len(s.output_ids) == 20 for s in seqs)


def test_penalised_and_sampled_rows_beside_greedy_ones(checkpoint):
    """A batch mixing a penalised greedy row (drafts and verify read the drafts so far on the host), a sampled
    row and a plain greedy row: the greedy rows give exactly the tokens of plain decoding."""
    rows = [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
            SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=16),
            SamplingParams(temperature=0.0, max_tokens=16)]
    outputs = []
    for k in (None, 3):
        engine = engine_for(checkpoint, k)
        seqs = [engine.add(p, params) for p, params in zip(PROMPTS, rows)]
        while engine.sequences:
            engine.step()
        outputs.append([s.output_ids for s in seqs])
        assert all(len(s.output_ids) == 16 for s in seqs)
    plain, spec = outputs
    assert spec[0] == plain[0] and spec[2] == plain[2]
    assert plain[0] != run_all(engine_for(checkpoint), PROMPTS[:1], rows[2])[0][0], "the penalty changes the output"


def test_auto_draft_length_explores_then_keeps_identical_output(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want, _ = run_all(engine_for(checkpoint), PROMPTS, params)
    model, _ = load_model(checkpoint, "cpu", torch.float32)
    engine = Engine(model, None, checkpoint, speculative=SpeculativeConfig(4, auto=True))
    got, _ = run_all(engine, PROMPTS, params)
    assert got == want
    chooser = engine.speculator.chooser
    assert all(len(times) >= chooser.explore_steps for times in chooser.seconds.values()), "every k was tried"
    assert 1 <= engine.speculator.k <= 4


def test_draft_length_chooser_maximises_expected_tokens_per_second():
    chooser = DraftLengthChooser(4, explore_steps=1)
    for k, seconds in {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}.items():
        assert chooser.next_k([0.0] * 4) == k  # exploring in order
        chooser.record(k, seconds)
    # tokens per second: k=1 1.95, k=2 2.50, k=3 2.38, k=4 2.23
    assert chooser.next_k([0.95, 0.80, 0.10, 0.05]) == 2
    # cheaper long steps or better late acceptance move the choice
    assert chooser.best([0.95, 0.9, 0.9, 0.9]) == 4


def test_logprobs_equal_with_speculation(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = list(engine_for(checkpoint).generate(PROMPTS[0], params))
    spec = list(engine_for(checkpoint, 2).generate(PROMPTS[0], params))
    assert [e.token_id for e in spec] == [e.token_id for e in plain]
    assert [e.logprob for e in spec] == pytest.approx([e.logprob for e in plain], abs=1e-4)


def test_rollback_leaves_the_caches_of_never_seeing_rejected_tokens(checkpoint):
    model, _ = load_model(checkpoint, "cpu", torch.float32)
    prefix, extra = torch.tensor(PROMPTS[2][:5]), torch.tensor(PROMPTS[2][5:])
    clean = SequenceCache()
    model(prefix, [len(prefix)], [clean])
    model(extra[:2], [2], [clean])  # the two tokens that were "accepted"

    spec = SequenceCache()
    model(prefix, [len(prefix)], [spec])
    spec.record_steps = True
    model(extra, [len(extra)], [spec])  # verify 4 tokens, keep 2
    spec.truncate(len(prefix) + 2)
    spec.stop_recording()
    assert spec.num_tokens == clean.num_tokens
    for name in ("keys", "values", "conv", "recurrent"):
        a, b = getattr(spec, name), getattr(clean, name)
        assert a.keys() == b.keys()
        for layer in a:
            # equal up to fp32 rounding: the two runs multiply matrices of different row counts
            assert torch.allclose(a[layer], b[layer], rtol=1e-4, atol=1e-5), (name, layer)
    # and decoding on from both gives the same logits
    nxt = torch.tensor([11])
    assert torch.allclose(model.logits(model(nxt, [1], [spec])), model.logits(model(nxt, [1], [clean])), atol=1e-5)


def test_draft_vocabulary_keeps_greedy_output(checkpoint):
    """Drafting over the first 64 ids only (the test vocabulary has 256): exactly the same tokens, and the
    drafts never leave the subset (plus the always-draftable eos id)."""
    params = SamplingParams(temperature=0.0, max_tokens=20)
    want, _ = run_all(engine_for(checkpoint), PROMPTS, params)
    engine = engine_for(checkpoint, 2, draft_vocab=64)
    assert engine.speculator.draft_vocab.ids.tolist() == list(range(64)) + [255]
    drafted = []
    draft = engine.speculator.draft
    engine.speculator.draft = lambda *a: (lambda out: (drafted.extend(out[0].flatten().tolist()), out)[1])(draft(*a))
    got, _ = run_all(engine, PROMPTS, params)
    assert got == want
    assert drafted and set(drafted) <= set(range(64)) | {255}
    assert any(t >= 64 for o in want for t in o), "the output needs tokens outside the draft vocabulary"


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_sampling_distribution_is_preserved(checkpoint, draft_vocab):
    """First two sampled tokens' joint distribution: speculative vs plain sampling (chi-square); with a draft
    vocabulary the drafts' q is zero outside it, and the residual must still restore p exactly."""
    params = dict(temperature=1.0, top_k=3, max_tokens=2)
    n = 400
    counts = []
    for k in (None, 2):
        engine = engine_for(checkpoint, k, draft_vocab)
        c = Counter()
        for seed in range(n):
            c[tuple(run_all(engine, [PROMPTS[1]], SamplingParams(seed=seed, **params))[0][0])] += 1
        counts.append(c)
    plain, spec = counts
    keys = [key for key in plain if plain[key] >= 10]
    chi2 = sum((spec[key] - plain[key]) ** 2 / (spec[key] + plain[key]) for key in keys)
    assert len(keys) >= 3
    # two-sample chi-square with len(keys)-1 degrees of freedom; p < 0.001 bound
    assert chi2 < 10 + 4 * len(keys), (chi2, plain, spec)


def test_speculative_flags():
    def parse(**kw):
        return parse_speculative_config(argparse.Namespace(**{"mtp": None, "speculative_config": None, **kw}))

    with pytest.raises(UserError, match="straight quotes"):
        parse(speculative_config="{\u201cmethod\u201d:\u201cmtp\u201d,\u201cnum_speculative_tokens\u201d:2}")
    with pytest.raises(UserError, match="1 to 4"):
        parse(speculative_config='{"method":"mtp","num_speculative_tokens":9}')
    assert parse(speculative_config='{"method":"mtp","num_speculative_tokens":"auto"}') == SpeculativeConfig(4, auto=True)
    with pytest.raises(UserError, match="not both"):
        parse(mtp=2, speculative_config='{"method":"mtp"}')
    assert parse(speculative_config='{"method":"mtp","num_speculative_tokens":3}') == SpeculativeConfig(3)
    assert parse(mtp=2) == SpeculativeConfig(2)
    assert parse() is None
    assert parse(speculative_config='{"method":"mtp","num_speculative_tokens":2,"draft_vocab_size":32768}') == \
        SpeculativeConfig(2, draft_vocab_size=32768)
    with pytest.raises(UserError, match="draft_vocab_size must be a positive integer"):
        parse(speculative_config='{"method":"mtp","draft_vocab_size":0}')
    with pytest.raises(UserError, match="unknown key"):
        parse(speculative_config='{"method":"mtp","num_draft":2}')


def test_sequences_compare_by_identity(checkpoint):
    """Two requests with the same prompt are different sequences, and finding one in the engine's list must not
    compare prompts (with 32K-token prompts that took ms per step)."""
    class Uncomparable(list):
        def __eq__(self, other):
            raise AssertionError("a prompt was compared")

    engine = engine_for(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    a, b = engine.add(PROMPTS[0], params), engine.add(PROMPTS[0], params)
    a.prompt_ids, b.prompt_ids = Uncomparable(a.prompt_ids), Uncomparable(b.prompt_ids)
    assert a != b and engine.sequences.index(b) == 1
    engine.cancel(a)
    assert engine.sequences == [b]


def test_the_fused_argmax_and_logsumexp_keep_the_verify_outcome(checkpoint, monkeypatch):
    """A greedy verify takes its rows' argmax and logsumexp from kernels/sample_draw.row_stats where the fused sampling
    kernels run (Triton's interpreter here): the same tokens and logprobs as PyTorch's argmax and logsumexp, and the
    kernel really ran on the verify rows."""
    pytest.importorskip("triton")
    from roofline.engine import sampling
    from roofline.kernels import sample_draw

    rows_seen = []
    real = sample_draw.row_stats
    monkeypatch.setattr(sample_draw, "row_stats", lambda scores: rows_seen.append(scores.shape[0]) or real(scores))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = list(engine_for(checkpoint, 2).generate(PROMPTS[0], params))
    monkeypatch.setattr(sampling, "FUSED_SAMPLING_DEVICES", ("cpu",))
    fused = list(engine_for(checkpoint, 2).generate(PROMPTS[0], params))
    assert [e.token_id for e in fused] == [e.token_id for e in plain]
    assert [e.logprob for e in fused] == pytest.approx([e.logprob for e in plain], abs=1e-5)
    assert 3 in rows_seen  # a verify of two drafts: 3 rows
