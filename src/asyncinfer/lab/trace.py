"""Request traces: what arrives when, how long its prompt is and how many tokens it generates.

The file format is JSON Lines, one request per line::

    {"arrival": 0.25, "prompt_len": 412, "output_len": 64, "priority": 0, "id": "r7"}

``arrival`` is seconds from the start of the trace; ``priority`` (default 0, lower
is more urgent) and ``id`` (default: the line number) are optional.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncinfer.config import check_int
from asyncinfer.errors import InvalidParameterError

#: The most requests a trace holds (about 500 MB of the lab's request and record objects, hours of replay): a
#: synthetic trace of 100,000,000 requests was some 46 GB of Python objects, killed by the OOM killer.
MAX_TRACE_REQUESTS = 10**6


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; ``output_len`` tokens are generated (no early stop)."""

    id: str
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival, (int, float)) and math.isfinite(self.arrival) and self.arrival >= 0):
            raise InvalidParameterError("arrival", self.arrival, "seconds >= 0")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, value, "an integer >= 1")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidParameterError("priority", self.priority, "an integer")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace, sorted by arrival (ties keep file order).

    Raises:
        InvalidParameterError: a line that is not a valid request (the message names the line), a file
            with no request or more than :data:`MAX_TRACE_REQUESTS`, or two requests with one id.
    """
    requests: list[TraceRequest] = []
    with open(path, "rb") as fh:  # decoded line by line: a line that is not UTF-8 is refused by its number
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            if len(requests) == MAX_TRACE_REQUESTS:  # refused before its lines fill the memory
                raise InvalidParameterError("trace", str(path), f"at most {MAX_TRACE_REQUESTS} request lines "
                                            f"(line {lineno} is one more)")
            try:
                line = raw.decode("utf-8")
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError(f"a JSON {type(row).__name__}, not an object")
                requests.append(
                    TraceRequest(
                        id=str(row.get("id", f"r{lineno}")),
                        arrival=row["arrival"],
                        prompt_len=row["prompt_len"],
                        output_len=row["output_len"],
                        priority=row.get("priority", 0),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                # (a UnicodeDecodeError is a ValueError: the line is not UTF-8 text)
                why = f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else _why(exc)
                raise InvalidParameterError("trace", f"{path}:{lineno}", f"a JSON object with arrival, prompt_len, "
                                            f"output_len[, priority, id] ({why})") from exc
    if not requests:  # nothing to replay: every figure would be undefined
        raise InvalidParameterError("trace", str(path), "at least one request line (the file has none)")
    if len({r.id for r in requests}) != len(requests):
        raise InvalidParameterError("trace", str(path), "unique request ids")
    return sorted(requests, key=lambda r: r.arrival)


def _why(exc: BaseException) -> str:
    """What is wrong with a trace line that raised ``exc`` as it was read."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text: byte {exc.object[exc.start]:#04x} at {exc.start}"
    if isinstance(exc, RecursionError):
        return "JSON nested deeper than Python's recursion limit"
    return str(exc)


def save_trace(trace: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(asdict(request)) + "\n" for request in trace)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def synthetic_trace(
    num_requests: int,
    *,
    rate: float = 2.0,
    seed: int = 0,
    short_prompt: tuple[int, int] = (16, 256),
    long_prompt: tuple[int, int] = (512, 2048),
    long_fraction: float = 0.2,
    output: tuple[int, int] = (8, 256),
    priorities: Sequence[int] = (0, 2, 4),
    max_prompt_len: int | None = None,
) -> list[TraceRequest]:
    """A mixed-length trace: Poisson arrivals at ``rate`` requests/s.

    Prompts are log-uniform in ``short_prompt``, or in ``long_prompt`` with
    probability ``long_fraction``; output lengths log-uniform in ``output``;
    priorities drawn uniformly from ``priorities``. Same seed, same trace.
    ``max_prompt_len`` caps both prompt ranges (the replay refuses a prompt of
    ``max_model_len`` tokens or more: pass ``max_model_len - 1``).

    Raises:
        InvalidParameterError: ``num_requests`` outside 1 to :data:`MAX_TRACE_REQUESTS`, or a bad range, rate or
            fraction (named).
    """
    check_int("num_requests", num_requests, 1, MAX_TRACE_REQUESTS)
    if not (rate > 0 and math.isfinite(rate)):
        raise InvalidParameterError("rate", rate, "a finite number of requests per second > 0")
    if not 0.0 <= long_fraction <= 1.0:
        raise InvalidParameterError("long_fraction", long_fraction, "a fraction in [0, 1]")
    for name, (lo, hi) in (("short_prompt", short_prompt), ("long_prompt", long_prompt), ("output", output)):
        if not 1 <= lo <= hi:
            raise InvalidParameterError(name, (lo, hi), "a range (lo, hi) with 1 <= lo <= hi")
    if not priorities:
        raise InvalidParameterError("priorities", priorities, "at least one priority level")
    if max_prompt_len is not None:
        if not (isinstance(max_prompt_len, int) and max_prompt_len >= 1):
            raise InvalidParameterError("max_prompt_len", max_prompt_len, "an integer >= 1")
        short_prompt = (min(short_prompt[0], max_prompt_len), min(short_prompt[1], max_prompt_len))
        long_prompt = (min(long_prompt[0], max_prompt_len), min(long_prompt[1], max_prompt_len))
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(num_requests):
        span = long_prompt if rng.random() < long_fraction else short_prompt
        out.append(
            TraceRequest(
                id=f"r{i}",
                arrival=round(t, 6),
                prompt_len=_log_uniform(rng, *span),
                output_len=_log_uniform(rng, *output),
                priority=rng.choice(list(priorities)),
            )
        )
        t += rng.expovariate(rate)
    return out
