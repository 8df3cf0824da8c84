"""The bundled model as a yardstick: task accuracy and MTP acceptance, measured with roofline's engine.

    python -m training.evaluate [MODEL] [--arithmetic N] [--recall N] [--recall-facts F] [--json]

Prompts come from the held-out split of training/tasks.py and are rendered with the
checkpoint's own chat template; answers are greedy. Every later optimisation (quantised
formats, fast kernels, speculation, KV compression) is checked against these numbers.
"""

from __future__ import annotations

import argparse
import json

import torch

from roofline.engine.cache import SequenceCache
from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams

from .tasks import TaskGenerator, answer_is_correct


def heldout(task: str, n: int, seed: int = 1234, **kwargs) -> list[dict]:
    gen = TaskGenerator(seed=seed, split="heldout")
    return [getattr(gen, task)(**kwargs) for _ in range(n)]


def prompt_ids(engine: Engine, conv: dict) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        conv["messages"][:-1], tools=conv.get("tools"), add_generation_prompt=True, enable_thinking=conv["enable_thinking"]
    )
    return engine.tokenizer.encode(text)


def greedy_outputs(engine: Engine, convs: list[dict], max_tokens: int = 160, batch: int = 32) -> list[list[int]]:
    """Greedy completions (token ids, the stop token included), `batch` sequences decoding together."""
    outputs: list[list[int]] = []
    for start in range(0, len(convs), batch):
        seqs = [engine.add(prompt_ids(engine, c), SamplingParams(temperature=0.0, max_tokens=max_tokens)) for c in convs[start : start + batch]]
        while engine.sequences:
            engine.step()
        outputs += [s.output_ids for s in seqs]
    return outputs


def accuracy(engine: Engine, convs: list[dict], max_tokens: int = 160) -> float:
    outputs = greedy_outputs(engine, convs, max_tokens)
    correct = [answer_is_correct(c, engine.tokenizer.decode(o, skip_special_tokens=True)) for c, o in zip(convs, outputs)]
    return sum(correct) / len(correct)


@torch.no_grad()
def mtp_acceptance(engine: Engine, convs: list[dict], max_tokens: int = 160) -> tuple[float, float]:
    """Greedy MTP draft acceptance at draft positions 1 and 2 over the models' own greedy outputs.

    At each generated position p the head drafts token p+2 from (token p+1, h_p); draft 2
    feeds the head its own post-norm output and draft token, as speculation does. Position 2
    counts only where draft 1 was right (that is when it is used). The head's cache holds
    the true history: draft 2 runs on a copy that is thrown away.
    """
    model = engine.model
    hits1 = total1 = hits2 = total2 = 0
    for conv, out in zip(convs, greedy_outputs(engine, convs, max_tokens)):
        prompt = prompt_ids(engine, conv)
        ids = torch.tensor(prompt + out, device=engine.device)
        hidden = model(ids, [len(ids)], [SequenceCache()])
        mtp_cache = SequenceCache()
        first = len(prompt) - 1  # h at the last prompt token predicts out[0]; drafts start there
        model.mtp_forward(ids[1 : first + 1], hidden[:first], [first], [mtp_cache])  # history
        for p in range(first, len(ids) - 2):
            draft_hidden = model.mtp_forward(ids[p + 1 : p + 2], hidden[p : p + 1], [1], [mtp_cache])
            draft1 = int(model.logits(draft_hidden).argmax(-1))
            total1 += 1
            if draft1 != int(ids[p + 2]):
                continue
            hits1 += 1
            if p + 3 >= len(ids):
                continue
            scratch = _copy_cache(mtp_cache)
            draft2 = int(model.logits(model.mtp_forward(torch.tensor([draft1], device=ids.device), draft_hidden, [1], [scratch])).argmax(-1))
            total2 += 1
            hits2 += int(draft2 == int(ids[p + 3]))
    return hits1 / max(total1, 1), hits2 / max(total2, 1)


def _copy_cache(cache: SequenceCache) -> SequenceCache:
    copy = SequenceCache()
    copy.num_tokens = cache.num_tokens
    for src, dst in ((cache.keys, copy.keys), (cache.values, copy.values)):
        dst.update({k: v.clone() for k, v in src.items()})
    return copy


def evaluate(engine: Engine, n_arithmetic: int, n_recall: int, recall_facts: int, mtp_samples: int) -> dict:
    recall = heldout("recall", n_recall, n_facts=recall_facts)
    recall_tokens = sum(len(prompt_ids(engine, c)) for c in recall) / max(len(recall), 1)
    arithmetic = heldout("arithmetic", n_arithmetic)
    result = {
        "arithmetic_accuracy": accuracy(engine, arithmetic),
        "recall_accuracy": accuracy(engine, recall, max_tokens=64),
        "recall_prompt_tokens_mean": recall_tokens,
        "n_arithmetic": n_arithmetic,
        "n_recall": n_recall,
    }
    if engine.model.mtp is not None and mtp_samples:
        result["mtp_acceptance_pos1"], result["mtp_acceptance_pos2"] = mtp_acceptance(engine, heldout("arithmetic", mtp_samples, seed=99))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--arithmetic", type=int, default=200)
    parser.add_argument("--recall", type=int, default=50)
    parser.add_argument("--recall-facts", type=int, default=60, help="facts per recall prompt (60 is about 1K tokens)")
    parser.add_argument("--mtp-samples", type=int, default=20)
    args = parser.parse_args()
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    print(json.dumps(evaluate(engine, args.arithmetic, args.recall, args.recall_facts, args.mtp_samples), indent=2))


if __name__ == "__main__":
    main()
