"""The grammar libraries for constrained decoding, measured on the engine's tokenizer: xgrammar and llguidance.

For each library that is installed, on the tokenizer of the model the engine loads (default: the
default model, SmolLM2-135M-Instruct, 49,152 tokens):

- ``tokenizer_s``: building the library's view of the vocabulary (once per model);
- per grammar (JSON schemas of growing size, "any JSON object", a regex, a choice):
  ``compile_s``, from the grammar's text to a matcher with its first mask computed (each round a
  fresh compiler, no cache: what a request with a new schema costs once);
- ``mask_us``: the per-token mask, walking a valid document's tokens: the bitmask of the allowed
  tokens computed before each token, then the token accepted (``accept_us``); median, p90 and max;
- ``apply_us``: turning one step's bitmasks into ``-inf`` logits for 1 and 32 rows of the vocabulary
  (torch shifts; numpy's ``unpackbits``, what the engine's sampler does; xgrammar's own CPU kernel, when
  installed), the copy of the logits included (``clone_only``: the copy alone).

Medians over ``--rounds``. Timings on a shared machine are noisy: compare the two libraries within one
run, and the median of several rounds.

    python benchmarks/structured_masks.py --json benchmarks/results/structured_masks.json
    python benchmarks/structured_masks.py --rounds 1 --grammars person regex       # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info

# Each grammar: (kind, spec, a document it accepts). The documents are written as a model would (one space
# after ":" and ","), and tokenized by the model's own tokenizer.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                               "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "quantity", "price"],
            },
        },
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                           "vip": {"type": "boolean"}},
            "required": ["name"],
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "items", "customer"],
}
GRAMMARS: dict[str, tuple[str, Any, str]] = {
    "person": ("json_schema", PERSON, '{"name": "Ada Lovelace", "age": 36}'),
    "order": ("json_schema", ORDER,
              ('{"id": "ABC-1234", "status": "shipped", "items": [{"sku": "pen-blue", "quantity": 3, "price": 1.5}, '
               '{"sku": "notebook", "quantity": 1, "price": 4.25}], "customer": {"name": "Grace Hopper", '
               '"email": "grace@example.com", "vip": true}, "note": null}')),
    "json_object": ("json_object", None,
                    '{"title": "A walk in the park", "tags": ["short", "calm"], "rating": 4.5, "draft": false}'),
    "regex": ("regex", r"\d{3}-\d{3}-\d{4}", "555-867-5309"),
    "choice": ("choice", ["positive", "negative", "neutral"], "neutral"),
}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Library:
    """One grammar library behind the few calls measured here."""

    name = ""

    def tokenizer(self, hf_tokenizer: Any, vocab_size: int) -> None: ...

    def matcher(self, kind: str, spec: Any) -> Any: ...

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None: ...

    def accept(self, matcher: Any, token: int) -> bool: ...


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"

    def tokenizer(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.tok = self.llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def matcher(self, kind: str, spec: Any) -> Any:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        m = M(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.version = getattr(xgrammar, "__version__", "?")

    def tokenizer(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)

    def matcher(self, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(spec))
        elif kind == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def shift_apply(logits: Any, bitmask: Any) -> None:
    """Each row's bits unpacked by torch shifts, then ``-inf`` where a bit is 0."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def numpy_apply(logits: Any, bitmask: Any) -> None:
    """The sampler's way, :func:`asyncinfer.grammar.apply_token_bitmask`: numpy's ``unpackbits``."""
    from asyncinfer.grammar import apply_token_bitmask

    apply_token_bitmask(logits, bitmask)


def time_us(fn: Callable[[], object], repeat: int = 50) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure(lib: Library, hf_tokenizer: Any, vocab_size: int, names: list[str], rounds: int) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    lib.tokenizer(hf_tokenizer, vocab_size)
    out: dict[str, Any] = {"version": lib.version, "tokenizer_s": time.perf_counter() - start, "grammars": {}}
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    for name in names:
        kind, spec, document = GRAMMARS[name]
        tokens = hf_tokenizer.encode(document, add_special_tokens=False)
        compile_s, masks, accepts = [], [], []
        for _ in range(rounds):
            start = time.perf_counter()
            m = lib.matcher(kind, spec)
            lib.fill(m, bitmask, 0)
            compile_s.append(time.perf_counter() - start)
            for i, token in enumerate(tokens):
                if not (bitmask[0, token // 32].item() >> (token % 32)) & 1:
                    raise AssertionError(f"{lib.name}: {name}'s token {i} ({token}) is not allowed by the mask")
                t0 = time.perf_counter()
                ok = lib.accept(m, token)
                accepts.append((time.perf_counter() - t0) * 1e6)
                if not ok:
                    raise AssertionError(f"{lib.name}: {name}'s token {i} ({token}) was refused")
                t0 = time.perf_counter()  # the next position's mask (after the last token: the end's)
                lib.fill(m, bitmask, 0)
                masks.append((time.perf_counter() - t0) * 1e6)
        out["grammars"][name] = {
            "tokens": len(tokens),
            "compile_s": statistics.median(compile_s),
            "mask_us": {"median": statistics.median(masks), "p90": _pct(masks, 0.9), "max": max(masks)},
            "accept_us": statistics.median(accepts),
        }
    return out


def fast_tokenizer(tokenizer: Any) -> Any:
    """The model's tokenizer as transformers' fast tokenizer, which both libraries' constructors take: itself, or
    (the engine's cached GGUF tokenizer, no transformers object) one over the same ``tokenizers`` backend."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model whose tokenizer is used (default: the engine's default model)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per grammar (median reported)")
    p.add_argument("--grammars", nargs="+", choices=sorted(GRAMMARS), default=list(GRAMMARS))
    p.add_argument("--libraries", nargs="+", choices=["llguidance", "xgrammar"], default=["llguidance", "xgrammar"])
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own setting)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from asyncinfer import AsyncEngine

    engine = AsyncEngine.from_pretrained(args.model, max_model_len=256)
    tokenizer = fast_tokenizer(engine.tokenizer)
    vocab_size = engine.model_config.vocab_size
    results: dict[str, Any] = {}
    for name in args.libraries:
        try:
            lib: Library = LLGuidance() if name == "llguidance" else XGrammar()
        except ImportError as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: NOT MEASURED ({results[name]})")
            continue
        results[name] = measure(lib, tokenizer, vocab_size, args.grammars, args.rounds)
        r = results[name]
        print(f"{name} {r['version']}: tokenizer {r['tokenizer_s'] * 1e3:.0f} ms")
        for g, f in r["grammars"].items():
            mask = f["mask_us"]
            print(f"  {g:12s} compile {f['compile_s'] * 1e3:8.2f} ms   mask/token median {mask['median']:8.1f} us"
                  f"  p90 {mask['p90']:8.1f}  max {mask['max']:8.1f}   accept {f['accept_us']:6.1f} us"
                  f"   ({f['tokens']} tokens)")

    # Applying the masks to the logits: the same for both libraries (the sampler's torch unpacking).
    apply: dict[str, float] = {}
    words = (vocab_size + 31) // 32
    gen = torch.Generator().manual_seed(0)
    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    for rows in (1, 32):
        logits = torch.randn(rows, vocab_size, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
        ways: dict[str, Callable[[Any, Any], object]] = {"torch_shifts": shift_apply, "numpy_unpackbits": numpy_apply,
                                                         "clone_only": lambda x, _: x}
        if xgrammar is not None:
            ways["xgrammar_kernel"] = xgrammar.apply_token_bitmask_inplace
        for way, fn in ways.items():
            apply[f"{way}_{rows}"] = time_us(lambda fn=fn, x=logits, m=bitmask: fn(x.clone(), m))
    print("apply a mask (us, a copy of the logits included): "
          + ", ".join(f"{k} {v:.1f}" for k, v in apply.items()))

    if args.json:
        given = argv if argv is not None else sys.argv[1:]
        record = {"command": "python benchmarks/structured_masks.py " + " ".join(given),
                  "machine": machine_info(), "model": args.model or "default", "vocab_size": vocab_size,
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "libraries": results, "apply_us": apply}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
