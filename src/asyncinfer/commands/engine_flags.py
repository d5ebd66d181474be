"""The engine options as command-line flags: one table, every ``EngineConfig`` field in it once.

:data:`FLAGS` gives each field of :class:`~asyncinfer.config.EngineConfig` (the keywords of
``AsyncEngine.from_pretrained``) its flag, how the flag's text is read and its help;
:func:`add_engine_flags` adds them all to a command, each help ending with the library's
default, and :func:`engine_options` returns the options given (a flag not given is absent from
the namespace, so the library's default holds). ``tests/cli/test_engine_flags.py`` holds the
table to the dataclass's fields, so an option added there and forgotten here fails a test, and
README.md's options table to this one.

Options that take None take ``none`` on the command line; :func:`flag_error` words an engine's
:class:`~asyncinfer.errors.InvalidParameterError` about such an option in the flag's terms, and
:func:`in_flag_terms` names the options of any other message (a ``ConfigurationError``'s) by their flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncinfer.commands import flag_value
from asyncinfer.config import MAX_THREADS, EngineConfig, UnknownOptionError
from asyncinfer.errors import InvalidParameterError, range_in_words

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

MiB = 1024**2


@dataclass(frozen=True)
class Flag:
    """One engine option's flag.

    ``read``: the flag's text to the option's value (None for an on/off pair ``--x`` / ``--no-x``);
    ``none``: what None means for an option whose default is None (and ``none`` is accepted on the
    command line wherever None is a value of the option).
    """

    field: str
    flag: str
    read: Callable[[str], Any] | None
    help: str
    metavar: str | None = None
    none: str | None = None
    repeat: bool = False  # KEY=VALUE, once per key

    @property
    def dest(self) -> str:
        """The namespace attribute (apart from the commands' own: ``--seed`` is a request's seed there)."""
        return f"engine_{self.field}"

    @property
    def takes_none(self) -> bool:
        """Whether ``none`` is a value of the flag (None of the option)."""
        return isinstance(self.read, _OrNone)


def _size(text: str) -> int:
    """A byte count, or a size such as ``512MiB`` / ``2GiB`` / ``4GB``."""
    from asyncinfer.planner import parse_bytes

    try:
        return parse_bytes(text)
    except InvalidParameterError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (a byte count up to 2**63 - 1, or e.g. 512MiB, "
                                         "2GiB, 4GB)") from None


#: The size reader of the size flags, for the commands' own flags that take a size too (serve's --max-body-bytes).
read_size = _size


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _layers(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


class _OrNone:
    """A flag's reader that also takes ``none`` (the option's None)."""

    def __init__(self, read: Callable[[str], Any]) -> None:
        self.read = read
        self.__name__ = read.__name__  # argparse names the type in its messages

    def __call__(self, text: str) -> Any:
        return None if text.strip().lower() == "none" else self.read(text)


def _or_none(read: Callable[[str], Any]) -> _OrNone:
    return _OrNone(read)


class _Ranged:
    """A number flag's reader whose refusal of text that is no number says the option's range, read from
    EngineConfig's own refusal of a value that is no number (one source for the range): argparse's message was
    "argument --max-model-len: 'abc' is not an integer", no range, where the sampling flags' said theirs."""

    def __init__(self, read: Callable[[str], Any], name: str, field: str, none: bool) -> None:
        self.read, self.field, self.none = read, field, none
        self.__name__ = name  # argparse names the type in its messages

    def __call__(self, text: str) -> Any:
        try:
            return self.read(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc}: allowed {self.allowed()}") from None

    def allowed(self) -> str:
        try:
            EngineConfig(**{self.field: object()})
        except InvalidParameterError as exc:
            return range_in_words(exc.allowed, none="none" if self.none else None)
        raise AssertionError(f"EngineConfig took {self.field}=object()")


def _reader(flag: Flag) -> Callable[[str], Any] | None:
    """The flag's argparse reader: a number's refusal says the range (:class:`_Ranged`)."""
    read = flag.read
    inner = read.read if isinstance(read, _OrNone) else read
    if inner is _int or inner is _float:
        return _Ranged(read, inner.__name__, flag.field, isinstance(read, _OrNone))
    return read


class Pair(tuple):  # type: ignore[type-arg]
    """A ``KEY=VALUE`` flag's ``(key, value)``, VALUE's text as typed beside it (``typed``): a refusal shows what was
    typed (``1e3``), not what JSON made of it (``1000.0``)."""

    typed: str

    def __new__(cls, key: str, value: Any, typed: str) -> Self:
        pair = super().__new__(cls, (key, value))
        pair.typed = typed
        return pair


#: The numbers a KEY=VALUE flag's VALUE may hold (what a float holds, 0 aside).
FLOAT_RANGE = "a nonzero magnitude from about 4.9e-324 to 1.8e308"


def read_value(key: str, raw: str) -> Any:
    """A ``KEY=VALUE`` flag's VALUE, read as JSON where it is JSON (else the text). A number past a float's range is
    refused (``argparse.ArgumentTypeError``), as typed: Python's JSON reads ``1e400`` as inf (passed on, shown as
    Infinity) and ``1e-400`` as 0.0 (refused as ``0.0 is invalid``, a value nobody typed); NaN and Infinity, which JSON
    has not, are text."""

    def finite(number: str) -> float:
        value = float(number)
        underflow = value == 0 and any(digit in "123456789" for digit in number.lower().partition("e")[0])
        if not math.isfinite(value) or underflow:
            raise argparse.ArgumentTypeError(f"{key}={number[:40]}: the number is past a float's range ({FLOAT_RANGE})")
        return value

    def not_json(constant: str) -> Any:
        raise ValueError(constant)  # NaN, Infinity: Python's JSON reads them, JSON has none: the text

    try:
        return json.loads(raw, parse_float=finite, parse_constant=not_json)
    except ValueError:
        return raw


def key_value(item: str, example: str = "prefill_budget=64") -> Pair:
    """A ``KEY=VALUE`` flag's pair (:func:`read_value`); ``example`` is a pair the flag takes, shown when ``item`` is
    not one (a scheduler's option by default)."""
    key, sep, raw = item.partition("=")
    if not (sep and key):
        raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE (e.g. {example})")
    return Pair(key, read_value(key, raw), raw)


def typed_texts(pairs: Any) -> dict[str, str]:
    """Each KEY's VALUE as typed, of a repeatable ``KEY=VALUE`` flag's pairs (:class:`Pair`)."""
    return {pair[0]: pair.typed for pair in pairs if isinstance(pair, Pair)}


class KeyValues(argparse.Action):
    """A repeatable ``KEY=VALUE`` flag (``type`` reads each pair): its pairs in the order given, each KEY once. A KEY
    given twice is refused by the flag, naming it: the pairs became a dict, which kept the last value silently
    (``--scheduler-option prefill_budget=0 --scheduler-option prefill_budget=64`` ran with 64, unchecked 0)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        pairs = list(getattr(namespace, self.dest, None) or ())
        key = values[0]
        if any(seen == key for seen, _ in pairs):
            raise argparse.ArgumentError(self, f"{key} is given twice: give each KEY once")
        setattr(namespace, self.dest, [*pairs, values])


#: Every field of EngineConfig, as a flag (tests/cli/test_engine_flags.py checks that none is missing).
FLAGS: tuple[Flag, ...] = (
    Flag("dtype", "--dtype", str, "weights, activations and KV cache dtype: auto (float32 on a CPU, bfloat16 on "
         "CUDA) | float32 | bfloat16 | float16", "DTYPE"),
    Flag("device", "--device", str, "auto | cpu | cuda | cuda:N", "DEVICE"),
    Flag("block_size", "--block-size", _int, "tokens per KV block, 1 to 256", "N"),
    Flag("kv_cache_memory", "--kv-cache-memory", _or_none(_size), "KV cache budget: bytes or a size (512MiB, 2GiB); "
         "overrides --kv-cache-fraction", "SIZE", none="none: from --kv-cache-fraction"),
    Flag("kv_cache_fraction", "--kv-cache-fraction", _or_none(_float),
         "KV cache budget as a fraction of the memory free after the weights, in (0, 0.95]", "FRACTION",
         none="none: on a CPU room for min(max-num-seqs, 4) requests of max-model-len tokens, at most 0.25 of that "
              "memory; on CUDA 0.25"),
    Flag("max_num_seqs", "--max-num-seqs", _int, "requests per step, 1 to 4096", "N"),
    Flag("max_num_batched_tokens", "--max-num-batched-tokens", _int,
         "tokens per step (longer prompts are prefilled in chunks)", "N"),
    Flag("max_model_len", "--max-model-len", _or_none(_int), "prompt + output tokens per request", "TOKENS",
         none="none: the model's context"),
    Flag("enable_chunked_prefill", "--enable-chunked-prefill", None, "split prompts longer than a step's budget"),
    Flag("scheduler", "--scheduler", str, "fifo | length-bucket | aging-priority | pd-split | a plugin's name | "
         "module:Class (docs/schedulers.md)", "NAME"),
    Flag("scheduler_options", "--scheduler-option", key_value, "a keyword of the scheduler, VALUE read as JSON "
         "(repeatable, each KEY once), e.g. prefill_budget=64 for pd-split", "KEY=VALUE", repeat=True),
    Flag("seed", "--engine-seed", _or_none(_int), "seed of the engine's generator, used by requests that set no "
         "seed of their own (--seed)", "SEED", none="none: fresh entropy for each engine"),
    Flag("num_threads", "--threads", _or_none(_int), f"torch CPU threads, 1 to {MAX_THREADS}", "N", none="none: torch's setting"),
    Flag("activation_reserve", "--activation-reserve", _size,
         "memory kept free for activations when the KV budget is a fraction: bytes or a size", "SIZE"),
    Flag("quantization", "--quantization", _or_none(str), "weight format (docs/formats.md): auto (on a CPU with "
         "--dtype auto: the GGUF file's own block format, q4_1 or q8_0, or native for a file of several formats, "
         "where asyncinfer's kernels run (q4_1 for the default model), "
         "else float16 weights; elsewhere none) | none (the dtype: float32 weights on a CPU) | q4_1 | q8_0 | q4_0 | "
         "q5_0 | q5_1 | q4_k | q5_k | q6_k (CPU, asyncinfer's kernels) | native (each projection in its GGUF file's "
         "own format where a kernel takes it) | float16 | int8 (CPU, not exact) | bfloat16 (CUDA: float16 and bfloat16 are the "
         "dtype)", "FORMAT"),
    Flag("quantization_skip", "--quantization-skip", _or_none(_layers),
         "comma-separated layer-name substrings a CPU format keeps in float32 (an empty string: none skipped)",
         "LAYERS", none="none: the format's own, int8: down_proj,lm_head"),
    Flag("pack_weights", "--pack-weights", None, "pack float32 projections for oneDNN at load "
         "(--no-pack-weights: plain F.linear)", none="wherever possible on a CPU"),
    Flag("activation_dtype", "--activation-dtype", str,
         "how the block formats' kernels round a step's activations: int16 (steps under 9 tokens; within "
         "float32's rounding) | int8 (every step: llama.cpp's numerics, faster, not exact) | bfloat16 (steps of 9 "
         "tokens or more in bfloat16: prefills, on CPUs with AMX / AVX-512 BF16; docs/formats.md)", "DTYPE"),
    Flag("torch_compile", "--torch-compile", None,
         "compile the decoder's element-wise chains with torch.compile at load (docs/formats.md)"),
    Flag("enable_prefix_caching", "--enable-prefix-caching", None,
         "reuse the KV blocks of prompt prefixes seen before"),
    Flag("kv_watermark", "--kv-watermark", _float,
         "fraction of the KV blocks kept free from new admissions, in [0, 0.5]", "FRACTION"),
    Flag("max_waiting_requests", "--max-waiting-requests", _or_none(_int),
         "requests that may wait beyond max-num-seqs; past it new requests are refused at once "
         "(EngineOverloadedError; over HTTP a 503 with Retry-After)", "N", none="none: no bound"),
    Flag("max_consecutive_step_failures", "--max-consecutive-step-failures", _int,
         "failed steps in a row (each fails only its own requests) after which the engine is declared dead", "N"),
    Flag("stall_timeout", "--stall-timeout", _or_none(_float),
         "seconds every request may be stuck (nothing scheduled) before they fail with RequestStalledError",
         "SECONDS", none="none: wait forever"),
    Flag("enable_metrics", "--enable-metrics", None, "record engine.metrics (Prometheus /metrics)"),
    Flag("memory_bandwidth", "--memory-bandwidth", _or_none(_float),
         "the device's memory bandwidth in bytes per second, for the roofline gauge", "BYTES_PER_S",
         none="none: measured at start-up"),
    Flag("log_request_text_rate", "--log-request-text-rate", _float,
         "fraction of the per-request INFO log lines that include prompt and output text, in [0, 1]", "FRACTION"),
)

BY_FIELD: dict[str, Flag] = {f.field: f for f in FLAGS}


def library_defaults() -> dict[str, Any]:
    """Each EngineConfig field's default, as ``from_pretrained`` takes it when the option is not given."""
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def shown_default(flag: Flag, default: Any) -> str:
    """The default as the flag's help states it: in the command line's terms (``none``, ``on``/``off``)."""
    if default is None:
        return flag.none or "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, int) and default >= MiB and default % MiB == 0 and flag.read is _size:
        return f"{default // MiB}MiB"
    return str(default)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Every engine option as a flag, its help ending with the library's default; none is set unless given."""
    from asyncinfer.commands.foreign_flags import ALIASES

    defaults = library_defaults()
    for flag in FLAGS:
        text = f"{flag.help} (default: {shown_default(flag, defaults[flag.field])})"
        names = (flag.flag, *ALIASES.get(flag.flag, ()))  # -c / --ctx-size for --max-model-len, -t for --threads
        if flag.read is None:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                dest=flag.dest, help=text)
        elif flag.repeat:
            parser.add_argument(*names, action=KeyValues, type=flag.read, default=argparse.SUPPRESS,
                                dest=flag.dest, metavar=flag.metavar, help=text)
        else:
            parser.add_argument(*names, type=_reader(flag), default=argparse.SUPPRESS, dest=flag.dest,
                                metavar=flag.metavar, help=text)


def flag_names() -> set[str]:
    """Every engine option's flag: its aliases and a switch's ``--no-`` form too."""
    from asyncinfer.commands.foreign_flags import ALIASES

    names: set[str] = set()
    for flag in FLAGS:
        names.update((flag.flag, *ALIASES.get(flag.flag, ())))
        if flag.read is None:  # a switch: argparse's BooleanOptionalAction adds its --no- form
            names.add("--no-" + flag.flag.removeprefix("--"))
    return names


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, as ``from_pretrained`` keywords."""
    options = {flag.field: getattr(args, flag.dest) for flag in FLAGS if hasattr(args, flag.dest)}
    if "scheduler_options" in options:
        options["scheduler_options"] = dict(options["scheduler_options"])
    return options


#: The characters of a KEY=VALUE flag's VALUE a refusal shows; a longer one is cut, its length said.
MAX_SHOWN_VALUE_CHARS = 200


def as_typed(value: Any, typed: str | None = None) -> str:
    """A KEY=VALUE flag's VALUE for a refusal: its text as ``typed`` (else as JSON writes ``value``), cut past
    :data:`MAX_SHOWN_VALUE_CHARS` (a number of 5,000 digits made a refusal of 5,000 characters)."""
    text = json.dumps(value) if typed is None else typed
    if len(text) <= MAX_SHOWN_VALUE_CHARS:
        return text
    return f"{text[:MAX_SHOWN_VALUE_CHARS // 2]}...({len(text)} characters)"


def typed_scheduler_options(args: argparse.Namespace) -> dict[str, str]:
    """Each ``--scheduler-option`` KEY's VALUE as typed (none given: empty)."""
    return typed_texts(vars(args).get(BY_FIELD["scheduler_options"].dest, ()))


def flag_error(exc: InvalidParameterError, given: dict[str, Any], typed: dict[str, str] | None = None) -> str | None:
    """``exc`` in the command line's terms when it is about an engine option given as a flag: the flag's
    name, and ``none`` where the flag takes it (the library's message says None); a scheduler's own refusal of a
    ``--scheduler-option`` it takes, as that flag (its VALUE as ``typed``, :func:`typed_scheduler_options`); else
    None."""
    typed = typed or {}
    flag = BY_FIELD.get(exc.parameter)
    plugin = given.get("scheduler_options") or {}
    if flag is None and exc.parameter in plugin:  # the scheduler's own check of a --scheduler-option it takes
        shown = f"{exc.parameter}={as_typed(plugin[exc.parameter], typed.get(exc.parameter))}"
        return f"{BY_FIELD['scheduler_options'].flag} {shown} is invalid: allowed {exc.allowed}"
    if flag is None or flag.field not in given:
        return None
    value = exc.value
    if flag.field == "scheduler_options" and isinstance(value, dict):  # as typed (KEY=VALUE), not a Python dict
        shown = " ".join(f"{key}={as_typed(v, typed.get(key))}" for key, v in value.items())
    else:
        shown = "none" if value is None else flag_value(value)
    from asyncinfer.embedding import EmbeddingConfig

    if isinstance(exc, UnknownOptionError) and exc.options is EmbeddingConfig:  # a generator's flag for an encoder
        # the library's list of option names, "did you mean max_seq_len?" included, named no flag this command has
        # (--scheduler-option too: an encoder has no scheduler)
        takes = [BY_FIELD[f.name].flag for f in dataclasses.fields(EmbeddingConfig) if f.name in BY_FIELD]
        return (f"{flag.flag} {shown} is invalid: allowed a flag a sentence encoder takes ({', '.join(takes)}); "
                f"{flag.flag} is a text generator's")
    if flag.field == "scheduler_options" and isinstance(value, dict):
        scheduler = given.get("scheduler") or "fifo"
        allowed = re.sub(r"^keywords \w+ accepts", f"keywords scheduler {scheduler} takes", exc.allowed)
        return f"{flag.flag} {shown} is invalid: allowed {allowed}"
    allowed = re.sub(r"\bNone\b", "none", exc.allowed) if flag.takes_none else exc.allowed
    return f"{flag.flag} {shown} is invalid: allowed {allowed}"


def in_flag_terms(text: str) -> str:
    """A message of the library's (a :class:`~asyncinfer.errors.ConfigurationError`'s, say) with each engine
    option named as its flag: ``Raise kv_cache_memory / kv_cache_fraction or lower max_model_len`` reads
    ``Raise --kv-cache-memory / --kv-cache-fraction or lower --max-model-len``. Only the fields spelt with an
    underscore are replaced (``device`` or ``seed`` are also words of the text)."""
    names = sorted((f for f in BY_FIELD if "_" in f), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    return pattern.sub(lambda m: BY_FIELD[m.group(1)].flag, text)
