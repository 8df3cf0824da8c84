"""The bandwidth ceiling of decoding: bytes read per token, counted from tensor headers, over named machines.

At batch 1 a decode step must read every weight it uses once, so tok/s <= bandwidth / bytes per
token. What one token reads, from the tensors a checkpoint actually holds (qwen35.md, "Bytes per
decoded token"):

- routed experts: top_k / num_experts of all expert bytes (uniform routing; modelled);
- the embedding: one row; lm_head and every other weight: once;
- GDN recurrent state: read and written in fp32, 2 * v_heads * k_dim * v_dim * 4 B per GDN layer;
- KV cache: full-attention layers * 2 (K, V) * kv_heads * head_dim * 2 B (bf16) per context token.

MTP-k speculation (modelled, random weights say nothing about acceptance): one step drafts k
tokens with the MTP head (MTP layer with its top-k experts, lm_head, one embedding row and the
head's own KV per draft) and verifies k+1 tokens with the main model, which reads its dense
weights once but the union of the experts the k+1 tokens route to. With uniform, independent
routing the expected number of distinct experts per layer is E * (1 - (1 - top_k/E)^(k+1)).
A step yields 1 + a_1 + ... + a_k tokens for per-position acceptance rates a_i (the fraction of
steps whose i-th draft is accepted, as vLLM reports them).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from ..checkpoint.classes import module_class
from ..checkpoint.reader import TensorInfo
from ..config import ModelConfig
from ..errors import UserError


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    bandwidth: float  # bytes/s, nominal


MACHINES: dict[str, Machine] = {
    m.name: m
    for m in (
        Machine("dgx-spark", "NVIDIA DGX Spark (GB10, LPDDR5X)", 273e9),
        Machine("m3-ultra", "Apple M3 Ultra", 0.82e12),
        Machine("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell", 1.8e12),
        Machine("h100", "NVIDIA H100 SXM", 3.35e12),
        Machine("h200", "NVIDIA H200", 4.8e12),
    )
}

DEFAULT_ACCEPTANCE = (0.95, 0.80)  # reported for MTP on the real 122B at draft positions 1 and 2
DEFAULT_CONTEXTS = (0, 32 * 1024, 128 * 1024)
KV_BYTES = 2  # bf16 KV cache


def parse_bandwidth(text: str) -> float:
    """'273', '273G', '273GB/s' -> 273e9; '4.2T', '4.2TB/s' -> 4.2e12 (bytes/s). A bare number is GB/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([gGtT]?)(?:[bB](?:/s)?)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"bandwidth {text!r}: give GB/s as a number (e.g. 273) or with a unit (273G, 4.2T)")
    return float(m.group(1)) * (1e12 if m.group(2).lower() == "t" else 1e9)


def machines(names: list[str] | None = None, bandwidth: str | None = None) -> list[Machine]:
    """Named machines (all when none named), plus a custom one for `--bandwidth`."""
    chosen = []
    for name in names or ([] if bandwidth else list(MACHINES)):
        if name not in MACHINES:
            raise UserError(f"unknown machine {name!r}; known: {', '.join(MACHINES)} (or give --bandwidth)")
        chosen.append(MACHINES[name])
    if bandwidth:
        bw = parse_bandwidth(bandwidth)
        chosen.append(Machine("custom", "--bandwidth", bw))
    return chosen


def parse_acceptance(text: str | None) -> tuple[float, ...]:
    if not text:
        return DEFAULT_ACCEPTANCE
    try:
        rates = tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UserError(f"--acceptance {text!r}: give comma-separated rates, e.g. 0.95,0.80") from None
    if not rates or any(not 0 <= r <= 1 for r in rates):
        raise UserError(f"--acceptance {text!r}: each rate must be between 0 and 1")
    return rates


# --- per-tensor classification ------------------------------------------------------------------

_INT4_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
NOT_READ_SUFFIXES = (".g_idx",)  # act-order index: checked at load, never read by a kernel


def tensor_format(info: TensorInfo) -> str:
    """The weight format a stored tensor belongs to: int4, fp8, int8, or its dtype (bf16, fp32...)."""
    name = info.name
    if name.endswith(_INT4_SUFFIXES):
        return "int4"
    if name.endswith(".weight_scale_inv") or info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if name.endswith(".weight_scale") or info.dtype == torch.int8:
        return "int8"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(info.dtype).removeprefix("torch."), str(info.dtype))


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


@dataclass
class ClassRow:
    cls: str
    fmt: str
    tensors: int = 0
    stored: int = 0  # bytes in the checkpoint
    read: float = 0.0  # bytes read per decoded token (MTP: per draft)


@dataclass
class TokenBytes:
    """What one decoded token reads, by part; see the module docstring for the model."""

    num_experts: int
    top_k: int
    experts_stored: int = 0  # all routed experts of the main model
    dense: int = 0  # every other weight read once per step (not embedding, lm_head)
    embed_row: int = 0
    lm_head: int = 0
    gdn_layers: int = 0
    gdn_state: int = 0  # bytes read + written per step
    attn_layers: int = 0
    kv_per_token: int = 0  # KV bytes read per context token
    mtp_dense: int = 0
    mtp_experts_stored: int = 0
    mtp_kv_per_token: int = 0
    rows: list[ClassRow] = field(default_factory=list)

    @property
    def has_mtp(self) -> bool:
        return self.mtp_dense > 0

    @property
    def expert_fraction(self) -> float:
        return self.top_k / self.num_experts if self.num_experts else 0.0

    def union_fraction(self, tokens: int) -> float:
        """Expected fraction of experts that `tokens` independently, uniformly routed tokens touch."""
        return 1 - (1 - self.expert_fraction) ** tokens if self.num_experts else 0.0

    @property
    def weights(self) -> float:
        """Weight bytes read per decoded token, no speculation."""
        return self.dense + self.experts_stored * self.expert_fraction + self.embed_row + self.lm_head

    def decode(self, context: int = 0) -> float:
        return self.weights + self.gdn_state + self.kv_per_token * context

    def draft(self, context: int = 0) -> float:
        """One MTP draft: the MTP layer (its top-k experts), lm_head, an embedding row, its KV."""
        return (self.mtp_dense + self.mtp_experts_stored * self.expert_fraction + self.lm_head + self.embed_row
                + self.mtp_kv_per_token * context)

    def verify(self, k: int, context: int = 0) -> float:
        """The main model on k+1 tokens: dense weights and KV once, the union of their experts."""
        return (self.dense + self.experts_stored * self.union_fraction(k + 1) + (k + 1) * self.embed_row + self.lm_head
                + self.gdn_state + self.kv_per_token * context)

    def mtp_step(self, k: int, context: int = 0) -> float:
        return self.verify(k, context) + k * self.draft(context)

    @staticmethod
    def tokens_per_step(k: int, acceptance: tuple[float, ...]) -> float:
        if k > len(acceptance):
            raise UserError(f"MTP-{k} needs {k} acceptance rates, got {len(acceptance)} ({','.join(map(str, acceptance))})")
        return 1 + sum(acceptance[:k])

    def per_token(self, k: int, context: int, acceptance: tuple[float, ...]) -> float:
        """Bytes per generated token, with MTP-k (k=0: plain decoding)."""
        if k == 0:
            return self.decode(context)
        return self.mtp_step(k, context) / self.tokens_per_step(k, acceptance)

    def ceiling(self, bandwidth: float, k: int = 0, context: int = 0, acceptance=DEFAULT_ACCEPTANCE) -> float:
        return bandwidth / self.per_token(k, context, acceptance)


def token_bytes(cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> TokenBytes:
    """Count bytes per decoded token from canonical tensor headers (vision tower already dropped)."""
    tb = TokenBytes(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok)
    rows: dict[tuple[str, str], ClassRow] = {}
    for name, info in tensors.items():
        cls, fmt, size = module_class(name), tensor_format(info), _nbytes(info)
        row = rows.setdefault((cls, fmt), ClassRow(cls, fmt))
        row.tensors += 1
        row.stored += size
        if name.endswith(NOT_READ_SUFFIXES):
            continue
        if cls == "mtp":
            if module_class(name[len("mtp."):]) == "experts":
                tb.mtp_experts_stored += size
                row.read += size * tb.expert_fraction
            else:
                tb.mtp_dense += size
                row.read += size
        elif cls == "experts":
            tb.experts_stored += size
            row.read += size * tb.expert_fraction
        elif cls == "embed":
            tb.embed_row += size // info.shape[0]
            row.read += size // info.shape[0]
        elif cls == "lm_head":
            tb.lm_head += size
            row.read += size
        else:
            tb.dense += size
            row.read += size
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tb.lm_head = _nbytes(tensors["model.embed_tokens.weight"])
    tb.gdn_layers = cfg.layer_types.count("linear_attention")
    tb.attn_layers = cfg.layer_types.count("full_attention")
    tb.gdn_state = tb.gdn_layers * 2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * KV_BYTES
    tb.kv_per_token = tb.attn_layers * kv_layer
    tb.mtp_kv_per_token = kv_layer if tb.has_mtp else 0
    order = {c: i for i, c in enumerate(["experts", "shared", "dense_mlp", "attention", "gdn", "gdn_small", "router",
                                         "embed", "lm_head", "other", "mtp"])}
    tb.rows = sorted(rows.values(), key=lambda r: (order.get(r.cls, 99), r.fmt))
    return tb


# --- reports ------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_rate(bw: float) -> str:
    return f"{bw / 1e12:.2f} TB/s" if bw >= 1e12 else f"{bw / 1e9:.0f} GB/s"


def format_context(n: int) -> str:
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def class_table(tb: TokenBytes, extra_rows: list[ClassRow] = ()) -> str:
    """Module class x format x tensors x stored bytes x bytes read per token."""
    lines = [f"{'class':<11}{'format':<8}{'tensors':>9}{'stored':>12}{'read/token':>14}"]
    rows = list(tb.rows) + list(extra_rows)
    for r in rows:
        read = format_bytes(r.read) + ("*" if r.cls == "mtp" else " ") if r.read else "- "
        lines.append(f"{r.cls:<11}{r.fmt:<8}{r.tensors:>9}{format_bytes(r.stored):>12}{read:>14}")
    total = sum(r.stored for r in rows)
    lines.append(f"{'total':<19}{sum(r.tensors for r in rows):>9}{format_bytes(total):>12}{format_bytes(tb.weights):>13}")
    if any(r.cls == "mtp" for r in rows):
        lines.append("* MTP head: read per draft token, only when speculating (not in the total)")
    return "\n".join(lines)


def bytes_summary(tb: TokenBytes, cfg: ModelConfig, contexts=DEFAULT_CONTEXTS) -> str:
    lines = ["bytes read per decoded token (batch 1):"]
    parts = []
    if tb.num_experts:
        parts.append(f"routed experts {format_bytes(tb.experts_stored * tb.expert_fraction)} "
                     f"({tb.top_k}/{tb.num_experts} of {format_bytes(tb.experts_stored)})")
    parts += [f"other weights {format_bytes(tb.dense)}", f"lm_head {format_bytes(tb.lm_head)}",
              f"embedding row {format_bytes(tb.embed_row)}"]
    lines.append(f"  weights      {format_bytes(tb.weights):>10}  = {', '.join(parts)}")
    lines.append(f"  GDN state    {format_bytes(tb.gdn_state):>10}  = {tb.gdn_layers} layers x {cfg.linear_num_value_heads} heads x "
                 f"{cfg.linear_key_head_dim}x{cfg.linear_value_head_dim} fp32, read + written")
    lines.append(f"  KV cache     {format_bytes(tb.kv_per_token):>10}  per context token = {tb.attn_layers} layers x "
                 f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim} x (K, V) x bf16")
    totals = " / ".join(format_bytes(tb.decode(c)) for c in contexts)
    lines.append(f"  total at context {' / '.join(format_context(c) for c in contexts)}: {totals}")
    if tb.has_mtp:
        mtp_layer = tb.mtp_dense + tb.mtp_experts_stored * tb.expert_fraction
        lines.append(f"  MTP draft    {format_bytes(tb.draft()):>10}  = MTP layer {format_bytes(mtp_layer)} + lm_head "
                     f"{format_bytes(tb.lm_head)} + embedding row (+ {format_bytes(tb.mtp_kv_per_token)} KV per context token)")
    return "\n".join(lines)


def ceiling_table(tb: TokenBytes, chosen: list[Machine], contexts=DEFAULT_CONTEXTS, mtp: int = 2,
                  acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE) -> str:
    ks = [0] + (list(range(1, mtp + 1)) if tb.has_mtp else [])
    for k in ks[1:]:
        tb.tokens_per_step(k, acceptance)  # raises a clear error if rates are missing
    col = 8
    group = len(ks) * col
    head1 = f"{'':<24}" + "".join(f"{'context ' + format_context(c):>{group}}  " for c in contexts)
    head2 = f"{'machine':<13}{'bandwidth':>11}" + "".join(
        "".join(f"{('plain' if k == 0 else f'MTP-{k}'):>{col}}" for k in ks) + "  " for _ in contexts)
    lines = ["ceiling in tok/s (batch 1, bandwidth / bytes per token):", head1.rstrip(), head2.rstrip()]
    for m in chosen:
        cells = "".join("".join(_rate_cell(tb.ceiling(m.bandwidth, k, c, acceptance), col) for k in ks) + "  " for c in contexts)
        lines.append(f"{m.name:<13}{format_rate(m.bandwidth):>11}{cells}".rstrip())
    if len(ks) > 1:
        rates = ", ".join(f"{a:.2f}" for a in acceptance[:mtp])
        verify = ("the union of the routed experts of k+1 tokens (E*(1-(1-top_k/E)^(k+1)) per layer, uniform routing)"
                  if tb.num_experts else "the weights once for k+1 tokens")
        lines.append(f"MTP-k is modelled: acceptance {rates} at draft positions 1..{mtp}; a verify step reads {verify}.")
    return "\n".join(lines)


def _rate_cell(v: float, width: int) -> str:
    return " " + (f"{v:.1f}" if v < 1000 else f"{v:.0f}").rjust(width - 1)


def report_dict(tb: TokenBytes, chosen: list[Machine], contexts=DEFAULT_CONTEXTS, mtp: int = 2,
                acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE) -> dict:
    """Everything above as JSON-ready numbers (bytes, tok/s)."""
    ks = [0] + (list(range(1, mtp + 1)) if tb.has_mtp else [])
    return {
        "bytes": {"weights_per_token": tb.weights, "gdn_state_per_token": tb.gdn_state, "kv_per_context_token": tb.kv_per_token,
                  "routed_experts_stored": tb.experts_stored, "dense": tb.dense, "lm_head": tb.lm_head,
                  "embed_row": tb.embed_row, "mtp_draft": tb.draft() if tb.has_mtp else None},
        "classes": [asdict(r) for r in tb.rows],
        "acceptance": list(acceptance[:mtp]) if len(ks) > 1 else [],
        "ceilings": [
            {"machine": m.name, "bandwidth": m.bandwidth, "context": c, "mtp": k,
             "bytes_per_token": tb.per_token(k, c, acceptance), "tok_s": tb.ceiling(m.bandwidth, k, c, acceptance)}
            for m in chosen for c in contexts for k in ks
        ],
    }


def model_token_bytes(model: str, formats: dict[str, str] | None = None, layers: int | None = None) -> tuple[str, ModelConfig, TokenBytes]:
    """`ceiling --model`: a named shape in a layout (default int4), or a checkpoint's own tensors (or its
    config in `formats`). Returns (title, config, token bytes); nothing is allocated or downloaded."""
    from pathlib import Path

    from ..checkpoint.loader import checkpoint_tensors
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.shapes import SHAPES, describe_layout, layout_tensors, resolve_layout, shape_config, shape_name
    from ..config import load_config
    from ..hub import ModelNotFound, resolve_model

    name = shape_name(model)
    if name and not Path(model).expanduser().exists():
        formats = formats or resolve_layout("int4")
        cfg = ModelConfig.from_dict(shape_config(name, layers), source=f"shape {name}")
        cut = f", first {layers} layers" if layers else ""
        return f"{name}{cut}, layout: {describe_layout(formats, cfg)}", cfg, token_bytes(cfg, layout_tensors(cfg, formats))
    if layers is not None:
        raise UserError("--layers applies to named shapes, not to checkpoints")
    try:
        folder = resolve_model(model, allow_download=False)
    except ModelNotFound as exc:
        raise UserError(f"{model}: not a known shape ({', '.join(SHAPES)}) and not a checkpoint ({exc})") from None
    cfg = load_config(folder)
    if formats:
        return f"{folder} (config), layout: {describe_layout(formats, cfg)}", cfg, token_bytes(cfg, layout_tensors(cfg, formats))
    return f"{folder} (its tensors)", cfg, token_bytes(cfg, checkpoint_tensors(CheckpointReader(folder)))
