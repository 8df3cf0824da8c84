"""Sampling parameters and the sampler: logits of a batch in, one token per row out.

Order, as in HF and vLLM: penalties -> temperature -> top_k -> top_p -> min_p -> sample.
Penalties: `repetition_penalty` looks at prompt + output (HF/vLLM); `presence_penalty`
and `frequency_penalty` look at the output only (OpenAI/vLLM). The reported logprobs
come from the model's raw distribution, before any of these transforms."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

# generation_config.json keys that give sampling defaults (do_sample is handled apart).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Below this temperature, logits / T overflows fp32 long before it differs from argmax (as vLLM).
_GREEDY_TEMPERATURE = 1e-5
# A sampled row with a top_k drawn in one launch after its top-k (kernels/sample_draw.py) instead of ~20 PyTorch
# kernels (H100, benchmarks/sampling.py: 102 against 131 us of kernel time a token, 355 against 679 us of back-to-back
# calls, the same tokens), and every row's argmax and logsumexp in one launch (`row_stats`, session 37) instead of
# ~15; ROOFLINE_FUSED_SAMPLING=0 opts out. The devices it runs on (tests add "cpu", where Triton's interpreter runs it).
FUSED_SAMPLING = os.environ.get("ROOFLINE_FUSED_SAMPLING", "1") != "0"
FUSED_SAMPLING_DEVICES = ("cuda",)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None = until the context limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs wanted per token

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Whether sampling reads the token history (which then must be on the host before the step samples)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first field out of range; return self."""
        # Written as "ok" conditions so that NaN fails them.
        _require("temperature", self.temperature >= 0, ">= 0")
        _require("top_p", 0 < self.top_p <= 1, "in (0, 1]")
        _require("top_k", self.top_k >= -1, ">= -1 (0 or -1 disable it)")
        _require("min_p", 0 <= self.min_p <= 1, "in [0, 1]")
        _require("repetition_penalty", self.repetition_penalty > 0, "> 0")
        _require("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]")
        _require("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]")
        if self.max_tokens is not None:
            _require("max_tokens", self.max_tokens >= 1, ">= 1")
        if self.logprobs is not None:
            _require("logprobs", self.logprobs >= 0, ">= 0")
        return self

    @classmethod
    def from_generation_config(cls, source: str | Path | dict, **overrides) -> SamplingParams:
        """Defaults from a checkpoint's generation_config.json (a directory holding it, the
        file, or its dict), replaced by every override that is not None. An explicit
        `do_sample: false` means greedy; a missing do_sample leaves temperature as given."""
        config = source if isinstance(source, dict) else _read_generation_config(Path(source))
        defaults = {k: config[k] for k in _GENERATION_CONFIG_KEYS if config.get(k) is not None}
        if config.get("do_sample") is False:
            defaults["temperature"] = 0.0
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{**defaults, **given}).validate()


def _require(name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}")


def _read_generation_config(path: Path) -> dict:
    if path.is_dir():
        path = path / "generation_config.json"
        if not path.exists():
            return {}
    return json.loads(path.read_text(encoding="utf-8"))


def device_tensor(values, device, dtype=torch.long) -> torch.Tensor:
    """A small host list (row indices, per-row parameters) as a tensor on `device`, without draining its queue.
    A pageable host-to-device copy makes PyTorch wait for the stream to go idle (copy then cudaStreamSynchronize),
    so a decode step launched ahead, or the next MTP draft, would stall behind it; a pinned buffer copied with
    non_blocking is queued like a kernel (the caching host allocator keeps it until the copy is done)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: seeded for reproducible requests, random otherwise."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class TopLogprobs(NamedTuple):
    """Each row's requested top logprobs, still as tensors (on the device until the engine reads them)."""

    values: torch.Tensor | None  # [B, k_max] raw log-probabilities, None when no row asked
    ids: torch.Tensor | None  # [B, k_max]
    wanted: list[int | None]  # per row: how many of the k_max it asked for (None: no logprobs)

    def rows(self) -> list[list[tuple[int, float]] | None]:
        """Per row, its k (id, logprob) pairs, [] for logprobs=0, None without logprobs (reads the tensors)."""
        if self.values is None:
            return [None if k is None else [] for k in self.wanted]
        values, ids = self.values.tolist(), self.ids.tolist()
        return [None if k is None else list(zip(ids[row][:k], values[row][:k])) for row, k in enumerate(self.wanted)]


class SampleResult(NamedTuple):
    token_ids: torch.Tensor  # LongTensor [B]
    logprobs: torch.Tensor  # FloatTensor [B], raw log-probability of each chosen token
    top_logprobs: TopLogprobs


class Sampler:
    """Stateless; one call per decode step for the whole batch.

    token_histories[i] holds row i's prompt + generated ids and prompt_lens[i] the prompt's
    length within it (repetition_penalty reads all of it, presence/frequency only the rest);
    token_histories may be None when no row is penalised.
    """

    def probabilities(
        self,
        logits: torch.Tensor,
        params_list: list[SamplingParams],
        token_histories: list[list[int]],
        prompt_lens: list[int],
    ) -> torch.Tensor:
        """The distribution [B, V] (fp32) each row's token is drawn from, after penalties,
        temperature and filters; a greedy row is one-hot on its argmax (lowest index on ties).
        Speculative decoding's acceptance test needs exactly these."""
        scores = _apply_penalties(logits.float(), params_list, token_histories, prompt_lens)
        sampled_rows = [i for i, p in enumerate(params_list) if not p.greedy]
        if len(sampled_rows) == len(params_list):
            return _filtered_probs(scores, params_list)
        probs = torch.zeros_like(scores).scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
        if sampled_rows:
            rows = device_tensor(sampled_rows, scores.device)
            probs[rows] = _filtered_probs(scores[rows], [params_list[i] for i in sampled_rows])
        return probs

    def sample(
        self,
        logits: torch.Tensor,
        params_list: list[SamplingParams],
        token_histories: list[list[int]],
        prompt_lens: list[int],
        generators: list[torch.Generator | None],
    ) -> SampleResult:
        """Pick one token per row of `logits` [B, V] (any float dtype).

        generators[i] drives row i's randomness (None: torch's global generator; greedy
        rows draw nothing). Logprobs are of the raw, unmodified distribution."""
        logits32 = logits.float()
        scores = _apply_penalties(logits32, params_list, token_histories, prompt_lens)
        sampled_rows = [i for i, p in enumerate(params_list) if not p.greedy]
        stats = fused_row_stats(logits32)
        unpenalised_greedy = stats is not None and scores is logits32 and not sampled_rows
        if len(sampled_rows) == len(params_list):  # every row samples (one chat stream): no argmax, no row gather
            token_ids = _draw_filtered(scores, params_list, generators)
        elif unpenalised_greedy:
            token_ids = stats.ids
        else:
            # Greedy rows: the argmax itself (lowest index on ties, as `probabilities`' one-hot), with no [B, V]
            # one-hot or log-softmax written: this runs once per decoded token.
            token_ids = scores.argmax(dim=-1)
            if sampled_rows:
                rows = device_tensor(sampled_rows, scores.device)
                token_ids[rows] = _draw_filtered(scores[rows], [params_list[i] for i in sampled_rows],
                                                 [generators[i] for i in sampled_rows])

        log_z = torch.logsumexp(logits32, dim=-1, keepdim=True) if stats is None else stats.log_z
        if unpenalised_greedy:
            logprobs = stats.top_logprob
        else:
            logprobs = (logits32.gather(1, token_ids[:, None]) - log_z).squeeze(1)
        return SampleResult(token_ids, logprobs, top_logprob_tensors(logits32, log_z, params_list))


def fused_row_stats(logits32: torch.Tensor):
    """The raw fp32 logits' argmax and logsumexp per row in one launch (kernels/sample_draw.row_stats) where the fused
    sampling kernels run, else None (the caller runs PyTorch's)."""
    if not (FUSED_SAMPLING and logits32.device.type in FUSED_SAMPLING_DEVICES and logits32.stride(-1) == 1):
        return None
    from ..kernels.sample_draw import row_stats

    return row_stats(logits32)


def _apply_penalties(logits, params_list, token_histories, prompt_lens) -> torch.Tensor:
    if not any(p.penalised for p in params_list):  # token_histories may be None then
        return logits
    scores = logits.clone()
    vocab = scores.shape[-1]
    for row, p in enumerate(params_list):
        history = torch.tensor(token_histories[row], dtype=torch.long, device=scores.device)
        if p.repetition_penalty != 1:
            seen = history.unique()
            values = scores[row, seen]
            # HF/vLLM convention: shrink positive logits, push negative ones further down.
            scores[row, seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            counts = torch.bincount(history[prompt_lens[row]:], minlength=vocab)[:vocab]
            scores[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return scores


# Candidates taken past the rows' largest top_k: scores tied with a row's k-th beyond them are dropped (HF keeps every
# tie), which takes more than this many equal scores at the boundary.
TIE_CANDIDATES = 64


def _top_ks(params_list, vocab: int) -> list[int]:
    """Each row's top_k, the vocabulary where it has none (0 or -1)."""
    return [p.top_k if 0 < p.top_k < vocab else vocab for p in params_list]


def _candidates(top_k: list[int], vocab: int) -> int | None:
    """How many of each row's largest scores the filters need (largest top_k + TIE_CANDIDATES), or None where some
    row has no top_k (or the count reaches the vocabulary) and the filters read the whole vocabulary."""
    count = max(top_k) + TIE_CANDIDATES
    return count if count < vocab else None


def _filter(scores, params_list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top_k / top_p, then min_p: (scores, ids), -inf where a token is dropped. Where every row has
    a top_k (Qwen3.5 recommends 20), only the top largest_k + TIE_CANDIDATES scores are ordered (topk, on the raw
    scores: a positive temperature keeps their order) and what follows reads those C scores a row: (scores [B, C],
    their token ids); a sort of 248K scores a token was most of what a sampled 122B step cost over a greedy one.
    Else over the vocabulary: (scores [B, V], None)."""
    device, vocab = scores.device, scores.shape[-1]

    def per_row(values, dtype=torch.float32) -> torch.Tensor:
        return device_tensor(values, device, dtype)[:, None]

    temperature = per_row([p.temperature for p in params_list])
    top_k = _top_ks(params_list, vocab)
    top_p = [p.top_p for p in params_list]
    ids = None
    candidates = _candidates(top_k, vocab)
    if candidates is not None:
        values, ids = scores.topk(candidates, dim=-1)  # descending; the rest is masked below anyway
        ids = ids.flip(-1)
        scores = _top_k_top_p(values.flip(-1) / temperature, per_row(top_k, torch.long), per_row(top_p))
    else:
        scores = scores / temperature
        if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
            ordered, order = scores.sort(dim=-1)  # ascending
            kept = _top_k_top_p(ordered, per_row(top_k, torch.long), per_row(top_p))
            scores = torch.empty_like(scores).scatter_(1, order, kept)
    min_p = [p.min_p for p in params_list]
    if any(m > 0 for m in min_p):
        # p_i < min_p * p_max  <=>  s_i < s_max + log(min_p): no softmax needed (the max is always a candidate).
        log_min_p = per_row([math.log(m) if m > 0 else -math.inf for m in min_p])
        threshold = scores.max(dim=-1, keepdim=True).values + log_min_p
        scores = scores.masked_fill(scores < threshold, -math.inf)
    return scores, ids


def _filtered_probs(scores, params_list) -> torch.Tensor:
    """The filtered distribution over the whole vocabulary [B, V] (`probabilities`: speculative acceptance reads it)."""
    kept, ids = _filter(scores, params_list)
    probs = torch.softmax(kept, dim=-1)
    return probs if ids is None else torch.zeros_like(scores).scatter_(1, ids, probs)


def _draw_filtered(scores, params_list, generators) -> torch.Tensor:
    """One token per row from the filtered distribution. Over the candidates where the filters took them: the
    softmax, the division by the noise and the argmax then read C scores a row, not the vocabulary; on CUDA with
    FUSED_SAMPLING, the top-k and then one launch for the rest (kernels/sample_draw.py)."""
    top_k = _top_ks(params_list, scores.shape[-1])
    candidates = _candidates(top_k, scores.shape[-1])
    if candidates is not None and FUSED_SAMPLING and scores.device.type in FUSED_SAMPLING_DEVICES:
        from ..kernels.sample_draw import draw_candidates

        values, ids = scores.topk(candidates, dim=-1)
        packed = [[p.temperature, k, p.top_p, math.log(p.min_p) if p.min_p > 0 else -math.inf]
                  for p, k in zip(params_list, top_k)]
        noise = exponential_noise(len(params_list), scores.shape[-1], generators, scores.device)
        return draw_candidates(values, ids, noise, device_tensor(packed, scores.device, torch.float32))
    kept, ids = _filter(scores, params_list)
    probs = torch.softmax(kept, dim=-1)
    if ids is None:
        return draw(probs, generators)
    return ids.gather(1, draw(probs, generators, ids, scores.shape[-1])[:, None]).squeeze(1)


def draw(probs, generators, ids=None, vocab: int | None = None) -> torch.Tensor:
    """One index per row of `probs` [B, V], drawn with generators[i] (None: torch's global one), on the device.
    With `ids` [B, C]: probs are over those token ids of a `vocab`-token vocabulary and the index is into C; each row
    still draws one exponential per vocabulary token, so a seeded row draws the same token whether its batch was
    filtered over candidates or over the vocabulary."""
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i,
    # one batched argmax instead of a multinomial per row. The clamp keeps 0/0 out.
    noise = exponential_noise(probs.shape[0], probs.shape[1] if ids is None else vocab, generators, probs.device)
    if ids is not None:
        noise = noise.gather(1, ids)
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def exponential_noise(rows: int, vocab: int, generators, device) -> torch.Tensor:
    """[rows, vocab] fp32 Exp(1) noise, row i drawn with generators[i] (None: torch's global generator)."""
    noise = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return noise


def _top_k_top_p(ordered, top_k, top_p) -> torch.Tensor:
    """On scores in ascending order (a row's candidates or its whole vocabulary): mask all but the top_k (ties with
    the k-th kept, as HF), then all but the smallest set of the rest whose probability reaches top_p. top_k [B, 1]
    long, top_p [B, 1]."""
    kth_largest = ordered.gather(1, ordered.shape[-1] - top_k)
    ordered = ordered.masked_fill(ordered < kth_largest, -math.inf)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    outside_top_p = cumulative <= 1 - top_p
    outside_top_p[:, -1] = False  # always keep the most likely token
    return ordered.masked_fill(outside_top_p, -math.inf)


def top_logprob_tensors(logits, log_z, params_list) -> TopLogprobs:
    """Each row's requested top-k (ids, raw log-probabilities); log_z [B, 1] is the rows' logsumexp (the
    log-softmax's top-k is the logits' top-k less log_z), 0 where `logits` are log-probabilities already."""
    wanted = [p.logprobs for p in params_list]
    k_max = min(max((k for k in wanted if k), default=0), logits.shape[-1])
    if k_max == 0:
        return TopLogprobs(None, None, wanted)
    values, ids = logits.topk(k_max, dim=-1)
    return TopLogprobs(values - log_z, ids, wanted)


def top_logprobs(logits, log_z, params_list) -> list[list[tuple[int, float]] | None]:
    """`top_logprob_tensors` read at once, as (id, logprob) lists per row."""
    return top_logprob_tensors(logits, log_z, params_list).rows()
