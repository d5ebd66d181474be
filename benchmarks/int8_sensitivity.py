"""Per-layer-type sensitivity of int8 weights on the real model: which layers tolerate int8.

For each choice of layers kept in float32, quantize the rest to int8 and compare with the
float32 model on the same teacher-forced text: top-1 agreement of the next-token prediction
and the mean KL divergence of the next-token distributions. Every variant sees the same
token ids (chat prompts followed by the float32 model's own greedy answers).

    python benchmarks/int8_sensitivity.py                # default model, 8 prompts x 64 tokens
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from asyncinfer.model_source import resolve_model
from asyncinfer.models import AttentionMetadata, load_model
from asyncinfer.models.quant import quantize_int8

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
]
VARIANTS: dict[str, tuple[str, ...]] = {
    "all int8": (),
    "lm_head fp32": ("lm_head",),
    "qkv fp32": ("qkv_proj",),
    "o_proj fp32": ("o_proj",),
    "gate_up fp32": ("gate_up_proj",),
    "down fp32": ("down_proj",),
    "attention fp32": ("qkv_proj", "o_proj"),
    "attention + lm_head fp32": ("qkv_proj", "o_proj", "lm_head"),
}


def forward_logits(model, ids: list[int], cfg) -> torch.Tensor:
    """Logits at every position of one sequence, in one prefill over a fresh paged cache."""
    n = len(ids)
    bs = 16
    blocks = -(-n // bs)
    caches = [(torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim), torch.zeros(blocks, bs, cfg.num_kv_heads,
                                                                                     cfg.head_dim))
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)), bs, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)  # [n, hidden]
        return model.compute_logits(hidden)  # [n, vocab]


def greedy_continuation(model, prompt: list[int], n: int, cfg) -> list[int]:
    ids = list(prompt)
    for _ in range(n):  # simple and slow on purpose: this is a reference, not the engine
        ids.append(int(forward_logits(model, ids, cfg)[-1].argmax()))
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    loaded = load_model(resolve_model(args.model), torch.float32, torch.device("cpu"))
    cfg, tok = loaded.config, loaded.tokenizer
    texts = []
    for q in QUESTIONS[: args.prompts]:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        texts.append((len(prompt), greedy_continuation(loaded.model, prompt, args.tokens, cfg)))
    ref = [forward_logits(loaded.model, ids, cfg)[p - 1:-1] for p, ids in texts]
    print(f"{len(texts)} prompts x {args.tokens} teacher-forced tokens; reference float32")
    print(f"{'variant':<28}{'top-1 agree':>12}{'mean KL':>10}{'weights MiB':>13}{'fwd s':>8}")
    for name, skip in VARIANTS.items():
        model = copy.deepcopy(loaded.model)
        nbytes = quantize_int8(model, skip) + sum(p.numel() * 4 for p in model.parameters())
        agree = total = 0
        kl = 0.0
        start = time.perf_counter()
        for (p, ids), r in zip(texts, ref):
            q = forward_logits(model, ids, cfg)[p - 1:-1]
            agree += int((q.argmax(-1) == r.argmax(-1)).sum())
            total += q.shape[0]
            kl += float(torch.nn.functional.kl_div(q.log_softmax(-1), r.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
        elapsed = time.perf_counter() - start
        print(f"{name:<28}{agree / total:>12.1%}{kl / total:>10.4f}{nbytes / 2**20:>13.1f}{elapsed:>8.2f}")


if __name__ == "__main__":
    main()
