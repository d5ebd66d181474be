"""What a request's output must look like: the :class:`StructuredOutput` spec of ``SamplingParams.structured``.

Plain data, no grammar library: the spec says *what* (a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar) and checks its own shape at construction. Turning
it into a token mask is :mod:`asyncinfer.grammar`'s job, for one model's vocabulary, when a request
carrying it is bound to that model (where a schema, regex or grammar the library refuses is an
:class:`~asyncinfer.errors.InvalidParameterError` naming ``structured``).

A spec is hashable and compares by value (two ``json_schema`` specs are equal when their schemas
are, keys in the same order: the order of ``properties`` is the order the JSON is written in): it is
the key of each model's cache of compiled grammars.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from asyncinfer.errors import InvalidParameterError, check_unicode
from asyncinfer.plain import plain_value

__all__ = ["MAX_CHOICES", "MAX_SPEC_CHARS", "StructuredKind", "StructuredOutput"]

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

#: The most characters a spec's text may hold (a schema as compact JSON, a pattern, a grammar, the
#: choices together): what compiling it may cost the engine once.
MAX_SPEC_CHARS = 65536
#: The most strings :meth:`StructuredOutput.choice` takes.
MAX_CHOICES = 1024

_NAME = "structured"


def _plain(value: object) -> object:
    """A ``str`` as the plain ``str`` it holds, a ``tuple`` as a plain tuple of its items (each ``str`` plain);
    anything else as it is (refused by the checks)."""
    if isinstance(value, tuple):
        items = tuple(plain_value(c) if isinstance(c, str) else c for c in tuple.__iter__(value))
        return value if type(value) is tuple and all(a is b for a, b in zip(items, value)) else items
    return plain_value(value) if isinstance(value, str) else value


def _too_long(what: str, chars: int) -> InvalidParameterError:
    return InvalidParameterError(_NAME, f"<{what} of {chars} characters>", f"at most {MAX_SPEC_CHARS} characters")


def _load_json(text: str) -> object:
    """``text`` parsed as JSON; InvalidParameterError when it is not JSON or is nested past what the parser
    can follow (Python's ``json`` raises RecursionError there, which no caller expects)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidParameterError(_NAME, text[:200], f"a JSON schema: not JSON ({exc})") from None
    except RecursionError:
        raise InvalidParameterError(_NAME, f"<a JSON text of {len(text)} characters nested too deeply to read>",
                                    "a JSON schema nested at most 64 levels") from None


def _canonical_json(schema: object) -> str:
    """``schema`` as compact JSON (its keys in their order); refuses anything JSON cannot hold exactly.

    The walk counts the characters the JSON will have at least (each key and string with its quotes, a
    container's brackets and commas, a number's first digit) and refuses a schema past ``MAX_SPEC_CHARS`` as soon
    as it gets there: one over HTTP can fill a 4 MiB body, and ``json.dumps`` writing it whole only to measure it
    held the GIL, and so the server's event loop and every other caller's stream, 0.3 s in one piece
    (``tests/server/test_fresh_pass32.py``)."""
    size = 0

    def grow(chars: int) -> None:
        nonlocal size
        size += chars
        if size > MAX_SPEC_CHARS:
            raise InvalidParameterError(_NAME, f"<JSON schema of more than {MAX_SPEC_CHARS} characters>",
                                        f"at most {MAX_SPEC_CHARS} characters")

    def check(value: object, depth: int) -> None:
        if depth > 64:
            raise InvalidParameterError(_NAME, "<a schema nested deeper than 64 levels>",
                                        "a JSON schema nested at most 64 levels")
        if isinstance(value, Mapping):
            grow(1)  # "{", and a "," or "}" after each item below ("{}" for none: 2 >= 1)
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidParameterError(_NAME, f"<a schema key {key!r}>",
                                                "a JSON schema whose keys are strings")
                grow(str.__len__(key) + 4)  # its quotes, ":" and what follows the item
                check(item, depth + 1)
        elif isinstance(value, (list, tuple)):
            grow(1)
            for item in value:
                grow(1)
                check(item, depth + 1)
        elif isinstance(value, str):
            grow(str.__len__(value) + 2)
        elif isinstance(value, float) and not math.isfinite(value):
            raise InvalidParameterError(_NAME, f"<a schema holding {value!r}>", "a JSON schema of finite numbers")
        elif not (value is None or isinstance(value, (int, float, bool))):
            raise InvalidParameterError(_NAME, f"<a schema holding a {type(value).__name__}>",
                                        "a JSON schema of dicts, lists, strings, numbers, booleans and None")
        else:
            grow(1)

    check(schema, 0)
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # a mapping json cannot write (not a dict): a bare TypeError before
        raise InvalidParameterError(_NAME, f"<a schema json cannot write: {exc}>",
                                    "a JSON schema of dicts, lists, strings, numbers, booleans and None") from None


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on a request's output: ``SamplingParams(structured=StructuredOutput.json_schema(...))``.

    Build it with one of the constructors; each checks its argument's shape and raises
    :class:`~asyncinfer.errors.InvalidParameterError` naming ``structured``:

    - :meth:`json_schema` — JSON that validates against a JSON schema (a dict, or its JSON text);
    - :meth:`json_object` — any JSON object;
    - :meth:`regex` — text that matches a regular expression as a whole (Rust ``regex`` syntax:
      no look-around or back-references);
    - :meth:`choice` — exactly one of a list of strings;
    - :meth:`grammar` — text of a context-free grammar: llama.cpp's GBNF (``root ::= ...``) or Lark
      (``start: ...``).

    JSON is written on one line with ``", "`` and ``": "`` between items (as Python's ``json.dumps``),
    no other whitespace. Whether the library accepts the schema, pattern or grammar (a keyword it does
    not support, a regex that does not parse) is checked when the request is bound to a model, before
    it is queued: an ``InvalidParameterError`` on ``structured`` with the library's reason.

    Fields (read-only; prefer the constructors): ``kind`` (one of ``"json_schema"``, ``"json_object"``,
    ``"regex"``, ``"choice"``, ``"grammar"``) and ``value``: the schema as compact JSON (keys in their order),
    ``""``, the pattern, the tuple of choices, or the grammar's text.
    """

    kind: StructuredKind
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        # Checked and kept as the plain str and tuple they hold: the spec is the key of each model's cache of
        # compiled grammars, and a str subclass's own __hash__ and __eq__ would decide which entry it finds.
        kind, value = _plain(self.kind), _plain(self.value)
        if kind is not self.kind:
            msgspec.structs.force_setattr(self, "kind", kind)
        if value is not self.value:
            msgspec.structs.force_setattr(self, "value", value)
        if kind not in _KINDS:
            raise InvalidParameterError(_NAME, kind, f"a StructuredOutput kind: {', '.join(_KINDS)}")
        if kind == "choice":
            if not isinstance(value, tuple) or not value or len(value) > MAX_CHOICES:
                shown = f"<{len(value)} choices>" if isinstance(value, tuple) else value
                raise InvalidParameterError(_NAME, shown, f"1 to {MAX_CHOICES} non-empty strings")
            if not all(isinstance(c, str) and c for c in value):
                raise InvalidParameterError(_NAME, value if len(value) <= 8 else f"<{len(value)} choices>",
                                            f"1 to {MAX_CHOICES} non-empty strings")
            chars = sum(len(c) for c in value)
            if chars > MAX_SPEC_CHARS:
                raise _too_long("choices", chars)
            for c in value:
                check_unicode(_NAME, c, "choice")
            return
        if not isinstance(value, str):
            raise InvalidParameterError(_NAME, value, f"a string for kind={kind!r}")
        if kind == "json_object":
            if value:
                raise InvalidParameterError(_NAME, value, "an empty value for kind='json_object'")
            return
        if not value:
            raise InvalidParameterError(_NAME, value, f"a non-empty {_WHAT[kind]}")
        if len(value) > MAX_SPEC_CHARS:
            raise _too_long(_WHAT[kind], len(value))
        check_unicode(_NAME, value, _WHAT[kind])
        if kind == "json_schema":
            schema = _load_json(value)
            if not isinstance(schema, (dict, bool)):
                raise InvalidParameterError(_NAME, value[:200], "a JSON schema (a JSON object)")

    # ---------------------------------------------------------------- constructors

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> StructuredOutput:
        """JSON that validates against ``schema``: a dict (JSON-serialisable) or its JSON text."""
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise _too_long("JSON schema", len(schema))
            text, schema = schema, _load_json(schema)
            if not isinstance(schema, Mapping):  # named as given: '5' parsed would read as an int passed
                raise InvalidParameterError(_NAME, text[:200],
                                            "a JSON schema (a dict, or its JSON text: a JSON object)")
        if not isinstance(schema, Mapping):
            raise InvalidParameterError(_NAME, schema, "a JSON schema (a dict, or its JSON text)")
        text = _canonical_json(schema)
        if len(text) > MAX_SPEC_CHARS:
            raise _too_long("JSON schema", len(text))
        return cls(kind="json_schema", value=text)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (``{...}``)."""
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Text that matches ``pattern`` as a whole (Rust ``regex`` syntax; ``^``/``$`` are implied)."""
        if not isinstance(pattern, str):
            raise InvalidParameterError(_NAME, pattern, "a regular expression (a non-empty string)")
        return cls(kind="regex", value=pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        """Exactly one of ``choices`` (non-empty strings; duplicates are dropped, the order kept)."""
        if isinstance(choices, str) or not isinstance(choices, Sequence):
            raise InvalidParameterError(_NAME, choices, f"a list of 1 to {MAX_CHOICES} non-empty strings")
        # the items it holds, up to one past the limit (a sequence whose __len__ lies, or whose __getitem__ never
        # raises IndexError, was read whole: forever)
        items = list(itertools.islice(choices, MAX_CHOICES + 1))
        if len(items) > MAX_CHOICES:
            raise InvalidParameterError(_NAME, f"<more than {MAX_CHOICES} choices>",
                                        f"1 to {MAX_CHOICES} non-empty strings")
        if not all(isinstance(c, str) for c in items):  # before they are hashed: a dict was a bare TypeError
            raise InvalidParameterError(_NAME, items if len(items) <= 8 else f"<{len(items)} choices>",
                                        f"1 to {MAX_CHOICES} non-empty strings")
        return cls(kind="choice", value=tuple(dict.fromkeys(str.__str__(c) for c in items)))

    @classmethod
    def grammar(cls, grammar: str) -> StructuredOutput:
        """Text of a context-free grammar: GBNF (llama.cpp's, ``root ::= ...``) or Lark (``start: ...``)."""
        if not isinstance(grammar, str):
            raise InvalidParameterError(_NAME, grammar, "a grammar's text (GBNF or Lark)")
        return cls(kind="grammar", value=grammar)

    # ------------------------------------------------------------------- helpers

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a ``json_schema`` spec (a new dict each call), else None."""
        return json.loads(self.value) if self.kind == "json_schema" and isinstance(self.value, str) else None


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}
