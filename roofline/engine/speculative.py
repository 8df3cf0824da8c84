"""MTP speculative decoding: the model's own multi-token-prediction head drafts k tokens, the
main model verifies them in one step, and only tokens the main model would have produced
are kept.

Per sequence, between steps, the head keeps "pending pairs": the main model's post-norm
hidden states of the newest positions and the tokens that follow them. A step:

1. Draft: the head runs on the pending pairs (its cache now holds only true history) and
   drafts d1 from the last one; for d2..dk it is fed its own post-norm output and draft.
2. Verify: the main model runs [last token, d1..dk] in one forward, remembering its GDN
   state after each position.
3. Accept: greedy keeps the longest prefix of drafts equal to the main model's argmax;
   sampling accepts d_j with probability min(1, p/q) and otherwise resamples from the
   normalised positive part of p - q, which leaves the output distribution exactly p
   (Leviathan et al., Chen et al. 2023). One more token (the bonus) always comes from p.
4. Roll back both caches to the accepted tokens; the verified hidden states become the
   head's next pending pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .cache import SequenceCache
from .sampling import Sampler, top_logprobs

MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp", "deepseek_mtp")  # names vLLM accepts for this


MAX_DRAFT_TOKENS = 4


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 2  # with `auto`, the most drafts the chooser may use
    auto: bool = False  # choose k from measured acceptance and step time
    draft_vocab_size: int | None = None  # draft over the first N token ids (+ special tokens) only


class DraftVocabulary:
    """Drafts over part of the vocabulary, so a draft step reads a fraction of the LM head (on the 122B the
    head is most of a draft's bytes): the head's first `size` rows (byte-level BPE ids grow roughly with
    rarity) and every special token. Verification is unchanged, so the output is exactly what it is
    without this; only acceptance can drop, where the right token lies outside the subset."""

    def __init__(self, model, size: int, keep_ids=()):
        from ..kernels.dispatch import install_weight_kernel

        self.vocab = model.config.vocab_size
        ids = sorted(set(range(min(size, self.vocab))) | {i for i in keep_ids if 0 <= i < self.vocab})
        self.ids = torch.tensor(ids, device=model.device)
        self.head = model.lm_head.take_rows(self.ids)
        if "forward" in vars(model.lm_head):  # the fast path gave the full head a kernel: the subset gets one too
            install_weight_kernel(self.head)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 logits: the subset's, -inf elsewhere (so sampling and penalties see the full vocabulary)."""
        out = torch.full((hidden.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=hidden.device)
        out[:, self.ids] = self.head(hidden).float()
        return out


class DraftLengthChooser:
    """`num_speculative_tokens: "auto"`: pick k maximising expected tokens per second.

    Expected tokens of a step with k drafts is 1 + r_1 + ... + r_k, where r_j is the measured
    rate at which draft position j is accepted (all earlier drafts accepted too); its cost is
    the measured wall time of a draft + verify step with k drafts. Every k is tried
    `explore_steps` times first, and again every `refresh_steps` steps, since acceptance
    drifts with the text and step time with the batch.
    """

    def __init__(self, k_max: int, explore_steps: int = 4, refresh_steps: int = 256):
        self.k_max, self.explore_steps, self.refresh_steps = k_max, explore_steps, refresh_steps
        self.seconds: dict[int, list[float]] = {k: [] for k in range(1, k_max + 1)}
        self.steps = 0

    def next_k(self, acceptance: list[float]) -> int:
        if self.steps % self.refresh_steps == 0 and self.steps:
            self.seconds = {k: times[-1:] for k, times in self.seconds.items()}
        for k, times in self.seconds.items():
            if len(times) < self.explore_steps:
                return k
        return self.best(acceptance)

    def best(self, acceptance: list[float]) -> int:
        def rate(k: int) -> float:
            times = sorted(self.seconds[k])
            return (1 + sum(acceptance[:k])) / times[len(times) // 2]

        return max(self.seconds, key=rate)

    def record(self, k: int, seconds: float) -> None:
        self.steps += 1
        self.seconds[k] = (self.seconds[k] + [seconds])[-16:]


@dataclass
class DraftState:
    """The MTP head's per-sequence state between steps."""

    cache: SequenceCache = field(default_factory=SequenceCache)
    pending_hidden: torch.Tensor | None = None  # [n, H] main-model hidden states not yet shown to the head
    pending_tokens: list[int] = field(default_factory=list)  # the token following each of them


@dataclass
class Verified:
    tokens: list[int]  # accepted drafts, then the bonus token
    logprobs: list[float]  # raw log-probabilities under the main model
    top: list  # top logprobs per token (None where not asked)
    drafted: int  # drafts proposed
    accepted: int  # drafts accepted


class MtpSpeculator:
    def __init__(self, model, sampler: Sampler, config: SpeculativeConfig, keep_ids=()):
        if model.mtp is None:
            raise UserError("speculative decoding needs the checkpoint's MTP head (mtp.* tensors), and this checkpoint has none")
        self.model, self.sampler = model, sampler
        self.draft_vocab = DraftVocabulary(model, config.draft_vocab_size, keep_ids) if config.draft_vocab_size else None
        self.draft_logits = self.draft_vocab.logits if self.draft_vocab else model.logits
        self.graphs = self.draft_graphs = None  # the engine's DecodeGraphs (main model, MTP head) when pooled
        self.k_max = config.num_speculative_tokens
        self.k = self.k_max  # drafts in the current step (varies only with `auto`)
        self.chooser = DraftLengthChooser(self.k_max) if config.auto else None
        # acceptance statistics by draft position, for /metrics, benchmarks and the chooser
        self.drafted = [0] * self.k_max
        self.accepted = [0] * self.k_max

    def extend(self, state: DraftState, hidden: torch.Tensor, input_ids: list[int], next_token: int) -> None:
        """After a plain forward over `input_ids`: pair each position's hidden state with the token after it."""
        tokens = input_ids[1:] + [next_token]
        if state.pending_hidden is None or not state.pending_tokens:
            state.pending_hidden, state.pending_tokens = hidden, tokens
        else:
            state.pending_hidden = torch.cat([state.pending_hidden, hidden])
            state.pending_tokens = state.pending_tokens + tokens

    def begin_step(self) -> None:
        if self.chooser:
            self.k = self.chooser.next_k(self.acceptance_rates())

    def end_step(self, seconds: float) -> None:
        if self.chooser:
            self.chooser.record(self.k, seconds)

    def _head(self, tokens: list[list[int]], hidden: list[torch.Tensor], caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over each sequence's (token, hidden) pairs, advancing its cache by them; returns the
        post-norm hidden state and the logits of each sequence's last pair."""
        model = self.model
        m = max(len(t) for t in tokens)
        if self.draft_graphs and m <= MAX_DRAFT_TOKENS + 1:  # right-padded to m pairs: their extra keys are never seen
            pad = [m - len(t) for t in tokens]
            ids = [x for t, p in zip(tokens, pad) for x in t + [0] * p]
            rows = torch.cat([torch.cat([h, h.new_zeros(p, h.shape[1])]) for h, p in zip(hidden, pad)])
            buf = self.draft_graphs.run(ids, caches, m, hidden=rows)
            last = torch.tensor([i * m + len(t) - 1 for i, t in enumerate(tokens)], device=model.device)
            for cache, t in zip(caches, tokens):
                cache.advance(len(t))
            return buf.hidden[last], buf.logits[last]
        out = model.mtp_forward(torch.tensor([x for t in tokens for x in t], device=model.device), torch.cat(hidden),
                                [len(t) for t in tokens], caches)
        out = out[torch.tensor([len(t) for t in tokens], device=model.device).cumsum(0) - 1]
        return out, self.draft_logits(out)

    def draft(self, states: list[DraftState], params, histories, prompt_lens, generators):
        """k draft tokens and their draft distributions q per sequence."""
        caches = [s.cache for s in states]
        hidden, logits = self._head([s.pending_tokens for s in states], [s.pending_hidden for s in states], caches)
        true_lengths = [c.num_tokens for c in caches]  # the pending pairs are true history: they stay
        drafts: list[list[int]] = [[] for _ in states]
        qs: list[list[torch.Tensor]] = [[] for _ in states]
        for j in range(self.k):
            if j:
                hidden, logits = self._head([[d[-1]] for d in drafts], list(hidden[:, None]), caches)
            q = self.sampler.probabilities(logits, params, [h + d for h, d in zip(histories, drafts)], prompt_lens)
            for i, p in enumerate(params):
                token = int(q[i].argmax()) if p.greedy else int(torch.multinomial(q[i], 1, generator=generators[i]))
                drafts[i].append(token)
                qs[i].append(q[i])
        for cache, length in zip(caches, true_lengths):
            cache.truncate(length)  # drafts beyond the first are not true history
        return drafts, qs

    def _verify_forward(self, caches, inputs: list[list[int]]):
        """The main model over each sequence's [last token, drafts]: (hidden, logits, keep) where
        keep(i, n) leaves cache i holding exactly the first n of its step's tokens."""
        model, m = self.model, self.k + 1
        ids = [t for x in inputs for t in x]
        if self.graphs:
            buf = self.graphs.run(ids, caches, m, rollback=True)  # GDN state saved after each position
            rows = len(ids)
            return buf.hidden[:rows], buf.logits[:rows], lambda i, n: self.graphs.keep(buf, i, caches[i], m, n)
        for cache in caches:
            cache.record_steps = True  # GDN state after every position, for the rollback below
        hidden = model(torch.tensor(ids, device=model.device), [len(x) for x in inputs], caches)

        def keep(i: int, n: int) -> None:
            caches[i].truncate(caches[i].step_start + n)
            caches[i].stop_recording()

        return hidden, model.logits(hidden), keep

    def verify(self, caches, last_tokens, drafts, qs, states, params, histories, prompt_lens, generators) -> list[Verified]:
        inputs = [[t, *d] for t, d in zip(last_tokens, drafts)]
        hidden, logits, keep = self._verify_forward(caches, inputs)
        raw = torch.log_softmax(logits, dim=-1)
        results = []
        for i, (p_params, draft) in enumerate(zip(params, drafts)):
            rows = slice(i * (self.k + 1), (i + 1) * (self.k + 1))
            row_histories = [histories[i] + draft[:j] for j in range(self.k + 1)]
            p = self.sampler.probabilities(logits[rows], [p_params] * (self.k + 1), row_histories, [prompt_lens[i]] * (self.k + 1))
            tokens = self._accept(p, qs[i], draft, p_params, generators[i])
            accepted = len(tokens) - 1
            for j in range(self.k):
                self.drafted[j] += 1
                self.accepted[j] += int(j < accepted)
            positions = [i * (self.k + 1) + j for j in range(len(tokens))]
            top = top_logprobs(raw[positions], 0.0, [p_params] * len(tokens))  # raw: log-probabilities already
            results.append(Verified(tokens, [float(raw[r, t]) for r, t in zip(positions, tokens)], top, self.k, accepted))
            keep(i, 1 + accepted)  # the last token and the accepted drafts; the bonus token is pending
            states[i].pending_hidden = hidden[positions]
            states[i].pending_tokens = list(tokens)
        return results

    def _accept(self, p: torch.Tensor, q: list[torch.Tensor], draft: list[int], params, generator) -> list[int]:
        tokens = []
        for j, d in enumerate(draft):
            if params.greedy:
                ok = int(p[j].argmax()) == d
            else:
                ok = float(torch.rand((), generator=generator, device=p.device)) * float(q[j][d]) <= float(p[j][d])
            if not ok:
                if params.greedy:
                    return tokens + [int(p[j].argmax())]
                residual = (p[j] - q[j]).clamp_min(0)
                residual = residual if float(residual.sum()) > 0 else p[j]
                return tokens + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
            tokens.append(d)
        bonus = p[len(draft)]
        return tokens + [int(bonus.argmax()) if params.greedy else int(torch.multinomial(bonus, 1, generator=generator))]

    def acceptance_rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    def mean_accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts plus the bonus token."""
        return 1 + sum(self.accepted) / self.drafted[0] if self.drafted[0] else 0.0
