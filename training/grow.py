"""Grow a trained checkpoint by one full-attention layer at the end of the trunk, computing what it computed.

Why (issue 3, 2026-12-03): on held-out recall at 100 facts the trunk finds the fact line but then
miscopies the later tokens of its value (teacher-forced, stage 6: first value token right in 0.925 of
prompts, the whole value in 0.30), while the shipped model's MTP head, one more full-attention layer
over the trunk's final states, predicts those tokens almost perfectly (cross entropy 0.0002 against the
trunk's 0.285). Part of that is structural (the MTP input at each position holds the next token's
embedding, which makes "copy the token after the match" a one-layer lookup), so it shows the skill is
learnable here, not that a third trunk attention layer will learn it; the trunk has two attention
layers of eight, and this gives it a third to try.

The new layer starts as a copy of the trunk's last full-attention layer with its output projections
zero (attention o_proj, every routed expert's down_proj, the shared expert's down_proj): its residual
branches add exactly 0, so the grown model's logits and MTP drafts equal the original's until training
moves them. Usage:

    python -m training.grow roofline/models/tiny OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def grown_config(cfg: dict) -> dict:
    out = dict(cfg)
    out["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    out["layer_types"] = list(cfg["layer_types"]) + ["full_attention"]
    out.pop("transformers_version", None)
    return out


@torch.no_grad()
def grow(src: str | Path, out: str | Path) -> dict:
    """Write the grown checkpoint to `out`; returns its config."""
    from transformers import Qwen3_5MoeForCausalLM

    from training.model import make_text_config, save_checkpoint
    from training.train import load_for_training

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    if "full_attention" not in cfg["layer_types"]:
        raise ValueError(f"{src / 'config.json'}: no full_attention layer to copy")
    model, mtp = load_for_training(src, seed=0)
    new_cfg = grown_config(cfg)
    text_cfg = make_text_config(new_cfg)
    text_cfg._experts_implementation = "eager"
    text_cfg._attn_implementation = "sdpa"
    grown = Qwen3_5MoeForCausalLM(text_cfg).float()
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    new_index = cfg["num_hidden_layers"]
    if unexpected or any(not k.startswith(f"model.layers.{new_index}.") for k in missing):
        raise RuntimeError(f"grown model does not match {src}: missing {missing}, unexpected {unexpected}")
    last_attention = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    layer = grown.model.layers[new_index]
    layer.load_state_dict(model.model.layers[last_attention].state_dict())
    for weight in (layer.self_attn.o_proj.weight, layer.mlp.experts.down_proj, layer.mlp.shared_expert.down_proj.weight):
        weight.zero_()
    generation = json.loads((src / "generation_config.json").read_text()) if (src / "generation_config.json").exists() else None
    save_checkpoint(grown, mtp, new_cfg, out, generation_config=generation)
    for name in COPIED_FILES:
        if (src / name).exists() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    return new_cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="checkpoint directory (the bundled model's layout, with mtp.* tensors)")
    ap.add_argument("out", help="directory for the grown checkpoint")
    args = ap.parse_args(argv)
    cfg = grow(args.src, args.out)
    print(f"wrote {args.out}: {cfg['num_hidden_layers']} layers {cfg['layer_types']}")


if __name__ == "__main__":
    main()
