"""``asyncinfer generate``: a batch job, JSONL in and JSONL out, with a progress bar.

Input, one request a line (``--file``; ``-`` reads stdin)::

    {"prompt": "Once upon a time"}                                  # a text
    {"messages": [{"role": "user", "content": "Hi!"}], "id": "q7"}  # a chat (its template applied)
    {"prompt": [1, 2, 3], "max_tokens": 32, "temperature": 0.7}     # token ids; per-line sampling fields

``--prompt TEXT`` (repeatable) gives the prompts on the command line instead
(``--chat`` sends texts as a user message). The file is UTF-8 (a byte-order mark at its start is
skipped), each line strict JSON
(no NaN or Infinity); ``messages`` is a non-empty list of ``{"role": ..., "content": ...}``
dicts and ``id`` (default: the line's number, from 0) a string (valid Unicode) or an integer.
Every line is checked before anything runs, so a bad line fails the job at once (exit
status 2), naming its line number. All requests are submitted together (at most
``--concurrency`` in flight) and the engine batches them.

Output: one line per request, in input order (``--output``, default stdout)::

    {"id": "q7", "text": "...", "finish_reason": "stop", "prompt_tokens": 9, "completion_tokens": 20}

A model without a tokenizer (a GGUF file with no vocabulary, a directory without tokenizer files) takes
token-id prompts only, and its lines add the output's ``"token_ids"`` (its ``text`` is empty).
A line that asks for ``"logprobs": K`` gets ``"logprobs"``: per generated token
``{"token_id": ..., "logprob": ..., "top": [[token_id, logprob], ...]}`` (K alternatives; with ``n`` > 1,
each of ``"outputs"`` has its own).
A line's ``"structured"`` constrains its output, as ``SamplingParams(structured=...)`` does, written as an
object of one key named after ``StructuredOutput``'s constructor: ``{"json_schema": {...}}``,
``{"json_object": true}``, ``{"regex": "[0-9]+"}``, ``{"choice": ["yes", "no"]}`` or ``{"grammar": "root ::= ..."}``
(it needs ``asyncinfer[structured]``).

A request the engine refuses (e.g. too long), or fails alone while it runs (a structured
constraint past the grammar library's limits), gets ``{"id": ..., "error": "..."}``
and the job goes on; the exit status is then 1. The requests go through the engine's own
admission control, as an HTTP server's do: with ``--max-waiting-requests N``, a request sent
while ``--max-num-seqs`` + N others are in flight is refused (its ``error`` says so), so keep
``--concurrency`` within that sum to have every request run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import msgspec

from asyncinfer.commands import CommandError, check_chats_render, check_one_model, read_number
from asyncinfer.errors import (
    EngineOverloadedError,
    InvalidParameterError,
    RequestFailedError,
    check_unicode,
    range_in_words,
)
from asyncinfer.prompts import check_messages, check_text_prompt, prompt_kind
from asyncinfer.sampling_params import SamplingParams, field_hint
from asyncinfer.structured import StructuredOutput

_REQUEST_KEYS = {"prompt", "messages", "id"}


def _key_hint(key: str) -> str:
    """What a line's unknown ``key`` most likely meant: the field for another library's name (``max_new_tokens``:
    ``max_tokens``) or a close spelling of a key a line takes; "" if none."""
    return field_hint(key, (*sorted(_REQUEST_KEYS), *SamplingParams.__struct_fields__))


#: The engine's fix for a ``max_tokens`` past the context, a Python call, as a job says it: the key of a --file line.
_TRUNCATE_IN_A_LINE = ("SamplingParams(truncate_output_to_model_len=True)",
                       'a --file line\'s "truncate_output_to_model_len": true')
#: The same fix for a --prompt job, which sets no line's keys: the flags it has.
_TRUNCATE_BY_FLAGS = ("SamplingParams(truncate_output_to_model_len=True) to stop at --max-model-len",
                      "lower --max-tokens, or raise --max-model-len")
#: The same where no --max-model-len was given: the model's whole context is in use, none to raise it to.
_TRUNCATE_AT_THE_MODELS_CONTEXT = (_TRUNCATE_BY_FLAGS[0],
                                   "lower --max-tokens (--max-model-len is the model's whole context already)")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    # Not required in argparse's terms: run_generate says what is missing, and explains a prompt given as MODEL.
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; this or --file is needed)")
    source.add_argument("--file", metavar="JSONL", help="one request a line ('-': stdin); see the format above (this or --prompt is needed)")
    p.add_argument("--output", "-o", default="-", metavar="JSONL", help="where the results go (default: stdout)")
    p.add_argument("--chat", action="store_true", help="send text prompts as a user message (chat template)")
    p.add_argument("--concurrency", metavar="N", type=read_number(int, "an integer >= 1"), default=64, help="requests in flight at most (default: 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway without a terminal)")


@dataclass(frozen=True)
class Job:
    id: Any
    prompt: Any
    params: SamplingParams


def run_generate(args: argparse.Namespace, options: dict[str, Any], params: SamplingParams) -> int:
    # an empty path is no file (an unset variable): it read "--file : No such file or directory"
    for flag, value, std in (("--file", args.file, "stdin"), ("--output", args.output, "stdout")):
        if value is not None and not value.strip():
            raise CommandError(f"{flag} {value!r} is invalid: allowed a file's path, or '-' for {std}")
    _check_source(args)
    _check_output_is_not_input(args.file, args.output)
    if args.concurrency < 1:
        raise InvalidParameterError("--concurrency", args.concurrency, "an int >= 1")
    _check_room(args, options, params)
    jobs = list(_jobs(args, params))
    if not jobs:
        raise CommandError(f"{_source(args.file)}: no requests in it")
    with _open_output(args.output) as out:
        return asyncio.run(_run(args.model_arg or args.model, options, jobs, out, args, params))


def _check_source(args: argparse.Namespace) -> None:
    """The prompts come from ``--prompt`` or ``--file``; a text given where the command takes its MODEL
    (``asyncinfer generate "some text"``, as ``chat`` takes its prompt) is explained, not loaded as a model."""
    given = args.model_arg
    prompts_given = bool(args.prompt) or args.file is not None  # then MODEL is a model: a missing one, "does not exist"
    if given is not None and not prompts_given and _reads_as_a_prompt(given):
        shown = given if len(given) <= 60 else given[:57] + "..."
        also = f" --model {args.model}" if args.model else ""
        raise CommandError(f"{shown!r} was read as the model (asyncinfer generate's argument is the MODEL, a path "
                           "or a name): give the prompt with --prompt, e.g. asyncinfer generate"
                           f"{also} --prompt {_quoted(shown)} (or many in a JSONL file: --file FILE)")
    check_one_model("generate", given, args.model)
    if not args.prompt and args.file is None:
        raise CommandError("asyncinfer generate needs its prompts: --prompt TEXT (repeatable) or --file FILE (JSONL, "
                           "one request a line; '-' reads stdin)")
    empty = [i for i, text in enumerate(args.prompt or (), 1) if not text]
    if empty:
        # ``--prompt "$PROMPT"`` with the variable unset: the model was loaded to refuse it as the job's one error
        which = "--prompt ''" if len(args.prompt) == 1 else f"--prompt number {empty[0]} of {len(args.prompt)}"
        raise CommandError(f"{which} is empty (an unset variable?): give the text of each prompt")


def _check_room(args: argparse.Namespace, options: dict[str, Any], params: SamplingParams,
                loaded_context: int | None = None) -> None:
    """``--prompt`` jobs whose ``--max-tokens`` no prompt leaves room for in ``--max-model-len`` (a prompt takes one
    token at least): refused before the model loads where the flag is given, else once it has loaded (its context
    is then the model's, ``loaded_context``) and before any prompt runs, as ``chat`` refuses them, in the flags'
    terms (the model was loaded to refuse each prompt, suggesting a --file line's key that a --prompt job has no way
    to set; a job of the model's context ran and failed each prompt with exit status 1). A --file line sets its own
    ``max_tokens``: checked per line, once loaded."""
    given = options.get("max_model_len")
    context = given if given is not None else loaded_context
    if not args.prompt or context is None or params.truncate_output_to_model_len or params.max_tokens < context:
        return
    if given is not None:
        raise CommandError(f"--max-tokens {params.max_tokens} is invalid: allowed less than --max-model-len "
                           f"({context}), a prompt takes one token at least; lower --max-tokens or raise --max-model-len")
    raise CommandError(f"--max-tokens {params.max_tokens} is invalid: allowed less than the model's context ({context} "
                       "tokens, the default --max-model-len), a prompt takes one token at least; lower --max-tokens")


def _check_output_is_not_input(source: str | None, output: str) -> None:
    """``--output`` naming the ``--file`` it reads (the same path, or a link to it) would replace the prompts with
    the results: refused before anything is read or written."""
    import os

    if source in (None, "-") or output == "-":
        return
    try:
        same = os.path.samefile(source, output)
    except (OSError, ValueError):  # the output does not exist yet (or the input does not: --file says so)
        return
    if same:
        raise CommandError(f"--output {output} is the --file it reads ({source}): writing the results there would "
                           "replace the prompts; choose another --output")


def _reads_as_a_prompt(text: str) -> bool:
    """Whether ``text``, given as the MODEL, is text and no model: not a path here, a known name or a Hub id, and
    with a space in it or shaped as no path (no ``/``, no ``.suffix``: a mistyped ``./my-model`` is left to the
    load's "does not exist")."""
    import os
    from pathlib import Path

    from asyncinfer.model_source import is_hub_id, known_name

    if not any(c.isspace() for c in text) and ("/" in text or "\\" in text or Path(text).suffix):
        return False
    try:
        if Path(os.path.expanduser(text)).exists():
            return False
    except (OSError, ValueError):  # too long for a path, or a NUL in it: text
        return True
    return not (known_name(text) or is_hub_id(text) or text.lower().endswith(".gguf"))


def _quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _jobs(args: argparse.Namespace, params: SamplingParams) -> Iterator[Job]:
    if args.prompt:
        for i, text in enumerate(args.prompt):
            yield Job(i, [{"role": "user", "content": text}] if args.chat else text, params)
        return
    with _open_input(args.file) as lines:
        try:
            for number, line in enumerate(lines, 1):
                if number == 1:  # a byte-order mark, as Windows editors save UTF-8: not part of the JSON
                    line = line.removeprefix("\ufeff")
                if line.strip():
                    yield _job(line, number, params, args)
        except UnicodeDecodeError as exc:  # a ValueError, not an OSError: name the file here
            byte = exc.object[exc.start:exc.start + 1].hex()
            raise CommandError(f"{_source(args.file)}: not UTF-8 text ({exc.reason} 0x{byte}); save it as UTF-8") from None


def _source(file: str) -> str:
    """``--file`` as an error names it: ``-`` is the standard input, ``stdin``."""
    return "stdin" if file == "-" else file


def _job(line: str, number: int, params: SamplingParams, args: argparse.Namespace) -> Job:
    where = f"{_source(args.file)} line {number}"
    try:
        item = json.loads(line, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:  # nested deeper than Python's reader goes (a traceback-free "internal error" before)
        raise CommandError(f"{where}: not JSON that can be read (arrays or objects nested too deeply)") from None
    except ValueError as exc:
        plain = not line.lstrip().startswith(("{", "[", '"'))  # a text file of prompts, one a line
        hint = (": each line is a JSON object such as {\"prompt\": \"Tell me a joke\"} (or a JSON string); plain "
                "prompts go on the command line as --prompt TEXT") if plain else ""
        said = str(exc)
        if "integer string conversion" in said:  # Python's own advice (sys.set_int_max_str_digits) is not the user's
            said = f"a number of more than {sys.get_int_max_str_digits()} digits"
        raise CommandError(f"{where}: not JSON ({said}){hint}") from None
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise CommandError(f"{where}: expected an object with 'prompt' or 'messages' (one of them)")
    overrides = {k: v for k, v in item.items() if k not in _REQUEST_KEYS}
    unknown = sorted(set(overrides) - set(SamplingParams.__struct_fields__))
    if unknown:  # before the missing prompt: {"promt": "y"} is named by its misspelt key
        raise CommandError(f"{where}: unknown key(s) {', '.join(_shown(k) for k in unknown)}: the keys are prompt, "
                           "messages, id and "
                           "SamplingParams' fields (max_tokens, temperature, stop, ...)"
                           + "".join(f"; {hint}" for hint in map(_key_hint, unknown) if hint))
    if ("prompt" in item) == ("messages" in item):
        raise CommandError(f"{where}: expected an object with 'prompt' or 'messages' (one of them)")
    if overrides.get("structured") is not None:
        overrides["structured"] = _structured(overrides["structured"], where)
    try:
        line_params = SamplingParams(**{**msgspec.structs.asdict(params), **overrides})
    except InvalidParameterError as exc:  # the line's value as the line wrote it, the range in JSON's words
        plain = str(exc) == str(InvalidParameterError(exc.parameter, exc.value, exc.allowed))
        text = (f"{exc.parameter}={_shown(exc.value, 240)} is invalid: allowed "
                f"{range_in_words(exc.allowed, none='null')}") if plain else str(exc)
        raise CommandError(f"{where}: {text}") from None
    if "messages" in item and not _is_chat(item["messages"]):
        raise CommandError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                           f"dicts (strings), not {_shown(item['messages'])}")
    request_id = item.get("id", number - 1)
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise CommandError(f"{where}: 'id' must be a string or an integer, not {_shown(request_id)}")
    if isinstance(request_id, str):  # written back in the line's output, which cannot hold a lone surrogate
        try:
            check_unicode("id", request_id, "string")
        except InvalidParameterError as exc:
            raise CommandError(f"{where}: 'id' must be valid Unicode, not {exc.value}") from None
    prompt = item["messages"] if "messages" in item else item["prompt"]
    _check_prompt(prompt, "messages" if "messages" in item else "prompt", where)
    if args.chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return Job(request_id, prompt, line_params)


#: A line's ``"structured"`` object: its one key, the ``StructuredOutput`` constructor it names.
_STRUCTURED = {"json_schema": StructuredOutput.json_schema, "json_object": StructuredOutput.json_object,
               "regex": StructuredOutput.regex, "choice": StructuredOutput.choice, "grammar": StructuredOutput.grammar}


def _structured(value: Any, where: str) -> StructuredOutput:
    """A line's ``"structured"``, ``{"regex": "[0-9]+"}`` say, as the ``StructuredOutput`` it names: JSON cannot
    hold the Python object that ``SamplingParams.structured`` takes (every object was refused, naming Python's
    constructors)."""
    form = ('an object of one key: {"json_schema": {...}}, {"json_object": true}, {"regex": "..."}, '
            '{"choice": ["...", ...]} or {"grammar": "..."}')
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _STRUCTURED:
        raise CommandError(f"{where}: structured={_shown(value)} is invalid: allowed null or {form}")
    ((kind, spec),) = value.items()
    if kind == "json_object":
        if spec is not True:
            raise CommandError(f"{where}: structured={_shown(value)} is invalid: allowed {{\"json_object\": true}}")
        return StructuredOutput.json_object()
    try:
        return _STRUCTURED[kind](spec)
    except InvalidParameterError as exc:
        raise CommandError(f"{where}: structured.{kind}={_shown(exc.value, 240)} is invalid: allowed "
                           f"{range_in_words(exc.allowed, none='null')}") from None


def _no_constant(name: str) -> Any:
    """json's hook for NaN, Infinity and -Infinity: Python's json module reads them, JSON has none."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a finite JSON number that no float holds
        raise ValueError(f"{text} is out of a float's range")
    return value


def _check_prompt(prompt: Any, key: str, where: str) -> None:
    """A line's prompt by the engine's own rules that need no model (``prompts.prompt_kind``, its text's and chat
    messages' checks), plus token ids >= 0: refused with the line's number before the load (the model's own limits,
    an id past its vocabulary or a prompt past its context, stay a request's error)."""
    kind = prompt_kind(prompt)
    if kind is None or (kind == "text" and not prompt) or (kind == "ids" and min(prompt) < 0):
        raise CommandError(f"{where}: '{key}' must be a non-empty string, a non-empty list of token ids (integers "
                           f">= 0) or a list of chat messages, not {_shown(prompt)}")
    try:
        if kind == "text":
            check_text_prompt(prompt)
        elif kind == "chat":
            check_messages(prompt)
    except InvalidParameterError as exc:
        item = exc.parameter.removeprefix("prompt")  # "[2].role"
        if exc.allowed.startswith("valid Unicode"):  # (a message's: any of its texts, its name's too)
            raise CommandError(f"{where}: '{key}{item}' must be valid Unicode, not {exc.value}") from None
        raise CommandError(f"{where}: {key}{item}={_shown(exc.value)} is invalid: allowed {exc.allowed}") from None


def _is_chat(messages: Any) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def _shown(value: Any, limit: int = 60) -> str:
    """A line's value as the line wrote it, in JSON (``null``, ``true``, ``["a"]``), cut past ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # (what json.loads makes always dumps; a value of the engine's own may not)
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def _open_input(name: str) -> Iterator[TextIO]:
    if name == "-":
        yield sys.stdin
    else:
        with _opened("--file", name, "r") as fh:
            yield fh


@contextlib.contextmanager
def _open_output(name: str) -> Iterator[TextIO]:
    if name == "-":
        if sys.stdout is None:  # started with it closed (>&-): refused before the load, not once every request ran
            raise CommandError("--output -: standard output is closed: give --output FILE")
        yield sys.stdout
    else:
        with _opened("--output", name, "w") as fh:
            yield fh


def _opened(flag: str, name: str, mode: str) -> TextIO:
    """``open(name)``; a path that cannot be opened is the error of the flag that gave it."""
    try:
        return open(name, mode, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"{flag} {name}: {exc.strerror or exc}") from None


class _Progress:
    """Requests done and output tokens/s, on stderr: tqdm's bar on a terminal, nothing otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.tokens = 0
        self.start = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def done(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.rate:.1f} tok/s", refresh=False)

    @property
    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _logprobs(logprobs: list[Any] | None) -> list[dict[str, Any]]:
    """A sample's ``Logprob``s as JSON: each generated token's id and log-probability and its ``top``
    alternatives as ``[token_id, logprob]`` pairs; a log-probability of -inf (a token no sample could take)
    is null, the output being strict JSON."""
    def number(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return [{"token_id": lp.token_id, "logprob": number(lp.logprob), "top": [[t, number(v)] for t, v in lp.top]}
            for lp in logprobs or []]


async def _run(model: Any, options: dict[str, Any], jobs: list[Job], out: TextIO, args: argparse.Namespace,
               params: SamplingParams) -> int:
    from asyncinfer.engine import AsyncEngine

    engine = await AsyncEngine.load(model, **options)
    try:
        _check_room(args, options, params, engine.max_model_len)  # the model's own context, where no flag gave one
    except CommandError:
        await engine.aclose()
        raise
    if args.chat:  # every line a chat: refused once, not line by line
        check_chats_render(engine.get_tokenizer(), model, "generate --chat")
    ids_only = engine.get_tokenizer() is None  # no text to give: the output is its token ids
    if ids_only and all(isinstance(job.prompt, str) for job in jobs):  # refused once, not line by line
        await engine.aclose()
        raise CommandError(f"{str(model)!r} has no tokenizer (no tokenizer files beside its weights, or none in its "
                           "GGUF file), so generate cannot encode text prompts for it: give each prompt as token "
                           'ids, a --file line such as {"prompt": [1, 2, 3]}')
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    written = failed = 0
    limit = asyncio.Semaphore(args.concurrency)
    progress = _Progress(len(jobs), not args.no_progress)

    async def one(i: int, job: Job) -> None:
        nonlocal written, failed
        async with limit:
            try:
                result = await engine.generate(job.prompt, job.params, request_id=f"generate-{i}")
                record: dict[str, Any] = {"id": job.id, "text": result.text, "finish_reason": result.finish_reason,
                                          "prompt_tokens": len(result.prompt_token_ids),
                                          "completion_tokens": sum(len(o.token_ids) for o in result.outputs)}
                wants = job.params.logprobs is not None  # asked for on the line: written, not dropped
                if ids_only:
                    record["token_ids"] = list(result.outputs[0].token_ids)
                if wants:
                    record["logprobs"] = _logprobs(result.outputs[0].logprobs)
                if len(result.outputs) > 1:
                    record["outputs"] = [{"text": o.text, "finish_reason": o.finish_reason,
                                          **({"token_ids": list(o.token_ids)} if ids_only else {}),
                                          **({"logprobs": _logprobs(o.logprobs)} if wants else {})}
                                         for o in result.outputs]
                progress.done(record["completion_tokens"])
            except (InvalidParameterError, EngineOverloadedError, RequestFailedError) as exc:  # this request only
                from asyncinfer.commands.engine_flags import in_flag_terms

                fix = (_TRUNCATE_IN_A_LINE if args.file is not None else _TRUNCATE_BY_FLAGS
                       if options.get("max_model_len") is not None else _TRUNCATE_AT_THE_MODELS_CONTEXT)
                record = {"id": job.id, "error": in_flag_terms(str(exc)).replace(*fix)}
                failed += 1
                progress.done(0)
        results[i] = record
        while written < len(results) and results[written] is not None:  # in input order
            out.write(json.dumps(results[written], ensure_ascii=False) + "\n")
            results[written] = None
            written += 1
        out.flush()

    try:
        async with engine:
            await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))
    finally:
        progress.close()
    elapsed = time.perf_counter() - progress.start
    print(f"{len(jobs) - failed} of {len(jobs)} requests done in {elapsed:.1f} s, {progress.tokens} output tokens "
          f"({progress.rate:.1f} tokens/s)" + (f"; {failed} refused or failed (see their 'error')" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0
