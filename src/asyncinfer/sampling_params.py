"""Per-request sampling parameters.

:class:`SamplingParams` is an immutable ``msgspec.Struct``; every field is
checked when the object is built (also by ``msgspec.convert`` and
:meth:`SamplingParams.with_updates`), so a bad value raises
:class:`~asyncinfer.errors.InvalidParameterError` before a request is queued.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from asyncinfer.errors import InvalidParameterError, check_unicode
from asyncinfer.plain import plain_value
from asyncinfer.structured import StructuredOutput

__all__ = ["MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "SamplingParams", "UnknownSamplingFieldError",
           "plain_params"]

_MAX_SEED = 2**63 - 1
# Sampling runs in float32: logits are divided by the temperature and scaled by the
# repetition penalty, so values whose effect would overflow or vanish there are refused.
_MAX_TEMPERATURE = 1e4
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 1e-2, 1e2
_MAX_LOGPROBS = 20
_MAX_N = 64
#: The most stop strings a request may give, and the most characters they may hold together: what
#: building its stop automaton costs the engine thread once (the check per token does not depend on them).
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 16384
#: The most ``stop_token_ids`` a request may give (each is checked against the vocabulary at the call).
MAX_STOP_TOKEN_IDS = 4096


#: The fields that hold a number (an int, or a float where an int is also taken).
_NUMBERS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "logprobs", "min_tokens", "n")


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as "max_tokens" is almost surely a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            return False
        return True
    return isinstance(value, float) and math.isfinite(value)


def _check_int(name: str, value: object, lo: int | None, hi: int | None, allowed: str) -> None:
    if not _is_int(value):
        raise InvalidParameterError(name, value, allowed)
    assert isinstance(value, int)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidParameterError(name, value, allowed)


_STOP_ALLOWED = (
    f"None, a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
    f"of at most {MAX_STOP_CHARS} characters together"
)


def _shown(value: object) -> object:
    """``value`` as an error message shows it: a long list by its length."""
    if isinstance(value, (list, tuple)) and _real_len(value) > 8:
        return f"<a list of {_real_len(value)}>"
    return value


def _real_len(value: list[Any] | tuple[Any, ...]) -> int:
    """How many items a list or tuple holds, whatever a subclass's ``__len__`` says (nothing is read)."""
    return list.__len__(value) if isinstance(value, list) else tuple.__len__(value)


def _real_items(value: list[Any] | tuple[Any, ...]) -> list[Any]:
    """The items a list or tuple holds, as a plain list, whatever a subclass's ``__iter__`` yields."""
    return list(list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value))


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidParameterError(name, value, "a bool (True or False)")


#: Other libraries' keywords for a request's sampling, and the field asyncinfer has for them.
_OTHER_FIELDS: dict[str, tuple[str, str]] = {
    "max_new_tokens": ("transformers'", "max_tokens"), "n_predict": ("llama.cpp's", "max_tokens"),
    "max_completion_tokens": ("OpenAI's", "max_tokens"), "min_new_tokens": ("transformers'", "min_tokens"),
    "num_return_sequences": ("transformers'", "n"), "repeat_penalty": ("llama.cpp's", "repetition_penalty"),
    "top_logprobs": ("OpenAI's", "logprobs"), "stop_sequences": ("another library's", "stop"),
    "response_format": ("OpenAI's", "structured"), "guided_json": ("vLLM's", "structured"),
    "guided_regex": ("vLLM's", "structured"), "guided_choice": ("vLLM's", "structured"),
    "guided_grammar": ("vLLM's", "structured"),
}
#: Other libraries' keywords with no field of their own here, and what asyncinfer does instead.
_NO_FIELD: dict[str, str] = {
    "do_sample": "sampling is on where temperature > 0 (greedy, temperature=0, is the default)",
}


class UnknownSamplingFieldError(InvalidParameterError, TypeError):
    """A keyword :class:`SamplingParams` has no field for (another library's name such as transformers'
    ``max_new_tokens``, or a misspelling): an :class:`~asyncinfer.errors.InvalidParameterError` naming it, the
    fields and the one meant; also a ``TypeError``, Python's error for an unexpected keyword. Positional arguments
    (``SamplingParams(16)``: its fields are keywords only) are refused with it too, naming the fields."""


def field_hint(name: str, known: tuple[str, ...] | None = None) -> str:
    """What a caller who gave ``name``, a keyword :class:`SamplingParams` has no field for, most likely meant: the
    field for another library's keyword (``max_new_tokens is transformers' name: asyncinfer's is max_tokens``),
    what stands in for one with none, or a close spelling among ``known`` (the fields by default); "" if none."""
    import difflib

    if name in _OTHER_FIELDS:
        library, field = _OTHER_FIELDS[name]
        return f"{name} is {library} name: asyncinfer's is {field}"
    if name in _NO_FIELD:
        return f"{name} has no SamplingParams field: {_NO_FIELD[name]}"
    close = difflib.get_close_matches(name, known or SamplingParams.__struct_fields__, n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else ""


def unknown_field(name: str, value: object) -> UnknownSamplingFieldError:
    """The error for a keyword ``name`` that :class:`SamplingParams` has no field for, with the hint that fits. Read
    as the plain text it holds (a ``str`` subclass's is kept as a plain ``str``); a name that is not valid Unicode (a
    lone surrogate) is named with it escaped, so the message can be written and logged."""
    name = plain_value(name)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    hint = field_hint(name)
    return UnknownSamplingFieldError(name, value, f"a SamplingParams field: {', '.join(SamplingParams.__struct_fields__)}"
                                     + (f"; {hint}" if hint else ""))


class _SamplingParamsMeta(type(msgspec.Struct)):  # type: ignore[misc]
    """Builds :class:`SamplingParams`: a keyword it has no field for is :class:`UnknownSamplingFieldError` with a
    hint (msgspec's own ``TypeError`` read only "Unexpected keyword argument 'max_new_tokens'")."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except TypeError:
            fields = cls.__struct_fields__
            if args:  # SamplingParams(16): msgspec's "Extra positional arguments provided" named no keyword
                raise UnknownSamplingFieldError(
                    "SamplingParams", args, "keyword arguments only",
                    message=f"SamplingParams takes keyword arguments only, not {len(args)} positional "
                            f"({', '.join(map(repr, args[:3]))}{', ...' if len(args) > 3 else ''}): e.g. "
                            "SamplingParams(max_tokens=16, temperature=0.7); its fields: " + ", ".join(fields),
                ) from None
            for name, value in kwargs.items():
                if name not in fields:
                    raise unknown_field(name, value) from None
            raise


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, metaclass=_SamplingParamsMeta):
    """How to pick tokens for one request, and when to stop.

    All fields are keyword-only and validated at construction.

    Attributes:
        max_tokens: most tokens to generate (the stop token counts). int >= 1. Default 128.
        temperature: softmax temperature, a float in [0, 1e4] (sampling runs in float32).
            ``0`` means greedy (argmax); the default is greedy, so nothing is random unless
            asked for.
        top_k: keep only the k most likely tokens before sampling. ``0`` or ``-1``
            disables it, else an int >= 1 (values above the vocabulary size keep everything).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability mass reaches ``top_p``. float in (0, 1]; ``1`` disables it.
        min_p: drop tokens whose probability is below ``min_p`` times that of the
            most likely token. float in [0, 1]; ``0`` disables it.
        repetition_penalty: transformers/CTRL-style penalty over every token in the
            prompt and the output: positive logits are divided by it, negative ones
            multiplied. float in [0.01, 100]; ``1`` disables it, > 1 discourages repeats.
        presence_penalty: OpenAI-style, subtracted once from the logit of every token
            already in the output. float in [-2, 2].
        frequency_penalty: OpenAI-style, subtracted from a token's logit once per time
            it already occurs in the output. float in [-2, 2].
        seed: seed of this request's own random generator; a seeded request samples
            the same tokens whatever else is batched with it. int in [0, 2**63 - 1],
            or ``None`` for the engine-wide generator (fresh entropy for each engine unless
            ``EngineConfig.seed`` is set, so unseeded samples differ from run to run).
        stop: string(s) that end generation when they appear in the output text. A
            string or a list of non-empty strings, or ``None``: at most
            :data:`MAX_STOP_STRINGS` (1024) strings of at most :data:`MAX_STOP_CHARS` (16384)
            characters together, counted as held (a subclass's ``__len__`` is not asked). Kept as
            a plain ``str`` or ``list`` of them (a tuple becomes a list). See :attr:`stop_strings`.
        stop_token_ids: token ids (>= 0) that end generation, besides EOS. A list of at most
            :data:`MAX_STOP_TOKEN_IDS` (4096), or ``None``.
        ignore_eos: keep generating past EOS (the engine does not stop on it; the
            sampler does not mask it either). bool.
        logprobs: return the sampled token's log-probability and the ``logprobs`` most
            likely alternatives. int in [0, 20] (``0``: only the sampled token), or
            ``None`` for no log-probabilities.
        include_stop_str_in_output: keep the matched stop string at the end of the
            output text (it is cut off by default). bool.
        skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the
            output text. bool, default True.
        min_tokens: EOS and ``stop_token_ids`` are masked out until this many tokens
            have been generated, and ``stop`` strings are looked for only from then on: one
            completed in the text before is not matched later (as vLLM). int in [0, max_tokens].
        n: parallel samples of the same prompt, int in [1, 64], and at most the model's ``max_num_seqs``
            (checked at the call: the samples run together). The prompt is
            computed once and its KV blocks are shared (copied on the first divergent
            write). With a ``seed``, sample ``i`` uses ``seed + i`` (mod 2**63), so it
            equals a lone request with that seed. Greedy (``temperature=0``, the default)
            picks the same tokens for every sample, so ``n > 1`` without a ``temperature``
            returns ``n`` copies of one answer: set ``temperature`` (e.g. ``1.0``, which an
            OpenAI request without ``temperature`` samples at) for different samples.
        truncate_output_to_model_len: what happens when the prompt's tokens plus
            ``max_tokens`` exceed the engine's ``max_model_len``. False (default): the
            request is refused with ``InvalidParameterError`` on ``max_tokens``, as vLLM's
            server refuses it. True: it runs, and its output stops once prompt + output
            reach ``max_model_len`` (``finish_reason="length"``). bool.
        structured: constrain the output to a JSON schema, any JSON object, a regular expression,
            one of a list of strings or a grammar: a :class:`~asyncinfer.structured.StructuredOutput`
            (``StructuredOutput.json_schema(schema)``, ``.json_object()``, ``.regex(pattern)``,
            ``.choice([...])``, ``.grammar(text)``), or ``None`` (default). Tokens the constraint does
            not allow are masked before temperature, top-k/p and min-p, greedy or sampled; a reply
            ends with ``finish_reason="stop"`` once the constraint is complete (EOS, or nothing else
            may follow), ``"length"`` if ``max_tokens`` cut it first (then it is incomplete). A spec
            the grammar library refuses is an ``InvalidParameterError`` on ``structured`` when the
            request is bound to a model, before it is queued. Needs ``asyncinfer[structured]``;
            docs/structured_output.md.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    n: int = 1
    truncate_output_to_model_len: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        for name in _NUMBERS:  # checked and kept as the plain numbers they hold: a subclass's comparisons may lie
            value = getattr(self, name)
            plain = plain_value(value)
            if plain is not value:
                msgspec.structs.force_setattr(self, name, plain)

        _check_int("max_tokens", self.max_tokens, 1, None, "an int >= 1")

        t = self.temperature
        if not _is_real(t) or not 0 <= t <= _MAX_TEMPERATURE:
            raise InvalidParameterError("temperature", t, f"a float in [0, {_MAX_TEMPERATURE:g}] (0 = greedy)")

        k = self.top_k
        if not _is_int(k) or (k < 1 and k not in (0, -1)):
            raise InvalidParameterError("top_k", k, "0 or -1 (disabled), or an int >= 1")

        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise InvalidParameterError("top_p", p, "a float in (0, 1]")

        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise InvalidParameterError("min_p", m, "a float in [0, 1]")

        r = self.repetition_penalty
        if not _is_real(r) or not (_MIN_REPETITION_PENALTY <= r <= _MAX_REPETITION_PENALTY):
            raise InvalidParameterError(
                "repetition_penalty", r,
                f"a float in [{_MIN_REPETITION_PENALTY:g}, {_MAX_REPETITION_PENALTY:g}] (1 = off)",
            )

        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise InvalidParameterError(name, v, "a float in [-2, 2]")

        if self.seed is not None:
            _check_int("seed", self.seed, 0, _MAX_SEED, "None or an int in [0, 2**63 - 1]")

        stop = self.stop
        if stop is not None:
            # Checked and kept as built-in values: a str or list subclass's __len__ may lie about its content.
            if isinstance(stop, str):
                items = [str.__str__(stop)]
            elif isinstance(stop, (list, tuple)):
                if _real_len(stop) > MAX_STOP_STRINGS:  # before looking at them: a long list costs nothing
                    raise InvalidParameterError("stop", f"<{_real_len(stop)} strings>", _STOP_ALLOWED)
                items = _real_items(stop)
            else:
                raise InvalidParameterError("stop", stop, "None, a non-empty string or a list of them")
            chars = 0
            for i, s in enumerate(items):
                if not isinstance(s, str) or not str.__len__(s):
                    raise InvalidParameterError("stop", _shown(stop), "None, a non-empty string or a list of them")
                items[i] = s = str.__str__(s)
                chars += len(s)
                check_unicode("stop", s, "string")  # a lone surrogate is in no text a model writes: it could never stop
            if chars > MAX_STOP_CHARS:
                raise InvalidParameterError("stop", f"<{len(items)} strings, {chars} characters>", _STOP_ALLOWED)
            msgspec.structs.force_setattr(self, "stop", items[0] if isinstance(stop, str) else items)

        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                raise InvalidParameterError("stop_token_ids", ids, "None or a list of ints >= 0")
            if _real_len(ids) > MAX_STOP_TOKEN_IDS:  # before reading them
                raise InvalidParameterError(
                    "stop_token_ids", f"<{_real_len(ids)} ids>", f"None or a list of at most {MAX_STOP_TOKEN_IDS} ints >= 0"
                )
            id_list = [plain_value(i) for i in _real_items(ids)]
            if not all(_is_int(i) and i >= 0 for i in id_list):
                raise InvalidParameterError("stop_token_ids", ids, "None or a list of ints >= 0")
            msgspec.structs.force_setattr(self, "stop_token_ids", id_list)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "truncate_output_to_model_len"):
            _check_bool(name, getattr(self, name))

        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, _MAX_LOGPROBS, f"None or an int in [0, {_MAX_LOGPROBS}]")

        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, f"an int in [0, max_tokens={self.max_tokens}]")

        _check_int("n", self.n, 1, _MAX_N, f"an int in [1, {_MAX_N}]")

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidParameterError(
                "structured", _shown(self.structured),
                "None or a StructuredOutput (StructuredOutput.json_schema(...), .json_object(), .regex(...), "
                ".choice([...]), .grammar(...))",
            )
        if self.structured is not None and type(self.structured) is not StructuredOutput:
            # a subclass built again as the plain spec it holds: the spec keys the compiled-grammar cache, and a
            # subclass's __hash__ and __eq__ would let its grammar be found for another request's spec
            held = msgspec.structs.asdict(self.structured)
            msgspec.structs.force_setattr(self, "structured", StructuredOutput(kind=held["kind"], value=held["value"]))

    # ------------------------------------------------------------------ helpers

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` normalised to a tuple (empty when there is none), duplicates removed."""
        stop = self.stop
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        return tuple(dict.fromkeys(stop))

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition/presence/frequency penalties is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of ``n``: one sample, with seed ``seed + index``."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        if self.n == 1 and seed == self.seed:
            return self
        return msgspec.structs.replace(self, n=1, seed=seed)

    def with_updates(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied; the result is validated again."""
        fields = self.__struct_fields__
        for name, value in changes.items():
            if name not in fields:
                raise unknown_field(name, value)
        return msgspec.structs.replace(self, **changes)


def plain_params(params: SamplingParams) -> SamplingParams:
    """``params`` as a plain :class:`SamplingParams` built again from the values it holds: what a request runs
    with. Built again, every check runs on what the parameters hold when the request is made, so a subclass
    whose ``__post_init__`` skips the checks, and a ``stop`` or ``stop_token_ids`` list grown in place after
    the parameters were built, cannot slip past a range or a limit (``InvalidParameterError`` naming the
    field); the lists become the new parameters' own copies, so what the caller changes later changes nothing."""
    held = msgspec.structs.asdict(params)  # the values held, not what a subclass's attributes say
    return SamplingParams(**{name: held[name] for name in SamplingParams.__struct_fields__})
