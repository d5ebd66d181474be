"""From what a caller passes to a validated :class:`Request`: prompts, ids, texts.

Runs before anything is queued, so every error here is an
:class:`InvalidParameterError` raised at the call, and nothing is left behind.
A prompt whose tokenization costs more than :data:`OFF_LOOP_CHARS` characters of text
(:func:`prompt_cost`: its characters, plus :data:`ITEM_COST_CHARS` for each chat
message the template renders) is tokenized in a worker thread (the engine does that), and so is
any prompt that comes once the loop has tokenized that much in its current turn (:class:`LoopShare`),
after :func:`check_prompt_chars` refused, without tokenizing, any prompt too long to
ever fit and any chat of more than :data:`MAX_CHAT_MESSAGES` messages. Texts must be
valid Unicode: a lone surrogate (``"\ud800"``) is refused here, naming the prompt,
rather than by the tokenizer. Everything is checked as :func:`plain_prompt` makes it (built-in
``str``, ``list`` and ``dict``), so a subclass whose ``__len__`` lies cannot slip past a limit.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncinfer.errors import (
    InvalidParameterError,
    MaxTokensOverContextError,
    PromptTooLongError,
    check_unicode,
    native_panics_as,
)
from asyncinfer.plain import plain_value
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams, plain_params

if TYPE_CHECKING:  # (the model-free checks, used before any model is loaded, import no torch)
    from asyncinfer.holder import ModelVersion

Prompt = str | Sequence[int] | Sequence[dict[str, str]]

MAX_EMBED_TEXTS = 65536
#: The longest tenant name (``embed(tenant=...)``, and the server's tenants, whose names head its request ids).
MAX_TENANT_CHARS = 128
MAX_REQUEST_ID_CHARS = 512  # ids are kept per request and copied into every output
#: The longest ``cache_salt``: the prefix cache keeps a request's salt in its first cached block (the root of its
#: hash chain) and the grammar cache in its keys, after the request has ended, until they are evicted.
MAX_CACHE_SALT_CHARS = 512
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # lower is more urgent; policies do float math on it
OFF_LOOP_CHARS = 4096  # prompts costlier than this (prompt_cost) are tokenized in a worker thread, not on the loop
#: The most messages a chat prompt may hold (refused before any is looked at).
MAX_CHAT_MESSAGES = 4096
#: What one chat message (rendered by the template) or one embed() text costs to tokenize besides its
#: characters, counted in characters of text (prompt_cost, texts_cost).
ITEM_COST_CHARS = 64
#: The most items a sequence other than a list or a tuple is read for (through its own ``__getitem__``, until it
#: raises IndexError): more than any prompt's token ids, chat's messages or embed() call's texts.
MAX_SEQUENCE_ITEMS = 2**22


class LoopShare:
    """How much tokenizing one engine does on the event loop in one turn of it: at most :data:`OFF_LOOP_CHARS`
    of cost (:func:`prompt_cost`, :func:`texts_cost`) together. A prompt within the limit alone is still
    tokenized in a worker thread when the calls before it in the same turn used the share: a burst of many
    short prompts (an HTTP call of 256 of them, a caller's ``gather`` of as many calls) would otherwise hold
    the loop for their sum, every other caller waiting. A turn is what the loop runs between two looks at its
    sockets: the share comes back with the next one."""

    def __init__(self, chars: int = OFF_LOOP_CHARS) -> None:
        self.chars = chars
        self._used = 0
        self._renewing = False

    def take(self, cost: int) -> bool:
        """Whether work of ``cost`` may run on the loop now (then it counts against this turn's share);
        False: run it in a worker thread. Call it on the loop."""
        if cost > self.chars - self._used:
            return False
        if cost and not self._renewing:  # the share comes back once this turn's ready callbacks have run
            asyncio.get_running_loop().call_soon(self._renew)
            self._renewing = True
        self._used += cost
        return True

    def _renew(self) -> None:
        self._used = 0
        self._renewing = False


def plain_text(value: Any) -> Any:
    """A ``str`` (of a subclass too) as the plain ``str`` it holds; anything else as it is.

    ``str.__str__`` copies the characters themselves: a subclass's own ``__str__`` or ``__len__``
    cannot change what the checks then count."""
    return str.__str__(value) if isinstance(value, str) else value


def plain_prompt(prompt: Any) -> Any:
    """``prompt`` in built-in types, so that every check looks at its real content, not at what a
    subclass's ``__len__`` (or ``__bool__``) says: a text as a plain ``str``; a list, tuple or other
    sequence of token ids or chat messages as a plain ``list`` of the items it holds (:func:`plain_list`;
    its token ids are read as plain ints once its length is checked, :func:`prompt_token_ids`); each chat message (up
    to :data:`MAX_CHAT_MESSAGES` of them: a longer chat is refused by its real count) as a plain ``dict`` of
    plain ``str`` keys and values. Bytes, ranges and other values are returned as they are (the checks
    refuse them). The engine's calls do this first of all."""
    if isinstance(prompt, str):
        return plain_text(prompt)
    items = plain_list(prompt, "prompt")
    if items is None:
        return prompt
    if len(items) <= MAX_CHAT_MESSAGES and items and isinstance(items[0], dict):
        items = [_plain_message(m) for m in items]
    return items


def plain_list(value: Any, name: str = "prompt") -> list[Any] | None:
    """A list or tuple as a plain list of the items it holds (whatever a subclass's ``__iter__`` or
    ``__len__`` says), another sequence as the list of its first items, up to :data:`MAX_SEQUENCE_ITEMS` (one whose
    ``__getitem__`` never raises IndexError is endless: read whole, it held the caller's loop, and every request on
    it, while the list grew until memory ran out); None for a ``str``, bytes, a range or a value that is no
    sequence. ``InvalidParameterError`` naming ``name`` for a sequence of more items."""
    if isinstance(value, list):
        return list(list.__iter__(value))
    if isinstance(value, tuple):
        return list(tuple.__iter__(value))
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, range)):
        items = list(itertools.islice(value, MAX_SEQUENCE_ITEMS + 1))
        if len(items) > MAX_SEQUENCE_ITEMS:
            raise InvalidParameterError(name, f"<a {type(value).__name__} of more than {MAX_SEQUENCE_ITEMS} items>",
                                        f"a sequence of at most {MAX_SEQUENCE_ITEMS} items")
        return items
    return None


def _plain_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    return {plain_text(k): plain_text(v) for k, v in dict.items(message)}


#: The parameters of a request given none: ``SamplingParams()``'s defaults, cut at the model's context.
DEFAULT_PARAMS = SamplingParams(truncate_output_to_model_len=True)


def check_request_args(params: SamplingParams | None, priority: Any,
                       cache_salt: Any) -> tuple[SamplingParams, int, str | None]:
    """The request's parameters, checked as they hold now (``None`` params: the defaults, their ``max_tokens`` cut
    where the context ends, as the HTTP server's default is: a caller who chose no limit is not refused for the
    default's 128 tokens on a short ``max_model_len``), its priority as the
    plain ``int`` and its cache salt as the plain ``str`` they hold (:func:`~asyncinfer.plain.plain_value`): the
    engine thread compares the one and hashes the other, and a subclass's own methods would run there (a salt
    whose ``__hash__`` raised failed its neighbours' step)."""
    priority, cache_salt = plain_value(priority), plain_value(cache_salt)
    if params is None:
        params = DEFAULT_PARAMS
    elif not isinstance(params, SamplingParams):
        raise InvalidParameterError("params", params, "a SamplingParams instance or None")
    else:  # checked again as what it holds now (a subclass, a stop list grown since): the request's own copy
        params = plain_params(params)
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidParameterError("priority", priority, f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS):
        shown = cache_salt if not isinstance(cache_salt, str) else f"<{len(cache_salt)} chars>"
        raise InvalidParameterError("cache_salt", shown, f"a string of at most {MAX_CACHE_SALT_CHARS} characters, or None")
    if cache_salt is not None:  # as every other text a caller gives (a tenant, a request id, a prompt)
        check_unicode("cache_salt", cache_salt)
    return params, priority, cache_salt


def make_request(
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    priority: int,
    cache_salt: str | None,
    max_model_len: int,
) -> Request:
    """A :class:`Request` from checked arguments and the prompt's token ids (length-checked here)."""
    check_prompt_len(prompt_ids, max_model_len, params)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        params=params,
        arrival_time=time.time(),
        priority=priority,
        cache_salt=cache_salt,
    )


def check_prompt_len(prompt_ids: list[int], max_model_len: int, params: SamplingParams | None = None) -> None:
    """Refuse a prompt that leaves no room to generate (a :class:`PromptTooLongError`, as a prompt refused by its
    size before tokenizing is) and, as vLLM's server does, a prompt plus ``params.max_tokens`` over
    ``max_model_len`` (unless ``params.truncate_output_to_model_len``)."""
    if len(prompt_ids) >= max_model_len:
        raise past_context(max_model_len, prompt_tokens=len(prompt_ids))
    if params is not None:
        _check_max_tokens(params, max_model_len, len(prompt_ids))


def check_room_for_max_tokens(max_model_len: int, params: SamplingParams) -> None:
    """Refuse, before any prompt is tokenized, a ``params.max_tokens`` that no prompt leaves room for (a prompt takes
    one token at least, so ``max_model_len - 1`` is the most), as :func:`check_prompt_len` would refuse it once the
    prompt is tokenized (unless ``params.truncate_output_to_model_len``)."""
    _check_max_tokens(params, max_model_len, None)


def _check_max_tokens(params: SamplingParams, max_model_len: int, prompt_len: int | None) -> None:
    """The one ``max_tokens`` rule: at most the room a prompt of ``prompt_len`` tokens leaves (None: not tokenized
    yet, one token at least)."""
    room = max_model_len - (1 if prompt_len is None else prompt_len)
    if params.max_tokens <= room or params.truncate_output_to_model_len:
        return
    if prompt_len is None:
        allowed = f"at most max_model_len - 1 = {room} (a prompt takes one token at least; or "
    else:
        allowed = (f"at most max_model_len - prompt tokens = {max_model_len} - {prompt_len} = {room} (or shorten"
                   " the prompt, or ")
    raise MaxTokensOverContextError(
        params.max_tokens, allowed + "SamplingParams(truncate_output_to_model_len=True) to stop at max_model_len)",
        max_model_len=max_model_len, prompt_tokens=prompt_len)


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is (meant as) chat messages: a non-empty list whose first item is a dict."""
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray, range))
            and len(prompt) > 0 and isinstance(prompt[0], dict))


def prompt_chars(prompt: Any) -> int:
    """Characters of text a prompt holds (its messages' roles and contents; 0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if is_chat(prompt):
        return sum(len(v) for m in prompt if isinstance(m, dict) for v in (m.get("role"), m.get("content"))
                   if isinstance(v, str))
    return 0


def prompt_cost(prompt: Any) -> int:
    """What tokenizing ``prompt`` costs, in characters of text: its characters, plus
    :data:`ITEM_COST_CHARS` for each chat message (the template renders every one,
    empty or not). Over :data:`OFF_LOOP_CHARS`, it is tokenized in a worker thread.

    A chat message's characters are those of every key and value it holds, not only its role and content: a
    template may render any of them (a ``name``, a reasoning, tool calls), and the text it renders is tokenized
    (a message with a ``name`` of a million characters, counted as its content alone, was rendered and tokenized
    on the event loop: 1.2 s with every other caller waiting). A value that is no text, number, list or dict (an
    object a template renders through its own ``__str__``) makes the chat cost more than the loop's share."""
    if is_chat(prompt):
        limit = OFF_LOOP_CHARS + 1
        cost = ITEM_COST_CHARS * len(prompt)
        for message in prompt:
            if cost >= limit:
                break
            cost += _held_chars(message, limit - cost)
        return cost
    return prompt_chars(prompt)


def _held_chars(value: Any, limit: int) -> int:
    """The characters of text ``value`` holds (a string, a number as written out, or the keys and values of the
    lists, tuples and dicts nested in it, each item counting at least one), read as the built-in types hold them
    and counted up to ``limit`` (reached at once by an object of another type: its text is unknown)."""
    total = 0
    stack = [value]
    while stack and total < limit:
        item = stack.pop()
        if isinstance(item, str):
            total += max(str.__len__(item), 1)
        elif isinstance(item, (list, tuple, dict)):
            total += 1
            items = (dict.items(item) if isinstance(item, dict)
                     else list.__iter__(item) if isinstance(item, list) else tuple.__iter__(item))
            stack.extend(itertools.islice(items, limit - total))  # never more than can be counted
        elif item is None or isinstance(item, (bool, float)):
            total += 24  # the longest a float is written out
        elif isinstance(item, int):
            total += int.bit_length(item) // 3 + 2  # at least its decimal digits and a sign
        else:
            return limit
    return min(total, limit)


def texts_cost(texts: Sequence[str]) -> int:
    """What tokenizing ``embed()``'s texts costs, in characters (:func:`prompt_cost`'s measure)."""
    return sum(map(len, texts)) + ITEM_COST_CHARS * len(texts)


def too_long(value: str, allowed: str, **sizes: int) -> PromptTooLongError:
    """The refusal of a prompt by its size alone (:func:`check_chat_size`, :func:`check_prompt_chars`), before any
    token is counted: :func:`asyncinfer.history.trim_messages` reads it from ``count_tokens`` as over any budget.
    ``sizes``: :class:`PromptTooLongError`'s ``max_model_len``, ``prompt_tokens`` or ``prompt_chars``."""
    return PromptTooLongError(value, allowed, **sizes)


def past_context(max_model_len: int, *, prompt_tokens: int | None = None, prompt_chars: int | None = None,
                 chars_limit: int | None = None) -> PromptTooLongError:
    """The one refusal of a prompt that leaves no room to generate in ``max_model_len``: ``prompt_tokens`` of them
    (counted or a list of ids), or ``prompt_chars`` characters of text, more than ``chars_limit`` (what
    ``max_model_len`` tokens of the vocabulary can hold), refused before tokenizing."""
    allowed = f"at most max_model_len - 1 = {max_model_len - 1} tokens"
    if prompt_tokens is not None:
        return too_long(f"<{prompt_tokens} tokens>", allowed, max_model_len=max_model_len, prompt_tokens=prompt_tokens)
    assert prompt_chars is not None and chars_limit is not None
    return too_long(f"<{prompt_chars} characters>", f"{allowed} (no text over {chars_limit} characters fits)",
                    max_model_len=max_model_len, prompt_chars=prompt_chars)


def check_chat_size(prompt: Any) -> None:
    """Refuse a chat of more than :data:`MAX_CHAT_MESSAGES` messages before looking at any of them."""
    if is_chat(prompt) and len(prompt) > MAX_CHAT_MESSAGES:
        raise too_long(f"<{len(prompt)} chat messages>", f"at most {MAX_CHAT_MESSAGES} chat messages")


def check_prompt_chars(prompt: Any, version: ModelVersion) -> None:
    """Refuse, without tokenizing, a prompt too long to fit ``max_model_len`` tokens whatever its tokens.

    No token of the vocabulary decodes to more than ``version.max_token_chars``
    characters, so a longer text needs more tokens than the model takes; a list of
    token ids is refused by its length before its ids are checked; a chat of more than
    :data:`MAX_CHAT_MESSAGES` messages is refused before any is looked at.
    """
    check_chat_size(prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray)) and not is_chat(prompt):
        if len(prompt) >= version.max_model_len:
            raise past_context(version.max_model_len, prompt_tokens=len(prompt))
        return
    chars = prompt_chars(prompt)
    limit = version.max_model_len * version.max_token_chars
    if chars > limit:
        raise past_context(version.max_model_len, prompt_chars=chars, chars_limit=limit)


def check_request_id(request_id: Any) -> str:
    """``request_id`` as the plain ``str`` it holds (:func:`plain_text`), checked: the engine thread keys its
    tables by it, and a ``str`` subclass's ``__hash__`` or ``__eq__`` would run there, in every step (one that
    raised killed the engine for everyone)."""
    request_id = plain_text(request_id)
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        shown = request_id if not isinstance(request_id, str) or len(request_id) <= 64 else f"<{len(request_id)} chars>"
        raise InvalidParameterError("request_id", shown, f"a string of 1 to {MAX_REQUEST_ID_CHARS} characters")
    check_unicode("request_id", request_id)  # (written into logs and answers as UTF-8)
    return request_id


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """``stop_token_ids`` are ids of the model's vocabulary (an id past it could never stop anything)."""
    bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameterError("stop_token_ids", params.stop_token_ids, f"token ids in [0, {vocab_size - 1}]")


#: What a model without a chat template, or without a tokenizer, allows instead of chat messages (or text); the
#: HTTP server answers a chat completion refused so with a message of its own, pointing to /v1/completions.
NO_CHAT_TEMPLATE = "text or token ids: this model has no chat template"
NO_TOKENIZER = "token ids: this model was loaded without a tokenizer"

#: Added to the refusal of a list of prompts (as a transformers pipeline takes them): each call is one prompt.
_ONE_PROMPT_PER_CALL = ("; one prompt per call: for several, run the calls at once and the engine batches them "
                        "(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))")


def prompt_kind(prompt: Any) -> str | None:
    """What ``prompt`` is by its shape alone, whatever the model (the engine's reading, and ``generate --file``'s
    before any model is loaded): ``"text"`` (a str), ``"chat"`` (a non-empty sequence of dicts), ``"ids"`` (a
    non-empty sequence of ints, bools not counted) or None (no prompt: bytes, a range, an empty list, a mix)."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (bytes, bytearray, range)) or not isinstance(prompt, Sequence) or not prompt:
        return None
    if all(isinstance(m, dict) for m in prompt):
        return "chat"
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "ids"
    return None


def check_text_prompt(text: str) -> None:
    """A text prompt's rules that need no model: not empty, valid Unicode."""
    if not text:
        raise InvalidParameterError("prompt", text, "a non-empty string")
    check_unicode("prompt", text)


def check_messages(messages: Sequence[Any]) -> None:
    """Chat messages' rules that need no model: at most :data:`MAX_CHAT_MESSAGES`, each a dict with string
    ``role`` (one of :data:`CHAT_ROLES`) and ``content``, every text it holds valid Unicode."""
    check_chat_size(messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParameterError(f"prompt[{i}]", message, "a dict with string 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidParameterError(f"prompt[{i}]", message, "a dict with string 'role' and 'content'")
        for text in (t for item in message.items() for t in item if isinstance(t, str)):
            check_unicode(f"prompt[{i}]", text)  # role, content and any other key a template may render (name...)
        if role not in CHAT_ROLES:
            raise InvalidParameterError(f"prompt[{i}].role", role, f"one of {', '.join(map(repr, CHAT_ROLES))}")


def _several_prompts(prompt: object) -> bool:
    """Whether ``prompt`` is a non-empty list or tuple of prompts: texts, or lists of chat messages or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(p, str) or (isinstance(p, (list, tuple)) and bool(p)) for p in prompt)


def prompt_token_ids(prompt: Prompt, version: ModelVersion) -> list[int]:
    """A text, chat messages or token ids as the token ids the model reads.

    Bytes, bytearrays and ranges are refused: a prompt is text, messages or a list of ints.
    """
    if isinstance(prompt, (bytes, bytearray, range)):
        raise InvalidParameterError("prompt", prompt, "a str, a list of chat messages or a list of token ids")
    check_chat_size(prompt)
    kind = prompt_kind(prompt)
    if kind == "text":
        check_text_prompt(prompt)  # type: ignore[arg-type]
        ids = _in_vocabulary(_encode(_need_tokenizer(version, "a text prompt"), prompt), version)
    elif kind == "chat":
        ids = _in_vocabulary(chat_token_ids(version, prompt), version)  # type: ignore[arg-type]
    elif kind == "ids":
        ids = [plain_value(t) for t in prompt]  # the numbers they hold: an int subclass's comparisons may lie
        vocab = version.model_config.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:  # the id and where it is: "prompt=49159 is invalid" read as if it were the whole prompt
            allowed = f"token ids in [0, {vocab - 1}]"
            raise InvalidParameterError("prompt", ids[bad], allowed,
                                        message=f"prompt token id {ids[bad]} (at index {bad}) is invalid: allowed {allowed}")
    else:
        raise InvalidParameterError("prompt", prompt, "a non-empty string, list of chat messages or list of token ids"
                                    + _ONE_PROMPT_PER_CALL * _several_prompts(prompt))
    if not ids:
        raise InvalidParameterError("prompt", prompt, "a prompt of at least one token")
    return ids


def _in_vocabulary(ids: list[int], version: ModelVersion) -> list[int]:
    """``ids`` the tokenizer made, refused unless each is an id of the model's vocabulary: a tokenizer file may
    give ids past its own count (a sparse vocabulary, an added token's or a post-processor's id), which the
    load's check of that count cannot see, and one such id failed the step of every request batched with it."""
    vocab = version.model_config.vocab_size
    if ids and not (0 <= min(ids) and max(ids) < vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidParameterError("prompt", f"<a text its tokenizer encodes with id {bad}>",
                                    f"a prompt whose tokens are ids of the model's vocabulary [0, {vocab - 1}]")
    return ids


# The roles a chat message may have, in the library and over HTTP alike (the server's ``messages.[i].role``
# check reads this): ``developer`` is OpenAI's newer name for ``system`` and is rendered as ``system``.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_AS_RENDERED = {"developer": "system"}


def chat_token_ids(version: ModelVersion, messages: Sequence[dict[str, str]]) -> list[int]:
    """Render chat messages with the version's template (generation prompt added) into token ids.

    Refuses more than :data:`MAX_CHAT_MESSAGES` messages, and texts that are not valid Unicode,
    before the template runs.
    """
    tokenizer = _need_tokenizer(version, "chat messages")
    check_messages(messages)
    from asyncinfer.models.tokenizer import chat_template_of, render_chat

    if chat_template_of(tokenizer) is None:
        raise InvalidParameterError("prompt", "chat messages", NO_CHAT_TEMPLATE)
    rendered = [{**m, "role": ROLE_AS_RENDERED[m["role"]]} if m["role"] in ROLE_AS_RENDERED else m for m in messages]

    try:
        text = render_chat(tokenizer, rendered, add_generation_prompt=True)
    # The template is the model's code: whatever it raises (its own checks with jinja2's raise_exception, e.g.
    # roles out of order, a limit of its render budget: ChatTemplateLimitError, or any other error) means it
    # refuses these messages, the caller's error.
    except Exception as exc:  # noqa: BLE001 - see above
        raise InvalidParameterError("prompt", "chat messages", f"messages this model's chat template accepts ({exc})")
    if isinstance(text, str):  # what the template rendered of values no check above reads (a key's nested text)
        check_unicode("prompt", text)
    return _encode(tokenizer, text, add_special_tokens=False)


def _encode(tokenizer: Any, text: str, **options: Any) -> list[int]:
    """``tokenizer.encode(text, **options)`` as a list; a panic of the tokenizers library's Rust code on this text
    (a tokenizer file it cannot follow: a ``Precompiled`` charsmap whose entries point past its end) is this
    prompt's InvalidParameterError, not a ``PanicException``, which derives from ``BaseException`` only and went
    past every ``except Exception`` of the caller's."""
    with native_panics_as(lambda exc: InvalidParameterError(
            "prompt", f"<a text of {len(text)} characters its tokenizer panicked on: {exc}>",
            "a prompt this model's tokenizer can encode")):
        return list(tokenizer.encode(text, **options))


def _need_tokenizer(version: ModelVersion, what: str) -> Any:
    if version.tokenizer is None:
        verb = "rendered" if what == "chat messages" else "encoded"
        raise InvalidParameterError("prompt", what, NO_TOKENIZER, message=(
            f"prompt: this model was loaded without a tokenizer, so {what} cannot be {verb} for it: send the prompt "
            "as token ids (a list of integers)"))
    return version.tokenizer


def check_tenant(tenant: Any) -> str | None:
    """``embed()``'s ``tenant``: None, or the plain ``str`` it holds, 1 to :data:`MAX_TENANT_CHARS` printable
    characters (as the server holds its tenants' names). The engine keeps it while the call's texts wait, a key
    of the batcher's turns: a subclass's own ``__hash__`` or ``__eq__`` would run on the engine thread."""
    if tenant is None:
        return None
    name = plain_value(tenant)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_CHARS or not name.isprintable():
        shown = name if not isinstance(name, str) or len(name) <= 64 else f"<{len(name)} chars>"
        raise InvalidParameterError("tenant", shown, f"None or a string of 1 to {MAX_TENANT_CHARS} printable "
                                                     "characters")
    return name


def check_texts(texts: Any) -> list[str]:
    """``embed()``'s input as a list of strings (a single string is one text)."""
    if isinstance(texts, str):
        texts = plain_text(texts)
        check_unicode("texts", texts)
        return [texts]
    items = plain_list(texts, "texts")  # its real items, whatever a subclass's __len__ says
    if items is not None:
        texts = items
    if not isinstance(texts, list) or not texts or len(texts) > MAX_EMBED_TEXTS:
        raise InvalidParameterError("texts", texts, f"a string or a list of 1 to {MAX_EMBED_TEXTS} strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidParameterError(f"texts[{i}]", text, "a string")
        texts[i] = text = plain_text(text)
        check_unicode(f"texts[{i}]", text)
    return texts
