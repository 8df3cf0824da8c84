"""MTP speculative decoding: the model's own multi-token-prediction head drafts k tokens, the
main model verifies them in one step, and only tokens the main model would have produced
are kept.

Per sequence, between steps, the head keeps "pending pairs": the main model's post-norm
hidden states of the newest positions and the tokens that follow them. A step:

1. Draft: the head runs on the pending pairs (its cache now holds only true history) and
   drafts d1 from the last one; for d2..dk it is fed its own post-norm output and draft.
   After a verify the head has already run on the new pairs (step 4), so d1 comes from its
   stored output.
2. Verify: the main model runs [last token, d1..dk] in one forward, remembering its GDN
   state after each position.
3. Accept: greedy keeps the longest prefix of drafts equal to the main model's argmax;
   sampling accepts d_j with probability min(1, p/q) and otherwise resamples from the
   normalised positive part of p - q, which leaves the output distribution exactly p
   (Leviathan et al., Chen et al. 2023). One more token (the bonus) always comes from p.
4. The verified hidden states become the head's pending pairs, and the head runs on them
   at once (before the rollback copies and before the host's bookkeeping between steps),
   so the GPU has the next draft's first forward to do while the host is busy; then the
   main model's caches roll back to the accepted tokens.

Drafts, their distributions and the acceptance stay on the device: drafts are fed back to the
head as device tensors and verified from them, and the host reads one small tensor per step
(tokens, accepted counts, logprobs), plus top logprobs where asked. Only a repetition,
presence or frequency penalty makes the host read the drafts so far, to build its history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .cache import SequenceCache
from .sampling import Sampler, device_tensor, draw, fused_row_stats, top_logprobs

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
        out[:, self.ids] = self.head.logits(hidden)
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
    # The head's post-norm output [H] and logits [V] at its newest pair, while no pair is pending: d1 comes from them
    head_hidden: torch.Tensor | None = None
    head_logits: torch.Tensor | None = None

    def ready_to_draft(self) -> bool:
        return bool(self.pending_tokens) or self.head_logits is not None


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
        state.head_hidden = state.head_logits = None  # superseded by the new pairs
        if state.pending_hidden is None or not state.pending_tokens:
            state.pending_hidden, state.pending_tokens = hidden, tokens
        else:
            state.pending_hidden = torch.cat([state.pending_hidden, hidden])
            state.pending_tokens = state.pending_tokens + tokens

    def catch_up(self, states: list[DraftState]) -> None:
        """Run the head over the pending pairs now, advancing its caches, and keep its output at the newest pair
        for the next draft: after each chunk of a long prompt, so a prompt's hidden states do not pile up until
        the first draft (then one head forward over all of it), and right after each verify."""
        states = [s for s in states if s.pending_tokens]
        if not states:
            return
        hidden, logits = self._head([s.pending_tokens for s in states], [s.pending_hidden for s in states],
                                    [s.cache for s in states])
        hidden, logits = hidden.clone(), logits.clone()  # out of the graph's buffers, which the next replay reuses
        for i, state in enumerate(states):
            state.pending_hidden, state.pending_tokens = None, []
            state.head_hidden, state.head_logits = hidden[i], logits[i]

    def begin_step(self) -> None:
        if self.chooser:
            self.k = self.chooser.next_k(self.acceptance_rates())

    def end_step(self, seconds: float) -> None:
        if self.chooser:
            self.chooser.record(self.k, seconds)

    def _head(self, tokens: list[list[int]] | torch.Tensor, hidden: list[torch.Tensor] | torch.Tensor,
              caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over each sequence's (token, hidden) pairs, advancing its cache by them; returns the
        post-norm hidden state and the logits of each sequence's last pair. Pairs come as host token lists with
        a hidden tensor per sequence, or as one device token [B] and hidden row [B, H] per sequence (a draft
        fed back: the host never reads it)."""
        model = self.model
        fed_back = isinstance(tokens, torch.Tensor)
        lengths = [1] * len(caches) if fed_back else [len(t) for t in tokens]
        m = max(lengths)
        if self.draft_graphs and m <= MAX_DRAFT_TOKENS + 1:  # right-padded to m pairs: their extra keys are never seen
            if fed_back:
                ids, rows = tokens, hidden
            else:
                pad = [m - n for n in lengths]
                ids = [x for t, p in zip(tokens, pad) for x in t + [0] * p]
                rows = torch.cat([torch.cat([h, h.new_zeros(p, h.shape[1])]) for h, p in zip(hidden, pad)])
            buf = self.draft_graphs.run(ids, caches, m, hidden=rows)
            for cache, n in zip(caches, lengths):
                cache.advance(n)
            b = len(caches)
            if all(n == m for n in lengths):  # each sequence's last pair ends its m rows: views, no gather kernels
                return buf.hidden[: b * m].view(b, m, -1)[:, -1], buf.logits[: b * m].view(b, m, -1)[:, -1]
            last = device_tensor([i * m + n - 1 for i, n in enumerate(lengths)], model.device)
            return buf.hidden[last], buf.logits[last]
        ids = tokens if fed_back else device_tensor([x for t in tokens for x in t], model.device)
        out = model.mtp_forward(ids, hidden if fed_back else torch.cat(hidden), lengths, caches)
        out = out[device_tensor(lengths, model.device).cumsum(0) - 1]
        return out, self.draft_logits(out)

    def draft(self, states: list[DraftState], params, histories, prompt_lens, generators):
        """k draft tokens per sequence, [B, k] on the device, and their draft distributions q [B, k, V] (None
        when every row is greedy and unpenalised: the drafts are the head's argmax). The host reads nothing
        unless a penalty needs the drafts so far."""
        caches = [s.cache for s in states]
        self.catch_up(states)  # only where a plain step or a prompt left pairs since: a verify ran the head already
        hidden, logits = (_rows([getattr(s, name) for s in states]) for name in ("head_hidden", "head_logits"))
        for state in states:
            state.head_hidden = state.head_logits = None  # the drafts below move the head on; the verify brings new pairs
        true_lengths = [c.num_tokens for c in caches]  # the pairs shown are true history: they stay
        penalised = any(p.penalised for p in params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for j in range(self.k):
            if j:
                hidden, logits = self._head(drafts[-1], hidden, caches)
            if not (sampled or penalised):
                drafts.append(logits.argmax(dim=-1))
                continue
            so_far = torch.stack(drafts, 1).tolist() if penalised and drafts else [[] for _ in params]
            q = self.sampler.probabilities(logits, params, [h + d for h, d in zip(histories, so_far)] if penalised else None,
                                           prompt_lens)
            token = q.argmax(dim=-1)  # a greedy row's q is one-hot on its argmax
            if sampled:
                token[sampled] = draw(q[sampled], [generators[i] for i in sampled])
            drafts.append(token)
            qs.append(q)
        for cache, length in zip(caches, true_lengths):
            cache.truncate(length)  # drafts beyond the first are not true history
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    def _verify_forward(self, caches, ids: torch.Tensor):
        """The main model over each sequence's row of `ids` [B, m] (last token, drafts): (hidden, logits, keep)
        where keep(i, n) leaves cache i holding exactly the first n of its step's tokens."""
        model, (b, m) = self.model, ids.shape
        if self.graphs:
            buf = self.graphs.run(ids.reshape(-1), caches, m, rollback=True)  # new GDN states to the spare buffers
            return buf.hidden[: b * m], buf.logits[: b * m], lambda i, n: self.graphs.keep(buf, i, caches[i], m, n)
        for cache in caches:
            cache.record_steps = True  # GDN state after every position, for the rollback below
        hidden = model(ids.reshape(-1), [m] * b, caches)

        def keep(i: int, n: int) -> None:
            caches[i].truncate(caches[i].step_start + n)
            caches[i].stop_recording()

        return hidden, model.logits(hidden), keep

    def verify(self, caches, last_tokens, drafts, qs, states, params, histories, prompt_lens, generators) -> list[Verified]:
        """Verify `drafts` [B, k] (from `draft`) in one main-model step, accept on the device and read the
        outcome back once (and once more for top logprobs, when a row asks for them)."""
        b, k = drafts.shape
        m = k + 1
        ids = torch.cat([device_tensor(last_tokens, drafts.device)[:, None], drafts], 1)
        hidden, logits, keep = self._verify_forward(caches, ids)
        greedy = all(p.greedy and not p.penalised for p in params)
        stats = fused_row_stats(logits.float()) if greedy else None  # every row's argmax and logsumexp, one launch
        tokens, accepted = self._accept(logits, ids, qs, params, histories, prompt_lens, generators, stats)
        if stats is not None:  # greedy rows' tokens are their argmax
            token_logprobs = stats.top_logprob.view(b, m)
        else:  # log p(token) = logit - logsumexp: two small reductions, not a log-softmax over every row's vocabulary
            scores = logits.float().view(b, m, -1)
            token_logprobs = scores.gather(2, tokens[..., None]).squeeze(2) - torch.logsumexp(scores, dim=-1)
        outcome = torch.cat([tokens.double(), accepted[:, None].double(), token_logprobs.double()], 1).tolist()  # one read
        want_top = any(p.logprobs is not None for p in params)
        raw = torch.log_softmax(logits, dim=-1) if want_top else None
        results, kept = [], []
        for i, row in enumerate(outcome):
            n = int(row[m]) + 1  # the accepted drafts, then the next token
            for j in range(k):
                self.drafted[j] += 1
                self.accepted[j] += int(j < n - 1)
            positions = [i * m + j for j in range(n)]
            top = (top_logprobs(raw[positions], 0.0, [params[i]] * n) if want_top else [None] * n)  # raw: log-probabilities
            results.append(Verified([int(t) for t in row[:n]], row[m + 1 : m + 1 + n], top, k, n - 1))
            states[i].pending_hidden = hidden[i * m : i * m + n]  # the last token and the accepted drafts ...
            states[i].pending_tokens = results[-1].tokens  # ... each paired with the token after it
            kept.append(n)
        # The next draft's first head forward goes to the GPU now (a sequence that stops here wastes one), then the
        # rollback (a replay of the kept tokens' GDN state where drafts were rejected): the main caches keep the last
        # token and the accepted drafts; the next token is pending.
        self.catch_up(states)
        for i, n in enumerate(kept):
            keep(i, n)
        return results

    def _accept(self, logits, ids, qs, params, histories, prompt_lens, generators,
                stats=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, k+1], accepted [B]) on the device: row i's first accepted[i] tokens are its accepted drafts and
        the next one comes from the main model. Greedy rows accept drafts equal to the main model's argmax (`stats`'
        ids, which `verify` gives when every row is greedy and unpenalised); sampled rows accept d_j with probability
        min(1, p/q) and otherwise draw from the normalised positive part of p - q (from p after the last draft)."""
        b, m = ids.shape
        drafts = ids[:, 1:]
        if stats is not None:
            target = stats.ids.view(b, m)
            return target, _leading_true(target[:, :-1] == drafts)  # a greedy row's accepted drafts equal its argmax
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        penalised = any(p.penalised for p in params)
        rows = [i for i in range(b) for _ in range(m)]
        so_far = drafts.tolist() if penalised else None
        p = self.sampler.probabilities(
            logits, [params[i] for i in rows],
            [histories[i] + so_far[i][:j] for i in range(b) for j in range(m)] if penalised else None,
            [prompt_lens[i] for i in rows]).view(b, m, -1)
        target = p.argmax(dim=-1)  # greedy rows: p is one-hot on the argmax
        ok = target[:, :-1] == drafts
        nxt = target.gather(1, _leading_true(ok)[:, None]).squeeze(1)
        if sampled:
            s = device_tensor(sampled, ids.device)
            q = torch.cat([qs[s], torch.zeros_like(qs[s][:, :1])], 1)  # after the last draft: q = 0, the residual is p
            u = torch.stack([torch.rand(m - 1, generator=generators[i], device=ids.device) for i in sampled])
            d = drafts[s][..., None]
            ok[s] = u * q[:, :-1].gather(2, d).squeeze(2) <= p[s, :-1].gather(2, d).squeeze(2)
            first = _leading_true(ok[s])
            at = first[:, None, None].expand(-1, 1, p.shape[-1])
            p_at, q_at = p[s].gather(1, at).squeeze(1), q.gather(1, at).squeeze(1)
            residual = (p_at - q_at).clamp_min(0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
            nxt[s] = draw(residual / residual.sum(-1, keepdim=True), [generators[i] for i in sampled])
        accepted = _leading_true(ok)
        tokens = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, accepted[:, None], nxt[:, None])
        return tokens, accepted

    def acceptance_rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    def mean_accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts plus the bonus token."""
        return 1 + sum(self.accepted) / self.drafted[0] if self.drafted[0] else 0.0


def _rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, ...] from B rows: a view for one row (the usual single-user step), a stack otherwise."""
    return rows[0][None] if len(rows) == 1 else torch.stack(rows)


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Per row of a bool [B, k]: how many entries are True before the first False (the drafts accepted)."""
    return ok.int().cumprod(1).sum(1)
