"""What each weight format costs in quality on the real model, against plain float32.

For every format (the engine's ``quantization`` / ``quantization_skip`` / ``pack_weights``),
on a copy of the same loaded model:

(a) teacher-forced top-1 agreement with plain float32 over a held-out text
    (``benchmarks/data/heldout.txt``, plain English prose written for this project), read in
    prefill chunks of ``--chunk`` tokens;
(b) greedy decoding of ``--prompts`` chat prompts (chat template applied; plain text without one) for ``--tokens`` new
    tokens, prompts decoded together: the fraction of prompts whose tokens are all identical to
    float32's and the mean common-prefix fraction; for the block formats also one prompt at a time
    (their kernels take another path below ``kernels.PANEL_MIN_ROWS`` rows);
The block formats (``q8_0``, ``q4_1``) run on asyncinfer's kernels, decode attention included.
    With ``activation_dtype="int8"`` rows too (the block formats' kernels rounding a step's activations to
    int8, llama.cpp's numerics); for every block format also (a) read a token per step over the first
    ``--step-tokens`` tokens ("top1_agreement_token_by_token"): the path a decode takes, where the
    activations are rounded with int16 (a prefill chunk of PANEL_MIN_ROWS tokens or more multiplies float32
    activations with int16 in the avx2 and scalar kernel variants, int16 ones in the AVX-512 variants; int8 rounds
    every step).
(c) with ``--sensitivity``: int8's per-layer-kind sensitivity, (a) for int8 everywhere except
    one kind of projection, and for int8 on one kind only.

    python benchmarks/quality.py --sensitivity --json benchmarks/results/quality.json

The quality gates (tests/models/test_quality_gates.py) run a short version of (a) and (b).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUESTIONS, git_commit, machine_info

from asyncinfer import kernels
from asyncinfer.model_source import resolve_model
from asyncinfer.models import load_model
from asyncinfer.models.quality import (
    batched_greedy,
    formatted,
    greedy_match,
    teacher_forced_argmax,
    top1_agreement,
)
from asyncinfer.models.quant import BLOCK_FORMATS, BlockLinear, can_pack, default_skip, weight_bytes

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
PACK = can_pack(torch.device("cpu"), torch.float32)

#: (name, quantization, quantization_skip, pack_weights, activation_dtype).
FORMATS: tuple[tuple[str, str | None, tuple[str, ...], bool, str], ...] = (
    ("float32 packed (dtype='float32')", None, (), PACK, "int16"),
    ("float16 (CPU default without a block format)", "float16", (), PACK, "int16"),
    (f"int8, default skip {default_skip('int8')}", "int8", default_skip("int8"), PACK, "int16"),
    ("int8, no skip", "int8", (), PACK, "int16"),
    ("q8_0 (asyncinfer's kernels)", "q8_0", (), PACK, "int16"),
    ("q8_0, activation_dtype='int8'", "q8_0", (), PACK, "int8"),
    ("q4_1, head q8_0 (this GGUF's default)", "q4_1", (), PACK, "int16"),
    ("q4_1, activation_dtype='int8'", "q4_1", (), PACK, "int8"),
)


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The first ``n`` benchmark questions, each as a one-turn chat with the generation prompt; for a model without
    a chat template (a base model's GGUF, a file written by make_gguf.py), each question as plain text (said once on
    stdout)."""
    out = []
    for question in QUESTIONS[:n]:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 tokenize=False)
        except ValueError as exc:  # no chat template, or one that does not compile: the questions as plain text
            if not out:
                print(f"[quality] no chat template to apply ({exc}): the prompts are the questions as plain text")
            return [tokenizer.encode(q, add_special_tokens=True) for q in QUESTIONS[:n]]
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def reference_inputs(tokenizer: Any, model: str, n: int, context: int) -> dict[str, Any]:
    """The held-out text's tokens (its first ``context``, the model's context length, where it holds more) and the
    prompts; SystemExit with the reason where the model's tokenizer cannot give them (it has none, or it encodes the
    text to almost nothing)."""
    if tokenizer is None:
        raise SystemExit(f"quality.py: {model} has no tokenizer; the held-out text and the prompts are text, so it "
                         "needs a model with one (tokenizer files beside its weights, or a GGUF file's vocabulary)")
    text = tokenizer.encode(HELDOUT.read_text(), add_special_tokens=False)
    if len(text) < 2:
        raise SystemExit(f"quality.py: {model}'s tokenizer encodes the held-out text ({HELDOUT.name}) to "
                         f"{len(text)} token(s): it reads none of this text (the load's log says why)")
    if len(text) > context:
        print(f"[quality] the held-out text is {len(text)} tokens, the model's context {context}: reading its first "
              f"{context}")
        text = text[:context]
    return {"text": text, "prompts": chat_prompts(tokenizer, n)}


def measure(model: torch.nn.Module, ref: dict[str, Any], args: argparse.Namespace, greedy: bool) -> dict[str, Any]:
    """(a), and (b) when ``greedy``, of one formatted model against the float32 reference."""
    start = time.perf_counter()
    row: dict[str, Any] = {"top1_agreement": round(top1_agreement(ref["argmax"], teacher_forced_argmax(
        model, ref["text"], args.chunk)), 4)}
    if greedy:
        identical, prefix = greedy_match(ref["greedy"], batched_greedy(model, ref["prompts"], args.tokens))
        row |= {"greedy_identical": round(identical, 4), "greedy_prefix": round(prefix, 4)}
        if any(isinstance(m, BlockLinear) for m in model.modules()):
            # A token per step: below kernels.PANEL_MIN_ROWS rows the kernels round activations (int16 or int8).
            n = args.step_tokens
            row["top1_agreement_token_by_token"] = round(top1_agreement(ref["argmax"][:n], teacher_forced_argmax(
                model, ref["text"][:n], 1)), 4)
            # One prompt at a time too: below kernels.PANEL_MIN_ROWS rows the kernels round activations.
            alone = [batched_greedy(model, [p], args.tokens)[0] for p in ref["prompts"]]
            identical, prefix = greedy_match(ref["greedy"], alone)
            row |= {"greedy_identical_alone": round(identical, 4), "greedy_prefix_alone": round(prefix, 4)}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def sensitivity(base: torch.nn.Module, ref: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """int8 everywhere but one kind, then int8 on one kind only: teacher-forced top-1 agreement."""
    rows = []
    variants = [(f"all int8 but {k}", (k,)) for k in KINDS] + [
        (f"only {k} int8", tuple(o for o in KINDS if o != k)) for k in KINDS]
    variants += [("all int8 but down_proj and lm_head", ("down_proj", "lm_head"))]
    for name, skip in variants:
        row = {"variant": name, "quantization_skip": list(skip)} | measure(
            formatted(base, "int8", skip, pack=PACK), ref, args, greedy=False)
        print(f"  {name:<40}{row['top1_agreement']:>10.2%}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the teacher-forced text (tokens)")
    ap.add_argument("--step-tokens", type=int, default=768,
                    help="tokens of the text read one per step for the block formats (default 768)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), torch.float32, torch.device("cpu"))
    base, tok = loaded.model, loaded.tokenizer
    ref = reference_inputs(tok, args.model or "the default model", args.prompts, base.config.max_position_embeddings)
    ref["argmax"] = teacher_forced_argmax(base, ref["text"], args.chunk)
    ref["greedy"] = batched_greedy(base, ref["prompts"], args.tokens)
    print(f"held-out text: {len(ref['text'])} tokens, chunks of {args.chunk}; {len(ref['prompts'])} chat prompts x "
          f"{args.tokens} greedy tokens; reference: plain float32 (F.linear)")
    print(f"{'format':<46}{'top-1':>8}{'greedy same':>13}{'prefix':>8}{'weights MiB':>13}")
    rows = []
    for name, method, skip, pack, act in FORMATS:
        if method in BLOCK_FORMATS and not kernels.available():
            print(f"{name:<46} not measured: {kernels.unavailable_reason()}")
            continue
        row = {"format": name, "quantization": method, "quantization_skip": list(skip), "pack_weights": pack,
               "activation_dtype": act, "weight_bytes": weight_bytes(loaded.config, 4, method, skip)}
        row |= measure(formatted(base, method, skip, pack=pack, activation_dtype=act), ref, args, greedy=True)
        rows.append(row)
        alone = (f"   (one prompt at a time: {row['greedy_identical_alone']:.2%} same, prefix "
                 f"{row['greedy_prefix_alone']:.2%}; top-1 a token a step {row['top1_agreement_token_by_token']:.2%})"
                 if "greedy_identical_alone" in row else "")
        print(f"{name:<46}{row['top1_agreement']:>8.2%}{row['greedy_identical']:>13.2%}{row['greedy_prefix']:>8.2%}"
              f"{row['weight_bytes'] / 2**20:>13.1f}{alone}", flush=True)
    result: dict[str, Any] = {"formats": rows}
    if args.sensitivity:
        print("int8 sensitivity (teacher-forced top-1 agreement with float32):")
        result["int8_sensitivity"] = sensitivity(base, ref, args)
    if args.json:
        result["meta"] = {"command": "python benchmarks/quality.py " + " ".join(sys.argv[1:]),
                          "date": datetime.date.today().isoformat(), "commit": git_commit(), "machine": machine_info(),
                          "text_tokens": len(ref["text"]), "prompts": len(ref["prompts"]), "new_tokens": args.tokens,
                          "chunk": args.chunk, "step_tokens": args.step_tokens, "reference": "plain float32 (F.linear), same loaded weights"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
