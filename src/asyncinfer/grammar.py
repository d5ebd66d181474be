"""Structured output's engine side: a :class:`~asyncinfer.structured.StructuredOutput` spec compiled
for one model's vocabulary, and the per-sample matchers whose token masks the sampler applies.

Built on llguidance (the optional extra ``asyncinfer[structured]``; ``benchmarks/structured_masks.py``
measured it against xgrammar, docs/structured_output.md has the figures), imported only when a
structured request first needs it. Three objects:

- :class:`GrammarCompiler` — one per model version (``EngineCore.grammars``, built at load, cheap):
  the library's view of the vocabulary (built on first use, ~1 s) and a bounded LRU cache of compiled
  grammars keyed by spec. :meth:`GrammarCompiler.compile` is thread-safe and blocking: the engine calls
  it in a worker thread (off the event loop and off the engine thread), :meth:`GrammarCompiler.cached`
  is the loop's free look-up first.
- :class:`CompiledGrammar` — a spec compiled and checked (it parses, and some text satisfies it);
  :meth:`CompiledGrammar.matcher` gives each sample its own matcher (a copy of a template: cheap).
- :class:`GrammarMatcher` — one sample's parser state: :meth:`~GrammarMatcher.fill` writes the allowed
  tokens of the next position as a bitmask row, :meth:`~GrammarMatcher.accept` advances by a sampled
  token; :attr:`~GrammarMatcher.is_stopped` says the grammar is complete and nothing may follow.

:func:`apply_token_bitmask` sets the disallowed logits of a batch of rows to ``-inf``.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asyncinfer.errors import InvalidParameterError, is_native_panic, native_panics_as
from asyncinfer.structured import StructuredOutput

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "apply_token_bitmask",
    "bitmask_words",
    "library_missing",
]

#: Compiled grammars a model keeps (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
#: How JSON is written: one line, ``", "`` and ``": "`` between items (json.dumps's own separators).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_INSTALL = "pip install 'asyncinfer[structured]'"


def library_missing() -> str | None:
    """Why structured output cannot run here (the grammar library is not installed), or None."""
    try:
        import llguidance.hf  # noqa: F401 - the package and the part the compiler uses
    except ImportError as exc:
        return f"structured output needs llguidance ({_INSTALL}): {exc}"
    return None


def schema_refusal(schema: Any) -> str | None:
    """llguidance's reason for refusing the JSON schema ``schema`` on its own (no JSON satisfies it, say), or None when
    it takes it (or is not installed). For naming the part of a refused spec that is at fault (a tool's parameters);
    blocking, on a stack of its own as a compile is."""
    if library_missing() is not None:
        return None
    import llguidance

    def check() -> str:
        matcher = llguidance.LLMatcher
        try:
            grammar = matcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
        except ValueError as exc:
            return str(exc)
        return str(matcher.validate_grammar(grammar))

    reason = _on_compile_stack(check)
    return _reason(reason) if reason else None


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask: bit ``t % 32`` of word ``t // 32`` allows token ``t``."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t]`` to ``-inf`` where bit ``t`` of ``bitmask[i]`` is 0, in place.

    ``logits``: [rows, vocab] float on any device; ``bitmask``: [rows, >= bitmask_words(vocab)] int32 on the CPU.
    """
    rows, vocab = logits.shape
    # The complement's bits, unpacked: 1 where a token is blocked (no pass over rows x vocab to negate them).
    bits = np.unpackbits(np.invert(bitmask[:rows].numpy().view(np.uint8)), axis=-1, bitorder="little")[:, :vocab]
    blocked = torch.from_numpy(bits.view(np.bool_))
    if logits.device.type != "cpu":
        blocked = blocked.to(logits.device, non_blocking=True)
    logits.masked_fill_(blocked, float("-inf"))


MAX_REASON_CHARS = 300  # of the library's reason quoted in an error


class GrammarMatcher:
    """One sample's position in its grammar (engine thread only)."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous)."""
        out = bitmask[row]
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar does not allow it (the matcher is then in error)."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_stopped(self) -> bool:
        """Whether the grammar is complete and no token but EOS may follow (or the matcher is in error)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """The matcher's error ("" when none)."""
        return str(self._m.get_error())

    def refusal(self, spec: StructuredOutput, token_id: int, position: int) -> InvalidParameterError:
        """The request's error when its grammar could not follow a token its own mask allowed: the library
        gave up on the spec mid-way (e.g. a regex whose lexer needs more states than the library's limits
        allow), a fault of the spec, named as ``structured``; the library's reason without its state dump.
        ``position`` is the token's place in the sample's output (1 for the first), ``token_id`` its id."""
        reason = self.error.split("<state>", 1)[0].strip() or "no reason given"
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + "..."
        allowed = (f"a {_WHAT[spec.kind]} the grammar library can follow within its limits (it stopped at output "
                   f"token {position}, token id {token_id}: {reason})")
        return InvalidParameterError("structured", _shown(spec), allowed)


_AT = re.compile(r"^at \d+\(\d+\): ")  # the place in the library's own grammar text, which the caller never wrote
_EXCERPT = re.compile(r"^\s*\d+ \| ")  # the start of a quoted line of that grammar text


def _reason(text: str) -> str:
    """The library's reason for refusing a spec, as the caller can read it: without the place in and the quoted
    lines of the grammar text the library wraps a spec in (``start: /.../``) and without a matcher's state dump
    (``<state>`` and its parser's statistics, dozens of lines), cut to MAX_REASON_CHARS."""
    lines = _AT.sub("", text.split("<state>", 1)[0].strip()).splitlines()  # not the matcher's state dump
    for i, line in enumerate(lines):
        if _EXCERPT.match(line):
            lines = lines[:i]
            break
    reason = "\n".join(lines).strip() or "no reason given"
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    # cut short, the quoted spec goes first: the last "error: ..." line (the regex parser's verdict) stays whole
    verdict = next((line.strip() for line in reversed(lines) if line.startswith("error: ")), "")[:MAX_REASON_CHARS // 2]
    return reason[: MAX_REASON_CHARS - len(verdict)] + "... " + verdict


class CompiledGrammar:
    """A spec compiled for one vocabulary; :meth:`matcher` gives each sample its own state."""

    __slots__ = ("_template", "spec")

    def __init__(self, spec: StructuredOutput, template: Any) -> None:
        self.spec = spec
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


#: The stack of the thread a spec is compiled on. llguidance walks a grammar's rules recursively as it builds it,
#: and a grammar within the size limits whose rules nest through one another (1,300 rules of ``r{i} ::= "z{i}"
#: ( "a" | "b" r{i+1} )?``, 57 KB) ran past a thread's default 8 MiB and took the process down with a segfault:
#: every model and every caller's request, at one request. Reserved address space, not memory: pages are used as
#: the walk touches them.
COMPILE_STACK_BYTES = 512 * 1024 * 1024
_stack_size_lock = threading.Lock()


def _on_compile_stack(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own with a :data:`COMPILE_STACK_BYTES` stack; its result, or its exception.
    (``threading.stack_size`` is the process's setting for threads started after it: set and restored under a lock,
    around this thread's start only.)"""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, re-raised there
            error.append(exc)

    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="asyncinfer-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if error:
        raise error[0]
    return result[0]


class GrammarCompiler:
    """Compiles specs for one model's vocabulary, with a bounded LRU cache (thread-safe).

    ``tokenizer``: the model's (a fast Hugging Face tokenizer); ``vocab_size``: the model's logits
    columns; ``eos_token_ids``: the tokens that end a reply (a complete grammar allows them).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        # keyed by (namespace, spec): a namespace's compiled specs are its own (see cached())
        self._cache: OrderedDict[tuple[str | None, StructuredOutput], CompiledGrammar] = OrderedDict()
        self._held: Counter[str | None] = Counter()  # the cache's entries by namespace (see _evict)
        self._lock = threading.Lock()
        self._vocab_lock = threading.Lock()
        self._vocab: Any = None
        self._vocab_error: str | None = None
        self.compiled = 0  # specs compiled (cache misses), for tests and metrics

    def cached(self, spec: StructuredOutput, namespace: str | None = None) -> CompiledGrammar | None:
        """The compiled grammar of ``spec`` if the cache holds it for ``namespace`` (marked recently used), else
        None. ``namespace`` is the request's ``cache_salt``: requests find only the specs compiled in their own
        namespace, so that, as with cached prompt prefixes, a caller cannot tell from its time to first token
        which specs another tenant sent (``None``, requests without a salt, is one namespace of its own)."""
        key = (namespace, spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def compile(self, spec: StructuredOutput, namespace: str | None = None) -> CompiledGrammar:
        """``spec`` compiled (from ``namespace``'s entries of the cache when it holds it: :meth:`cached`).
        Blocking: call it off the event loop.

        Raises:
            InvalidParameterError: on ``structured``: the library refuses the spec (with its reason), no
                text satisfies it, or the library is not installed.
        """
        found = self.cached(spec, namespace)
        if found is not None:
            return found
        compiled = _on_compile_stack(self._compile, spec)
        key = (namespace, spec)
        with self._lock:
            if key not in self._cache:  # two threads may compile the same spec: counted once
                self._held[namespace] += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            self.compiled += 1
            while len(self._cache) > self.cache_size:
                self._evict()
        return compiled

    def _evict(self) -> None:
        """Drop the least recently used entry of the namespace holding the most entries (of those tied, the one
        whose entry was used least recently). Dropped from the whole cache's least recently used end, a caller
        sending a cache's worth of distinct specs (256 short regular expressions: 0.4 s of compiles on the default
        model's vocabulary) evicted every other tenant's, each compiled again at its next request (a GBNF grammar
        of 1,500 rules: 1.5 s); now such a caller evicts its own, and a namespace holding fewer entries than
        another keeps them. With one namespace it is a plain LRU cache. Called holding ``_lock``."""
        most = max(self._held.values())
        key = next(k for k in self._cache if self._held[k[0]] == most)  # oldest first
        del self._cache[key]
        self._held[key[0]] -= 1
        if not self._held[key[0]]:
            del self._held[key[0]]

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        missing = library_missing()
        if missing is not None:
            raise InvalidParameterError("structured", _shown(spec), f"None: {missing}")
        import llguidance

        vocabulary = self._vocabulary(spec)
        panicked = native_panics_as(lambda exc: InvalidParameterError(
            "structured", _shown(spec), f"a {_WHAT[spec.kind]} llguidance can compile (it panicked: {_reason(str(exc))})"))
        try:  # the library refuses some specs by raising (a schema number past f64, NaN, a bare `true`, ...)
            with panicked:
                grammar = _grammar_text(llguidance, spec)
                _check_schemas(spec, grammar)
                matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
                refused = matcher.is_error()
                if not refused:
                    probe = torch.zeros((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
                    GrammarMatcher(matcher).fill(probe, 0)  # also builds the lexer's first states, off the engine thread
        except InvalidParameterError:
            raise
        except ValueError as exc:  # (UnicodeEncodeError too: a text holding a lone surrogate)
            raise InvalidParameterError("structured", _shown(spec),
                                        f"a {_WHAT[spec.kind]} llguidance accepts: {_reason(str(exc))}") from None
        if refused:
            raise InvalidParameterError("structured", _shown(spec), f"a {_WHAT[spec.kind]} llguidance accepts: "
                                                                    f"{_reason(matcher.get_error())}")
        if matcher.is_error():  # compiled, but its first mask found no text to start with (a $ref loop, say)
            raise InvalidParameterError("structured", _shown(spec), f"a {_WHAT[spec.kind]} that some text satisfies "
                                                                    f"(llguidance: {_reason(matcher.get_error())})")
        if matcher.is_error() or not bool(probe.any()):
            raise InvalidParameterError("structured", _shown(spec), f"a {_WHAT[spec.kind]} that some text satisfies")
        return CompiledGrammar(spec, matcher)

    def _vocabulary(self, spec: StructuredOutput) -> Any:
        """llguidance's view of the vocabulary, built once (a tokenizer it cannot read: refused each time)."""
        with self._vocab_lock:
            if self._vocab is None and self._vocab_error is None:
                try:
                    self._vocab = _ll_tokenizer(self.tokenizer, self.vocab_size, list(self.eos_token_ids) or None)
                except Exception as exc:  # noqa: BLE001 - e.g. a slow (Python) tokenizer: no structured output
                    self._vocab_error = f"{type(exc).__name__}: {exc}"
                except BaseException as exc:  # a panic of the library's Rust code on the model's tokenizer file
                    if not is_native_panic(exc):
                        raise
                    self._vocab_error = f"the grammar library panicked reading it: {exc}"
            if self._vocab_error is not None:
                raise InvalidParameterError("structured", _shown(spec),
                                            f"None: this model's tokenizer cannot be used for it ({self._vocab_error})")
            return self._vocab


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
         "choice": "list of choices", "grammar": "grammar"}


#: A JSON schema's bound keywords: llguidance reads them as i64 for an integer range, and a bound of 2**63 or more
#: in size saturates. Two near -2**63 crashed the whole process (a segmentation fault in the library's regex of the
#: range: one caller's ``response_format`` took the server down), one above 2**63 - 1 let the range's text be
#: 9223372036854775807, outside the schema.
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: The largest size a bound may have (exclusive): 2**63, as the float the library reads it as.
MAX_SCHEMA_BOUND = float(2**63)


#: The most distinct regular expressions (``pattern``s and ``format``s) a JSON schema may ask one value to match at
#: once: a value's own, those its ``allOf`` items and ``$ref`` targets merge into it (and, for an object or an
#: array, into each of its properties and items), and the most of any one ``anyOf``/``oneOf`` alternative.
#: llguidance intersects them into one regular expression whose construction grows exponentially with their
#: number, before any of its own limits apply: 20 took 1.4 s, 25 asked for gigabytes and the process aborted
#: ("memory allocation of 8216641536 bytes failed", SIGABRT) — one caller's schema took the server down.
#: The library itself gives up on 8 to 16 such patterns (``Unable to determine if regex is empty``).
MAX_SCHEMA_PATTERNS = 8
#: The most regular-expression intersections (``&``) a Lark grammar may hold, for the same reason.
MAX_GRAMMAR_INTERSECTIONS = 8
#: The most schema objects :func:`_schema_patterns` may visit (an object once for each value it is merged into);
#: past it the schema is refused. Its walk is Python, holding the GIL: 100,000 visits take about 0.15 s.
MAX_SCHEMA_MERGE_WORK = 100_000


def _check_no_options(spec: StructuredOutput) -> None:
    """Refuse a JSON schema whose top level holds ``x-guidance``: llguidance reads its own options there, past
    those the engine sets (:data:`_JSON_OPTIONS`), and ``lenient`` (ignore the keywords it cannot enforce) or a
    ``whitespace_pattern`` (text of the caller's choosing between items) would let a reply break the schema, even
    the JSON syntax, that the engine promises it keeps.

    Raises:
        InvalidParameterError: naming ``structured``.
    """
    try:
        schema = json.loads(spec.value) if isinstance(spec.value, str) else None
    except (ValueError, RecursionError):  # not a schema the library reads either: it refuses it
        return
    if isinstance(schema, dict) and "x-guidance" in schema:
        raise InvalidParameterError("structured", _shown(spec),
                                    "a JSON schema without llguidance's own options (a top-level 'x-guidance' key: "
                                    "'lenient' or a 'whitespace_pattern' would let replies break the schema)")


def _check_schemas(spec: StructuredOutput, grammar: str) -> None:
    """Refuse a grammar whose JSON schemas (a json_schema spec's own, or a Lark grammar's ``%json {...}``) hold a
    bound of size :data:`MAX_SCHEMA_BOUND` or more (see :data:`_BOUND_KEYS`), or ask one value to match more than
    :data:`MAX_SCHEMA_PATTERNS` regular expressions, or a Lark grammar of more than
    :data:`MAX_GRAMMAR_INTERSECTIONS` intersections, before the library reads it.

    Raises:
        InvalidParameterError: naming ``structured`` and what is past its bound.
    """
    decoder = json.JSONDecoder()
    lark = not grammar.startswith("{")  # a JSON schema's and a regex's grammar is itself JSON, a Lark one is not
    if lark:
        count = _intersections(grammar)
        if count > MAX_GRAMMAR_INTERSECTIONS:
            raise InvalidParameterError("structured", _shown(spec),
                                        f"a {_WHAT[spec.kind]} of at most {MAX_GRAMMAR_INTERSECTIONS} intersections "
                                        f"(&) of regular expressions, got {count}")
    starts = [] if lark else [0]
    at = grammar.find("%json")
    while at >= 0:
        brace = grammar.find("{", at)
        if brace >= 0:
            starts.append(brace)
        at = grammar.find("%json", at + 5)
    for start in starts:
        try:
            document, _ = decoder.raw_decode(grammar, start)
        except (ValueError, RecursionError):  # not JSON (the library refuses it), or deeper than the library reads
            continue
        _check_integer_bounds(spec, document)
        schemas = [document]
        if start == 0 and isinstance(document, dict) and isinstance(document.get("grammars"), list):
            schemas = [g.get("json_schema") for g in document["grammars"] if isinstance(g, dict)]
        for schema in schemas:
            if isinstance(schema, dict):
                count = _schema_patterns(schema)
                if count > MAX_SCHEMA_PATTERNS:
                    raise InvalidParameterError(
                        "structured", _shown(spec),
                        f"a {_WHAT[spec.kind]} that asks one value to match at most {MAX_SCHEMA_PATTERNS} regular "
                        f"expressions (pattern, format) at once (merged by allOf and $ref), got {count}"
                        if count <= MAX_SCHEMA_MERGE_WORK else
                        f"a {_WHAT[spec.kind]} whose merges (allOf, $ref) visit at most {MAX_SCHEMA_MERGE_WORK} "
                        f"schema objects")


def _intersections(lark: str) -> int:
    """The ``&`` operators of a Lark grammar: those outside its string literals, regular expressions and comments."""
    count = 0
    i, n = 0, len(lark)
    while i < n:
        c = lark[i]
        if c == "/" and lark.startswith("//", i):
            end = lark.find("\n", i)
            i = n if end < 0 else end
        elif c in "\"/":
            i += 1
            while i < n and lark[i] != c and lark[i] != "\n":
                i += 2 if lark[i] == "\\" else 1
        elif c == "&":
            count += 1
        i += 1
    return count


def _resolve(root: dict, ref: str) -> object:
    """The part of ``root`` a ``$ref`` names when it is a local JSON pointer (``#``, ``#/$defs/name``, its parts
    %-encoded or not), else None."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node: object = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_REF_KEYS = ("$ref", "$dynamicRef")


def _schema_patterns(root: dict) -> int:
    """The most distinct regular expressions (``pattern``s and ``format``s) ``root`` asks any one value to match:
    see :data:`MAX_SCHEMA_PATTERNS`. A ``$ref`` that is no local JSON pointer (to an ``$anchor`` or an ``$id``,
    which the library may follow) counts as merging every pattern the schema holds. Past
    :data:`MAX_SCHEMA_MERGE_WORK` visits, a count above it."""
    try:
        return _count_patterns(root, [MAX_SCHEMA_MERGE_WORK])
    except _TooComplex:
        return MAX_SCHEMA_MERGE_WORK + 1


class _TooComplex(Exception):
    """The walk of :func:`_schema_patterns` went past :data:`MAX_SCHEMA_MERGE_WORK`."""


def _spend(budget: list[int], units: int) -> None:
    budget[0] -= units
    if budget[0] < 0:
        raise _TooComplex


def _count_patterns(root: dict, budget: list[int]) -> int:
    everything: set[tuple[str, str]] = set()
    stack: list[object] = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            everything |= _own_patterns([value])
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    seen: set[frozenset[int]] = set()
    groups: list[list[object]] = [[root]]
    worst = 0
    while groups:
        nodes, elsewhere = _merged(root, groups.pop(), budget)
        key = frozenset(id(node) for node in nodes)
        if key in seen:
            continue
        seen.add(key)
        count = len(everything if elsewhere else _own_patterns(nodes))
        children: dict[tuple[str, str], list[object]] = {}
        for node in nodes:
            for word in ("anyOf", "oneOf"):
                alternatives = node.get(word)
                if isinstance(alternatives, list) and alternatives:
                    _spend(budget, len(alternatives))
                    most = 0  # each alternative is merged with the value's own: the costliest one counts
                    for alternative in alternatives:
                        merged, far = _merged(root, [alternative], budget)
                        most = max(most, len(everything if far else _own_patterns(merged)))
                    count += most
                    groups.extend([alt] for alt in alternatives)
            for word in ("properties", "patternProperties"):
                members = node.get(word)
                if isinstance(members, dict):
                    _spend(budget, len(members))
                    for name, child in members.items():
                        children.setdefault((word, name), []).append(child)
            for word in ("items", "additionalProperties", "contains"):
                children.setdefault((word, ""), []).append(node.get(word))
            prefix = node.get("prefixItems")
            if isinstance(prefix, list):
                _spend(budget, len(prefix))
                for index, child in enumerate(prefix):
                    children.setdefault(("prefixItems", str(index)), []).append(child)
        worst = max(worst, count)
        groups.extend(group for group in children.values() if any(isinstance(child, dict) for child in group))
    return worst


def _merged(root: dict, group: list[object], budget: list[int]) -> tuple[list[dict], bool]:
    """The schemas that apply to one value: ``group``'s, and those their ``allOf`` items and ``$ref`` targets merge
    in, each once; and whether a ``$ref`` among them is no local JSON pointer."""
    out: list[dict] = []
    ids: set[int] = set()
    elsewhere = False
    stack = list(reversed(group))
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in ids:
            continue
        _spend(budget, 1)
        ids.add(id(node))
        out.append(node)
        items = node.get("allOf")
        if isinstance(items, list):
            _spend(budget, len(items))
            stack.extend(items)
        for word in _REF_KEYS:
            ref = node.get(word)
            if isinstance(ref, str):
                target = _resolve(root, ref)
                elsewhere = elsewhere or target is None
                stack.append(target)
    return out, elsewhere


def _own_patterns(nodes: list[dict]) -> set[tuple[str, str]]:
    return {(word, node[word]) for node in nodes for word in ("pattern", "format") if isinstance(node.get(word), str)}


def _check_integer_bounds(spec: StructuredOutput, document: object) -> None:
    """Refuse a JSON document holding a bound of size :data:`MAX_SCHEMA_BOUND` or more (see :data:`_BOUND_KEYS`).

    Raises:
        InvalidParameterError: naming ``structured`` and the bound.
    """
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if key in _BOUND_KEYS and isinstance(item, (int, float)) and not isinstance(item, bool) \
                        and not _bound_fits(item):
                    raise InvalidParameterError(
                        "structured", _shown(spec),
                        f"a {_WHAT[spec.kind]} whose bounds ({', '.join(_BOUND_KEYS)}) are under 2**63 "
                        f"(9223372036854775808) in size, got {key} {item!r}")
                stack.append(item)
        elif isinstance(value, list):
            stack.extend(value)


def _bound_fits(value: float) -> bool:
    try:
        return abs(float(value)) < MAX_SCHEMA_BOUND
    except OverflowError:  # an int past float's range
        return False


def _shown(spec: StructuredOutput) -> str:
    value = spec.value if isinstance(spec.value, str) else repr(list(spec.value))
    return f"{spec.kind}: {value[:200]}{'...' if len(value) > 200 else ''}"


def _grammar_text(llguidance: Any, spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (its errors are reported by the matcher built from it)."""
    M = llguidance.LLMatcher
    value = spec.value
    if spec.kind == "json_schema":
        _check_no_options(spec)
        return M.grammar_from_json_schema(value, overrides=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return M.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
    if spec.kind == "regex":
        return M.grammar_from_regex(value)
    if spec.kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if is_lark_syntax(value):
        return M.grammar_from_lark(value)
    try:  # GBNF, converted to Lark
        lark = gbnf_to_lark(value) if len(value) <= GBNF_IN_PROCESS_CHARS else _gbnf_to_lark_apart(value)
    except Exception as exc:  # noqa: BLE001 - the converter's own errors (a grammar it cannot read)
        raise InvalidParameterError("structured", _shown(spec), f"a GBNF or Lark grammar: {exc}") from None
    return M.grammar_from_lark(lark)


#: GBNF grammars longer than this are converted to Lark in a child interpreter (:func:`_gbnf_to_lark_apart`).
GBNF_IN_PROCESS_CHARS = 4096
#: The longest a child interpreter may take to convert a GBNF grammar; past it the spec is refused.
GBNF_CONVERT_SECONDS = 20.0
_CONVERT = ("import sys; from llguidance.gbnf_to_lark import gbnf_to_lark; "
            "sys.stdout.buffer.write(gbnf_to_lark(sys.stdin.buffer.read().decode('utf-8')).encode('utf-8'))")


def _gbnf_to_lark_apart(text: str) -> str:
    """``text`` (GBNF) as Lark, converted by llguidance's converter in a child interpreter. The converter is
    pure Python and quadratic in the rules (about 4 s of CPU for 2,000 rules, 0.06 s for 250): run here it
    would hold this process's GIL all that time, and every thread that releases the GIL often (the engine
    thread's step, the event loop) would wait for it at each turn (a neighbour's tokens took 17 times as
    long beside two such compiles). Apart, it costs its own core and is cut off after
    :data:`GBNF_CONVERT_SECONDS`. ValueError with the converter's reason when it fails."""
    try:
        done = subprocess.run([sys.executable, "-c", _CONVERT], input=text.encode("utf-8"), capture_output=True,
                              timeout=GBNF_CONVERT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise ValueError(f"its conversion to Lark took over {GBNF_CONVERT_SECONDS:g} s") from None
    except OSError as exc:  # no interpreter to start (an embedded Python whose sys.executable is not one)
        raise ValueError(f"a grammar this long is converted in a child interpreter, which could not start "
                         f"({type(exc).__name__}: {exc}); write it in Lark") from None
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ValueError(lines[-1] if lines else f"the converter exited with status {done.returncode}")
    return done.stdout.decode("utf-8")


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    import json

    return json.dumps(text, ensure_ascii=False)


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None) -> Any:
    """llguidance's tokenizer from the model's: its ``tokenizers`` backend (a Hugging Face fast tokenizer's
    ``backend_tokenizer``, or the engine's cached tokenizer of a GGUF file, which is the same object),
    serialised without padding or truncation. TypeError for a tokenizer without one (a slow, Python one)."""
    import llguidance
    from tokenizers import Tokenizer

    try:
        backend = tokenizer.backend_tokenizer
    except AttributeError:
        backend = None
    if not isinstance(backend, Tokenizer):
        raise TypeError("only tokenizers backed by the `tokenizers` library (fast tokenizers) are supported")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
