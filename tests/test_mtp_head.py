"""The MTP head equals a hand-written reference of its formula (transformers ignores mtp.*)."""

import copy

import torch

from roofline.checkpoint import load_model
from roofline.engine.cache import SequenceCache
from tiny_checkpoints import reference_model, text_config, write_variant

IDS = torch.tensor([5, 17, 99, 3, 250, 42, 7, 7, 128, 64])


def zero_centred_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_mtp_logits(hf, mtp, ids):
    """x_p = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)]); y = layer(x) at positions p; logits = lm_head(norm(y))."""
    with torch.no_grad():
        hidden = hf.model(ids[None]).last_hidden_state[0]  # after the final norm
        embeds = hf.model.embed_tokens(ids)
        x = torch.cat([zero_centred_norm(embeds[1:], mtp["mtp.pre_fc_norm_embedding.weight"]),
                       zero_centred_norm(hidden[:-1], mtp["mtp.pre_fc_norm_hidden.weight"])], dim=-1)
        x = x @ mtp["mtp.fc.weight"].t()
        full = hf.config.layer_types.index("full_attention")
        layer = copy.deepcopy(hf.model.layers[full])
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
        t = x.shape[0]
        positions = torch.arange(t)[None]
        cos_sin = hf.model.rotary_emb(x[None], positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(zero_centred_norm(y[0], mtp["mtp.norm.weight"]))


def test_mtp_head_matches_formula(tmp_path):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=7)
    write_variant(hf, mtp, tmp_path / "c", cfg=cfg)
    model, report = load_model(tmp_path / "c", "cpu", torch.float32)
    assert report.has_mtp
    want = reference_mtp_logits(hf, mtp, IDS)

    hidden = model(IDS, [len(IDS)], [SequenceCache()])
    got = model.logits(model.mtp_forward(IDS[1:], hidden[:-1], [len(IDS) - 1], [SequenceCache()]))
    assert (got - want).abs().max() / want.abs().max() < 2e-4

    # drafting position by position over the head's own KV cache gives the same logits
    cache = SequenceCache()
    steps = [model.logits(model.mtp_forward(IDS[p + 1 : p + 2], hidden[p : p + 1], [1], [cache])) for p in range(len(IDS) - 1)]
    assert (torch.cat(steps) - want).abs().max() / want.abs().max() < 2e-4
