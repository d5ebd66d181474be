"""Request bodies of the OpenAI API, checked and mapped onto the engine's arguments.

A body is a JSON object. Its fields fall in four groups, per endpoint:

- mapped: turned into :class:`SamplingParams` or the engine call's arguments;
- asyncinfer's own (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
  ``stop_token_ids``, as vLLM names them, and ``priority``), sent by OpenAI clients through ``extra_body``;
- ignored: OpenAI fields that change nothing here (``store``, ``metadata``, ...);
- structured: chat's ``response_format`` and ``tools``/``tool_choice``/``parallel_tool_calls``
  (:mod:`asyncinfer.server.tools`), and vLLM's ``guided_json``, ``guided_regex``,
  ``guided_choice`` and ``guided_grammar`` on both endpoints: a
  :class:`~asyncinfer.structured.StructuredOutput` in the request's ``SamplingParams``; a spec
  the grammar library refuses is a 400 naming the body field it came from;
- neutral only: OpenAI features this server lacks (``logit_bias``, ``echo``, legacy
  ``functions``, ...). Their "off" value is accepted; anything else is a 400 naming the
  field, so a client never silently gets something other than what it asked for.

Any other field is a 400 ("Unrecognized request argument supplied"), as OpenAI
answers.

A body is decoded (:func:`decode_json`) into its endpoint's shape (:data:`CHAT_BODY`,
:data:`COMPLETION_BODY`, :data:`EMBEDDING_BODY`: msgspec Structs of the endpoint's fields): only the
fields the server reads become Python objects. An unknown field is refused where the decoder meets it,
its value unread; ignored and neutral-only fields are kept as their raw JSON text (``msgspec.Raw``),
skipped by the decoder without building anything (``metadata`` is read only when its text fits
OpenAI's limits, :data:`MAX_METADATA_BYTES`); each of ``messages`` is decoded into the keys a message
has (its content parts into their ``type`` and ``text``), its other keys skipped the same way. So a body full of bulk the server ignores costs a scan of
its bytes, never the objects. Value ranges are :class:`SamplingParams`'s own checks, but for ``temperature``: OpenAI's
[0, 2] over HTTP (:data:`MAX_TEMPERATURE`; the Python API takes up to 1e4). Defaults are OpenAI's where
they differ from the engine's: without `temperature` a request samples at 1.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from asyncinfer.errors import InvalidParameterError
from asyncinfer.prompts import CHAT_ROLES, ROLE_AS_RENDERED
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.server.errors import MAX_SHOWN_NAME, APIError, shown
from asyncinfer.server.tools import ToolFormat, ToolUse, check_tool_calls, hermes_messages, parse_tool_use
from asyncinfer.structured import StructuredOutput

MAX_PROMPTS = 256  # prompts in one /v1/completions body
MAX_SAMPLES = 256  # prompts x n in one body: one call may not flood the engine
#: The most log-probabilities (each token's and its alternatives') a whole, non-streamed answer may hold:
#: completions x max_tokens x (1 + top_logprobs). It holds them all until it is sent, at about 600 bytes each
#: while it is built (92 held, then the JSON's objects), so 256 completions of 8192 tokens with 20 alternatives
#: would take tens of GB; such a request is refused at once (stream it: a stream holds one chunk at a time).
MAX_WHOLE_LOGPROBS = 1 << 20
MAX_EMBED_INPUTS = 2048  # texts in one /v1/embeddings body (OpenAI's limit)
#: ``/v1/completions``' token limit for a body without ``max_tokens``, OpenAI's and vLLM's default (chat
#: completions without one run to the context length, as OpenAI's do).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0  # OpenAI's, for a body without `temperature` (its clients expect sampling)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; SamplingParams (the Python API) takes up to 1e4
_TEMPERATURE_RANGE = f"a number in [0, {MAX_TEMPERATURE:g}] (OpenAI's range; 0 = greedy)"
#: ``top_p`` over HTTP is OpenAI's [0, 1]; SamplingParams takes (0, 1]. 0 keeps the most likely token only, as the
#: smallest positive mass does (the sampler always keeps the first token: tests/server/test_stranger22.py).
_TOP_P_RANGE = "a number in [0, 1] (OpenAI's range; 0 = the most likely token only)"
_SMALLEST_TOP_P = math.ulp(0.0)

# SamplingParams fields a body may set under the same name.
_SAMPLING = ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
             "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's extensions
_COMMON = ("model", "user", "stream", "stream_options", "priority", *_SAMPLING, *_GUIDED)

_CHAT = (*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
         "tool_choice", "parallel_tool_calls")
_CHAT_IGNORED = ("store", "metadata", "service_tier", "prompt_cache_key",
                 "prompt_cache_retention", "safety_identifier", "reasoning_effort", "verbosity")
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}

_COMPLETION = (*_COMMON, "prompt", "logprobs", "best_of")
_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
}

_EMBEDDING = ("model", "input", "encoding_format", "dimensions", "user")

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for response_format.json_schema.name (fullmatch)
# OpenAI's own bounds on `metadata` (ignored here, but checked so its bulk is refused, not carried)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

# The most bytes of `metadata`'s JSON text that can hold OpenAI's largest (16 pairs of 64 + 512 characters,
# each written as a 12-byte escaped surrogate pair), with room for spacing; a longer text is refused unread.
MAX_METADATA_BYTES = MAX_METADATA_PAIRS * (12 * (MAX_METADATA_KEY_CHARS + MAX_METADATA_VALUE_CHARS) + 64) + 4096
_MAX_NEUTRAL_BYTES = 64  # a neutral field's "off" value is a short literal (null, {}, [], "auto", ["text"], ...)
MAX_JSON_DEPTH = 32  # nesting levels of a request body: OpenAI's bodies use a handful

# The library's roles (one definition, asyncinfer.prompts), as the template reads them; ``tool`` is checked apart.
_ROLES = {role: ROLE_AS_RENDERED.get(role, role) for role in CHAT_ROLES if role != "tool"}
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "function_call")  # what a message is read for


def _shape(name: str, read: tuple[str, ...], skipped: tuple[str, ...]) -> type[msgspec.Struct]:
    """A body's msgspec shape: ``read`` fields decoded as any JSON, ``skipped`` ones kept as raw text;
    an unknown field is a ``ValidationError`` where the decoder meets it."""
    fields: list[tuple[str, Any, Any]] = [(f, Any, msgspec.UNSET) for f in read if f not in skipped]
    fields += [(f, msgspec.Raw, msgspec.UNSET) for f in skipped]
    return msgspec.defstruct(name, fields, forbid_unknown_fields=True)


# One message's shape: the keys chat reads; any other key (`name`, ...) skipped unread. Its `content`
# is kept raw and read as a text or a list of parts, each part only for its `type` and `text`.
_MESSAGE = msgspec.defstruct("ChatMessage", [(k, msgspec.Raw if k == "content" else Any, msgspec.UNSET)
                                             for k in _MESSAGE_KEYS])
_PART = msgspec.defstruct("ContentPart", [("type", Any, msgspec.UNSET), ("text", Any, msgspec.UNSET)])


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


#: The endpoints' body shapes, for :func:`decode_json`.
CHAT_BODY = _shape("ChatBody", _CHAT, ("messages", *_CHAT_IGNORED, *_CHAT_NEUTRAL))
COMPLETION_BODY = _shape("CompletionBody", _COMPLETION, tuple(_COMPLETION_NEUTRAL))
EMBEDDING_BODY = _shape("EmbeddingBody", _EMBEDDING, ())
#: The smallest body each endpoint's shape takes, as an empty body's 400 shows it.
_EXAMPLE_BODIES: dict[type[msgspec.Struct] | None, str] = {
    CHAT_BODY: '{"messages": [{"role": "user", "content": "Hi"}]}',
    COMPLETION_BODY: '{"prompt": "Hi"}',
    EMBEDDING_BODY: '{"input": "Hi"}',
}
_UNKNOWN = re.compile(r"Object contains unknown field `(.*)`", re.DOTALL)


@functools.cache
def _decoder(shape: Any) -> msgspec.json.Decoder[Any]:
    """msgspec's JSON decoder for ``shape``, reading every number with a fraction or an exponent as Python's
    ``float()`` does: a literal beyond a 64-bit float (``1e400``) is an infinity, as Python's ``json`` reads
    it, never msgspec's "Number out of range" (a ``ValidationError`` that no field's check would name), and is
    then refused by the check of the field that holds it."""
    return msgspec.json.Decoder(shape, float_hook=float)


# msgspec's refusal of an integer literal Python will not build (more digits than sys.get_int_max_str_digits())
_INT_OUT_OF_RANGE = re.compile(r"Integer value out of range(?: - at `\$(.*)`)?", re.DOTALL)


def _decode(raw: bytes | msgspec.Raw, shape: Any = Any, where: str = "") -> Any:
    """``raw`` decoded as JSON into ``shape`` (any JSON by default): :func:`_decoder`'s reading. ``where``: the
    body field ``raw`` is (``""`` for the body itself), for the 400 naming the field that holds an integer of
    more digits than Python reads (``sys.get_int_max_str_digits()``, 4300), wherever it sits in the body, and,
    for a field's raw text (``where`` not empty), the 400 naming the field whose text is not valid JSON: a
    field kept raw was skipped unread when the body was decoded, so its strings' UTF-8 is read only here (an
    invalid byte sequence in a message's ``content`` was a ``DecodeError``, a 500)."""
    try:
        return _decoder(shape).decode(raw)
    except msgspec.ValidationError as exc:
        found = _INT_OUT_OF_RANGE.fullmatch(str(exc))
        if found is None:
            raise
        field = _field_path(where, found.group(1) or "") or None
        raise APIError(400, f"`{field}` holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                            "which this server does not read.", param=field) from None
    except msgspec.DecodeError as exc:  # (after ValidationError, its subclass)
        if not where:
            raise
        raise APIError(400, f"`{where}` is not valid JSON: {exc}.", param=where) from None


def _field_path(where: str, at: str) -> str:
    """msgspec's path below ``where`` (``.stop[1]``; ``[...]`` for a value under some key) as the body's field
    is named (``stop.[1]``)."""
    below = at.replace("[...]", "").replace("[", ".[").lstrip(".")
    return ".".join(part for part in (where, below) if part)


def decode_json(raw: bytes, shape: type[msgspec.Struct] | None = None) -> Any:
    """A request body as JSON, decoded into ``shape`` (one of the ``*_BODY`` shapes: then the dict of the
    fields it holds, skipped ones as ``msgspec.Raw``) or whole (``None``). A 400 for a body that is not JSON,
    not an object (with a shape), holds an unknown field (with a shape), or is nested deeper than
    ``MAX_JSON_DEPTH`` in what was decoded (never a ``RecursionError`` from the decoder, or later from
    whatever walks the value)."""
    try:
        value = _decode(raw, Any if shape is None else shape)
    except msgspec.ValidationError as exc:  # only with a shape: its fields are any JSON, so the body's own
        unknown = _UNKNOWN.fullmatch(str(exc))
        if unknown is None:
            raise APIError(400, "The request body must be a JSON object.") from None
        raise _unrecognized(unknown.group(1)) from None
    except msgspec.DecodeError as exc:
        field = _lone_surrogate_field(raw)
        if field is not None:
            raise APIError(400, f"`{field or 'the request body'}` holds an escaped lone surrogate (\\ud800 to "
                                "\\udfff without its pair), which is not valid Unicode text.",
                           param=field or None) from None
        raise APIError(400, f"The request body is not valid JSON: {_decode_error_words(raw, exc, shape)}") from None
    except RecursionError:
        raise _too_deep() from None
    if shape is not None:
        value = {f: v for f in value.__struct_fields__ if (v := getattr(value, f)) is not msgspec.UNSET}
    check_depth(value, MAX_JSON_DEPTH)
    return value


def _decode_error_words(raw: bytes, exc: msgspec.DecodeError, shape: type[msgspec.Struct] | None = None) -> str:
    """Why a body is not JSON, in a client's words where the decoder's would puzzle: an empty body (``curl -X POST``
    without ``-d``) is "Input data was truncated" to msgspec (the example it is shown is one its endpoint takes,
    ``shape``'s: a chat's messages, sent to /v1/embeddings, were refused as an unrecognized field), and a UTF-8
    byte-order mark (as Windows tools write it) or UTF-16 text (PowerShell's Out-File) an "invalid character (byte
    0)"."""
    if not raw.strip():
        return (f"it is empty. Send a JSON object, e.g. {_EXAMPLE_BODIES.get(shape, _EXAMPLE_BODIES[CHAT_BODY])} "
                "(curl: -H 'Content-Type: application/json' -d '{...}').")
    if raw.startswith(b"\xef\xbb\xbf"):
        return "it begins with a UTF-8 byte-order mark (EF BB BF), which JSON does not allow: send the text without it."
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(raw) > 1 and (raw[0] == 0) != (raw[1] == 0)):
        return ("it is UTF-16 text (a byte-order mark FF FE / FE FF, or a NUL byte beside each ASCII character, as "
                "PowerShell's Out-File and Notepad's \"Unicode\" write it): send it as UTF-8.")
    return str(exc)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_field(raw: bytes) -> str | None:
    """The field of a body msgspec refused that holds an escaped lone surrogate (``"\\ud800"``, which JSON's
    grammar allows but no valid Unicode text holds), named as :func:`_field_path` names fields
    (``messages.[0].content``; ``""`` for a key of the body itself), or ``None`` when the body is not JSON even
    so, or holds no such text. Python's ``json`` reads such escapes, so the 400 can name the field, as the
    issue asks of every refusal; the walk stops ``MAX_JSON_DEPTH`` levels down (a deeper body is refused as
    too deep wherever its surrogate sits)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None
    level: list[tuple[str, Any]] = [("", value)]
    for _ in range(MAX_JSON_DEPTH + 1):
        below: list[tuple[str, Any]] = []
        for where, node in level:
            if isinstance(node, str):
                if _SURROGATE.search(node):
                    return where
            elif isinstance(node, dict):
                for key, child in node.items():
                    if _SURROGATE.search(key):
                        return where
                    below.append((f"{where}.{key}" if where else key, child))
            elif isinstance(node, list):
                below.extend((f"{where}.[{i}]", child) for i, child in enumerate(node))
        if not below:
            return None
        level = below
    return None


def _too_deep() -> APIError:
    return APIError(400, f"The request body is nested deeper than this server reads ({MAX_JSON_DEPTH} levels).")


def check_depth(value: Any, levels: int) -> None:
    """A 400 when ``value`` holds containers more than ``levels`` levels below it (only what was decoded:
    a ``msgspec.Raw`` is no container)."""
    level: list[Any] = [value]
    for _ in range(levels):  # one list of containers per level, so the walk stops at the limit
        level = [child for node in level if isinstance(node, (list, dict))
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (list, dict))]
        if not level:
            return
    raise _too_deep()


def _unrecognized(key: str) -> APIError:
    shown = key if len(key) <= MAX_SHOWN_NAME else f"{key[:MAX_SHOWN_NAME]}... ({len(key)} characters)"
    return _bad(shown, f"Unrecognized request argument supplied: {shown}")


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, msgspec.Raw) and len(value) == 4 and bytes(value) == b"null")


_NOT_NEUTRAL = object()  # what a neutral field's raw text too long to be an "off" value stands for


def _plain(value: Any, max_bytes: int, where: str) -> Any:
    """A skipped field's value (the body's field ``where``): decoded from its raw text when that is at most
    ``max_bytes`` long (else ``_NOT_NEUTRAL``, unread); a value already decoded (a body given as a dict) as it is."""
    if not isinstance(value, msgspec.Raw):
        return value
    if len(value) > max_bytes:
        return _NOT_NEUTRAL
    try:
        return _decode(value, Any, where)
    except RecursionError:  # within a few KiB of text: nested past the decoder's limit
        raise _too_deep() from None


def _fields(body: Any, allowed: tuple[str, ...], ignored: tuple[str, ...] = (),
            neutral: Mapping[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """The body's mapped fields (``None`` values dropped); refuses unknown and non-neutral ones."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    neutral = neutral or {}
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in neutral:
            value = _plain(value, _MAX_NEUTRAL_BYTES, key)
            if not any(value == ok and type(value) is type(ok) for ok in neutral[key]):
                accepted = " or ".join(json.dumps(ok) for ok in neutral[key])
                raise _bad(key, f"`{key}` is not supported by this server (accepted: {accepted}).",
                           "unsupported_parameter")
        elif key in allowed:
            if not _is_null(value):
                out[key] = value
        elif key not in ignored:
            raise _unrecognized(key)
        elif isinstance(value, msgspec.Raw):  # ignored, never read: its UTF-8 is checked here, or never
            _check_utf8(value, key)
    return out


def _typed(fields: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = fields.get(key)
    if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is int)):
        raise _bad(key, f"`{key}` must be {what}, got {shown(value)}.")
    return value


@dataclass(frozen=True)
class _Common:
    """What every generation endpoint shares."""

    model: str | None
    user: str | None
    stream: bool
    include_usage: bool
    priority: int | None
    sampling: dict[str, Any]  # SamplingParams keywords, max_tokens possibly missing
    max_tokens_field: str  # the body field that set max_tokens ("max_completion_tokens" in chat)
    structured_field: str  # the body field that set SamplingParams.structured (when one did)

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """The request's parameters. Without `temperature` it samples at OpenAI's default, 1 (the engine's
        own default is greedy); without a token limit it has the endpoint's default (:meth:`default_limit`),
        cut where prompt + output reach the model's context length."""
        kw = {"temperature": DEFAULT_TEMPERATURE, **self.sampling}
        if kw.get("top_p") == 0 and not isinstance(kw["top_p"], bool):
            kw["top_p"] = _SMALLEST_TOP_P
        if "max_tokens" not in kw:
            kw.update(max_tokens=self.default_limit(max_model_len), truncate_output_to_model_len=True)
        try:
            params = SamplingParams(**kw)
        except InvalidParameterError as exc:
            if exc.parameter == "max_tokens":
                raise InvalidParameterError(self.max_tokens_field, exc.value, exc.allowed) from None
            if exc.parameter == "temperature":  # the HTTP range, not the Python API's (a negative one too)
                raise InvalidParameterError("temperature", exc.value, _TEMPERATURE_RANGE) from None
            if exc.parameter == "top_p":  # the HTTP range: 0 too
                raise InvalidParameterError("top_p", exc.value, _TOP_P_RANGE) from None
            raise
        if params.temperature > MAX_TEMPERATURE:  # a number by now: SamplingParams checked its type
            raise InvalidParameterError("temperature", kw["temperature"], _TEMPERATURE_RANGE)
        if params.logprobs is not None and not self.stream:
            held = self.num_prompts * params.n * params.max_tokens * (1 + params.logprobs)
            if held > MAX_WHOLE_LOGPROBS:
                raise InvalidParameterError(
                    "logprobs", params.logprobs,
                    f"at most {MAX_WHOLE_LOGPROBS} log-probabilities in a whole answer, got completions x token limit "
                    f"x (1 + alternatives) = {self.num_prompts * params.n} x {params.max_tokens} x "
                    f"{1 + params.logprobs} = {held}: stream it (`stream: true`), or lower `n`, the token limit "
                    "or the alternatives")
        return params

    @property
    def num_prompts(self) -> int:
        return 1

    def default_limit(self, max_model_len: int) -> int:
        """The token limit of a body without one: chat runs to the context length, as OpenAI's does."""
        return max_model_len

    def field(self, parameter: str) -> str:
        """The body field an engine parameter name stands for (this body's own token-limit field)."""
        if parameter == "structured":
            return self.structured_field
        return self.max_tokens_field if parameter == "max_tokens" else self.rename(parameter)

    @staticmethod
    def rename(parameter: str) -> str:
        """The body field an engine parameter name stands for, whatever the body."""
        return parameter

    @property
    def n(self) -> int:
        n = self.sampling.get("n", 1)
        return n if isinstance(n, int) else 1


def _common(fields: dict[str, Any]) -> dict[str, Any]:
    model = _typed(fields, "model", str, "a string")
    user = _typed(fields, "user", str, "a string")
    stream = bool(_typed(fields, "stream", bool, "a boolean"))
    priority = _typed(fields, "priority", int, "an integer")
    options = _typed(fields, "stream_options", dict, "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "`stream_options` is only allowed when `stream` is true.")
        extra = sorted(set(options) - {"include_usage", "include_obfuscation"})
        if extra:
            raise _bad(f"stream_options.{extra[0]}"[:MAX_SHOWN_NAME],
                       f"Unrecognized argument in `stream_options`: {extra[0][:MAX_SHOWN_NAME]}")
        for key in ("include_usage", "include_obfuscation"):
            if options.get(key) is not None and not isinstance(options[key], bool):
                raise _bad(f"stream_options.{key}", f"`stream_options.{key}` must be a boolean, got "
                                                    f"{shown(options[key])}.")
        if options.get("include_obfuscation") is True:  # OpenAI's padding of each chunk against size side channels
            raise _bad("stream_options.include_obfuscation", "`stream_options.include_obfuscation` is not supported by "
                       "this server (accepted: null or false): its chunks carry no `obfuscation` field.",
                       "unsupported_parameter")
        include_usage = options.get("include_usage") is True
    sampling = {k: fields[k] for k in _SAMPLING if k in fields}
    common = {"model": model, "user": user, "stream": stream, "include_usage": include_usage, "priority": priority,
              "sampling": sampling, "max_tokens_field": "max_tokens", "structured_field": "structured"}
    guided = [k for k in _GUIDED if k in fields]
    if len(guided) > 1:
        raise _bad(guided[1], f"At most one of {', '.join(_GUIDED)} may be set, got {' and '.join(guided)}.")
    if guided:
        _constrain(common, guided[0], _guided(guided[0], fields[guided[0]]))
    return common


def _constrain(common: dict[str, Any], field: str, spec: StructuredOutput) -> None:
    """Set the request's ``structured`` spec, from body field ``field`` (only one field may set it)."""
    if "structured" in common["sampling"]:
        raise _bad(field, f"`{field}` cannot be combined with `{common['structured_field']}`: both constrain the "
                          "output.")
    common["sampling"]["structured"] = spec
    common["structured_field"] = field


def _spec(field: str, build: Any, value: Any) -> StructuredOutput:
    """``build(value)``, its shape error as a 400 naming ``field``."""
    try:
        return build(value)  # type: ignore[no-any-return]
    except InvalidParameterError as exc:
        raise _bad(field, f"`{field}` is invalid: {shown(exc.value)} (allowed: {exc.allowed}).") from None


def _guided(field: str, value: Any) -> StructuredOutput:
    if field == "guided_json":
        if not isinstance(value, (dict, str)):
            raise _bad(field, "`guided_json` must be a JSON schema (an object, or its JSON text).")
        return _spec(field, StructuredOutput.json_schema, value)
    if field == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _bad(field, "`guided_choice` must be a list of strings.")
        return _spec(field, StructuredOutput.choice, value)
    if not isinstance(value, str):
        raise _bad(field, f"`{field}` must be a string.")
    return _spec(field, StructuredOutput.regex if field == "guided_regex" else StructuredOutput.grammar, value)


def _response_format(value: Any) -> tuple[str, StructuredOutput] | None:
    """Chat's ``response_format``: None for text, else the body field of its spec and the spec."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format", '`response_format` must be an object with a `type`: "text", "json_object" '
                                      'or "json_schema".')
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise _bad(f"response_format.{extra[0]}", f"Unrecognized argument in `response_format`: {extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutput.json_object()
    if kind != "json_schema":
        raise _bad("response_format.type", '`response_format.type` must be "text", "json_object" or "json_schema", '
                                           f"got {shown(kind)}.")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "`response_format.json_schema` must be an object with a `name` "
                                                  "(and a `schema`, a JSON schema; without one, any JSON object).")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad("response_format.json_schema.name", "`response_format.json_schema.name` must be 1 to 64 "
                                                       f"letters, digits, '_' or '-', got {shown(name)}.")
    for key, kinds, what in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise _bad(f"response_format.json_schema.{key}", f"`response_format.json_schema.{key}` must be {what}.")
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:  # OpenAI's `schema` is optional: without one, any JSON object
        return field, StructuredOutput.json_object()
    if not isinstance(schema, dict):
        raise _bad(field, f"`{field}` must be a JSON schema (an object).")
    return field, _spec(field, StructuredOutput.json_schema, schema)


@dataclass(frozen=True)
class ChatRequest(_Common):
    """A checked ``/v1/chat/completions`` body."""

    messages: list[dict[str, str]]  # as the template renders them in the Hermes format: the tools' system message
    # included, the history's calls and results written into the text
    top_logprobs: int | None  # the engine's ``logprobs`` when the body asked for them
    tool_use: ToolUse | None  # the tools the model may call (None: no tools, or tool_choice "none")
    # The messages checked, as chat templates read them: an assistant's ``tool_calls`` (arguments decoded) and
    # ``tool`` messages (with ``tool_call_id``) kept as such, for a format whose template renders them.
    history: list[dict[str, Any]]

    @staticmethod
    def rename(parameter: str) -> str:
        """The body field an engine parameter name stands for."""
        if parameter == "prompt":
            return "messages"
        if parameter.startswith("prompt["):
            return "messages.[" + parameter.removeprefix("prompt[")
        return {"logprobs": "top_logprobs"}.get(parameter, parameter)

    @property
    def prompt_also(self) -> tuple[str, ...]:
        """The body's fields other than ``messages`` rendered into the prompt: ``tools`` where they are shown to
        the model (not with ``tool_choice: "none"``)."""
        return ("tools",) if self.tool_use is not None else ()

    @property
    def has_tool_turns(self) -> bool:
        """The history holds an assistant's tool calls or a tool's result."""
        return any(m["role"] == "tool" or "tool_calls" in m for m in self.history)

    def in_format(self, fmt: ToolFormat) -> ChatRequest:
        """This request for a model whose tool format is ``fmt``: its tools bound to it, and a forced call's
        grammar in its syntax (a 400 on ``tools`` when that grammar is refused). Parsing made them Hermes's."""
        if self.tool_use is None or self.tool_use.format is fmt:
            return self
        use = self.tool_use.bound(fmt)
        sampling = dict(self.sampling)
        if use.forced:
            sampling["structured"] = _calls_grammar(use)
        return replace(self, tool_use=use, sampling=sampling)


def _calls_grammar(use: ToolUse) -> StructuredOutput | None:
    try:
        return use.structured()
    except InvalidParameterError as exc:  # the tools fit one by one, their calls' grammar together does not
        raise _bad("tools", f"`tools` cannot be constrained to: their calls' grammar is {exc.value} (allowed: "
                            f"{exc.allowed}); offer fewer or smaller tools.") from None


def parse_chat(body: Any) -> ChatRequest:
    fields = _fields(body, _CHAT, _CHAT_IGNORED, _CHAT_NEUTRAL)
    common = _common(fields)
    if "max_completion_tokens" in fields:
        common["sampling"]["max_tokens"] = fields["max_completion_tokens"]
        common["max_tokens_field"] = "max_completion_tokens"
    want = _typed(fields, "logprobs", bool, "a boolean")
    top = fields.get("top_logprobs")
    if top is not None and not want:
        raise _bad("top_logprobs", "`top_logprobs` requires `logprobs` to be true.")
    if want:
        common["sampling"]["logprobs"] = 0 if top is None else top
    _check_metadata(body.get("metadata"))
    if "messages" not in fields:
        raise _bad("messages", "Missing required parameter: 'messages'.")
    history = chat_history(fields["messages"])
    messages = hermes_messages(history)
    if "response_format" in fields:
        fmt = _response_format(fields["response_format"])
        if fmt is not None:
            _constrain(common, *fmt)
    tool_use = parse_tool_use(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"))
    if tool_use is not None:
        messages = tool_use.with_prompt(messages)
        calls = _calls_grammar(tool_use)
        if calls is not None:
            _constrain(common, "tools", calls)
    return ChatRequest(**common, messages=messages, top_logprobs=top, tool_use=tool_use, history=history)


def _check_metadata(metadata: Any) -> None:
    """`metadata` (ignored) within OpenAI's limits: at most 16 pairs of strings, keys up to 64 characters,
    values up to 512."""
    metadata = _plain(metadata, MAX_METADATA_BYTES, "metadata")
    if metadata is None:
        return
    check_depth(metadata, MAX_JSON_DEPTH - 1)  # as deep in the body as the limit allows
    if not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
            and all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS
                    and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items())):
        raise _bad("metadata", f"`metadata` must be an object of at most {MAX_METADATA_PAIRS} string pairs, keys of at "
                               f"most {MAX_METADATA_KEY_CHARS} characters and values of at most "
                               f"{MAX_METADATA_VALUE_CHARS}.")


def chat_history(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages checked, as chat templates read them: ``{"role", "content"}`` (text parts joined by
    newlines; ``developer`` as ``system``), an assistant's ``tool_calls`` as
    :func:`asyncinfer.server.tools.check_tool_calls` gives them, a ``tool`` message with its
    ``tool_call_id``. Anything malformed is a 400 naming its field."""
    if isinstance(value, msgspec.Raw):
        value = _messages(value)
    if not isinstance(value, list) or not value:
        raise _bad("messages", "`messages` must be a non-empty list of messages.")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"`{where}` must be an object with `role` and `content`.")
        role = message.get("role")
        if role == "function" or message.get("function_call"):
            raise _bad(where, "Legacy function messages are not supported by this server: use `tool_calls` and "
                              "`tool` messages.", "unsupported_parameter")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise _bad(f"{where}.tool_call_id", f"`{where}.tool_call_id` must be a string.")
            out.append({"role": "tool", "tool_call_id": message["tool_call_id"],
                        "content": _content(message.get("content"), role, where)})
            continue
        if not isinstance(role, str) or role not in _ROLES:  # (a list or an object is unhashable: no lookup)
            raise _bad(f"{where}.role", f"`{where}.role` must be one of {shown(sorted([*_ROLES, 'tool']))}, got {shown(role)}.")
        turn: dict[str, Any] = {"role": _ROLES[role], "content": _content(message.get("content"), role, where)}
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = check_tool_calls(message["tool_calls"], where)
            if calls:
                turn["tool_calls"] = calls
        elif message.get("tool_calls") is not None:
            raise _bad(f"{where}.tool_calls", f"Only assistant messages carry `tool_calls`, not {shown(role)} ones.")
        out.append(turn)
    return out


def _messages(raw: msgspec.Raw) -> Any:
    """``messages`` from its raw text: each message an object of the keys chat reads (any other key
    skipped unread), a message that is no object left as its raw text (refused by the caller), and
    ``None`` for anything but a list."""
    try:
        items = _decode(raw, list[msgspec.Raw], "messages")
    except msgspec.ValidationError:
        return None
    except RecursionError:
        raise _too_deep() from None
    out: list[Any] = []
    for i, item in enumerate(items):
        try:
            message = _decode(item, _MESSAGE, f"messages.[{i}]")
        except msgspec.ValidationError:
            out.append(item)
            continue
        except RecursionError:
            raise _too_deep() from None
        fields = {k: v for k in _MESSAGE_KEYS if (v := getattr(message, k)) is not msgspec.UNSET}
        if "content" in fields:
            fields["content"] = _message_content(fields["content"], f"messages.[{i}].content")
        _check_utf8(item, f"messages.[{i}]")  # its other keys were skipped unread (its content's parts: named above)
        check_depth(fields, MAX_JSON_DEPTH - 2)  # body > messages > this message
        out.append(fields)
    return out


def _message_content(raw: msgspec.Raw, where: str) -> Any:
    """A message's ``content`` (the body's field ``where``) from its raw text: a text, ``None``, or a list of
    parts (each an object of its ``type`` and ``text``, other keys skipped unread; an array part stands as an
    empty list, anything else as itself); anything else as its raw text (refused by the caller, whatever it
    holds)."""
    try:
        return _decode(raw, str | None, where)
    except msgspec.ValidationError:
        pass
    try:
        items = _decode(raw, list[msgspec.Raw], where)
    except msgspec.ValidationError:
        return raw
    parts: list[Any] = []
    for j, item in enumerate(items):
        try:
            part = _decode(item, _PART, f"{where}.[{j}]")
        except msgspec.ValidationError:  # not an object: refused, naming its JSON type
            parts.append([] if bytes(memoryview(item)[:1]) == b"[" else _decode(item, Any, f"{where}.[{j}]"))
            continue
        _check_utf8(item, f"{where}.[{j}]")  # its other keys were skipped unread
        parts.append({k: v for k in ("type", "text") if (v := getattr(part, k)) is not msgspec.UNSET})
    return parts


_UTF8_SLICE = 64 * 1024  # bytes of a raw value checked at a time (_check_utf8)


def check_body_utf8(raw: bytes) -> None:
    """A 400 when the body ``raw`` holds bytes that are not UTF-8 anywhere, once it was decoded and checked field by
    field (each field's own check names it first): a key given twice is read as its last copy, and the first copy of
    a field kept as raw text was dropped unread, its bytes never checked."""
    at = _invalid_utf8_at(raw)
    if at is not None:
        raise APIError(400, f"The request body is not valid JSON: invalid UTF-8 at byte {at} (where no field read "
                            "holds it: in the first copy of a key given twice, say, of which the last is read).")


def _check_utf8(raw: msgspec.Raw, where: str) -> None:
    """A 400 naming ``where`` when ``raw``'s text is not UTF-8. msgspec checks the UTF-8 of the strings it decodes
    only: an object's keys the decode skips unread (a message's ``name``, a content part's ``cache_control``) were
    never checked, and such a body was answered 200 where the same bytes in a field read were a 400."""
    at = _invalid_utf8_at(raw)
    if at is not None:
        raise APIError(400, f"`{where}` is not valid JSON: invalid UTF-8 at byte {at} of its text.", param=where)


def _invalid_utf8_at(raw: bytes | msgspec.Raw) -> int | None:
    """Where ``raw``'s text stops being UTF-8 (None: it is UTF-8 throughout)."""
    # read in slices of the body's own memory, each decoded and dropped: a message of megabytes of ignored bulk is
    # checked without a copy of it (tests/server/test_ignored_bulk.py holds the decode's memory to that)
    view, decoder = memoryview(raw), codecs.getincrementaldecoder("utf-8")()
    for start in range(0, len(view), _UTF8_SLICE):
        try:
            decoder.decode(view[start : start + _UTF8_SLICE], start + _UTF8_SLICE >= len(view))
        except UnicodeDecodeError as exc:
            return start + exc.start
    return None


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"`{where}.content` must be a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            at = f"{where}.content.[{j}]"
            raise _bad(at, f'`{at}` must be a content part, {{"type": "text", "text": ...}}, got {shown(part)}.')
        if part.get("type") == "text" and not isinstance(part.get("text"), str):
            at = f"{where}.content.[{j}].text"
            raise _bad(at, f"`{at}` must be a string (the part's text), got "
                           f"{'nothing' if part.get('text') is None else shown(part['text'])}.")
        if part.get("type") != "text":
            raise _bad(f"{where}.content.[{j}]", f"Only text content parts are supported, got {shown(part.get('type'))}.",
                       "unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


@dataclass(frozen=True)
class CompletionRequest(_Common):
    """A checked ``/v1/completions`` body; ``prompts`` are texts or token-id lists."""

    prompts: list[str | list[int]]

    @staticmethod
    def rename(parameter: str) -> str:
        return "prompt" if parameter.startswith("prompt") else parameter

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def default_limit(self, max_model_len: int) -> int:
        """OpenAI's (and vLLM's) default for completions: 16 tokens (fewer where the context ends first)."""
        return COMPLETIONS_DEFAULT_MAX_TOKENS


def parse_completion(body: Any) -> CompletionRequest:
    fields = _fields(body, _COMPLETION, (), _COMPLETION_NEUTRAL)
    common = _common(fields)
    if "logprobs" in fields:
        common["sampling"]["logprobs"] = fields["logprobs"]
    best_of = _typed(fields, "best_of", int, "an integer")
    if best_of is not None and best_of != common["sampling"].get("n", 1):
        raise _bad("best_of", "`best_of` is not supported by this server (only equal to `n`).", "unsupported_parameter")
    if "prompt" not in fields:
        raise _bad("prompt", "Missing required parameter: 'prompt'.")
    request = CompletionRequest(**common, prompts=completion_prompts(fields["prompt"]))
    if len(request.prompts) * request.n > MAX_SAMPLES:
        raise _bad("n", f"At most {MAX_SAMPLES} completions per request (prompts x n), got "
                        f"{len(request.prompts)} x {request.n}.")
    return request


def completion_prompts(value: Any) -> list[str | list[int]]:
    """A prompt, a list of prompts, token ids, or a list of token-id lists, as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [list(value)]
    if isinstance(value, list) and 0 < len(value) <= MAX_PROMPTS:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_ids(p) for p in value):
            return [list(p) for p in value]
    raise _bad("prompt", f"`prompt` must be a string, a list of 1 to {MAX_PROMPTS} strings, a list of token ids, "
                         "or a list of token-id lists.")


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked ``/v1/embeddings`` body."""

    model: str | None
    texts: list[str]
    base64: bool
    dimensions: int | None
    user: str | None = None  # the tenant where ServerSettings.tenant_from="request"


def _token_id(value: Any) -> bool:
    """Whether ``value`` is written as a token id (an integer; JSON's ``true`` is no id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_embedding(body: Any) -> EmbeddingRequest:
    fields = _fields(body, _EMBEDDING)
    model = _typed(fields, "model", str, "a string")
    user = _typed(fields, "user", str, "a string")
    dimensions = _typed(fields, "dimensions", int, "an integer")
    fmt = fields.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f'`encoding_format` must be "float" or "base64", got {shown(fmt)}.')
    value = fields.get("input")
    if value is None:
        raise _bad("input", "Missing required parameter: 'input'.")
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and (all(_token_id(t) for t in texts) or all(
            isinstance(t, list) and all(_token_id(i) for i in t) for t in texts)):
        raise _bad("input", "Token-id input is not supported by this server: send the text.", "unsupported_parameter")
    if not (isinstance(texts, list) and 0 < len(texts) <= MAX_EMBED_INPUTS
            and all(isinstance(t, str) for t in texts)):
        raise _bad("input", f"`input` must be a string or a list of 1 to {MAX_EMBED_INPUTS} strings.")
    if any(t == "" for t in texts):  # as OpenAI's: an empty string has nothing to embed
        raise _bad("input", "`input` cannot hold an empty string: every text to embed needs at least one character.")
    return EmbeddingRequest(model, list(texts), fmt == "base64", dimensions, user)
