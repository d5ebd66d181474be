"""The ``asyncinfer`` command (also ``python -m asyncinfer``).

    asyncinfer chat "What is the capital of France?"   # one-shot, streamed; Ctrl-C stops it
    asyncinfer chat                                     # interactive: /reset, /exit; Ctrl-C stops a reply
    asyncinfer generate --file prompts.jsonl --output out.jsonl   # a batch job, with a progress bar
    asyncinfer bench                                    # throughput and latency at a few concurrencies
    asyncinfer info                                     # the model and its memory plan (no weights read)
    asyncinfer plan MODEL --batch 8 --seq-len 4096 --device-memory 24GiB   # the budget, no weights loaded
    asyncinfer embed "first text" "second text"         # sentence embeddings (all-MiniLM-L6-v2)
    asyncinfer lab --synthetic 200                      # compare schedulers on a simulated trace
    asyncinfer serve MODEL --port 8000                  # an OpenAI-compatible HTTP server (asyncinfer[server])

Every engine and sampling option defaults to the library's own default
(``EngineConfig``, ``SamplingParams``); ``asyncinfer COMMAND --help`` lists them.
An error is one line on stderr (exit status 2); ``ASYNCINFER_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from asyncinfer.commands import flag_value, read_number
from asyncinfer.errors import AsyncInferError, ConfigurationError, InvalidParameterError, exception_text, range_in_words
from asyncinfer.sampling_params import SamplingParams

# (flag, SamplingParams field, type, help)
_SAMPLING_ARGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--max-tokens", "max_tokens", int, "most tokens to generate"),
    ("--temperature", "temperature", float, "0 = greedy"),
    ("--top-p", "top_p", float, "nucleus sampling mass, in (0, 1]"),
    ("--top-k", "top_k", int, "keep the k most likely tokens (0 or -1: off)"),
    ("--min-p", "min_p", float, "drop tokens below min_p x the top probability"),
    ("--repetition-penalty", "repetition_penalty", float, "> 1 discourages repeats"),
    ("--presence-penalty", "presence_penalty", float, "in [-2, 2]"),
    ("--frequency-penalty", "frequency_penalty", float, "in [-2, 2]"),
    ("--seed", "seed", int, ("seed of the request's own generator (default: none: unseeded, drawn from the "
                             "engine's generator, --engine-seed)")),
)


def _defaults(cls: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls)}
    return {name: getattr(cls(), name) for name in cls.__struct_fields__}  # a msgspec Struct


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from asyncinfer.commands.engine_flags import add_engine_flags

    p.add_argument(*_names("--model"), metavar="MODEL", default=None,
                   help="HF model directory, .gguf file, known name or a Hugging Face Hub id in the local HF cache "
                        "(default: SmolLM2-135M-Instruct, fetched once)")
    add_engine_flags(p)


def _names(flag: str) -> tuple[str, ...]:
    """``flag`` and the other tools' flags that are its aliases on every command that has it (``-m`` for
    ``--model``, ``-t`` for ``--threads``, ``-c`` / ``--ctx-size`` for ``--max-model-len``:
    :data:`~asyncinfer.commands.foreign_flags.ALIASES`)."""
    from asyncinfer.commands.foreign_flags import ALIASES

    return (flag, *ALIASES.get(flag, ()))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    defaults = _defaults(SamplingParams)
    from asyncinfer.commands.foreign_flags import ALIASES

    for flag, field, kind, text in _SAMPLING_ARGS:
        shown = "" if defaults[field] is None else f" (default: {defaults[field]})"  # (--seed says its own)
        metavar = "SEED" if field == "seed" else "N" if kind is int else "NUMBER"
        p.add_argument(flag, *ALIASES.get(flag, ()), type=read_number(kind, _sampling_range(field)), default=None,
                       dest=field, metavar=metavar,
                       help=text + shown)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past EOS")


def _weight_format(value: str) -> str | None:
    """A ``--quantization`` value of ``asyncinfer plan`` as the planner's: "none" is None (the dtype)."""
    return None if value.lower() == "none" else value


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (the rest keep the library's defaults)."""
    from asyncinfer.commands.engine_flags import engine_options

    return engine_options(args)


def _sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """SamplingParams from the sampling flags given (the rest keep their defaults)."""
    flags = {field: flag for flag, field, _, _ in _SAMPLING_ARGS} | {"stop": "--stop", "ignore_eos": "--ignore-eos"}
    given = {f: getattr(args, f) for f in flags if getattr(args, f, None) is not None}
    try:
        return SamplingParams(**{**given, **overrides})
    except InvalidParameterError as exc:  # named by its flag: "--max-tokens -3 is invalid", not max_tokens=-3
        field, _, index = exc.parameter.partition("[")  # "stop[1]": the second --stop
        flag = flags.get(field)
        if flag is None or field not in given:
            raise
        value, allowed = exc.value, range_in_words(exc.allowed, none=None)  # the flag takes no none: it is left out
        if field == "stop" and isinstance(value, list):  # the one bad --stop, not the list of them
            value = next((v for v in value if not (isinstance(v, str) and v)), value)
            allowed = "a non-empty string"
        shown = flag_value(value)
        which = f" (occurrence {int(index.rstrip(']')) + 1})" if index.rstrip("]").isdigit() else ""
        raise InvalidParameterError(flag, value, allowed,
                                    message=f"{flag} {shown}{which} is invalid: allowed {allowed}") from None


def _info(args: argparse.Namespace) -> int:
    """The model's shapes and the memory plan, from its config alone (no weight is read)."""
    from asyncinfer.engine import AsyncEngine
    from asyncinfer.memory import MemoryPlan, format_bytes
    from asyncinfer.model_source import resolve_model
    from asyncinfer.models.encoder import is_encoder_dir
    from asyncinfer.models.loader import read_model_config

    model = args.model_arg or args.model
    path = resolve_model(model)
    encoder = is_encoder_dir(path)
    mc = None if encoder else read_model_config(path)  # a file that is no model: the error alone, no line before
    head = [f"model: {path}"]  # printed once the plan is made: an error (a bad option) is the only output
    if mc is not None:
        head.append(f"architecture: {mc.architecture}, {mc.num_layers} layers, hidden {mc.hidden_size}, heads "
                    f"{mc.num_heads}/{mc.num_kv_heads} kv, vocab {mc.vocab_size}, context {mc.max_position_embeddings}")
    try:
        plan = AsyncEngine.plan_memory(path, **_engine_options(args))
    except ConfigurationError as exc:
        from asyncinfer.commands.engine_flags import in_flag_terms

        command = f"asyncinfer plan {model}" if model else "asyncinfer plan"
        print(*head, sep="\n")
        print(f"memory plan: {in_flag_terms(str(exc))} ({command} shows the whole budget)")
        return 1
    print(*head, sep="\n")
    if isinstance(plan, MemoryPlan):
        from asyncinfer.config import EngineConfig, for_model

        options = _engine_options(args)
        config = EngineConfig.from_options(options)
        if mc is not None:
            # "auto": this file's own block format where it runs (plan_memory above logged any fallback)
            config = for_model(config, options, mc, warn=False)
        weights = config.quantization or "the dtype"
        print(f"dtype {str(config.dtype).removeprefix('torch.')} on {config.device}, weight format: {weights}")
        if config.device.type == "cpu":
            print(f"kernels: {_kernels_line()}")
        print(f"memory plan: {plan.describe()}")
        from asyncinfer.planner import OVERHEAD_BYTES

        overhead = OVERHEAD_BYTES[config.device.type]
        engine_bytes = plan.weight_bytes + plan.kv_bytes + plan.activation_reserve
        # the process's own (torch, Python, the tokenizer, a server) as asyncinfer plan estimates it: without it the
        # figure read as a total 25-33% under the peak measured at the same flags (stranger68)
        print(f"needs {format_bytes(engine_bytes + overhead)} in all: {format_bytes(engine_bytes)} for the weights, "
              f"KV cache and activation reserve, and an estimated {format_bytes(overhead)} for torch, Python, the "
              "tokenizer and a server (KV memory on the CPU is committed as it is used); planned from the config, no "
              "weight read")
    else:
        print(f"embedding model; memory plan: {plan.describe()}")
    return 0


def _kernels_line() -> str:
    """asyncinfer's CPU kernels here: the variant and where its library came from, or why they cannot run."""
    from asyncinfer import kernels

    if not kernels.available():
        return f"unavailable ({kernels.unavailable_reason()})"
    info = kernels.build_info()
    source = "installed" if info["source"] == "installed" else f"run-time build, {info['path']}"
    return f"{info['isa']} ({source})"


def _plan(args: argparse.Namespace) -> int:
    from asyncinfer.memory import read_model_config
    from asyncinfer.model_source import resolve_model
    from asyncinfer.planner import parse_bytes, plan_deployment

    path = resolve_model(args.model_arg or args.model)
    from asyncinfer.models.encoder import is_encoder_dir

    if is_encoder_dir(path):  # the budget table is a generator's (KV cache, batch, length)
        from asyncinfer.commands import CommandError

        raise CommandError(f"{str(args.model_arg or args.model)!r} is a sentence encoder: asyncinfer plan budgets "
                           "generators (KV cache, batch, length); asyncinfer info prints an encoder's memory plan")
    plan = plan_deployment(
        read_model_config(path), model_name=path.name, batch=args.batch, seq_len=args.seq_len, device=args.device,
        dtype=args.dtype, quantization=_weight_format(args.quantization),
        block_size=args.block_size,
        device_memory=None if args.device_memory is None else parse_bytes(args.device_memory),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
    )
    print(plan.table())
    return 0 if plan.fits else 1


def _engine_flag_names() -> set[str]:
    """The engine options' flags (imported when asked: engine_flags imports the library)."""
    from asyncinfer.commands.engine_flags import flag_names

    return flag_names()


class _SpelledAs(argparse.Action):
    """A flag with aliases that keeps, beside its value, the spelling typed (``DEST_flag``), for its refusal to
    name: ``plan -c 100000`` is refused as ``-c 100000``, not as ``--seq-len``, a flag the user never typed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string or self.option_strings[0])


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory, .gguf file or known name (default: SmolLM2-135M-Instruct)")
    p.add_argument(*_names("--model"), metavar="MODEL", default=None,
                   help="the model (same as MODEL; default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch", metavar="N", type=read_number(int, "an integer >= 1"), default=1,
                   help="requests served at once, each of --seq-len tokens (default: 1; an engine given no KV budget "
                        "holds min(--max-num-seqs, 4) of them: asyncinfer info shows its plan)")
    # the engine's max_model_len in the plan it prints: the engine commands' flag for it is an alias
    p.add_argument("--seq-len", *_names("--max-model-len"), metavar="TOKENS", action=_SpelledAs,
                   type=read_number(int, "an integer >= 2, at most the model's context"), default=None,
                   help="tokens per request, prompt + output: the engine's --max-model-len (default: the model's "
                        "context)")
    p.set_defaults(seq_len_flag="--seq-len")
    p.add_argument("--dtype", metavar="DTYPE", default="auto",
                   help="auto (float32 on cpu, bfloat16 on cuda) | float32 | bfloat16 | float16 (default: auto)")
    # No argparse choices: the planner checks the value against the engine's own list of formats
    # (models.quant.QUANTIZATION_METHODS), so plan takes every format the engine takes.
    p.add_argument("--quantization", default="auto", metavar="FORMAT",
                   help="weight format: auto (the engine's default: on cpu with --dtype auto, a GGUF's own block "
                        "format where it has one, q4_1 for the default model, else float16 weights), none (the "
                        "dtype), or any format the engine's quantization option takes (docs/formats.md): on cpu "
                        "float16, int8, the block formats q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, or native; "
                        "on cuda float16 or bfloat16 (the dtype) (default: auto)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the target device (default: cpu)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="e.g. 24GiB or 80GB (default: measured here: available RAM, or the CUDA device's total)")
    p.add_argument("--block-size", metavar="N", type=read_number(int, "an integer in [1, 256]"), default=16, help="tokens per KV block (the engine's block_size) (default: 16)")
    p.add_argument("--max-num-batched-tokens", metavar="N", type=read_number(int, "an integer >= 1"), default=1024, help="tokens per step (for activations) (default: 1024)")
    p.add_argument("--max-num-seqs", metavar="N", type=read_number(int, "an integer in [1, 4096]"), default=128, help="requests per step (for the logits) (default: 128)")


def _parse_options(items: list[str], names: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """``NAME.KEY=VALUE`` pairs (VALUE read as JSON, else kept as text, as ``--scheduler-option`` reads it:
    :func:`~asyncinfer.commands.engine_flags.read_value`) -> per-scheduler options, NAME one of ``names``, the
    policies run (an option for another, a typo or one left out of --schedulers, would change nothing), each
    NAME.KEY once; and each VALUE as typed, for a refusal."""
    from asyncinfer.commands.engine_flags import FLOAT_RANGE, read_value

    options: dict[str, dict[str, Any]] = {}
    typed: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, raw = item.partition("=")
        name, dot, key = target.rpartition(".")
        if not (sep and dot and name and key):
            raise InvalidParameterError("--option", item, "NAME.KEY=VALUE, e.g. pd-split.prefill_budget=64")
        if name not in names:
            raise InvalidParameterError("--option", item, f"NAME one of the schedulers run: {', '.join(names)}")
        if key in options.get(name, {}):  # the last one was kept silently, the first never checked
            raise InvalidParameterError("--option", item, f"each NAME.KEY once ({target} is given twice)")
        try:
            value = read_value(key, raw)
        except argparse.ArgumentTypeError:
            raise InvalidParameterError("--option", item, f"a VALUE whose numbers are 0 or of {FLOAT_RANGE}") from None
        options.setdefault(name, {})[key] = value
        typed.setdefault(name, {})[key] = raw
    return options, typed


def _lab(args: argparse.Namespace) -> int:
    import importlib.util

    from asyncinfer import lab
    from asyncinfer.schedulers import SchedulerConfig

    if args.calibrate:
        from asyncinfer.commands import check_output_path
        from asyncinfer.commands.calibrate import calibrate

        check_output_path("--calibrate", args.calibrate)  # before the calibration's minutes, not after them

        command = f"asyncinfer lab --calibrate {args.calibrate}" + (f" --model {args.model}" if args.model else "")
        command += f" --threads {args.threads}" if args.threads else ""
        model = calibrate(args.model, command=command, num_threads=args.threads)
        model.save(args.calibrate)
        print(f"cost model written to {args.calibrate}: {model.coefficients}")
        print(f"fit over {model.meta['fit_samples']} shapes: mean relative error "
              f"{model.meta['fit_mean_rel_error']:.1%}, max {model.meta['fit_max_rel_error']:.1%}")
        return 0
    from asyncinfer.commands import CommandError, check_output_path, plot_path

    unused = [flag for flag, value in (("--model", args.model), ("--threads", args.threads)) if value is not None]
    if unused:  # calibration's flags: the replay itself loads no model and runs no torch
        raise CommandError(f"{' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} used only with --calibrate "
                           "(the lab replays the trace on a cost model and loads no model; --cost-model FILE picks "
                           "one made by asyncinfer lab --calibrate FILE --model MODEL)")
    needed = -(-args.max_model_len // args.block_size)
    if needed > LAB_MAX_BLOCKS:  # no --num-blocks holds it: the flag to change is --max-model-len
        raise CommandError(f"--max-model-len {args.max_model_len} is invalid: allowed at most "
                           f"{LAB_MAX_BLOCKS * args.block_size}, the tokens of --num-blocks' largest, {LAB_MAX_BLOCKS} "
                           f"blocks of --block-size {args.block_size}")
    if needed > args.num_blocks:  # checked before the trace is read or saved, in the flags' terms
        raise CommandError(f"--num-blocks {args.num_blocks} is invalid: allowed at least {needed}, the blocks of "
                           f"--block-size {args.block_size} tokens that one --max-model-len {args.max_model_len} "
                           "request needs (or lower --max-model-len)")
    slo = lab.Slo(ttft=args.slo_ttft, tpot=args.slo_tpot)
    # an empty file to read is no file: --trace '' replayed a synthetic trace as if --trace were left out, and
    # --cost-model '' read the working directory ("Is a directory")
    for flag, value, instead in (("--trace", args.trace, "a synthetic trace"),
                                 ("--cost-model", args.cost_model, "the shipped one")):
        if value is not None and not value.strip():
            raise CommandError(f"{flag} {value!r} is invalid: allowed a file's path (leave {flag} out for {instead})")
    # the outputs' paths checked before the replay runs, not once it is over
    if args.json:  # an empty --json or --plot writes nothing
        check_output_path("--json", args.json)
    if args.save_trace:
        check_output_path("--save-trace", args.save_trace)
    if args.plot and importlib.util.find_spec("matplotlib") is not None:  # else: "no plot", below
        args.plot = plot_path(args.plot)
    if args.trace:
        try:
            trace = lab.load_trace(args.trace)
        except OSError as exc:  # named by its flag, as generate's --file
            raise CommandError(f"--trace {args.trace}: {exc.strerror or exc}") from None
        source = args.trace
    else:
        if args.max_model_len < 2:  # a prompt of one token and one output token
            raise CommandError(f"--max-model-len {args.max_model_len} is invalid: allowed an integer >= 2 (a "
                               "synthetic request's prompt and output)")
        # prompts within --max-model-len (the replay refuses longer ones): `lab --max-model-len 1024` drew long
        # prompts up to 2048 tokens and was refused as "--trace 'r15' is invalid" with no --trace given
        trace = lab.synthetic_trace(args.synthetic, rate=args.rate, seed=args.seed, long_fraction=args.long_fraction,
                                    priorities=args.priorities, max_prompt_len=args.max_model_len - 1)
        source = f"synthetic: {args.synthetic} requests, {args.rate}/s, seed {args.seed}"
    if args.save_trace:
        try:
            lab.save_trace(trace, args.save_trace)
        except OSError as exc:  # named by its flag, as --trace is (the disk full, say)
            raise CommandError(f"--save-trace {args.save_trace}: {exc.strerror or exc}") from None
    names = _lab_schedulers(args)
    if args.list_schedulers:
        for name in names:
            print(name)
        return 0
    options, typed = _parse_options(args.option, names)
    try:
        cost = lab.load_cost_model(args.cost_model)
    except OSError as exc:
        raise CommandError(f"--cost-model {args.cost_model}: {exc.strerror or exc}") from None
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len)
    results, summaries = {}, []
    for name in names:
        try:
            result = lab.simulate(trace, name, cost_model=cost, config=config, num_blocks=args.num_blocks,
                                  block_size=args.block_size, options=options.get(name),
                                  enable_prefix_caching=not args.no_prefix_caching)
        except InvalidParameterError as exc:
            raise _option_error(exc, name, options.get(name) or {}, typed.get(name) or {}) from None
        results[name] = result.records
        summaries.append(lab.summarize(name, result.records, slo))
    asked, produced = sum(t.output_len for t in trace), max(s.output_tokens for s in summaries)
    cut = (f"; {produced} produced: each request ends at --max-model-len {args.max_model_len}"
           if produced < asked else "")  # the figures are of the shorter outputs
    print(f"trace: {source} ({len(trace)} requests, {sum(t.prompt_len for t in trace)} prompt and "
          f"{asked} output tokens{cut})")
    print(f"cost model: {args.cost_model or 'shipped'} ({cost.meta.get('model', '?')}, "
          f"{cost.meta.get('cpu', '?')}); {args.num_blocks} blocks x {args.block_size}, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    print(f"SLO: TTFT <= {slo.ttft}s and TPOT <= {slo.tpot}s; times in simulated seconds\n")
    print(lab.format_table(summaries))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"trace": source, "summaries": [s.to_dict() for s in summaries]}, fh, indent=2)
    if args.plot:
        if lab.save_plot(results, summaries, args.plot, title=source):
            print(f"\nplot saved to {args.plot}")
        else:
            print("\nno plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def _option_error(exc: InvalidParameterError, name: str, given: dict[str, Any],
                  typed: dict[str, str]) -> AsyncInferError:
    """A scheduler's refusal of its ``--option`` values, named by the flag as typed (``--option
    pd-split.prefill_budget=0``), as serve names ``--scheduler-option``; other errors pass unchanged."""
    from asyncinfer.commands import CommandError
    from asyncinfer.commands.engine_flags import as_typed

    if exc.parameter in given:
        value = as_typed(given[exc.parameter], typed.get(exc.parameter))
        return CommandError(f"--option {name}.{exc.parameter}={value} is invalid: allowed {exc.allowed}")
    if exc.parameter == "scheduler_options" and given:
        shown = " ".join(f"--option {name}.{key}={as_typed(value, typed.get(key))}" for key, value in given.items())
        return CommandError(f"{shown} is invalid: allowed {exc.allowed}")
    return exc


def _plugin_file_path(module: str) -> InvalidParameterError:
    """The refusal of a ``--plugin`` that names a file (``examples/custom_scheduler.py``), with the dotted name
    it means: it read as ``No module named 'examples/custom_scheduler'``."""
    parts = [p for p in module.removesuffix(".py").replace("\\", "/").split("/") if p not in ("", ".")]
    where = parts[0] if len(parts) > 1 else "it"
    return InvalidParameterError("--plugin", module, f"an importable module: a module's dotted name, not a file's "
                                 f"path (here {'.'.join(parts)}, run from the directory that holds {where})")


def _lab_schedulers(args: argparse.Namespace) -> list[str]:
    """The policies to compare: --schedulers, else the built-ins, the installed entry points and the
    names that the --plugin modules registered with @register_scheduler."""
    import importlib
    from importlib.metadata import entry_points

    from asyncinfer.schedulers import (
        ENTRY_POINT_GROUP,
        available_schedulers,
        builtin_schedulers,
        registered_schedulers,
    )
    from asyncinfer.step import ENDS_ENGINE

    before = set(available_schedulers())
    for module in args.plugin:
        if "/" in module or "\\" in module:  # a file's path, as a shell completes it: it read as no module
            raise _plugin_file_path(module)
        if not module or module.startswith("."):
            raise InvalidParameterError("--plugin", module, "an importable module (an absolute module name)")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if module.endswith(".py"):  # "policies.py": no such package
                raise _plugin_file_path(module) from exc
            raise InvalidParameterError("--plugin", module, f"an importable module ({exc})") from exc
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # the plugin's own code failed as it was imported: its fault
            # (a class of its own deriving from BaseException, or asyncio.CancelledError, too: it was a traceback)
            raise InvalidParameterError(
                "--plugin", module, f"an importable module (importing it raised {exception_text(exc)})") from exc
    if args.schedulers is not None:  # given: an empty list, or a name twice, runs nothing the user asked for
        names = [n.strip() for n in args.schedulers.split(",")]
        if not all(names):
            raise InvalidParameterError("scheduler", args.schedulers,
                                        "a comma-separated list of scheduler names, none empty (--list-schedulers "
                                        "prints them)")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidParameterError("scheduler", args.schedulers,
                                        f"each scheduler named once ({', '.join(map(repr, twice))} twice)")
        return names
    # A plugin's names: new since the import, or (when the module or another one registered the name
    # earlier in this process) those whose class the plugin module defines.
    own = {name for name, cls in registered_schedulers().items()
           if any(cls.__module__ == m or cls.__module__.startswith(m + ".") for m in args.plugin)}
    plugins = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | (set(available_schedulers()) - before) | own
    return builtin_schedulers() + sorted(plugins - set(builtin_schedulers()))


# The lab builds a real KVCacheManager: a Python object per block (about 200 bytes), so 2**20 blocks hold 256 MiB
# of the machine's memory; --num-blocks 1000000000 asked for some 200 GB and died of MemoryError (or of the OOM
# killer). 2**20 blocks of 16 tokens are 16M tokens of KV cache, more than any one device holds for a model.
# lab.simulate's own bound (asyncinfer.lab.simulator.MAX_SIM_BLOCKS, for a caller in Python too; not imported: the
# command line loads the lab only when it runs it).
LAB_MAX_BLOCKS = 2**20
# A trace's requests likewise (asyncinfer.lab.trace.MAX_TRACE_REQUESTS): --synthetic 100000000 was some 46 GB.
LAB_MAX_REQUESTS = 10**6


def _ranged_int(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """A flag's integer in [``low``, ``high``] (no ``high``: >= ``low``), refused naming the range (argparse's own
    message named the parsing function: "invalid _positive_int value: 'abc'")."""
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer {bounds}{what}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not {bounds}{what}")
        return value

    return parse


_positive_int = _ranged_int(1)


def _sampling_range(field: str) -> Callable[[], str]:
    """The range of SamplingParams' ``field`` in the flags' words, read from SamplingParams' refusal of a value
    that is no number (one source for the range)."""

    def read() -> str:
        try:
            SamplingParams(**{field: object()})
        except InvalidParameterError as exc:
            return range_in_words(exc.allowed, none=None)
        raise AssertionError(f"SamplingParams took {field}=object()")

    return read


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,2,4") from None


def _add_lab_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="JSONL", default=None, help="JSONL trace: arrival, prompt_len, output_len[, priority, id] (default: none: a synthetic trace, "
                                                                           "--synthetic)")
    src.add_argument("--synthetic", type=_ranged_int(1, LAB_MAX_REQUESTS), default=200, metavar="N",
                     help=f"generate N requests, at most {LAB_MAX_REQUESTS} (default: 200)")
    p.add_argument("--rate", metavar="PER_S", type=read_number(float, "a finite number of requests per second > 0"), default=0.25, help="synthetic arrivals per second (Poisson) (default: 0.25)")
    p.add_argument("--seed", metavar="SEED", type=read_number(int, "any integer"), default=0, help="synthetic trace seed (default: 0)")
    p.add_argument("--long-fraction", metavar="FRACTION", type=read_number(float, "a fraction in [0, 1]"), default=0.2, help="synthetic share of long prompts (512-2048 tokens; synthetic prompts stay "
                        "below --max-model-len) (default: 0.2)")
    p.add_argument("--priorities", metavar="LIST", type=_int_list, default=(0, 2, 4), help="synthetic priority levels (default: 0,2,4)")
    p.add_argument("--save-trace", default=None, metavar="FILE", help="write the trace used as JSONL (default: none)")
    p.add_argument("--schedulers", metavar="NAMES", default=None,
                   help="comma-separated names (default: the built-ins, installed plugins and --plugin's names)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, so that its @register_scheduler names exist (repeatable; default: none)")
    p.add_argument("--list-schedulers", action="store_true", help="print the names --schedulers would default to")
    p.add_argument("--option", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="a scheduler option, e.g. pd-split.prefill_budget=64 (repeatable; default: none)")
    p.add_argument("--cost-model", default=None, metavar="FILE", help="cost model JSON (default: the shipped one)")
    p.add_argument("--num-blocks", metavar="N", type=_ranged_int(1, LAB_MAX_BLOCKS), default=4096,
                   help=f"KV blocks of the simulated engine, 1 to {LAB_MAX_BLOCKS} (default: 4096)")
    p.add_argument("--block-size", metavar="N", type=_ranged_int(1, 256, " (the engine's block_size)"), default=16,
                   help="tokens per KV block, 1 to 256 as the engine's block_size (default: 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="simulate the engine with prefix caching off")
    # Limits that suit the shipped CPU cost model (a 64-request decode step costs seconds there).
    p.add_argument("--max-num-seqs", metavar="N", type=_positive_int, default=16,
                   help="requests per step (default: 16; the engine's is 128)")
    p.add_argument("--max-num-batched-tokens", metavar="N", type=_positive_int, default=512,
                   help="tokens per step (default: 512; the engine's is 1024)")
    p.add_argument(*_names("--max-model-len"), metavar="TOKENS", type=_positive_int, default=4096,
                   help="prompt + output tokens per request (default: 4096)")
    p.add_argument("--slo-ttft", metavar="SECONDS", type=read_number(float, "seconds > 0 (inf: no bound)"), default=5.0, help="TTFT SLO in seconds (default: 5.0)")
    p.add_argument("--slo-tpot", metavar="SECONDS", type=read_number(float, "seconds > 0 (inf: no bound)"), default=0.5, help="TPOT SLO in seconds (default: 0.5)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw the figures into this PNG file (default: none)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the per-policy figures as JSON (default: none)")
    p.add_argument("--calibrate", default=None, metavar="OUT",
                   help="time the real runner of --model, write a cost model JSON to OUT, and exit (default: none: no "
                        "calibration)")
    p.add_argument(*_names("--model"), metavar="MODEL", default=None,
                   help="model to calibrate (default: SmolLM2-135M-Instruct)")
    p.add_argument(*_names("--threads"), metavar="N", type=read_number(int, "an integer in [1, 4096]"), default=None,
                   help="torch CPU threads while calibrating, 1 to 4096 (default: none: torch's setting)")


async def _embed(args: argparse.Namespace) -> int:
    from asyncinfer.engine import AsyncEngine

    empty = [i for i, text in enumerate(args.texts, 1) if not text]
    if empty:  # ``asyncinfer embed "$TEXT"`` with the variable unset: the encoder was loaded to embed nothing
        from asyncinfer.commands import CommandError

        which = "the text ''" if len(args.texts) == 1 else f"text number {empty[0]} of {len(args.texts)}"
        raise CommandError(f"{which} is empty (an unset variable?): give each text to embed")

    options = {"device": args.device, "dtype": args.dtype}
    if args.threads is not None:
        options["num_threads"] = args.threads
    from asyncinfer import EmbeddingPlan

    # What the model is, from its config, before any weight is read: a generator was loaded whole, then refused
    if not isinstance(AsyncEngine.plan_memory(args.model, **options), EmbeddingPlan):
        from asyncinfer.commands import CommandError

        raise CommandError(f"--model {args.model!r} is a generator (a text generation model), not a sentence "
                           "encoder: give --model a sentence encoder, e.g. all-MiniLM-L6-v2 (the default)")
    async with await AsyncEngine.load(args.model, name="embed", **options) as engine:
        (info,) = engine.model_info()
        vectors = await engine.embed(args.texts)
    if args.json:
        print(json.dumps({"model": info.source, "texts": args.texts, "embeddings": vectors.tolist()}))
        return 0
    print(f"model: {info.source} ({vectors.shape[1]} dimensions)")
    labels = [_text_label(text) for text in args.texts]
    width = max(len(label) for label in labels)
    unit = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # a model without Normalize: any length
    similarity = unit @ unit.T if vectors.shape[0] > 1 else None
    print("embedding (one text: no similarity to show):" if similarity is None else "cosine similarity:")
    for i, label in enumerate(labels):
        head = " ".join(f"{v:+.3f}" for v in vectors[i, :4].tolist())
        row = "" if similarity is None else "  " + " ".join(f"{x:5.2f}" for x in similarity[i].tolist())
        print(f"  {label:<{width}}  [{head} ...]{row}")
    return 0


def _text_label(text: str) -> str:
    """A text as one row's label of ``asyncinfer embed``'s table: as typed, cut to 60 characters, or quoted where
    it would not read as itself on one line (empty, blank at an end, a line break or a tab: an empty text's row had
    no label, and a text of two lines broke the table)."""
    shown = text if text and text.isprintable() and text.strip() == text else repr(text)
    return shown if len(shown) <= 60 else shown[:59] + "…"


def _serve(args: argparse.Namespace) -> int:
    from asyncinfer.commands.serve import listening_socket

    try:
        from asyncinfer.server import ServerSettings, api_keys_from_env, metrics_keys_from_env
    except ImportError as exc:
        from asyncinfer.commands import CommandError

        raise CommandError(f"{exc.name} is missing: pip install 'asyncinfer[server]'") from exc
    for flag, variable, keys in (("--api-key", "ASYNCINFER_API_KEY", args.api_key),
                                 ("--metrics-key", "ASYNCINFER_METRICS_KEY", args.metrics_key)):
        for key in keys:  # "sk-x,sk-y" was one key, sk-x and sk-y each a 401, where the variable splits it
            if "," in key:
                raise InvalidParameterError(flag, "<a key with a comma>", f"one key per {flag} without commas: repeat "
                                            f"{flag} for each key ({variable} takes them comma-separated)")
    settings = ServerSettings(api_keys=(*api_keys_from_env(), *args.api_key), max_body_bytes=args.max_body_bytes,
                              cache_isolation=args.cache_isolation, tenant_header=args.tenant_header,
                              metrics_keys=(*metrics_keys_from_env(), *args.metrics_key), tenant_from=args.tenant_from,
                              priority_header=args.priority_header, header_timeout=args.header_timeout,
                              body_timeout=args.body_timeout, send_timeout=args.send_timeout,
                              max_connections=args.max_connections, tenants=_tenants(args.tenant),
                              max_requests_per_tenant=args.max_requests_per_tenant)
    # Bound and listening before anything is loaded, held through the load and served by uvicorn: a port
    # in use, or taken by a second serve started a moment later, is refused at once.
    sock = listening_socket(args.host, args.port)
    with sock:
        return _serve_on(args, sock, settings)


def _serve_on(args: argparse.Namespace, sock: socket.socket, settings: Any) -> int:
    from asyncinfer.commands.serve import describe_serving
    from asyncinfer.engine import AsyncEngine
    from asyncinfer.server import ModelSpec, create_app, run_server

    port = sock.getsockname()[1]  # --port 0: the free port taken
    model = args.model_arg or args.model
    options = _engine_options(args)
    name = args.served_model_name
    if name is None:  # checked once the plan has found the model (below): a path that does not exist says so
        name = ModelSpec.served_name(model)
    else:  # refused here, before the load, rather than an empty name read as "not given"
        from asyncinfer.catalog import check_name
        from asyncinfer.commands import CommandError

        try:
            check_name(name)
        except InvalidParameterError as exc:
            raise CommandError(f"--served-model-name {name[:40]!r} is invalid: allowed {exc.allowed}") from None
    specs = [ModelSpec(model, name, options)]
    if args.embedding_model is not None and not args.embedding_model.strip():  # --embedding-model "$UNSET"
        from asyncinfer.commands import CommandError

        raise CommandError(f"--embedding-model {args.embedding_model!r} is invalid: allowed a sentence encoder's "
                           "name or directory, e.g. all-MiniLM-L6-v2, not an empty string (leave --embedding-model "
                           "out to serve no embedding model)")
    embedding_options = dict(args.embedding_option)
    if embedding_options and not args.embedding_model:
        from asyncinfer.commands import CommandError

        raise CommandError("--embedding-option sets an option of --embedding-model's sentence encoder: give "
                           "--embedding-model too")
    if args.embedding_model:
        device = {"device": options["device"]} if "device" in options else {}
        specs.append(ModelSpec(args.embedding_model, ModelSpec.served_name(args.embedding_model),
                               {**device, **embedding_options}))
    plans = [AsyncEngine.plan_memory(specs[0].model, **specs[0].options)]  # a bad path or option: here
    if len(specs) > 1:
        from asyncinfer.commands import CommandError
        from asyncinfer.commands.engine_flags import as_typed, typed_texts
        from asyncinfer.errors import ModelLoadError

        try:
            plans.append(AsyncEngine.plan_memory(specs[1].model, **specs[1].options))
        except ModelLoadError as exc:  # named by its flag: the served model's own error reads the same
            raise CommandError(f"--embedding-model {args.embedding_model!r}: {exc}") from None
        except InvalidParameterError as exc:
            if exc.parameter not in embedding_options:
                raise
            typed = typed_texts(args.embedding_option).get(exc.parameter)
            shown = f"{exc.parameter}={as_typed(embedding_options[exc.parameter], typed)}"  # as typed
            allowed = range_in_words(exc.allowed, none="null")  # VALUE is JSON: its words (true, null, an integer)
            raise CommandError(f"--embedding-option {shown} is invalid: allowed {allowed}") from None
    # The names taken from the paths, checked now that the plans found the models, before anything is printed: a
    # mistyped path past 200 characters was refused as a name to give with --served-model-name, then "does not exist"
    if args.served_model_name is None:
        # named where it came from: with no MODEL, the model ASYNCINFER_MODEL names (the user typed no path)
        what = "ASYNCINFER_MODEL's model" if model is None and os.environ.get("ASYNCINFER_MODEL", "").strip() else "the model"
        _path_name(specs[0].name, what, "--served-model-name")
    if len(specs) > 1:
        _path_name(specs[1].name, f"--embedding-model {args.embedding_model[:40]!r}")
    _check_embedding_model(args, specs, plans)
    print(describe_serving(specs, plans, host=args.host, port=port, api_keys=len(settings.accepted_keys),
                           metrics_keys=len(settings.metrics_keys), tenants=len(settings.tenants)), flush=True)
    with _request_lines(args.log_level):
        interrupted = run_server(create_app(specs, settings), args.host, port, args.log_level, settings, sock=sock)
    return 130 if interrupted else 0  # Ctrl-C ends it with 130, as every command


@contextlib.contextmanager
def _request_lines(log_level: str) -> Iterator[None]:
    """At ``--log-level info`` and below, each finished request's ``asyncinfer.requests`` line (tokens, time to
    first token, latency; the texts at ``--log-request-text-rate``) goes to stderr beside uvicorn's lines, in
    their format, while the server runs. The engine adds no handler of its own (docs/monitoring/README.md,
    "Logging"), so without this the lines went nowhere."""
    import logging

    if log_level not in ("info", "debug", "trace"):
        yield
        return
    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("asyncinfer.requests")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=None))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _path_name(name: str, what: str, flag: str | None = None) -> str:
    """``name``, the one a model is served under after its path, checked here: a file or directory name past 200
    characters (or not UTF-8) was refused by create_app, after the plan was printed, as ``models[0].name``, a name
    nobody gave."""
    from asyncinfer.catalog import check_name
    from asyncinfer.commands import CommandError

    try:
        return check_name(name)
    except InvalidParameterError as exc:
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
        raise CommandError(f"{what} would be served as {shown}, its file or directory name, which is invalid: allowed "
                           f"{exc.allowed}; " + (f"name it with {flag}" if flag else "link it under a valid name")) from None


def _check_embedding_model(args: argparse.Namespace, specs: list[Any], plans: list[Any]) -> None:
    """``--embedding-model`` must name a sentence encoder, served under a name of its own: refused here, before
    anything loads (a generator was loaded as a second chat model, and a clash of names failed the start-up
    with a traceback after the first model had loaded)."""
    if not args.embedding_model:
        return
    from asyncinfer import EmbeddingPlan
    from asyncinfer.commands import CommandError

    if not isinstance(plans[1], EmbeddingPlan):
        raise CommandError(f"--embedding-model {args.embedding_model!r} is a generator (a text generation model), "
                           "not a sentence encoder: give it a sentence encoder, e.g. all-MiniLM-L6-v2")
    if specs[1].name == specs[0].name:
        raise CommandError(f"--embedding-model {args.embedding_model!r} would be served as {specs[1].name!r}, the "
                           "name of the model served: give that one another with --served-model-name")


def _tenants(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``--tenant`` flags as ``ServerSettings.tenants``. A key given two tenants is refused: the last one was
    kept silently, so one tenant's callers were served as the other (its priority, its places, its request ids);
    the error names the tenants, never the key (a secret)."""
    from asyncinfer.commands import CommandError

    tenants: dict[str, Any] = {}
    for key, tenant in pairs:
        first = tenants.setdefault(key, tenant)
        if first != tenant:
            raise CommandError(f"--tenant gives one key two tenants, {first.name}:{first.priority} and "
                               f"{tenant.name}:{tenant.priority}: a key is one tenant's (give each tenant a key "
                               "of its own)")
    return tenants


def _tenant(text: str) -> tuple[str, Any]:
    """``--tenant KEY=NAME[:PRIORITY]``: the key (up to the last ``=``) and its ``Tenant``; the key is never
    shown in an error (it is a secret), the name and the priority are."""
    from asyncinfer.prompts import MAX_PRIORITY, MIN_PRIORITY
    from asyncinfer.server import Tenant

    key, sep, rest = text.rpartition("=")
    if not sep or not key or not rest:
        raise argparse.ArgumentTypeError("expected KEY=NAME[:PRIORITY], a non-empty key and tenant name")
    name, colon, priority = rest.rpartition(":")
    digits = priority.removeprefix("-")
    if not colon or not name or not (digits.isascii() and digits.isdigit()):
        name, priority = rest, "0"  # a name that holds a ':' of its own, without a priority
    if not MIN_PRIORITY <= int(priority) <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"tenant {name!r}: priority {priority} is outside "
                                         f"[{MIN_PRIORITY}, {MAX_PRIORITY}]")
    try:
        return key, Tenant(name, int(priority))
    except InvalidParameterError as exc:
        raise argparse.ArgumentTypeError(f"tenant {name[:40]!r}: {exc.allowed}") from None


def _embedding_option(item: str) -> tuple[str, Any]:
    """``--embedding-option``'s pair, its example one of an encoder's options (not a scheduler's)."""
    from asyncinfer.commands.engine_flags import key_value

    return key_value(item, example="max_batch_size=64")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from asyncinfer.commands.engine_flags import KeyValues, read_size

    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory, .gguf file or known name (same as --model; default: "
                        "SmolLM2-135M-Instruct, fetched once)")
    _add_engine_args(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in requests and /v1/models (default: SmolLM2-135M-Instruct for the "
                        "default model, a Hub id's whole id, else the file's or directory's name without .gguf)")
    p.add_argument("--embedding-model", default=None, metavar="MODEL",
                   help="also serve this sentence encoder on /v1/embeddings, e.g. all-MiniLM-L6-v2 (default: none)")
    p.add_argument("--embedding-option", action=KeyValues, default=[], type=_embedding_option, metavar="KEY=VALUE",
                   help="an option of --embedding-model's, VALUE read as JSON (repeatable, each KEY once): max_batch_size, "
                        "max_batch_tokens, max_wait_ms, max_busy_share, max_seq_len, batch_invariant, dtype, device, num_threads "
                        "(docs/models_and_embeddings.md; default: none, the encoder's defaults)")
    p.add_argument("--host", metavar="ADDRESS", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface "
                                                       "(default: 127.0.0.1, this machine only)")
    p.add_argument("--port", metavar="PORT", type=read_number(int, "a TCP port (0 to 65535)"), default=8000, help="TCP port to listen on (default: 8000)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted bearer key (repeatable; ASYNCINFER_API_KEY adds comma-separated ones; "
                        "default: none, anyone who reaches the port may call it)")
    p.add_argument("--max-body-bytes", type=read_size, default=4 * 1024 * 1024, metavar="SIZE",
                   help="larger request bodies get a 413 before they are read: bytes or a size (64KiB, 8MiB) "
                        "(default: 4194304, 4 MiB)")
    p.add_argument("--cache-isolation", default="off", choices=("off", "api-key", "header"),
                   help="share cached prompt prefixes only within one API key or one tenant header value "
                        "(default: off, shared by all)")
    p.add_argument("--tenant-header", default="x-tenant-id", metavar="HEADER",
                   help="the header --cache-isolation header and --tenant-from header read (default: x-tenant-id)")
    p.add_argument("--metrics-key", action="append", default=[], metavar="KEY",
                   help="a key that may read /metrics, not an API key (repeatable; ASYNCINFER_METRICS_KEY adds "
                        "comma-separated ones); with API keys and none of these, /metrics is off (default: none)")
    p.add_argument("--tenant", action="append", default=[], type=_tenant, metavar="KEY=NAME[:PRIORITY]",
                   help="an API key whose requests are tenant NAME (the head of their engine request ids) at "
                        "PRIORITY (an int, default 0; lower runs first with --scheduler aging-priority), with "
                        "--tenant-from api-key; the key is accepted like an --api-key (repeatable; default: none)")
    p.add_argument("--tenant-from", default="api-key", choices=("api-key", "header", "request"),
                   help="where a request's tenant and priority come from: its API key, --tenant-header set by a "
                        "proxy you trust, or the body's user and priority fields (trusted clients only) "
                        "(default: api-key)")
    p.add_argument("--priority-header", default=None, metavar="HEADER",
                   help="a header, set by a proxy you trust, carrying each request's integer priority "
                        "(default: none)")
    p.add_argument("--header-timeout", type=read_number(float, "a finite number of seconds > 0"), default=10.0, metavar="SECONDS",
                   help="seconds a connection has to send a request's headers (default: 10)")
    p.add_argument("--body-timeout", type=read_number(float, "a finite number of seconds > 0"), default=30.0, metavar="SECONDS",
                   help="seconds a request has to send its body once its headers are in (default: 30)")
    p.add_argument("--send-timeout", type=read_number(float, "a finite number of seconds > 0"), default=30.0, metavar="SECONDS",
                   help="seconds an answer may wait for its client to read it (a full send buffer) before the "
                        "connection is closed and its requests aborted (default: 30)")
    p.add_argument("--max-connections", type=read_number(int, "an integer >= 1"), default=512, metavar="N",
                   help="open connections at most; one more is answered 503 (default: 512)")
    p.add_argument("--max-requests-per-tenant", type=read_number(int, "an integer >= 1"), default=None, metavar="N",
                   help="generation requests one tenant (or, without one, one API key) may have in flight, each of "
                        "a prompt's n samples counted; one more is answered 429 (default: no limit)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level (default: info)")


def _version() -> str:
    import platform

    from asyncinfer import __version__

    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # noqa: BLE001 - a version string is not worth failing over
        torch_version = "?"
    return f"asyncinfer {__version__} (torch {torch_version}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    from asyncinfer.commands.bench import __doc__ as bench_doc
    from asyncinfer.commands.bench import add_bench_args
    from asyncinfer.commands.chat import add_chat_args
    from asyncinfer.commands.generate import __doc__ as generate_doc
    from asyncinfer.commands.generate import add_generate_args

    parser = _Parser(prog="asyncinfer", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chat = sub.add_parser("chat", help="chat with a model (one-shot with a prompt, interactive without)",
                          description="Chat with a model. In a session: /reset clears the history, /exit (or "
                                      "Ctrl-D) leaves, /help lists the commands, Ctrl-C stops the reply being "
                                      "written; a message that starts with / is typed with // (another line "
                                      "starting with / is no message: it gets a hint); a message of several lines "
                                      "goes between \"\"\" and \"\"\".",
                          formatter_class=_HelpFormatter)
    add_chat_args(chat)
    _add_engine_args(chat)
    _add_sampling_args(chat)
    generate = sub.add_parser("generate", help="run a batch of prompts (JSONL in, JSONL out), with a progress bar",
                              description=generate_doc, formatter_class=_HelpFormatter)
    generate.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    add_generate_args(generate)
    _add_engine_args(generate)
    _add_sampling_args(generate)
    bench = sub.add_parser("bench", help="measure throughput and latency (optionally against transformers)",
                           description=bench_doc, formatter_class=_HelpFormatter)
    bench.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    add_bench_args(bench)
    _add_engine_args(bench)
    info = sub.add_parser("info", help="print a model's shapes and memory plan (from its config: no weight read)",
                          description="Print a model's shapes and memory plan (from its config: no weight read).",
                          formatter_class=_HelpFormatter)
    info.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    _add_engine_args(info)
    plan = sub.add_parser("plan", help="print the memory budget of a deployment from the config alone (no weights)",
                          description="Print the memory budget of a deployment from the config alone (no weights). "
                                      "Exit status 0 when the plan fits the device memory, 1 when it does not "
                                      "(the table says why), 2 on an error.",
                          formatter_class=_HelpFormatter)
    _add_plan_args(plan)
    embed = sub.add_parser("embed", help="embed texts with a sentence encoder and print their cosine similarities",
                           description="Embed texts with a sentence encoder and print their cosine similarities.",
                           formatter_class=_HelpFormatter)
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to embed, one or more")
    embed.add_argument(*_names("--model"), metavar="MODEL", default="all-MiniLM-L6-v2",
                       help="sentence encoder (name or directory) (default: all-MiniLM-L6-v2)")
    embed.add_argument("--dtype", metavar="DTYPE", default="auto",
                       help="auto | float32 | bfloat16 | float16 (default: auto)")
    embed.add_argument("--device", metavar="DEVICE", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    embed.add_argument(*_names("--threads"), metavar="N", type=read_number(int, "an integer in [1, 4096]"), default=None,
                       help="torch CPU threads, 1 to 4096 (default: torch's setting, one per core; on a busy or shared "
                       "machine, 1)")
    embed.add_argument("--json", action="store_true", help="print the vectors as JSON (default: a table)")
    lab = sub.add_parser("lab", help="replay a request trace through schedulers in simulated time (no model)",
                         description="Replay a request trace through schedulers in simulated time (no model).",
                         formatter_class=_HelpFormatter)
    _add_lab_args(lab)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (asyncinfer[server])",
                           description="Serve a model over an OpenAI-compatible HTTP API (asyncinfer[server]).",
                           formatter_class=_HelpFormatter)
    _add_serve_args(serve)
    return parser


def _refuse_encoder(args: argparse.Namespace) -> None:
    """``chat``, ``generate`` and ``bench`` generate text: a sentence encoder given as their model is refused by
    name before it loads (it loaded, then every request failed with the library's "no generator to default
    to: add a generator with add_model()")."""
    model = getattr(args, "model_arg", None) or args.model
    if model is None:  # the default model (or ASYNCINFER_MODEL's, which the load names if it is no generator)
        return
    from asyncinfer.errors import ModelLoadError
    from asyncinfer.model_source import resolve_model
    from asyncinfer.models.encoder import is_encoder_dir

    try:
        path = resolve_model(model)
    except ModelLoadError:  # no such model: the command says so in its own order (its input checked first)
        return
    if is_encoder_dir(path):
        from asyncinfer.commands import CommandError

        raise CommandError(f"--model {str(model)!r} is a sentence encoder, not a generator (a text generation "
                           f"model): asyncinfer {args.command} needs a generator; asyncinfer embed takes encoders")


def _run(args: argparse.Namespace) -> int:
    if args.command in ("bench", "info", "plan", "serve"):  # (generate checks it after its prompt-as-MODEL hint)
        from asyncinfer.commands import check_one_model

        check_one_model(args.command, args.model_arg, args.model)
    if args.command in ("chat", "generate", "bench"):
        _refuse_encoder(args)
    if args.command == "chat":
        from asyncinfer.commands.chat import run_chat

        return run_chat(args, _engine_options(args), _sampling_params(args))
    if args.command == "generate":
        from asyncinfer.commands.generate import run_generate

        return run_generate(args, _engine_options(args), _sampling_params(args))
    if args.command == "bench":
        from asyncinfer.commands.bench import run_bench

        return run_bench(args, _engine_options(args))
    if args.command == "lab":
        return _lab(args)
    if args.command == "embed":
        return asyncio.run(_embed(args))
    if args.command == "serve":
        return _serve(args)
    if args.command == "plan":
        return _plan(args)
    return _info(args)


def _working_directory_importable() -> None:
    """Modules in the working directory import (a ``--plugin``, a ``--scheduler module:Class``), as under
    ``python -m asyncinfer``; the console script's path starts with its own directory instead. Appended,
    so a local file never shadows an installed package."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _kernel_setting_error(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was caused by) a bad ``ASYNCINFER_KERNEL_ISA`` (:class:`kernels.KernelISAError`):
    a setting of the user's, reported like any other user error."""
    from asyncinfer.kernels import KernelISAError  # torch is imported by now (the parser's construction)

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KernelISAError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


#: ``asyncinfer serve``'s own flags, by the ServerSettings field (the ``parameter`` of its errors).
_SERVE_FLAGS = {
    "api_keys": "--api-key", "metrics_keys": "--metrics-key", "max_body_bytes": "--max-body-bytes",
    "tenants": "--tenant", "cache_isolation": "--cache-isolation", "tenant_header": "--tenant-header", "tenant_from": "--tenant-from",
    "priority_header": "--priority-header", "header_timeout": "--header-timeout", "body_timeout": "--body-timeout",
    "send_timeout": "--send-timeout", "max_connections": "--max-connections",
    "max_requests_per_tenant": "--max-requests-per-tenant",
}
_KEY_FLAGS = ("api_keys", "metrics_keys")
_ENGINE_COMMANDS = ("chat", "generate", "bench", "info", "serve")  # the commands with the engine flags  # repeatable: the error names the one bad key, not the list


# ``asyncinfer plan``'s flags by the planner's parameter they set.
_PLAN_FLAGS = {
    "batch": "--batch", "seq_len": "--seq-len", "dtype": "--dtype", "quantization": "--quantization",
    "device": "--device", "device memory": "--device-memory", "device_memory": "--device-memory",
    "block_size": "--block-size", "max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs",
}

# ``asyncinfer lab``'s flags by the lab's parameter they set.
_LAB_FLAGS = {
    "rate": "--rate", "long_fraction": "--long-fraction", "num_requests": "--synthetic", "priorities": "--priorities",
    "scheduler": "--schedulers", "trace": "--trace", "cost_model": "--cost-model", "num_threads": "--threads",
    "slo_ttft": "--slo-ttft", "slo_tpot": "--slo-tpot",
}

# ``asyncinfer embed``'s flags by the embedding model's option they set.
_EMBED_FLAGS = {"dtype": "--dtype", "device": "--device", "num_threads": "--threads"}


def _serve_terms(text: str) -> str:
    """A serve setting's message in the command's terms: the API keys are ``--api-key`` and ``--tenant`` (or
    the variable), not the ``api_keys`` and ``tenants`` fields."""
    import re

    from asyncinfer.server.settings import TENANTS_GIVEN

    keys = "--api-key / --tenant (or ASYNCINFER_API_KEY)"
    for library, flags in ((TENANTS_GIVEN, "--tenant gives keys a tenant"), ("a key's Tenant", "a key's tenant"),
                           ("give those keys as plain API keys, the priorities of tenant names as tenant_priorities",
                            "give those keys as --api-key")):
        text = text.replace(library, flags)
    return re.sub(r"\bapi_keys(?: or tenants)?\b", keys, text).replace(f"no {keys} are set", f"no {keys} is given")


def _in_flags(exc: AsyncInferError, args: argparse.Namespace | None) -> str:
    """The error's message in the flags' terms: an engine option, a serve setting or a plan parameter given
    as a flag is named by it (``--api-key ''``, not ``api_keys=('',)``; ``--batch 0``, not ``batch=0``),
    and a ConfigurationError's text names the engine options by their flags."""
    if (isinstance(exc, InvalidParameterError) and exc.parameter.startswith("-")
            and str(exc) == str(InvalidParameterError(exc.parameter, exc.value, exc.allowed))):
        # a command's own check of its flag, as every other refusal reads (not "--concurrency=0 ... an int >= 1")
        return f"{exc.parameter} {flag_value(exc.value)} is invalid: allowed {range_in_words(exc.allowed, none=None)}"
    if (args is not None and isinstance(exc, InvalidParameterError) and exc.parameter == "model"
            and isinstance(exc.value, str) and not exc.value.strip()):  # -m "$UNSET": resolve_model's refusal
        return (f"--model {exc.value!r} is invalid: allowed a model directory, a .gguf file or a known name, not an "
                "empty string (leave --model out for the default model; . is the working directory)")
    if args is not None and args.command in ("plan", "embed", "lab") and isinstance(exc, InvalidParameterError):
        flag = {"plan": _PLAN_FLAGS, "embed": _EMBED_FLAGS, "lab": _LAB_FLAGS}[args.command].get(exc.parameter)
        if flag is None:
            return str(exc)
        if flag == "--seq-len":
            flag = args.seq_len_flag  # as typed: --max-model-len, -c, --ctx-size
        value = exc.value
        if value is None:  # a flag not given that the plan needs (--device-memory for cuda without CUDA here)
            return f"{flag} is needed: {exc.allowed}"
        if flag == "--trace" and isinstance(value, str) and value.rpartition(":")[2].isdigit():  # "t.jsonl:3"
            path, _, line = value.rpartition(":")
            return f"--trace {path} line {line}: expected {exc.allowed}"
        if flag == "--trace" and args.trace is not None and value != args.trace:  # a request of it (value: its id)
            return (f"--trace {args.trace}: request {value!r} is invalid: allowed {exc.allowed} (--max-model-len sets "
                    "the limit)")
        shown = flag_value(value)
        allowed = exc.allowed
        if (args.command, exc.parameter) == ("plan", "quantization"):  # the flag takes none (the dtype), not None
            import re

            allowed = re.sub(r"\bNone\b", "none", allowed)
        return f"{flag} {shown} is invalid: allowed {allowed}"
    if args is None or args.command not in _ENGINE_COMMANDS:
        return str(exc)
    from asyncinfer.commands.engine_flags import flag_error, in_flag_terms, typed_scheduler_options

    if isinstance(exc, InvalidParameterError):
        worded = flag_error(exc, _engine_options(args), typed_scheduler_options(args))
        if worded is not None:
            return worded
        flag = _SERVE_FLAGS.get(exc.parameter) if args.command == "serve" else None
        if flag is not None and exc.parameter == "metrics_keys" and not args.metrics_key:
            from asyncinfer.server.settings import METRICS_KEYS_ENV

            flag = f"{METRICS_KEYS_ENV}="  # every metrics key came from the variable: no --metrics-key was given
        if flag is not None:
            value = exc.value
            if exc.parameter in _KEY_FLAGS and isinstance(value, tuple):
                value = next((k for k in value if not (isinstance(k, str) and k)), value)
                return f"{flag} {value!r} is invalid: allowed a non-empty key"
            shown = flag_value(value)
            allowed = range_in_words(_serve_terms(exc.allowed), none=None)
            return f"{flag}{'' if flag.endswith('=') else ' '}{_serve_terms(shown)} is invalid: allowed {allowed}"
        return str(exc)
    if isinstance(exc, ConfigurationError):
        return in_flag_terms(str(exc))
    return str(exc)


def _contract_violation(exc: BaseException) -> str | None:
    """The message for a scheduler's broken contract (``ContractViolation``, whose text starts with the
    scheduler's name), or None for any other exception. Only once the checks were imported: the CLI does
    not import them (nor torch) to print an unrelated error."""
    testing = sys.modules.get("asyncinfer.schedulers.testing")
    if testing is None or not isinstance(exc, testing.ContractViolation):
        return None
    name, _, rest = str(exc).partition(" ")
    return f"scheduler {name.rstrip(':')} broke the scheduler contract (docs/schedulers.md): {rest or exc}"


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a value its type refuses, a missing argument) as every other error of the
    command: one line, ``asyncinfer: error: ...``, status 2, not the whole usage. The subcommands' parsers
    are of this class too (``add_subparsers`` makes them of the parser's class)."""

    def error(self, message: str) -> NoReturn:
        import re

        # a flag with aliases (--max-model-len/--ctx-size/-c) named by its own name, as its help and docs name it
        message = re.sub(r"^argument (--[\w-]+)(?:/-[\w-]+)+:", r"argument \1:", message)
        self.exit(2, f"asyncinfer: error: {_command_hint(message)}\n")


#: The commands, in --help's order (tests/cli/test_stranger9.py holds it to the parser's).
COMMANDS = ("chat", "generate", "bench", "info", "plan", "embed", "lab", "serve")
#: Other tools' commands (ollama's, vLLM's, llama.cpp's) and asyncinfer's for them.
_OTHER_COMMANDS = {
    "run": "chat (asyncinfer chat [--model MODEL] [PROMPT])", "completion": "generate",
    "complete": "generate", "cli": "chat", "pull": "chat (the default model is fetched on first use; another is a "
    "path, a .gguf file or a Hub id already in the local Hugging Face cache: huggingface-cli download OWNER/NAME)",
    "list": "info (asyncinfer info [MODEL]: a model's shapes and memory plan)", "ls": "info", "show": "info",
    "embeddings": "embed", "benchmark": "bench",
    "help": "--help (asyncinfer COMMAND --help for a command's flags)", "version": "--version",
}


def _command_hint(message: str) -> str:
    """argparse's message about the command, with the way on: with none, what the commands are and the first one
    to try; with an unknown one, asyncinfer's for another tool's (ollama's ``run``, ``serve`` for ``server``) or
    a close spelling."""
    import difflib
    import re

    commands = ", ".join(COMMANDS)
    if message == "the following arguments are required: COMMAND":
        return (f"a command is needed: {commands} (asyncinfer --help says what each does; to start: asyncinfer chat "
                "\"Hello!\")")
    unknown = re.match(r"^argument COMMAND: invalid choice: '(.*)' \(choose from .*\)$", message)
    if unknown is None:
        return message
    given = unknown.group(1)
    other = _OTHER_COMMANDS.get(given.lower())
    close = difflib.get_close_matches(given.lower(), commands.split(", "), n=1, cutoff=0.6)
    hint = f"; for {given}, use asyncinfer {other}" if other else f"; did you mean {close[0]}?" if close else ""
    return f"{given!r} is not a command of asyncinfer: the commands are {commands}{hint}"


def _flags_first(words: list[str], commands: dict[str, argparse.ArgumentParser]) -> str:
    """The refusal of a command line that starts with a command's flag (llama.cpp's ``-m x.gguf -p hi``, or
    ``asyncinfer -m x.gguf chat``): argparse read the flag's value as the command (``'x.gguf' is not a command``)."""
    import shlex

    command = next((w for w in words if w in commands), None)
    if command is not None:
        at = words.index(command)
        fixed = shlex.join(["asyncinfer", command, *words[:at], *words[at + 1:]])
        known = {f for a in commands[command]._actions for f in a.option_strings}
        flag = words[0].split("=", 1)[0]
        whose = f" ({flag} is a flag of asyncinfer {command}, not of asyncinfer)" if flag in known \
            else f" (asyncinfer {command} --help lists its flags)"
        return f"flags come after the command: {fixed}{whose}"
    return (f"{words[0]} is not a flag of asyncinfer itself: a command comes first, then its flags "
            f"({shlex.join(['asyncinfer', 'COMMAND', *words])}); the commands are {', '.join(COMMANDS)} "
            "(asyncinfer --help says what each does; to start: asyncinfer chat \"Hello!\")")


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with a flag the command does not have named as its command's near flag:
    ``--maxtokens`` gets "did you mean --max-tokens?" (argparse leaves such flags to the top parser, which
    does not know the subcommand's flags)."""
    import difflib

    from asyncinfer.commands.foreign_flags import refusal

    words = sys.argv[1:] if argv is None else argv
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    own = [f for a in parser._actions for f in a.option_strings]  # --help, --version
    if words and words[0].startswith("-") and words[0].split("=", 1)[0] not in own:
        parser.exit(2, f"asyncinfer: error: {_flags_first(words, subparsers)}\n")
    command = next((w for w in words if not w.startswith("-")), None)
    if command in subparsers:  # vLLM's and llama.cpp's flags: refused with a hint before argparse reads them
        known = [f for a in subparsers[command]._actions for f in a.option_strings]
        refused = refusal(command, words[words.index(command) + 1:], known, _engine_flag_names)
        if refused is not None:
            subparsers[command].exit(2, f"asyncinfer: error: {refused}\n")
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    # argparse has no public accessor for a parser's subparsers or flags: its actions are read.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    flags = [f for a in sub._actions for f in a.option_strings if f.startswith("--")]
    unknown = [a for a in extra if a.startswith("-")]
    near = [m for a in unknown for m in difflib.get_close_matches(a.split("=", 1)[0], flags, n=1, cutoff=0.6)]
    hint = f"; did you mean {' / '.join(near)}?" if near else f" (asyncinfer {args.command} --help lists the flags)"
    sub.exit(2, f"asyncinfer: error: unrecognized arguments: {' '.join(extra)}{hint}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help for a terminal: the docstrings' reST markup (````name````, ``:class:`X```) shown as plain text."""

    def format_help(self) -> str:
        return plain_text(super().format_help())


def plain_text(text: str) -> str:
    """``text`` without reST's double backticks, roles (``:func:`f``` -> ``f``) and literal-block markers (a
    paragraph's closing ``::`` -> ``:``)."""
    import re

    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"(?<=\S)::$", ":", text, flags=re.MULTILINE)
    return text.replace("``", "")


#: The status of a command whose output's reader went away: a shell's for a process ended by SIGPIPE (128 + 13).
BROKEN_PIPE_STATUS = 141


def _output_closed() -> int:
    """Leave quietly once standard output's reader has gone (``| head``): no error line, and standard output
    pointed at the null device, so that the interpreter's last flush of it at exit cannot fail again."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a replaced sys.stdout): nothing left to flush into a pipe
        pass
    return BROKEN_PIPE_STATUS


def _debugging() -> bool:
    return os.environ.get("ASYNCINFER_DEBUG") == "1"


def _user_error(message: str) -> int:
    """The error being handled as one line on stderr, status 2; with ``ASYNCINFER_DEBUG=1`` its traceback
    first (every error path of the command, as ``asyncinfer --help`` says)."""
    if _debugging():
        import traceback

        traceback.print_exc(file=sys.stderr)
    print(f"asyncinfer: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command; every failure is one line on stderr and a non-zero status, never a traceback.

    Ctrl-C ends it with status 130, at any moment: while the parser's construction imports torch
    (seconds) it is held back until the import is done (``_interrupts.deferred_interrupts``), and
    ``asyncinfer.__main__.main``, the console script's entry point, also covers this module's import.
    """
    from asyncinfer._interrupts import deferred_interrupts

    args: argparse.Namespace | None = None
    try:
        with deferred_interrupts():
            parser = build_parser()
        args = _parse(parser, argv)
        _working_directory_importable()
        return _run(args)
    except AsyncInferError as exc:
        return _user_error(_in_flags(exc, args))
    except BrokenPipeError:  # the output's reader left (asyncinfer info | head -1): as other tools, quietly
        return _output_closed()
    except OSError as exc:  # a file that cannot be read or written
        return _user_error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    except KeyboardInterrupt:  # the shell's prompt on a fresh line, no traceback
        print(file=sys.stderr)
        return 130
    except Exception as exc:
        if _kernel_setting_error(exc):  # the user's ASYNCINFER_KERNEL_ISA, not an internal error
            return _user_error(str(exc))
        broken = _contract_violation(exc)
        if broken is not None:  # a scheduler plugin's fault (``asyncinfer lab``), not an internal error
            return _user_error(broken)
        if _debugging():
            raise
        print(f"asyncinfer: internal error: {exception_text(exc)} (ASYNCINFER_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
