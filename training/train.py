"""Train the tiny Qwen3.5-MoE (trunk + MTP head jointly) and write it in Hugging Face layout.

    python -m training.train --out DIR [--steps N | --time-budget SECONDS] [--seed 0] ...

Steps, in one process:
  1. generate and tokenise training conversations (training/tasks.py, train split) with
     the tokenizer in roofline/models/tiny (training/train_tokenizer.py made it), pack them
     into rows of --row-len tokens;
  2. build Qwen3_5MoeForCausalLM from the config in training/model.py plus the MTP head;
  3. train: loss = CE(main, tok[t+1]) + w1 * CE(MTP draft 1, tok[t+2]) + w2 * CE(MTP draft 2,
     tok[t+3]) + router load-balancing, all on assistant tokens only; AdamW, bf16 autocast,
     linear warm-up then cosine decay;
  4. save bf16 safetensors shards (<= 15 MB each) with an index, config, generation config,
     tokenizer and chat template into --out;
  5. reload --out with Qwen3_5MoeForCausalLM.from_pretrained and measure greedy accuracy on
     held-out arithmetic and recall, tool calls, and the MTP head's agreement with the trunk.

With --time-budget and no --steps, a few timed steps first fix the number of steps so that
training fits the budget; the model is then rebuilt from the seed and trained for exactly
that many steps (the log prints it: rerun with --steps N to reproduce the run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from training.data import generate_docs, pack  # noqa: E402
from training.model import build_model, save_checkpoint, set_gdn, tiny_config_dict  # noqa: E402
from training.tasks import TASKS, parse_mix  # noqa: E402

TINY = REPO / "roofline" / "models" / "tiny"


def log(msg, fh=None):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


def router_hooks(modules):
    store = []

    def hook(_m, _inp, out):
        store.append(out[0] if isinstance(out, tuple) else out)

    handles = [m.register_forward_hook(hook) for m in modules]
    return store, handles


def balance_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style load balancing, averaged over layers: E * sum_e f_e * P_e."""
    total = 0.0
    for lg in router_logits:
        probs = torch.softmax(lg.float(), dim=-1)
        sel = torch.topk(probs, top_k, dim=-1).indices
        f = F.one_hot(sel, n_experts).float().sum(1).mean(0) / top_k
        total = total + n_experts * (f * probs.mean(0)).sum()
    return total / max(1, len(router_logits))


def compute_losses(model, mtp, ids, mask, mtp_steps: int, weights=None):
    """ids [B, L] int64, mask [B, L] bool (loss on token j when mask[j]).

    With `weights` ([B, L] float, 0 where there is no loss) each loss is the weighted mean of
    the per-token cross entropies, computed over all positions (no boolean indexing, so no
    host synchronisation); `mask` is then ignored."""
    B, L = ids.shape
    h = model.model(input_ids=ids).last_hidden_state  # post final norm
    lm = model.lm_head
    emb = model.model.embed_tokens
    out = {}

    def ce(states, targets, m, w):
        if w is None:
            return F.cross_entropy(lm(states[m]).float(), targets[m])
        per = F.cross_entropy(lm(states).float().flatten(0, 1), targets.flatten(), reduction="none")
        w = w.flatten()
        return (per * w).sum() / w.sum().clamp_min(1e-6)

    def sl(x, a, b=None):
        return None if x is None else x[:, a:b]

    # main: position t predicts tok[t+1]
    out["main"] = ce(h[:, :-1], ids[:, 1:], sl(mask, 1), sl(weights, 1))
    # MTP draft 1: (embed tok[t+1], h_t) at RoPE t predicts tok[t+2]
    pos = torch.arange(L, device=ids.device)
    y1 = mtp(emb(ids[:, 1:]), h[:, :-1], pos[: L - 1])  # [B, L-1, H], index t
    out["mtp1"] = ce(y1[:, :-1], ids[:, 2:], sl(mask, 2), sl(weights, 2))
    if mtp_steps >= 2:
        # draft 2: (embed tok[t+2], mtp.norm output at t) at RoPE t+1 predicts tok[t+3]
        y2 = mtp(emb(ids[:, 2:]), y1[:, :-1], pos[1: L - 1])  # index t, length L-2
        out["mtp2"] = ce(y2[:, :-1], ids[:, 3:], sl(mask, 3), sl(weights, 3))
    return out


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """All experts on all tokens as two dense matmuls, each expert's output scaled by its routing
    weight (0 for the experts a token did not pick): the same function and gradients as the
    top-k sparse forward, without transformers' per-expert loop and its host synchronisations.
    8 experts of 128 make this a 256 -> 2048 -> 256 MLP: cheap at this size."""
    n, hdim = hidden_states.shape
    e, two_i, _ = self.gate_up_proj.shape
    w = torch.zeros(n, e, device=hidden_states.device, dtype=top_k_weights.dtype)
    w = w.scatter(1, top_k_index, top_k_weights)
    gu = F.linear(hidden_states, self.gate_up_proj.reshape(e * two_i, hdim)).view(n, e, two_i)
    gate, up = gu.chunk(2, dim=-1)
    act = self.act_fn(gate) * up * w.unsqueeze(-1).to(up.dtype)  # [n, e, I]
    down = self.down_proj.permute(1, 0, 2).reshape(hdim, e * (two_i // 2))  # [H, e*I]
    return F.linear(act.reshape(n, -1), down).to(hidden_states.dtype)


def set_experts(modules, impl: str):
    """impl: 'dense' (dense_experts_forward) or 'eager' (transformers' own)."""
    import types

    n = 0
    for mod in modules:
        for m in mod.modules():
            if type(m).__name__ == "Qwen3_5MoeExperts":
                if impl == "dense":
                    m.forward = types.MethodType(dense_experts_forward, m)
                elif "forward" in m.__dict__:
                    del m.forward
                n += 1
    return n


def lr_at(step, total, peak, warmup, floor=0.05):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def make_optimizer(model, mtp, lr, wd):
    decay, no_decay = [], []
    for mod in (model, mtp):
        for n, p in mod.named_parameters():
            (decay if p.ndim >= 2 and "embed_tokens" not in n else no_decay).append(p)
    kw = {"fused": True} if torch.cuda.is_available() else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def load_for_training(model_dir, seed):
    """Continue from a saved checkpoint (fp32 master weights from the bf16 files)."""
    from transformers import Qwen3_5MoeForCausalLM

    from training.model import load_mtp

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, experts_implementation="eager")
    model.config._attn_implementation = "sdpa"
    mtp = load_mtp(model_dir, model, dtype=torch.float32)
    return model, mtp


def train(args, cfg, rows_ids, rows_mask, steps, device, fh, bench=False, stream=None):
    if args.init_from:
        model, mtp = load_for_training(args.init_from, args.seed)
    else:
        model, mtp = build_model(cfg, args.seed)
    n_exp = set_experts([model, mtp], args.experts)
    log(f"experts: {args.experts} ({n_exp} expert modules)", fh)
    n_gdn = set_gdn([model, mtp], args.gdn)
    log(f"gated delta rule: {args.gdn} ({n_gdn} GatedDeltaNet modules)", fh)
    model.to(device).train()
    mtp.to(device).train()
    opt = make_optimizer(model, mtp, args.lr, args.wd)
    gates = [m for m in list(model.modules()) + list(mtp.modules()) if type(m).__name__ == "Qwen3_5MoeTopKRouter"]
    store, handles = router_hooks(gates)
    gen = torch.Generator().manual_seed(args.seed + 17)
    if stream is None:
        R = rows_ids.shape[0]
        perm, pi = torch.randperm(R, generator=gen), 0
    warmup = args.warmup if args.warmup >= 0 else max(10, int(0.04 * steps))
    timed = stream is not None and args.steps <= 0  # the schedule follows the clock (--time-budget)
    cls_w = torch.tensor([0.0, 1.0, args.w_answer], device=device)
    t0 = time.time()
    times = []
    acc, last = {}, {}
    n_long = max(1, args.batch * args.row_len // args.long_row_len) if args.long_row_len else 0
    amp = args.amp if args.amp is not None else device.type == "cuda"
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bool(amp))
    step = 0
    while True:
        if timed:
            frac = (time.time() - t0) / args.time_budget
            if frac >= 1.0:
                break
        else:
            if step >= steps:
                break
            frac = step / max(1, steps)
        weights = None
        if stream is not None:
            long_step = bool(n_long) and args.long_every > 0 and step % args.long_every == args.long_every - 1
            kind = "long" if long_step else "short"
            ids_np, cls_np = stream.take(kind, n_long if long_step else args.batch)
            ids = torch.from_numpy(ids_np).to(device, non_blocking=True).long()
            cls = torch.from_numpy(cls_np).to(device, non_blocking=True).long()
            weights = cls_w[cls]
            mask = cls > 0
        else:
            if pi + args.batch > R:
                perm, pi = torch.randperm(R, generator=gen), 0
            idx = perm[pi: pi + args.batch]
            pi += args.batch
            ids = rows_ids[idx].to(device, non_blocking=True).long()
            mask = rows_mask[idx].to(device, non_blocking=True)
        if timed:
            lr = args.lr * (step + 1) / warmup if step < warmup else lr_at(
                int(frac * 100000), 100000, args.lr, 0, args.lr_floor)
        else:
            lr = lr_at(step, steps, args.lr, warmup, args.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        ts = time.time()
        store.clear()
        with autocast:
            losses = compute_losses(model, mtp, ids, mask, args.mtp_steps, weights)
            aux = balance_loss(store, cfg["num_experts"], cfg["num_experts_per_tok"])
        loss = losses["main"] + args.w_mtp1 * losses["mtp1"] + args.w_aux * aux
        if "mtp2" in losses:
            loss = loss + args.w_mtp2 * losses["mtp2"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), args.clip)
        opt.step()
        for k, v in list(losses.items()) + [("aux", aux)]:
            acc[k] = acc.get(k, 0.0) + v.detach().float()  # summed on the device: no sync per step
        acc["n"] = acc.get("n", 0) + 1
        step += 1
        if bench:
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - ts)
            continue
        total = "~" if timed else steps
        if step % args.log_every == 0 or (not timed and step == steps):
            n = acc.pop("n")
            msg = " ".join(f"{k} {float(v) / n:.4f}" for k, v in acc.items())
            extra = ""
            if stream is not None:
                extra = " rows used/reused " + ", ".join(f"{k} {stream.used[k]}/{stream.reused[k]}" for k in stream.used)
            if device.type == "cuda":
                extra += f" peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            log(f"step {step}/{total} lr {lr:.2e} {msg} gnorm {float(gn):.2f} elapsed {time.time() - t0:.0f}s{extra}", fh)
            last = {k: float(v) / n for k, v in acc.items()}
            acc = {}
        if args.save_every and step % args.save_every == 0 and (timed or step < steps):
            save_checkpoint(model, mtp, cfg, args.out, generation_config=generation_config(args.eos_ids))
            log(f"checkpoint saved at step {step}", fh)
        if args.hard_limit and time.time() - t0 > args.hard_limit:
            log(f"hard time limit reached at step {step}; stopping early", fh)
            break
    if acc.get("n") and not last:
        n = acc.pop("n")
        last = {k: float(v) / n for k, v in acc.items()}
    step -= 1  # index of the last step done
    for h in handles:
        h.remove()
    if bench:
        return times
    return model, mtp, {"steps_done": step + 1, "train_seconds": time.time() - t0, "final_losses": last}


def generation_config(eos):
    """eos = [<|im_end|>, <|endoftext|>] ids; greedy by default."""
    import transformers

    return {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False,
            "max_new_tokens": 512, "transformers_version": transformers.__version__}


# --------------------------------------------------------------------------- eval


@torch.no_grad()
def greedy_generate(model, tok, prompts: list[list[int]], max_new: int, eos_ids: list[int], batch: int = 64):
    """Greedy continuation of each prompt with transformers' generate, in left-padded batches of
    similar length (checked on CPU to give the same tokens as one prompt at a time)."""
    out = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    dev = next(model.parameters()).device
    pad = eos_ids[-1]
    for s in range(0, len(order), batch):
        chunk = order[s: s + batch]
        width = max(len(prompts[i]) for i in chunk)
        x = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk], device=dev)
        am = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk], device=dev)
        y = model.generate(input_ids=x, attention_mask=am, max_new_tokens=max_new, do_sample=False,
                           eos_token_id=eos_ids, pad_token_id=pad)
        for j, i in enumerate(chunk):
            new = y[j, width:].tolist()
            cut = [k for k, t in enumerate(new) if t in eos_ids]
            out[i] = new[: cut[0] + 1] if cut else new
    return out


@torch.no_grad()
def evaluate(model_dir, device, n_arith=200, n_recall=50, n_tool=24, n_mtp=48, seed=1234, fh=None, tok_dir=None,
             dtype=torch.bfloat16):
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeForCausalLM

    from training.chat import prompt_text, render
    from training.data import encode_conversation
    from training.model import load_mtp
    from training.tasks import TaskGenerator, answer_is_correct

    model_dir = Path(model_dir)
    tok_dir = Path(tok_dir or model_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    gcfg = json.loads((model_dir / "generation_config.json").read_text())
    eos = gcfg["eos_token_id"]
    template = (tok_dir / "chat_template.jinja").read_text()
    model = Qwen3_5MoeForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    gen = TaskGenerator(seed=seed, split="heldout")
    res = {}

    def run(convs, name, max_new):
        prompts = [tok.encode(prompt_text(c, template), add_special_tokens=False).ids for c in convs]
        outs = greedy_generate(model, tok, prompts, max_new, eos)
        texts = [tok.decode(o, skip_special_tokens=False) for o in outs]
        ok = [answer_is_correct(c, t) for c, t in zip(convs, texts)]
        res[name] = {"n": len(convs), "accuracy": sum(ok) / len(ok),
                     "mean_prompt_tokens": float(np.mean([len(p) for p in prompts]))}
        bad = [(c["messages"][-2]["content"][-80:], t[-120:]) for c, t, k in zip(convs, texts, ok) if not k][:3]
        log(f"eval {name}: {sum(ok)}/{len(ok)} = {100 * sum(ok) / len(ok):.1f}% "
            f"(prompt ~{res[name]['mean_prompt_tokens']:.0f} tokens) failures e.g. {bad}", fh)
        return texts

    t0 = time.time()
    arith = [gen.arithmetic(thinking=True) for _ in range(n_arith)]
    run(arith, "arithmetic_thinking", 160)
    arith_nt = [gen.arithmetic(thinking=False) for _ in range(max(1, n_arith // 3))]
    run(arith_nt, "arithmetic_no_thinking", 32)
    rec = [gen.recall(thinking=True, n_facts=95) for _ in range(n_recall)]
    run(rec, "recall_1k", 64)
    rec2 = [gen.recall(thinking=True, n_facts=215) for _ in range(max(1, n_recall // 5))]
    run(rec2, "recall_2k", 64)
    # tool calls: the first assistant turn must reproduce the reference call exactly
    tools = [gen.tool(thinking=bool(i % 2), name=None) for i in range(n_tool)]
    tools = [c for c in tools if c["task"] == "tool"]
    calls = []
    for c in tools:
        first = dict(c, messages=c["messages"][: [m["role"] for m in c["messages"]].index("assistant") + 1])
        calls.append(first)
    prompts = [tok.encode(prompt_text(c, template), add_special_tokens=False).ids for c in calls]
    outs = greedy_generate(model, tok, prompts, 128, eos)
    ok = 0
    for c, o in zip(calls, outs):
        full = render(c["messages"], c["tools"], False, c["enable_thinking"], template)
        ref = full[full.rindex("<tool_call>"): full.rindex("</tool_call>") + len("</tool_call>")]
        ok += ref in tok.decode(o, skip_special_tokens=False)
    res["tool_call_exact"] = {"n": len(calls), "accuracy": ok / max(1, len(calls))}
    log(f"eval tool_call_exact: {ok}/{len(calls)}", fh)
    run(tools, "tool_answer", 96)
    res["eval_generation_seconds"] = time.time() - t0

    # MTP head vs the trunk, teacher-forced on held-out reference conversations
    mtp = load_mtp(model_dir, model).eval()
    a1 = a2 = a2c = n1 = n2 = n2c = 0
    for i in range(n_mtp):
        c = gen.sample()
        ids, mask = encode_conversation(tok, c, template)
        x = torch.tensor(ids.astype(np.int64), device=device)[None]
        L = x.shape[1]
        m = torch.tensor(mask, device=device)
        h = model.model(input_ids=x).last_hidden_state
        main_pred = model.lm_head(h).argmax(-1)[0]  # main_pred[t] predicts tok[t+1]
        pos = torch.arange(L, device=device)
        y1 = mtp(model.model.embed_tokens(x[:, 1:]), h[:, :-1], pos[: L - 1])
        d1 = model.lm_head(y1).argmax(-1)[0]  # d1[t] drafts tok[t+2]
        y2 = mtp(model.model.embed_tokens(d1[None, :-1]), y1[:, :-1], pos[1: L - 1])
        d2 = model.lm_head(y2).argmax(-1)[0]  # d2[t] drafts tok[t+3]
        T = L - 3
        sel = m[2: 2 + T]  # the drafted token t+2 is an assistant token
        acc1 = (d1[:T] == main_pred[1: 1 + T]) & sel
        sel2 = sel & m[3: 3 + T]  # both drafted tokens are assistant tokens
        acc2 = (d2[:T] == main_pred[2: 2 + T]) & acc1 & sel2
        a1 += int(acc1.sum())
        n1 += int(sel.sum())
        a2c += int(acc2.sum())
        n2c += int((acc1 & sel2).sum())
        a2 += int(acc2.sum())
        n2 += int(sel2.sum())
    res["mtp_acceptance"] = {"position1": a1 / max(1, n1), "position2_given_1": a2c / max(1, n2c),
                             "position2_cumulative": a2 / max(1, n2), "tokens": n1,
                             "note": "teacher-forced on held-out reference conversations, greedy draft vs trunk argmax"}
    log(f"eval MTP acceptance: {res['mtp_acceptance']}", fh)
    return res


# --------------------------------------------------------------------------- streaming run


def run_stream(args, cfg, tok_path, mix, device, out, fh, t_start):
    """Train on rows generated in the background (training/data.py RowStream)."""
    from training.data import RowStream

    kinds = {"short": (args.row_len, args.max_facts, mix)}
    shares = {"short": 1.0}
    if args.long_row_len:
        kinds["long"] = (args.long_row_len, args.long_max_facts, mix)
        # tokens per long step == tokens per short step; one step in long_every is long
        shares = {"short": args.long_every - 1.0, "long": 1.0}
    t = time.time()
    ramps = {"short": (args.facts_start, args.facts_ramp)} if args.facts_ramp else None
    stream = RowStream(str(tok_path), args.seed, kinds, shares, args.workers, chunk_size=args.chunk_size,
                       max_fresh_rows=args.max_fresh_rows, ramps=ramps)
    n_long = max(1, args.batch * args.row_len // args.long_row_len) if args.long_row_len else 0
    stream.wait_for({"short": 4 * args.batch, **({"long": 2 * n_long} if n_long else {})})
    log(f"row stream: first rows after {time.time() - t:.1f}s ({ {k: stream.available(k) for k in kinds} })", fh)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    steps = args.steps if args.steps > 0 else 0
    model, mtp, info = train(args, cfg, None, None, steps, device, fh, stream=stream)
    stream.close()
    info["steps"] = info["steps_done"]
    info["rows_used"], info["rows_reused"] = dict(stream.used), dict(stream.reused)
    info["tokens_seen"] = sum(stream.used[k] * kinds[k][0] for k in kinds) + sum(
        stream.reused[k] * kinds[k][0] for k in kinds)
    log(f"trained {info['steps_done']} steps in {info['train_seconds']:.0f}s; final losses {info['final_losses']}; "
        f"rows used {info['rows_used']} reused {info['rows_reused']}", fh)
    save_trained(model, mtp, cfg, out, args, fh)
    del model, mtp  # free the GPU for the evaluation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    evaluate_and_record(out, info, args, device, t_start, fh)


def save_trained(model, mtp, cfg, out, args, fh) -> None:
    """Both training modes end here: the checkpoint (and, if asked, the tokenizer files)."""
    files = save_checkpoint(model, mtp, cfg, out, generation_config=generation_config(args.eos_ids))
    if args.copy_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(TINY / name, out / name)
    log(f"saved {[f.name for f in files]} ({sum(f.stat().st_size for f in files) / 1e6:.2f} MB)", fh)


def evaluate_and_record(out, info, args, device, t_start, fh) -> None:
    """Evaluate the saved checkpoint (unless --no-eval) and write train_result.json."""
    import transformers

    result = {"train": info, "wall_seconds_before_eval": time.time() - t_start,
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args)}
    if not args.no_eval:
        result["eval"] = evaluate(out, device, args.eval_arith, args.eval_recall, args.eval_tool, args.eval_mtp, fh=fh,
                                  tok_dir=TINY)
    result["wall_seconds"] = time.time() - t_start
    (out / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"done in {result['wall_seconds']:.0f}s", fh)


# --------------------------------------------------------------------------- main


def mix_arg(text: str) -> dict | None:
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: derive from --time-budget)")
    ap.add_argument("--time-budget", type=float, default=320.0, help="seconds of training when --steps is 0")
    ap.add_argument("--hard-limit", type=float, default=0.0, help="stop training after this many seconds (0: never)")
    ap.add_argument("--bench-steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--row-len", type=int, default=2560)
    ap.add_argument("--docs", type=int, default=300000)
    ap.add_argument("--max-facts", type=int, default=230)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--w-mtp1", type=float, default=0.3)
    ap.add_argument("--w-mtp2", type=float, default=0.1)
    ap.add_argument("--w-aux", type=float, default=0.01)
    ap.add_argument("--mtp-steps", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-arith", type=int, default=200)
    ap.add_argument("--eval-recall", type=int, default=50)
    ap.add_argument("--eval-tool", type=int, default=24)
    ap.add_argument("--eval-mtp", type=int, default=48)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--save-every", type=int, default=0, help="also save the checkpoint every N steps")
    ap.add_argument("--init-from", default="", help="continue training from this checkpoint directory")
    ap.add_argument("--mix", default=None, type=mix_arg,
                    help="task mix, e.g. arithmetic=0.3,recall=0.5,tool=0.15,chat=0.05 (tasks: " + ", ".join(TASKS) + ")")
    ap.add_argument("--min-facts", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=-1, help="warm-up steps (default 4%% of steps)")
    ap.add_argument("--lr-floor", type=float, default=0.05)
    ap.add_argument("--eval-only", action="store_true", help="only evaluate the checkpoint in --out")
    ap.add_argument("--eval-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--eval-seed", type=int, default=1234)
    ap.add_argument("--eval-json", default="")
    ap.add_argument("--tok-dir", default="")
    ap.add_argument("--copy-tokenizer", action="store_true", help="also copy tokenizer files and template into --out")
    ap.add_argument("--amp", type=int, default=None, help="bf16 autocast (default: on for CUDA)")
    ap.add_argument("--experts", default="dense", choices=["dense", "eager"],
                    help="training forward of the routed experts: dense (all experts, routing-weighted, no host "
                         "syncs) or transformers' eager per-expert loop; saved checkpoints are the same either way")
    ap.add_argument("--gdn", default="roofline", choices=["roofline", "transformers"],
                    help="chunked gated delta rule in training: roofline (training/model.py's "
                         "roofline_chunk_gated_delta_rule: one triangular solve per chunk batch, fp32, far fewer ops) "
                         "or transformers' own (torch_chunk_gated_delta_rule, or fla's kernel if it found fla)")
    ap.add_argument("--stream", action="store_true",
                    help="generate rows in background workers while training (fresh data every step); "
                         "with --time-budget and no --steps the learning-rate schedule follows the clock")
    ap.add_argument("--w-answer", type=float, default=1.0,
                    help="(--stream) loss weight of the tokens of looked-up values in recall answers")
    ap.add_argument("--long-row-len", type=int, default=0, help="(--stream) length of the occasional long rows")
    ap.add_argument("--long-every", type=int, default=4, help="(--stream) every Nth step is a long-row step")
    ap.add_argument("--long-max-facts", type=int, default=230)
    ap.add_argument("--chunk-size", type=int, default=1000, help="(--stream) conversations per generated chunk")
    ap.add_argument("--max-fresh-rows", type=int, default=3000, help="(--stream) rows generated ahead at most")
    ap.add_argument("--facts-start", type=int, default=30,
                    help="(--stream, --facts-ramp) recall curriculum: max facts of the first short-row chunk")
    ap.add_argument("--facts-ramp", type=int, default=0,
                    help="(--stream) short-row chunks over which max facts grows from --facts-start to --max-facts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    out = Path(args.out)
    if args.eval_only:
        device = torch.device(args.device)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.eval_dtype]
        res = evaluate(out, device, args.eval_arith, args.eval_recall, args.eval_tool, args.eval_mtp,
                       seed=args.eval_seed, tok_dir=args.tok_dir or TINY, dtype=dtype)
        print(json.dumps(res, indent=2))
        if args.eval_json:
            Path(args.eval_json).write_text(json.dumps(res, indent=2) + "\n")
        return
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / "train_log.txt", "a")
    t_start = time.time()
    device = torch.device(args.device)
    import transformers

    log(f"args {vars(args)}", fh)
    log(f"torch {torch.__version__} transformers {transformers.__version__} device "
        f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}", fh)

    from tokenizers import Tokenizer

    tok_path = TINY / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg = tiny_config_dict(tok.get_vocab_size(), eos)
    if args.init_from:  # the checkpoint's own config (a grown model has more layers than the default one)
        cfg = {k: v for k, v in json.loads((Path(args.init_from) / "config.json").read_text()).items()
               if k != "transformers_version"}
    args.eos_ids = eos

    mix = args.mix
    if args.stream:
        run_stream(args, cfg, tok_path, mix, device, out, fh, t_start)
        return
    t = time.time()
    docs = generate_docs(str(tok_path), args.seed, args.docs, "train", args.max_facts, args.row_len, args.workers,
                         mix=mix)
    ids_np, mask_np = pack(docs, args.row_len, eos[1], args.seed)
    n_tok, n_loss = ids_np.size, int(mask_np.sum())
    log(f"data: {len(docs)} conversations -> {ids_np.shape[0]} rows x {args.row_len}; "
        f"{n_loss} loss tokens ({100 * n_loss / n_tok:.1f}%); {time.time() - t:.1f}s", fh)
    del docs
    rows_ids = torch.from_numpy(ids_np)
    rows_mask = torch.from_numpy(mask_np)
    if device.type == "cuda":
        rows_ids, rows_mask = rows_ids.to(device), rows_mask.to(device)
        torch.backends.cuda.matmul.allow_tf32 = True

    steps = args.steps
    if steps <= 0:
        times = train(args, cfg, rows_ids, rows_mask, args.bench_steps, device, fh, bench=True)
        per = float(np.median(times[2:])) if len(times) > 3 else float(np.mean(times))
        steps = max(20, int(args.time_budget / per))
        log(f"benchmark: {per * 1000:.0f} ms/step (first steps {[round(x, 2) for x in times[:3]]}) -> {steps} steps "
            f"for a {args.time_budget:.0f}s budget; reproduce with --steps {steps}", fh)
    model, mtp, info = train(args, cfg, rows_ids, rows_mask, steps, device, fh)
    info["steps"] = steps
    info["tokens_seen"] = info["steps_done"] * args.batch * args.row_len
    log(f"trained {info['steps_done']} steps in {info['train_seconds']:.0f}s; final losses {info['final_losses']}", fh)

    save_trained(model, mtp, cfg, out, args, fh)
    del model, mtp  # free the GPU for the evaluation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    evaluate_and_record(out, info, args, device, t_start, fh)


if __name__ == "__main__":
    main()
