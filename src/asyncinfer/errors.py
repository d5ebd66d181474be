"""Every exception asyncinfer raises on purpose.

The tree::

    AsyncInferError
    ├── InvalidParameterError (also ValueError)   bad user input; names the parameter and the range
    │   ├── PromptTooLongError                    a prompt too long for the model's max_model_len
    │   └── MaxTokensOverContextError             max_tokens past the room the prompt leaves in
    │                                             max_model_len
    ├── ModelLoadError                            a model path, file or its weights could not be used
    │   └── SwapError                             swap_model could not load, check or warm up the new
    │                                             version; the old version keeps serving
    ├── ConfigurationError (also ValueError)      options that cannot work together (e.g. KV too small)
    ├── EngineClosedError                         you closed it (or never started it)
    │   └── WrongEventLoopError (also RuntimeError) called from another event loop than the
    │                                             one the engine started on
    ├── EngineOverloadedError                     too many requests wait (max_waiting_requests); retry later
    ├── ModelChangedError                         a prompt made for one version of a model (version_id=)
    │                                             came after a swap_model replaced it; make it again
    ├── RequestAbortedError                       an embed() call was aborted before its vectors were
    │                                             computed (remove_model or aclose with abort=True)
    ├── RequestFailedError                        one request broke: a fault in the engine step (or the
    │   │                                         command) that ran it; the cause is chained, and the
    │   │                                         engine keeps serving the other requests
    │   └── RequestStalledError                   the scheduler ran nothing for stall_timeout seconds
    │                                             while the request waited
    └── EngineDeadError                           it broke: the step loop died (or failed
                                                  max_consecutive_step_failures steps in a row); the
                                                  cause is chained

"You closed it" and "it broke" are kept apart on purpose: the first is a usage
error, the second a bug or a resource failure worth paging someone for.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
import reprlib
import threading
from collections.abc import Callable, Iterator


class AsyncInferError(Exception):
    """Base class of every asyncinfer error.

    Each pickles and copies as itself, its attributes included (``.parameter``, ``.retry_after``, ...): an error
    raised in another process (a ``ProcessPoolExecutor`` worker, a Ray task or replica) reaches its caller as the
    same type. Python's own rebuilding calls the class with ``args`` (the message alone), which the errors whose
    constructor takes more (``InvalidParameterError(parameter, value, allowed)``) refuse: the caller's unpickling
    failed, and a process pool counted its worker as broken. An attribute that pickle cannot write (the generator
    given as ``stop``, say, in ``InvalidParameterError.value``) goes as its repr: the error would not go at all, and
    the caller got pickle's ``TypeError`` in its place. A copy keeps every attribute itself (a deep copy shares one
    that has no copy)."""

    def __reduce__(self) -> tuple[object, ...]:
        state = {key: _picklable(value) for key, value in self.__dict__.items()}
        return _rebuilt, (type(self), *map(_picklable, self.args)), state or None

    def __copy__(self) -> AsyncInferError:
        again = _rebuilt(type(self), *self.args)
        again.__dict__.update(self.__dict__)
        return again

    def __deepcopy__(self, memo: dict[int, object]) -> AsyncInferError:
        again = _rebuilt(type(self))
        memo[id(self)] = again  # an attribute holding the error itself
        again.args = tuple(_deep(value, memo) for value in self.args)
        again.__dict__.update({key: _deep(value, memo) for key, value in self.__dict__.items()})
        return again


def _rebuilt(cls: type[AsyncInferError], *args: object) -> AsyncInferError:
    """An error of ``cls`` holding ``args``, its ``__init__`` not called (it may take more than ``args``), built as
    ``BaseException.__new__`` builds it; by the class's own ``__new__`` where that refuses (a subclass that is also
    an ``OSError``, ``class Missing(ModelLoadError, FileNotFoundError)``, is built by ``OSError.__new__`` only)."""
    try:
        return BaseException.__new__(cls, *args)
    except TypeError:
        return cls.__new__(cls, *args)


def _deep(value: object, memo: dict[int, object]) -> object:
    """A deep copy of ``value``, or ``value`` itself where it has none (a generator, a lock)."""
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # noqa: BLE001 - whatever deepcopy refuses
        return value


#: Values pickle always writes, not tried first (a long prompt is not written twice).
_PLAIN = (str, bytes, int, float, bool, type(None))
_trying = threading.local()


def _picklable(value: object) -> object:
    """``value`` itself where pickle can write it, else its bounded repr (for an error's ``__reduce__``). Tried
    once: an error held in a value being tried keeps its own values as they are, the outer try covers them."""
    if type(value) in _PLAIN or getattr(_trying, "on", False):
        return value
    _trying.on = True
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickle refuses (a generator, a lock, a local class)
        return _short_repr(value)
    finally:
        _trying.on = False
    return value


class InvalidParameterError(AsyncInferError, ValueError):
    """A user-supplied value is out of its allowed range.

    ``parameter`` is the name the user passed, ``allowed`` a human-readable range. ``message``
    replaces the default text (``parameter=value is invalid: allowed ...``) where that would
    misread, e.g. for a parameter the caller did not pass at all.
    """

    def __init__(self, parameter: str, value: object, allowed: str, *, message: str | None = None) -> None:
        self.parameter = parameter
        self.value = value
        self.allowed = allowed
        super().__init__(message or f"{parameter}={_short_repr(value)} is invalid: allowed {allowed}")


class PromptTooLongError(InvalidParameterError):
    """A prompt too long for the model: ``max_model_len`` tokens or more once tokenized, or refused by its size alone
    (more characters, token ids or chat messages than any prompt of the model may have) before any token is counted;
    an :class:`InvalidParameterError` on ``prompt``. :func:`asyncinfer.trim_messages` reads it from ``count_tokens``
    as over any budget."""

    def __init__(self, value: object, allowed: str, *, max_model_len: int | None = None,
                 prompt_tokens: int | None = None, prompt_chars: int | None = None) -> None:
        super().__init__("prompt", value, allowed)
        #: The model's context, where the prompt was refused against it (None: refused by another limit, the count
        #: of chat messages).
        self.max_model_len = max_model_len
        #: The prompt's tokens (or token ids), where it was refused by them.
        self.prompt_tokens = prompt_tokens
        #: The prompt's characters, where it was refused by them before tokenizing (more than any
        #: ``max_model_len - 1`` tokens of the vocabulary can hold).
        self.prompt_chars = prompt_chars


class MaxTokensOverContextError(InvalidParameterError):
    """``max_tokens`` past the room the prompt leaves in the model's ``max_model_len`` (prompt and output together),
    an :class:`InvalidParameterError` on ``max_tokens``: checked before the prompt is tokenized against the room a
    one-token prompt leaves (``prompt_tokens`` None), then against the prompt's own."""

    def __init__(self, value: object, allowed: str, *, max_model_len: int, prompt_tokens: int | None) -> None:
        super().__init__("max_tokens", value, allowed)
        self.max_model_len = max_model_len
        #: The prompt's tokens; None where it was refused before the prompt was tokenized.
        self.prompt_tokens = prompt_tokens


def check_unicode(parameter: str, text: str, what: str = "text") -> None:
    """Refuse a text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``): no tokenizer, grammar
    library or UTF-8 writer can take it. ``parameter`` names it in the error, ``what`` the kind of text."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(
            parameter, f"<a {what} with the lone surrogate {text[exc.start]!r} at index {exc.start}>",
            "valid Unicode text (no lone surrogates, U+D800 to U+DFFF)",
        ) from None


def _bounded_repr() -> reprlib.Repr:
    shown = reprlib.Repr()
    shown.maxlevel = 4
    shown.maxlist = shown.maxtuple = shown.maxset = shown.maxfrozenset = shown.maxdeque = shown.maxdict = 32
    shown.maxarray = 32
    shown.maxstring = shown.maxother = 240
    shown.maxlong = 5000  # ints whole (their repr stops at 4300 digits anyway)
    return shown


_SHOWN = _bounded_repr()


def _short_repr(value: object) -> str:
    """``repr(value)`` for the error's message, bounded: a huge value (a long text, a list of many items, a
    list holding one long text many times) is shown elided, so building the message costs little
    (``InvalidParameterError.value`` keeps the value itself)."""
    return _SHOWN.repr(value)


#: The Python words of an ``InvalidParameterError``'s range, and what a reader who does not write Python reads.
_PYTHON_WORDS = ((re.compile(r"\bTrue\b"), "true"), (re.compile(r"\bFalse\b"), "false"),
                 (re.compile(r"\ba bool\b"), "a boolean"), (re.compile(r"\ban int\b"), "an integer"),
                 (re.compile(r"\bints\b"), "integers"), (re.compile(r"\ba float\b"), "a number"),
                 (re.compile(r"\b2\*\*63 - 1\b"), str(2**63 - 1)), (re.compile(r"\b2\*\*31 - 1\b"), str(2**31 - 1)))


def range_in_words(allowed: str, *, none: str | None) -> str:
    """An ``InvalidParameterError``'s range (``"None or an int in [0, 2**63 - 1]"``) for a reader of a JSON body or
    a command line: None as ``none`` says (``"null"`` in JSON; ``None`` drops it, for a flag that cannot be given
    none: not giving it is none), ``an int`` / ``a float`` / ``a bool`` as ``an integer`` / ``a number`` /
    ``a boolean``, true and false in lower case, and ``2**63 - 1`` as the number."""
    if none is None:
        allowed = re.sub(r"\bNone(?:,| or) ", "", allowed)
    else:
        allowed = re.sub(r"\bNone\b", none, allowed)
    for pattern, word in _PYTHON_WORDS:
        allowed = pattern.sub(word, allowed)
    return allowed


#: The most characters of an exception's message :func:`exception_text` keeps.
MAX_EXCEPTION_TEXT = 1000


def exception_text(exc: BaseException) -> str:
    """``"Type: message"`` of an exception from code the engine does not own (a scheduler plugin, a tokenizer),
    for a request's error and the log: never raises (a ``__str__`` that raises or returns no string reads as
    the type's name and a note) and is bounded to :data:`MAX_EXCEPTION_TEXT` characters of message."""
    name = type(exc).__name__
    try:
        text = str(exc)
        if type(text) is not str:
            raise TypeError(f"__str__ returned {type(text).__name__}")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - whatever its __str__ does, the engine reports the fault
        return f"{name} (its message could not be read: its __str__ raised)"
    if len(text) > MAX_EXCEPTION_TEXT:
        text = f"{text[:MAX_EXCEPTION_TEXT]}... ({len(text)} characters)"
    return f"{name}: {text}" if text else name


def is_native_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a panic of a Rust library's code (pyo3's ``PanicException``: tokenizers, llguidance),
    which derives from ``BaseException`` only, so ``except Exception`` lets it through; not an exit, an interrupt
    or a cancellation."""
    return type(exc).__name__ == "PanicException" and not isinstance(exc, Exception)


@contextlib.contextmanager
def native_panics_as(make_error: Callable[[BaseException], Exception]) -> Iterator[None]:
    """Within the block, a panic of a Rust library's code (:func:`is_native_panic`) is raised as
    ``make_error(panic)`` instead (the panic not chained: its message is all it holds); anything else passes."""
    try:
        yield
    except BaseException as exc:
        if not is_native_panic(exc):
            raise
        raise make_error(exc) from None


class ModelLoadError(AsyncInferError):
    """The model could not be found, parsed or mapped onto the runner."""


class SwapError(ModelLoadError):
    """``swap_model`` could not load, check or warm up the new model version.

    The engine keeps serving the version it served before; the original
    exception is the ``__cause__``.
    """


class ConfigurationError(AsyncInferError, ValueError):
    """Engine options that are each valid but cannot work together."""


class EngineClosedError(AsyncInferError):
    """The engine is not running: it was closed, or used before ``async with``/``start()``."""


class WrongEventLoopError(EngineClosedError, RuntimeError):
    """The engine was called from an event loop other than the one it was started on.

    An engine belongs to one loop (its results are delivered there). From another
    thread, submit to that loop: ``asyncio.run_coroutine_threadsafe(engine.generate(...), engine.loop)``.
    """


class EngineOverloadedError(AsyncInferError):
    """More requests wait than ``max_waiting_requests`` allows; nothing was queued.

    ``retry_after`` is a hint in seconds (an HTTP layer sends it as ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class ModelChangedError(AsyncInferError):
    """A request's prompt was made for a version of its model (``version_id=`` of ``generate``/``stream``: token
    ids its tokenizer and chat template made) that no longer serves it: a ``swap_model`` came in between.
    Nothing was queued; make the prompt again with the serving version and submit it again.
    ``version_id``: the version it was made for; ``serving``: the version that serves now."""

    def __init__(self, message: str, version_id: int, serving: int) -> None:
        self.version_id = version_id
        self.serving = serving
        super().__init__(message)


class RequestAbortedError(AsyncInferError):
    """A request was aborted before it had a result (generation requests end with
    ``finish_reason="abort"`` instead; an ``embed()`` call, which has no partial
    result, raises this)."""


class RequestFailedError(AsyncInferError):
    """The engine failed this request: its tokenizer could not decode its tokens, a scheduler
    hook raised for it, or an exception in the step that ran it (the forward pass, the sampler,
    the scheduler's ``schedule``) or in taking it in. The exception is the ``__cause__``.

    A fault of one request fails that request alone; a fault of a step fails the requests of
    that step (every request the scheduler held, when ``schedule`` raised). Their blocks are
    freed and the engine serves the next ones. A step fault that repeats on
    ``max_consecutive_step_failures`` steps in a row is :class:`EngineDeadError` instead.
    """


class RequestStalledError(RequestFailedError):
    """The scheduler scheduled nothing for ``stall_timeout`` seconds while this request
    waited (a scheduler that cannot make progress); the message names the scheduler,
    the requests it held and the free KV blocks."""


class EngineDeadError(AsyncInferError):
    """The engine's step loop failed; the original exception is the ``__cause__``."""

