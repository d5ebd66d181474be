"""A cached GGUF tokenizer loaded without transformers: :class:`CachedTokenizer`.

A GGUF file's tokenizer is built by transformers once and saved (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``; :func:`asyncinfer.models.loader.gguf_tokenizer`). Loading that cache back through
transformers costs its import, ~1.2 s of CPU on the 2-core machine, more than the rest of a small model's load.
What the engine needs of a tokenizer is narrow: ``encode``, ``decode``, the chat template and the special
tokens. For the plain configuration transformers writes for a GGUF vocabulary (its generic ``TokenizersBackend``
class over a ``tokenizer.json`` that has its own post-processor and every named special token among its added
tokens), those are exactly the ``tokenizers`` library's ``Tokenizer`` and a Jinja rendering of the template,
so this class holds just those two: :func:`load_cached` returns one, or None for any other configuration (which
then loads through transformers as before).

Exactness, checked against transformers' own tokenizer from the same files (tests/models/test_tokenizer.py):

- ``encode(text, add_special_tokens=True)``: the backend's ids, the post-processor adding what it adds.
- ``decode(ids, skip_special_tokens=False)``: the backend's text (the configuration has no clean-up of spaces).
- ``apply_chat_template(messages, add_generation_prompt=..., tokenize=...)``: the template rendered as
  transformers renders it: a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension, a ``tojson`` filter that is ``json.dumps`` (non-ASCII kept), the globals
  ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``, and as variables ``messages`` (keys whose
  value is None dropped, a message's reasoning also given as ``reasoning_content`` and ``thinking``),
  ``tools``, ``documents``, ``add_generation_prompt`` and the named special tokens (``bos_token``,
  ``eos_token``, ...), which keyword arguments override. ``tokenize=True`` returns the ids of the rendered text
  encoded without special tokens (as a list, not transformers' dict).

The render budget. A chat template is the model file's code, run by every chat request (in a worker thread
shared with other work), so it renders on a budget (:mod:`asyncinfer.models.template_budget`), on this class and,
through :func:`render_chat`, on transformers' tokenizers too (their template rendered here, with the variables
transformers gives it: the same text). Past a limit the render stops with ``ChatTemplateLimitError`` (the engine
reports it as an ``InvalidParameterError`` on the prompt, as any template failure; text prompts are served on):

- ``MAX_TEMPLATE_WORK`` = 2**22 work units a render, plus ``TEMPLATE_WORK_PER_MESSAGE`` = 512 a message: a unit a
  loop item, a call (macro, method, filter, test), a node of a body run again, 32 characters or items of a value
  read (4 units a character for the filters that go through text in Python); 10**10 loop iterations stop
  after ~1 s, while the largest chat the engine takes (4096 messages, 2 M characters) used at most 1.9 M units
  with the templates in the tests (Mistral's) and 0.6 M with the default model's;
- ``MAX_TEMPLATE_CHARS`` = 2**25 characters written (output, a macro's or a block's buffer) and built (strings and
  lists of operators, methods, filters: an item counts as a character) in a render (the largest chat above: 9 M);
- ``MAX_TEMPLATE_VALUE_CHARS`` = 2**22 characters or items of one value, checked before it is built (``*``,
  ``+``, ``~``, ``%``, ``format``, widths, counts and replacements of str methods and filters, a list written
  out; a value compared, sorted or hashed, a list, tuple or dict held in several places counted in each);
  ``MAX_TEMPLATE_INT_BITS`` = 2**16 bits of an integer (``**``, ``*``); ``MAX_TOJSON_INDENT`` = 64;
- ``MAX_RENDERED_CHARS`` = 2**22 characters rendered (about a million tokens: more than a model takes);
- ``MAX_TEMPLATE_SOURCE_CHARS`` = 2**18 characters of source (real templates: under 20,000), checked before
  compiling: a longer one fails the model's chats, not its load; ``MAX_TEMPLATE_RANGE`` = 100,000 items of a
  ``range`` (Jinja's own sandbox limit).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

#: The named special tokens, in transformers' order: they are template variables and attributes.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# tokenizer_config.json keys that change nothing this class does (the rest send the load to transformers).
_PLAIN_KEYS = frozenset({*SPECIAL_TOKENS, "backend", "is_local", "local_files_only", "model_max_length",
                         "tokenizer_class", "clean_up_tokenization_spaces", "chat_template"})
_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"})
_REASONING = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, as templates name it

#: transformers' tokenizer options that change what a call returns or how it renders, with their defaults:
#: this class does the defaults only. Another value is refused, not ignored (``return_tensors="pt"`` gave a list,
#: ``return_dict=True`` a list where a dict was read, ``continue_final_message=True`` a closed last message).
_CALL_DEFAULTS: dict[str, Any] = {"return_tensors": None, "padding": False, "truncation": None, "max_length": None,
                                  "pad_to_multiple_of": None, "return_attention_mask": None,
                                  "return_token_type_ids": None, "return_offsets_mapping": False,
                                  "return_overflowing_tokens": False, "return_special_tokens_mask": False,
                                  "return_length": False, "stride": 0, "is_split_into_words": False,
                                  "text_pair": None}
_TEMPLATE_DEFAULTS: dict[str, Any] = {"return_tensors": None, "return_dict": False, "continue_final_message": False,
                                      "padding": False, "truncation": False, "max_length": None,
                                      "return_assistant_tokens_mask": False, "chat_template": None,
                                      "tokenizer_kwargs": None}


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` asks for what ``default`` does: itself, or "no" (None, False, 0, ``"do_not_pad"``)."""
    if value is None or value is False or value is default:
        return True
    if isinstance(value, bool):
        return value == default
    return isinstance(value, (int, str)) and (value in (0, "do_not_pad") or value == default)


def _transformers_options(call: str, given: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` less transformers' options of ``call`` left at their defaults; one set otherwise is refused."""
    from asyncinfer.errors import InvalidParameterError

    for name, value in given.items():
        if name in defaults and not _is_default(value, defaults[name]):
            raise InvalidParameterError(
                name, value, f"{defaults[name]!r} (the default) in CachedTokenizer.{call}: a GGUF file's cached "
                "tokenizer returns plain lists of ids and does the defaults of transformers' options only")
    return {name: value for name, value in given.items() if name not in defaults}


class CachedTokenizer:
    """The tokenizer of a GGUF file from its cache: ``tokenizers.Tokenizer`` plus the chat template.

    Speaks the part of transformers' tokenizer interface the engine and its users need: ``encode``,
    ``decode``, ``__call__`` (``{"input_ids": ...}``), ``apply_chat_template``, ``chat_template``,
    the named special tokens and their ids (``eos_token``, ``eos_token_id``, ...), ``special_tokens_map``,
    ``all_special_tokens``, ``all_special_ids``, ``get_vocab``, ``convert_tokens_to_ids``, ``convert_ids_to_tokens``, ``len()`` and
    ``backend_tokenizer``.
    """

    clean_up_tokenization_spaces = False

    def __init__(self, backend: Any, special_tokens: Mapping[str, str], chat_template: str | None) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map: dict[str, str] = dict(special_tokens)
        self.chat_template = chat_template
        # Compiled now, with the load, so that the first chat pays nothing more than the next. A template that does
        # not compile (too long: MAX_TEMPLATE_SOURCE_CHARS; no template; nested past Python's recursion limit or its
        # indentation) fails each chat, not the load: the model serves text prompts. (Raised here, it made every load
        # of the file take its cached tokenizer for damaged and build it again through transformers.)
        self._template: Any = None
        self._template_error: Exception | None = None
        if chat_template is not None:
            from asyncinfer.errors import exception_text
            from asyncinfer.models.template_budget import ChatTemplateLimitError

            try:
                self._template = compile_chat_template(chat_template)
            except ChatTemplateLimitError as exc:
                self._template_error = exc
            except Exception as exc:  # noqa: BLE001 - the file's template: whatever compiling it raised
                self._template_error = ValueError(
                    f"the chat template cannot be compiled ({type(exc).__name__}: {exception_text(exc)})")

    # ---------------------------------------------------------------- special tokens
    def __getattr__(self, name: str) -> Any:
        if name in SPECIAL_TOKENS:
            return self.special_tokens_map.get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKENS:
            token = self.special_tokens_map.get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, each once, in :data:`SPECIAL_TOKENS`' order."""
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]

    # ---------------------------------------------------------------- vocabulary
    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            if found is None and self.unk_token is not None:
                return self.backend_tokenizer.token_to_id(self.unk_token)
            return found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    # ---------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids. Through the library's ``encode_batch``, as transformers' tokenizers encode: it lets
        go of the GIL while it works, where ``encode`` holds it (a prompt of 600,000 characters, tokenized in a
        worker thread so that the event loop serves on, held the loop, and the engine thread, for 0.4 s)."""
        return list(self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **options: Any) -> dict[str, Any]:
        """``{"input_ids": ids}`` (a list of lists for a list of texts). transformers' options that change the result
        (``return_tensors``, ``padding``, ``truncation``, ...) are refused unless at their defaults."""
        _transformers_options("__call__", options, _CALL_DEFAULTS)
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encodings = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [list(e.ids) for e in encodings]}

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    # ---------------------------------------------------------------- chat
    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str | list[int]:
        """The conversation rendered by the chat template (see the module docstring); its ids with ``tokenize``.

        Raises:
            ValueError: the tokenizer has no chat template, its template does not compile, or the conversation is
                empty; an
                InvalidParameterError (a ValueError) for one of transformers' options this class does not do
                (``return_tensors``, ``return_dict``, ``continue_final_message``, ...) set to other than its default.
            TypeError: a message that is not a mapping.
            jinja2.TemplateError: the template refuses the conversation (its ``raise_exception``).
            ChatTemplateLimitError: the template went past a limit of its render budget (the module docstring).
        """
        if self._template_error is not None:
            raise type(self._template_error)(str(self._template_error))
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        if len(conversation) == 0:
            raise ValueError("cannot apply the chat template to an empty conversation")
        kwargs = _transformers_options("apply_chat_template", kwargs, _TEMPLATE_DEFAULTS)
        messages = [_message(m) for m in conversation]
        text = self._template.render(messages=messages, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be mappings, got {message!r}")
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING if key in plain), None)
    if reasoning is not None:  # the names templates read it under, as transformers gives them
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def chat_template_of(tokenizer: Any) -> str | None:
    """``tokenizer``'s chat template, or None where it has none to render: no tokenizer, no template, several named
    ones, or a template of nothing but whitespace (a file's ``tokenizer.chat_template = ""`` rendered every chat
    as no text, refused as "a prompt of at least one token", naming nothing of the template)."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template.strip() else None


def compile_chat_template(source: str) -> Any:
    """``source`` compiled in the sandboxed environment described in the module docstring, its ``render`` on the
    budget of :mod:`asyncinfer.models.template_budget`.

    Raises:
        ChatTemplateLimitError: a source longer than ``MAX_TEMPLATE_SOURCE_CHARS``.
        jinja2.TemplateSyntaxError: a source that is no template.
    """
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    from asyncinfer.models.template_budget import BudgetedEnvironment, check_source

    check_source(source)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (templates mark the assistant's text with it): its body."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses attribute names starting with "_"."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                _public(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            _public(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _public(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)``, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now, dict=Dict(), namespace=Namespace)
    return env.from_string(source)


def _strftime_now(fmt: str) -> str:
    from asyncinfer.models.template_budget import MAX_TEMPLATE_VALUE_CHARS, ChatTemplateLimitError

    if isinstance(fmt, str) and len(fmt) * 16 > MAX_TEMPLATE_VALUE_CHARS:
        raise ChatTemplateLimitError(f"the chat template would format a date with a format of {len(fmt)} characters")
    return datetime.now().strftime(fmt)


_COMPILED: dict[str, Any] = {}  # a template source: its template, or the exception compiling it raised
_COMPILED_MAX = 16
_COMPILED_LOCK = threading.Lock()


def _compiled(source: str) -> Any:
    """``source`` compiled once (a failure too: compiling a long template costs seconds, not each chat's)."""
    found = _COMPILED.get(source)
    if found is None:
        try:
            found = compile_chat_template(source)
        except Exception as exc:  # noqa: BLE001 - kept, and raised again (as a new exception) at each use
            found = exc
        with _COMPILED_LOCK:
            while len(_COMPILED) >= _COMPILED_MAX:
                _COMPILED.pop(next(iter(_COMPILED)))
            _COMPILED[source] = found
    if not isinstance(found, Exception):
        return found
    from asyncinfer.models.template_budget import ChatTemplateLimitError

    # a new exception each time: threads may raise it at once
    if isinstance(found, ChatTemplateLimitError):
        raise ChatTemplateLimitError(str(found))
    raise ValueError(f"the chat template cannot be compiled ({type(found).__name__}: {found})")


def render_chat(tokenizer: Any, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> str:
    """``conversation`` rendered by ``tokenizer``'s chat template, as ``tokenizer.apply_chat_template(...,
    tokenize=False)`` renders it, on the render budget (:mod:`asyncinfer.models.template_budget`), whatever
    the tokenizer: a :class:`CachedTokenizer` renders it itself; a transformers tokenizer's template (the one
    it would choose, ``get_chat_template``) is rendered here with the variables transformers gives it
    (the messages as :meth:`CachedTokenizer.apply_chat_template` makes them, ``tools``, ``documents``,
    ``add_generation_prompt``, its special tokens, then ``kwargs``).

    Raises:
        ValueError: no chat template, or an empty conversation.
        ChatTemplateLimitError: the template went past a limit of the budget.
        jinja2.TemplateError: the template refuses the conversation.
    """
    getter = getattr(tokenizer, "get_chat_template", None)
    if isinstance(tokenizer, CachedTokenizer) or not callable(getter):  # ours, or a tokenizer of the caller's own
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, tools=tools, documents=documents, **kwargs)
    source = getter(None, tools)
    if not isinstance(source, str):
        raise ValueError("this tokenizer has no chat template")  # noqa: TRY004 - transformers' error for it
    if len(conversation) == 0:
        raise ValueError("cannot apply the chat template to an empty conversation")
    special = {name: value if isinstance(value, str) else str(value)
               for name, value in dict(getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    return str(_compiled(source).render(messages=[_message(m) for m in conversation], tools=tools,
                                        documents=documents, add_generation_prompt=add_generation_prompt,
                                        **{**special, **kwargs}))


def load_cached(directory: Path) -> CachedTokenizer | None:
    """The tokenizer saved in ``directory`` as a :class:`CachedTokenizer`, or None when its configuration is one
    this class does not reproduce exactly (another tokenizer class, options that change encoding or decoding, a
    special token the vocabulary lacks, no post-processor, several chat templates): load it with transformers.

    Raises:
        OSError, ValueError: unreadable or malformed files (the caller rebuilds the cache).
    """
    files = {p.name for p in directory.iterdir() if not p.name.startswith("asyncinfer-")}
    if not files <= _FILES or not {"tokenizer.json", "tokenizer_config.json"} <= files:
        return None
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict) or not config.keys() <= _PLAIN_KEYS:
        return None
    if config.get("tokenizer_class") != "TokenizersBackend" or config.get("clean_up_tokenization_spaces", False):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if backend.post_processor is None or backend.encode_special_tokens:
        return None  # transformers would write a post-processor of its own
    special: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            return None
        special[name] = value
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    if not set(special.values()) <= added:
        return None  # transformers would add it to the vocabulary, which changes the encoding
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        if template is not None:
            return None
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None  # several named templates
    return CachedTokenizer(backend, special, template)
