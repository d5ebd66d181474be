"""Flags users bring from vLLM and llama.cpp: the equivalent ones are aliases of asyncinfer's flags
(:data:`ALIASES`), the rest are refused before anything runs with a hint naming what asyncinfer has instead
(:data:`REFUSED`, :func:`refusal`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

#: Other tools' flags that mean what an asyncinfer flag means: (asyncinfer's flag, its aliases).
ALIASES: dict[str, tuple[str, ...]] = {
    "--max-model-len": ("--ctx-size", "-c"),  # llama.cpp's context size: prompt + output tokens per sequence
    "--threads": ("-t",),  # llama.cpp's CPU threads
    "--model": ("-m",),  # llama.cpp's model file
    "--temperature": ("--temp",),  # llama.cpp's sampling temperature
}

_GPU_LAYERS = ("llama.cpp's layers offloaded to the GPU; asyncinfer puts the whole model on one device: "
               "--device cuda (or cpu)")
_PARALLEL = "vLLM's {}; asyncinfer runs a model on one device (replicas on several: docs/scale_out.md)"
_LOG_REQUESTS = ("vLLM's per-request logging switch; asyncinfer serve logs one line per request at --log-level info "
                 "(the default); --log-level warning leaves them out")
_CORS = ("vLLM's CORS setting; asyncinfer serve sends no CORS headers: a browser app reaches it through a proxy "
         "of the same origin, or one that adds them")
_CHAT_TEMPLATE = ("a chat template of one's own; asyncinfer uses the model's own (a model without one takes plain "
                  "text: asyncinfer generate --model MODEL --prompt TEXT)")
_TLS = "a TLS setting; asyncinfer serve speaks plain HTTP: put a proxy that holds the certificate in front of it"

#: Other tools' flags asyncinfer has no equivalent for, each with what to do instead.
REFUSED: dict[str, str] = {
    "--n-gpu-layers": _GPU_LAYERS, "-ngl": _GPU_LAYERS, "--ngl": _GPU_LAYERS, "--gpu-layers": _GPU_LAYERS,
    "--tensor-parallel-size": _PARALLEL.format("tensor parallelism"), "-tp": _PARALLEL.format("tensor parallelism"),
    "--pipeline-parallel-size": _PARALLEL.format("pipeline parallelism"),
    "-pp": _PARALLEL.format("pipeline parallelism"),
    "--gpu-memory-utilization": "vLLM's share of GPU memory; asyncinfer sizes its KV cache with --kv-cache-fraction "
                                "(of the memory free after the weights) or --kv-cache-memory SIZE",
    "--n-predict": "llama.cpp's tokens to predict; use --max-tokens N",
    "-n": "llama.cpp's tokens to predict; use --max-tokens N",
    "--batch-size": "llama.cpp's logical batch; asyncinfer's tokens per step are --max-num-batched-tokens N",
    "-b": "llama.cpp's logical batch; asyncinfer's tokens per step are --max-num-batched-tokens N",
    "--ubatch-size": "llama.cpp's physical batch; asyncinfer's tokens per step are --max-num-batched-tokens N",
    "--parallel": "llama.cpp's parallel sequences; asyncinfer's requests per step are --max-num-seqs N",
    "-np": "llama.cpp's parallel sequences; asyncinfer's requests per step are --max-num-seqs N",
    "--flash-attn": "llama.cpp's flash attention; asyncinfer picks its attention kernel itself; drop the flag",
    "-fa": "llama.cpp's flash attention; asyncinfer picks its attention kernel itself; drop the flag",
    "--mlock": "llama.cpp's memory lock; asyncinfer has none; drop the flag",
    "--no-mmap": "llama.cpp's mmap switch; asyncinfer reads the weights into memory at load; drop the flag",
    "--trust-remote-code": "vLLM's permission to run a model's own code; asyncinfer runs none (its own model "
                           "classes only); drop the flag",
    "--enforce-eager": "vLLM's switch off CUDA graphs; asyncinfer runs eagerly (--torch-compile opts in to "
                       "compilation); drop the flag",
    "--kv-cache-dtype": "vLLM's KV cache dtype; asyncinfer's KV cache is in --dtype",
    "--download-dir": "vLLM's download directory; asyncinfer never downloads a model but the default one "
                      "(ASYNCINFER_CACHE_DIR says where); a Hub id is read from the local Hugging Face cache "
                      "(HF_HUB_CACHE)",
    "--chat-template": _CHAT_TEMPLATE, "--chat-template-file": _CHAT_TEMPLATE,
    "--interactive": "llama.cpp's interactive mode; asyncinfer chat without a prompt is a session",
    "-i": "llama.cpp's interactive mode; asyncinfer chat without a prompt is a session",
    "--conversation": "llama.cpp's conversation mode; asyncinfer chat without a prompt is a session",
    "-cnv": "llama.cpp's conversation mode; asyncinfer chat without a prompt is a session",
    "--system-prompt": "a system prompt; use asyncinfer chat --system TEXT",
    "-sys": "a system prompt; use asyncinfer chat --system TEXT",
    "--disable-log-requests": _LOG_REQUESTS, "--enable-log-requests": _LOG_REQUESTS,
    "--disable-log-stats": "vLLM's periodic stats line; asyncinfer prints none (its figures are on /metrics)",
    "--uvicorn-log-level": "vLLM's uvicorn log level; use --log-level LEVEL",
    "--allowed-origins": _CORS, "--allowed-methods": _CORS, "--allowed-headers": _CORS, "--allow-credentials": _CORS,
    "--ssl-keyfile": _TLS, "--ssl-certfile": _TLS, "--ssl-ca-certs": _TLS,
    "--swap-space": "vLLM's CPU swap for preempted requests; asyncinfer recomputes a preempted request's KV "
                    "instead; drop the flag",
    "--tokenizer": "a tokenizer of one's own; asyncinfer uses the model's own (its files beside the weights, or "
                   "the GGUF file's)",
    "--cont-batching": "llama.cpp's continuous batching; asyncinfer always batches continuously; drop the flag",
    "-cb": "llama.cpp's continuous batching; asyncinfer always batches continuously; drop the flag",
    "--jinja": "llama.cpp's switch to the model's own chat template; asyncinfer always uses it; drop the flag",
    "--n-ctx": "llama-cpp-python's context size; use --max-model-len TOKENS",
    "--ctx_size": "llama.cpp's context size; use --max-model-len TOKENS",
}

#: Flags of one asyncinfer command that users give to the others.
_OTHER_COMMANDS: dict[str, str] = {
    "--host": "asyncinfer serve's (only serve listens: asyncinfer serve --host ADDRESS)",
    "--port": "asyncinfer serve's (only serve listens: asyncinfer serve --port PORT)",
    "--seed": "a request's seed, which serve's requests carry themselves; the engine's is --engine-seed SEED",
    "--prompt": "asyncinfer generate's; asyncinfer chat takes its prompt as its argument: asyncinfer chat \"TEXT\"",
    "-p": "llama.cpp's prompt; asyncinfer chat takes it as its argument (asyncinfer chat \"TEXT\"), asyncinfer "
          "generate as --prompt TEXT",
}


#: The sampling flags of chat and generate (tests/cli/test_stranger9.py holds them to the CLI's), refused on the
#: other commands with where they belong.
SAMPLING_FLAGS = ("--max-tokens", "--temperature", "--temp", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                  "--presence-penalty", "--frequency-penalty", "--stop", "--ignore-eos")


def _sampling_hint(command: str) -> str:
    if command == "serve":
        return ("a request's sampling parameter: over HTTP each request sets its own in its body (max_tokens, "
                "temperature, top_p, stop, ...)")
    return "a sampling flag of asyncinfer chat and asyncinfer generate"


def _samples_hint(command: str, name: str) -> str:
    what = ("OpenAI's samples of one prompt, n" if name == "--n" else
            "vLLM's best_of (candidates of which the n best are returned); asyncinfer returns every sample it makes, n")
    if command == "serve":
        return f"{what}, which serve's requests set in their body (\"n\": 2, with a temperature)"
    return (f"{what}, which a line of asyncinfer generate --file sets ({{\"prompt\": \"...\", \"n\": 2, "
            "\"temperature\": 0.8}: greedy, the default, gives n copies of one answer)")


#: Flags for samples of one prompt (OpenAI's and vLLM's request fields), refused on every command with where the
#: number goes: argparse read ``--n`` as an abbreviation, "ambiguous option: --n could match --no-progress, ...".
SAMPLES_FLAGS = ("--n", "--best-of")


_ENGINE_HINT = "an engine option, a flag of the commands that load the engine (asyncinfer chat, generate, bench, info, serve)"


def refusal(command: str, argv: Iterable[str], known: Iterable[str],
            engine_flags: Callable[[], Collection[str]] = frozenset) -> str | None:
    """The error for the first flag of ``argv`` (up to ``--``) that is another tool's (or another command's)
    and not one of this command's ``known`` flags, else None: ``-ngl 99`` is "-ngl is not an asyncinfer flag
    (llama.cpp's layers offloaded to the GPU: ...)". ``engine_flags``: the engine options' flags, read only when a
    flag is none of the command's (:func:`asyncinfer.commands.engine_flags.flag_names`, which imports the library),
    refused on the commands that load no engine (plan, embed, lab) with where they belong: ``plan --scheduler fifo``
    was argparse's "did you mean --seq-len?"."""
    own = set(known)
    for word in argv:
        if word == "--":
            return None
        name = word.split("=", 1)[0]
        if not name.startswith("-") or name in own:
            continue
        hint = REFUSED.get(name) or _OTHER_COMMANDS.get(name) or (
            _sampling_hint(command) if name in SAMPLING_FLAGS else
            _samples_hint(command, name) if name in SAMPLES_FLAGS else
            _ENGINE_HINT if name in engine_flags() else None)
        if hint is not None:
            return f"{name} is not a flag of asyncinfer {command}: it is {hint}"
    return None
