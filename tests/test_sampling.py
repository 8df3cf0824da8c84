import json
import math

import pytest
import torch

from roofline.engine.sampling import Sampler, SamplingParams, make_generator

sampler = Sampler()
# Probabilities 0.4, 0.3, 0.15, 0.1, 0.05 for tokens 0..4.
FIVE_PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
FIVE_LOGITS = FIVE_PROBS.log()[None]


def probabilities(logits, params, history=(), prompt_len=0):
    return sampler.probabilities(logits, [params], [list(history)], [prompt_len])[0]


def sample(logits, params_list, generators, histories=None, prompt_lens=None):
    rows = len(params_list)
    return sampler.sample(
        logits, params_list, histories or [[]] * rows, prompt_lens or [0] * rows, generators
    )


def renormalised(kept):
    expected = torch.zeros(5)
    expected[kept] = FIVE_PROBS[kept] / FIVE_PROBS[kept].sum()
    return expected


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.randn(4, 50)
    logits[3, [7, 30]] = 100.0
    result = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert result.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert result.token_ids[3] == 7


def test_top_k_1_equals_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    generators = [make_generator(i) for i in range(8)]
    top1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, generators)
    greedy = sample(logits, [SamplingParams(temperature=0)] * 8, [None] * 8)
    assert torch.equal(top1.token_ids, greedy.token_ids)


def test_seeded_runs_are_reproducible():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=0.9)]

    def run(seed):
        generator = make_generator(seed)
        return [sample(row[None], params, [generator]).token_ids.item() for row in logits]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_rows_are_independent_of_their_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2),
    ]
    batched = sample(logits, params, [make_generator(p.seed) for p in params])
    for row, p in enumerate(params):
        alone = sample(logits[row:row + 1], [p], [make_generator(p.seed)])
        assert alone.token_ids.item() == batched.token_ids[row].item()


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_k=4), [0, 1, 2, 3]),
        (SamplingParams(top_k=-1), [0, 1, 2, 3, 4]),
        (SamplingParams(top_k=99), [0, 1, 2, 3, 4]),
        (SamplingParams(top_p=0.65), [0, 1]),  # 0.4 + 0.3 reaches 0.65
        (SamplingParams(top_p=0.75), [0, 1, 2]),
        (SamplingParams(top_p=0.3), [0]),
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # keep p >= 0.3 * 0.4 = 0.12
        (SamplingParams(min_p=0.5), [0, 1]),
        # top_p acts on what top_k left, renormalised: 0.4/0.85 + 0.3/0.85 reaches 0.8 ...
        (SamplingParams(top_k=3, top_p=0.8), [0, 1]),
        # ... while on its own it needs three tokens.
        (SamplingParams(top_p=0.8), [0, 1, 2]),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(params, kept):
    probs = probabilities(FIVE_LOGITS, params)
    torch.testing.assert_close(probs, renormalised(kept))


def test_top_k_keeps_ties_with_the_kth_score():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert probabilities(logits, SamplingParams(top_k=1)).nonzero().flatten().tolist() == [1, 2]
    assert probabilities(logits, SamplingParams(top_k=3)).nonzero().flatten().tolist() == [1, 2, 3]


def test_top_k_over_candidates_equals_the_sort_of_the_whole_vocabulary(monkeypatch):
    """Where every row has a top_k, the filters order only the top largest_k + TIE_CANDIDATES scores (topk) instead
    of sorting the vocabulary: the same kept scores, as the sort leaves them, for rows of different top_k / top_p /
    temperature, and with ties at the k-th score (kept, as HF keeps them) within the candidates."""
    from roofline.engine import sampling

    torch.manual_seed(0)
    scores = torch.randn(4, 3000) * 3
    scores[3, 100:110] = scores[3].max() + 1  # ten ties at the top: top_k 5 keeps all ten
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.8), SamplingParams(top_k=5),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01), SamplingParams(top_k=5)]
    kept, ids = sampling._filter(scores, params)
    assert ids.shape == (4, 50 + sampling.TIE_CANDIDATES) and 50 + sampling.TIE_CANDIDATES < scores.shape[-1]
    fast = torch.full_like(scores, -math.inf).scatter_(1, ids, kept)  # what the candidates keep, in the vocabulary
    monkeypatch.setattr(sampling, "TIE_CANDIDATES", scores.shape[-1])  # no candidates: the whole vocabulary sorted
    whole, no_ids = sampling._filter(scores, params)
    assert no_ids is None and torch.equal(fast, whole)
    assert torch.isfinite(fast[3]).nonzero().flatten().tolist() == list(range(100, 110))
    count = [int(torch.isfinite(row).sum()) for row in fast]
    assert count[1] == 5 and 1 <= count[0] < 20 and 1 <= count[2] < 50  # top_p (and min_p) cut rows 0 and 2 further


def test_drawing_among_candidates_draws_what_the_whole_vocabulary_draws():
    """A row with a top_k draws among its candidates (softmax, noise and argmax over C scores), the token the draw over
    the whole vocabulary gives with the same generator state: each row still draws one exponential per vocabulary
    token. So a seeded row's token does not depend on whether its batch-mates let the filters take candidates."""
    from roofline.engine.sampling import _filtered_probs, draw

    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(temperature=1.0, top_k=40, min_p=0.05)]
    for seed in range(20):
        among = sample(logits, params, [make_generator(seed), make_generator(seed + 100)]).token_ids
        whole = draw(_filtered_probs(logits, params), [make_generator(seed), make_generator(seed + 100)])
        assert torch.equal(among, whole)
    probs = _filtered_probs(logits, params)  # the full distribution (speculative acceptance) keeps at most top_k each
    kept = [int((row > 0).sum()) for row in probs]
    assert 1 <= kept[0] <= 20 and 1 <= kept[1] <= 40 and torch.allclose(probs.sum(-1), torch.ones(2))


def test_the_fused_draw_draws_what_the_pytorch_filters_draw(monkeypatch):
    """kernels/sample_draw.py (ROOFLINE_FUSED_SAMPLING, Triton's interpreter here) against the PyTorch filters and
    draw with the same generator states: the same token for rows of every filter (temperature, top_k with ties at
    the k-th score, top_p, min_p), 40 seeds each. A mutated filter (top_p ignored) fails it."""
    pytest.importorskip("triton")
    from roofline.engine import sampling

    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(7)) * 2
    logits[3, 200:206] = logits[3].max() + 0.5  # six ties at the top: top_k 3 keeps all six
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(temperature=1.0, top_k=40, min_p=0.05),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.7, min_p=0.01), SamplingParams(temperature=0.8, top_k=3)]

    def tokens(fused, seeds):
        monkeypatch.setattr(sampling, "FUSED_SAMPLING", fused)
        monkeypatch.setattr(sampling, "FUSED_SAMPLING_DEVICES", ("cpu",))
        return sample(logits, params, [make_generator(s) for s in seeds]).token_ids.tolist()

    draws = [tokens(True, range(seed, seed + 4)) for seed in range(0, 160, 4)]
    assert draws == [tokens(False, range(seed, seed + 4)) for seed in range(0, 160, 4)]
    assert {row[3] for row in draws} <= set(range(200, 206)) and len({row[3] for row in draws}) > 1
    assert all(len({row[i] for row in draws}) > 1 for i in range(3))  # each row really samples


def test_temperature_scales_before_the_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    # Ratios to the top: exp(-1/T) and exp(-2/T), against min_p = 0.3.
    cold = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.3))
    hot = probabilities(logits, SamplingParams(temperature=2.0, min_p=0.3))
    torch.testing.assert_close(cold, torch.softmax(torch.tensor([2.0, 1.0, -math.inf]), 0))
    torch.testing.assert_close(hot, torch.softmax(logits[0] / 2, 0))


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt, output = [0, 1], [3, 3, 1]
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    probs = probabilities(logits, params, prompt + output, prompt_len=len(prompt))
    expected = torch.tensor([
        2.0 / 2,  # in the prompt only: repetition penalty alone
        -1.0 * 2 - 0.25 * 1 - 0.5,  # negative: multiplied; once in the output
        0.5,  # never seen
        3.0 / 2 - 0.25 * 2 - 0.5,  # twice in the output
        -2.0,
    ])
    torch.testing.assert_close(probs, torch.softmax(expected, 0))


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(logits, [params], [None], [[0]], [1]).token_ids.item() == 1


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    histories = [[1, 2, 3]] * 3
    result = sample(logits, params, [make_generator(9)] * 3, histories, [1] * 3)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert result.token_ids.dtype == torch.long and result.logprobs.dtype == torch.float32
    torch.testing.assert_close(result.logprobs, raw.gather(1, result.token_ids[:, None])[:, 0])
    top_values, top_ids = raw[0].topk(3)
    top = result.top_logprobs.rows()
    assert [token for token, _ in top[0]] == top_ids.tolist()
    assert [value for _, value in top[0]] == pytest.approx(top_values.tolist())
    assert top[1] == [] and top[2] is None


def test_temperature_sampling_matches_softmax():
    """Chi-square goodness of fit over 20,000 draws from a 5-token vocabulary."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    temperature, draws = 0.7, 20_000
    generator = make_generator(2024)
    result = sample(
        logits.expand(draws, 5), [SamplingParams(temperature=temperature)] * draws,
        [generator] * draws,
    )
    observed = torch.bincount(result.token_ids, minlength=5).float()

    def chi_square(probs):
        expected = probs * draws
        return ((observed - expected) ** 2 / expected).sum().item()

    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001 under the right distribution.
    assert chi_square(torch.softmax(logits / temperature, 0)) < 18.47
    # The test can tell temperature 0.7 from temperature 1.
    assert chi_square(torch.softmax(logits, 0)) > 100


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5),
        ("top_k", -2), ("min_p", 1.1), ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("max_tokens", 0),
        ("logprobs", -1),
    ],
)
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value}).validate()


def test_defaults_are_valid():
    assert SamplingParams().validate() == SamplingParams()


def test_generation_config_defaults_and_overrides(tmp_path):
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "repetition_penalty": 1.05, "eos_token_id": [1, 2]}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    for source in (tmp_path, tmp_path / "generation_config.json", config):
        params = SamplingParams.from_generation_config(source)
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
            0.6, 0.95, 20, 1.05
        )
    params = SamplingParams.from_generation_config(config, top_p=0.5, temperature=None, seed=7)
    assert (params.temperature, params.top_p, params.seed) == (0.6, 0.5, 7)


def test_generation_config_greedy_and_missing(tmp_path):
    greedy = {"do_sample": False, "temperature": 0.6}
    assert SamplingParams.from_generation_config(greedy).greedy
    assert SamplingParams.from_generation_config(greedy, temperature=0.7).temperature == 0.7
    assert SamplingParams.from_generation_config({"temperature": 0.6}).temperature == 0.6
    assert SamplingParams.from_generation_config(tmp_path) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0})


def test_a_batch_of_sampled_rows_draws_as_each_row_alone():
    """Every row sampled (no row gather) or mixed with a greedy row: each seeded row draws what it draws alone."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.7, top_k=10, seed=s) for s in (1, 2, 3)]
    together = sample(logits, params, [make_generator(p.seed) for p in params]).token_ids.tolist()
    alone = [sample(logits[i : i + 1], [p], [make_generator(p.seed)]).token_ids.item() for i, p in enumerate(params)]
    mixed = [SamplingParams(temperature=0.0), *params[1:]]
    assert together == alone
    assert sample(logits, mixed, [None, *(make_generator(p.seed) for p in params[1:])]).token_ids.tolist()[1:] == alone[1:]


@pytest.mark.gpu
def test_sampling_does_not_drain_the_device_queue_gpu():
    """The step launched ahead samples on the device: no host-to-device copy of row indices or per-row parameters
    may wait for the stream (PyTorch's sync debug mode raises on any synchronising call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(3, 248320, device="cuda")
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1, logprobs=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, min_p=0.05, seed=2)]
    generators = [make_generator(p.seed, "cuda") if not p.greedy else None for p in params]
    sampler.sample(logits, params, None, [0] * 3, generators)  # warm-up: the pinned host allocator's first blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.sample(logits, params, None, [0] * 3, generators)
        sampler.sample(logits[:1], params[:1], None, [0], generators[:1])  # one sampled stream: no row gather
        sampler.probabilities(logits, params, None, [0] * 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_the_fused_draw_on_the_gpu(monkeypatch):
    """The fused draw at the 122B's vocabulary on the GPU: the PyTorch filters' tokens for Qwen3.5's sampling defaults
    and min_p over 32 seeds, and no call that waits for the device queue."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from roofline.engine import sampling

    logits = torch.randn(3, 248320, device="cuda") * 3
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=40, min_p=0.05)]

    def tokens(fused):
        monkeypatch.setattr(sampling, "FUSED_SAMPLING", fused)
        return [sample(logits, params, [make_generator(seed + i, "cuda") for i in range(3)]).token_ids.tolist()
                for seed in range(0, 96, 3)]

    assert tokens(False) == tokens(True)  # the fused draw stays on for the check below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, [make_generator(i, "cuda") for i in range(3)])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_row_stats_is_the_rows_argmax_and_logsumexp():
    """kernels/sample_draw.row_stats (Triton's interpreter here, 64-score chunks): each row's argmax with the lowest
    index on ties, also between chunks, its logsumexp and the argmax's log-probability, on a row-sliced view, on a
    vocabulary that is no multiple of the chunk, and on a row of -inf but two scores."""
    pytest.importorskip("triton")
    from roofline.kernels.sample_draw import row_stats

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3)) * 3
    x[1, [200, 10, 70]] = x[1].max() + 1  # ties in three chunks: 10 wins
    x[2, [130, 129]] = x[2].max() + 1  # ties inside one chunk: 129 wins
    x[3] = -math.inf
    x[3, [777, 5]] = 1.5
    x[4, 999] = x[4].max() + 2  # the last, partial chunk
    view = x[1:]  # rows 1000 apart, not the first row of the storage
    stats = row_stats(view)
    assert stats.ids.tolist() == view.argmax(-1).tolist() == [10, 129, 5, 999]
    torch.testing.assert_close(stats.log_z, torch.logsumexp(view, -1, keepdim=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.top_logprob, view.max(-1).values - torch.logsumexp(view, -1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp32 scores"):
        row_stats(x.half())


@pytest.mark.parametrize("rows", ["greedy", "mixed", "penalised"])
def test_the_fused_argmax_and_logsumexp_give_the_pytorch_tokens_and_logprobs(monkeypatch, rows):
    """The sampler with ROOFLINE_FUSED_SAMPLING (row_stats and the fused draw, Triton's interpreter here) against
    PyTorch's: the same tokens, and the same logprobs and top logprobs within fp32 rounding, for greedy rows, greedy
    rows beside sampled ones, and penalised greedy rows (argmax over the penalised scores, logprobs of the raw ones)."""
    pytest.importorskip("triton")
    from roofline.engine import sampling

    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(11)) * 2
    logits[0, [2000, 40]] = logits[0].max() + 1  # a tie: 40
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    params = {"greedy": [greedy] * 3,
              "mixed": [greedy, SamplingParams(temperature=0.7, top_k=20, logprobs=2), greedy],
              "penalised": [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=1)] * 3}[rows]
    histories = [[40, 7], [int(logits[1].argmax()), 3], [9]] if rows == "penalised" else None

    def result(fused):
        monkeypatch.setattr(sampling, "FUSED_SAMPLING", fused)
        monkeypatch.setattr(sampling, "FUSED_SAMPLING_DEVICES", ("cpu",))
        r = sample(logits, params, [make_generator(1)] * 3, histories, [1, 1, 1] if histories else None)
        return r.token_ids.tolist(), r.logprobs, r.top_logprobs.values, r.top_logprobs.ids

    ids, logprobs, top_values, top_ids = result(True)
    want_ids, want_logprobs, want_top_values, want_top_ids = result(False)
    assert ids == want_ids
    if rows == "greedy":
        assert ids[0] == 40
    if rows == "penalised":  # the penalty moved row 1 off its raw argmax
        assert ids[1] != int(logits[1].argmax())
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(top_values, want_top_values, rtol=1e-6, atol=1e-6)
    assert torch.equal(top_ids, want_top_ids)


@pytest.mark.gpu
def test_row_stats_on_the_gpu():
    """row_stats at the 122B's vocabulary (4096-score chunks): torch's argmax (ties across chunks) and logsumexp."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from roofline.kernels.sample_draw import row_stats

    x = torch.randn(4, 248320, device="cuda") * 3
    x[1, [200000, 9000, 5000]] = x[1].max() + 1
    x[3, -1] = x[3].max() + 1
    stats = row_stats(x)
    assert stats.ids.tolist() == x.argmax(-1).tolist() and stats.ids[1] == 5000
    torch.testing.assert_close(stats.log_z, torch.logsumexp(x, -1, keepdim=True), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(stats.top_logprob, x.max(-1).values - torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)
