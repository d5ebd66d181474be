"""What a request's stop list and chat cost to take in, and what share of a core the intake's turns allow them.

Two pieces of a request's intake cost in proportion to what the caller sends, and docs/reliability.md's limits
table quotes both:

- the stop automaton (``detokenizer.StopMatcher``), built once per request on the engine thread: timed for a list
  of ``intake.STOP_BUILD_FREE_CHARS`` characters (the longest that never waits its turn) and for a list at both
  limits (``MAX_STOP_STRINGS`` strings of ``MAX_STOP_CHARS`` characters together, no two sharing a prefix past
  their first characters: the most states);
- the chat template with its tokenizing (``engine.apply_chat_template``, what the engine's worker thread does for
  a chat), timed per message for chats of 256, 1,024 and ``MAX_CHAT_MESSAGES`` short messages, after one warm-up
  render (the template's compile).

Times are the calling thread's CPU time (``time.thread_time``), the median of ``--repeats`` runs: what the work takes
from the thread it runs on, little changed by other processes sharing the machine (wall time would count their
turns on the core too).

From these, the share of one core that the turns' rates let a flood take: ``STOP_BUILD_CHARS_PER_S`` times a
character's build time, and ``CHAT_MESSAGES_PER_S`` times a message's render time.

    python benchmarks/intake_costs.py --json benchmarks/results/intake_costs.json
    python benchmarks/intake_costs.py --model PATH --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import git_commit, machine_info

from asyncinfer import AsyncEngine, intake
from asyncinfer.detokenizer import StopMatcher
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from asyncinfer.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path for the chat template (default: SmolLM2-135M-Instruct)")
    p.add_argument("--repeats", type=int, default=7, help="runs of each measure (the median is reported)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def stop_list(total: int, count: int) -> list[str]:
    """``count`` strings of ``total`` characters together, each starting with a character of its own (so the
    automaton has a state for nearly every character)."""
    length = max(1, total // count)
    return [chr(0x4E00 + i) + "".join(chr(0xE000 + (i * 7 + j) % 4096) for j in range(length - 1))
            for i in range(count)]


def timed(fn: Any, repeats: int) -> float:
    """The median CPU seconds of the calling thread over ``repeats`` calls of ``fn`` (the work is this thread's
    alone, and its CPU time is what it takes from the thread it runs on, whatever else shares the machine)."""
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        runs.append(time.thread_time() - start)
    return statistics.median(runs)


def stop_costs(repeats: int) -> dict[str, Any]:
    lists = {
        "free_size": stop_list(intake.STOP_BUILD_FREE_CHARS, 8),
        "at_limits": stop_list(MAX_STOP_CHARS, MAX_STOP_STRINGS),
    }
    out: dict[str, Any] = {}
    for name, strings in lists.items():
        chars = sum(map(len, strings))
        seconds = timed(lambda s=strings: StopMatcher(s), repeats)  # type: ignore[misc]
        out[name] = {"strings": len(strings), "chars": chars, "build_cpu_s": seconds, "per_char_s": seconds / chars}
    per_char = out["at_limits"]["per_char_s"]
    out["rate_chars_per_s"] = intake.STOP_BUILD_CHARS_PER_S
    out["core_share_at_rate"] = intake.STOP_BUILD_CHARS_PER_S * per_char
    return out


async def chat_costs(model: str | None, repeats: int) -> dict[str, Any]:
    engine = await AsyncEngine.load(model, num_threads=1)
    out: dict[str, Any] = {}
    async with engine:
        def chat(n: int) -> list[dict[str, str]]:
            return [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(n)]

        engine.apply_chat_template(chat(2))  # the template's compile
        for n in (256, 1024, MAX_CHAT_MESSAGES):
            messages = chat(n)
            seconds = timed(lambda m=messages: engine.apply_chat_template(m), repeats)  # type: ignore[misc]
            out[str(n)] = {"messages": n, "render_cpu_s": seconds, "per_message_s": seconds / n}
    per_message = out[str(MAX_CHAT_MESSAGES)]["per_message_s"]
    out["rate_messages_per_s"] = intake.CHAT_MESSAGES_PER_S
    out["core_share_at_rate"] = intake.CHAT_MESSAGES_PER_S * per_message
    return out


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    load_start = list(os.getloadavg())
    stops = stop_costs(args.repeats)
    chats = asyncio.run(chat_costs(args.model, args.repeats))
    return {
        "command": " ".join(["python", "benchmarks/intake_costs.py", *argv]),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
        "machine": machine_info(),
        "model": str(args.model or "SmolLM2-135M-Instruct"),
        "repeats": args.repeats,
        "stop_automaton": stops,
        "chat_template": chats,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args, argv)
    s, c = result["stop_automaton"], result["chat_template"]
    for name in ("free_size", "at_limits"):
        print(f"stop list {name:9s}: {s[name]['strings']:5d} strings, {s[name]['chars']:6d} chars, "
              f"built in {s[name]['build_cpu_s'] * 1e3:7.2f} ms of CPU ({s[name]['per_char_s'] * 1e9:.0f} ns a char)")
    print(f"  at {s['rate_chars_per_s']} chars/s: {s['core_share_at_rate']:.1%} of a core")
    for n in (256, 1024, MAX_CHAT_MESSAGES):
        row = c[str(n)]
        print(f"chat of {n:5d} messages: {row['render_cpu_s'] * 1e3:7.2f} ms of CPU ({row['per_message_s'] * 1e6:.1f} us a message)")
    print(f"  at {c['rate_messages_per_s']} messages/s: {c['core_share_at_rate']:.1%} of a core")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
