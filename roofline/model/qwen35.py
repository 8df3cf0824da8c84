"""The Qwen3.5 text model (MoE and dense) and its MTP head.

Module paths equal checkpoint tensor names (`model.layers.3.self_attn.q_proj`, `lm_head`,
`mtp.fc`), so the loader maps names without a translation table.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..engine.cache import SequenceCache
from .layers import DecoderLayer, RMSNorm, SlotBatch, StepBatch
from .slots import LinearSlot, plain_parameter


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = plain_parameter(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, t) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.weight[input_ids]


class MtpHead(nn.Module):
    """Multi-token prediction: one full-attention decoder layer fed [norm(embed(t+1)) | norm(h_t)].

    `h_t` is the main model's hidden state after the final norm. For k > 1 drafts the caller
    feeds the head's own post-`norm` output back as `hidden`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.fc = LinearSlot(h, 2 * h)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        # Layer index 0 of the head's own cache (each sequence has a separate MTP SequenceCache).
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, "full_attention")])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, batch: StepBatch | SlotBatch) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, batch))


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = LinearSlot(cfg.vocab_size, cfg.hidden_size)
        self.mtp = MtpHead(cfg) if cfg.mtp_num_hidden_layers > 0 else None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @staticmethod
    def step_batch(seq_lens: list[int], caches: list[SequenceCache], device) -> StepBatch:
        """Positions continue each sequence's cache; caches advance by the new tokens."""
        for cache in caches:
            cache.begin_step()
        positions = torch.cat(
            [torch.arange(c.num_tokens, c.num_tokens + n, device=device) for n, c in zip(seq_lens, caches)]
        )
        return StepBatch(list(seq_lens), positions, caches)

    @staticmethod
    def advance(batch: StepBatch) -> None:
        for n, cache in zip(batch.seq_lens, batch.caches):
            cache.num_tokens += n

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, seq_lens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """Run `input_ids` [N] (sequences' new tokens, flattened) and return post-final-norm hidden [N, H]."""
        batch = self.step_batch(seq_lens, caches, input_ids.device)
        x = self.model.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, batch)
        self.advance(batch)
        return self.model.norm(x)

    @torch.no_grad()
    def slot_forward(self, input_ids: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`forward` on pooled caches (the captured decode step); the caller advances the caches."""
        x = self.model.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, batch)
        return self.model.norm(x)

    @torch.no_grad()
    def mtp_slot_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """`mtp_forward` on the MTP head's pooled cache."""
        return self.mtp(self.model.embed(next_ids), hidden, batch)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    @torch.no_grad()
    def mtp_forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, seq_lens: list[int], mtp_caches: list[SequenceCache]
    ) -> torch.Tensor:
        """MTP draft hidden states [N, H] (post `mtp.norm`) for positions continuing `mtp_caches`."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head (no mtp.* tensors)")
        batch = self.step_batch(seq_lens, mtp_caches, next_ids.device)
        out = self.mtp(self.model.embed(next_ids), hidden, batch)
        self.advance(batch)
        return out
