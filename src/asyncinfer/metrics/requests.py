"""Requests in flight as the metrics see them, and the one log line each writes when it ends.

Loop side. A request is tracked from the moment it is posted to the engine
thread (``track``) until its last sample's final output passes through
``observe`` (or the engine dies). The outputs are the ones the engine thread
hands to the event loop anyway, so nothing here runs on the step loop.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncinfer.plain import logged

if TYPE_CHECKING:
    from asyncinfer.outputs import CoreOutput
    from asyncinfer.request import Request

#: One line per finished request, at INFO: ``logging.getLogger("asyncinfer.requests")``.
request_logger = logging.getLogger("asyncinfer.requests")


@dataclass(slots=True)
class LiveRequest:
    """What the metrics keep of one request in flight."""

    model: str
    request_id: str
    n: int
    prompt_len: int
    arrival: float
    prompt_ids: list[int] | None  # kept only when its text may be logged (sampled)
    request: Request  # the engine's request (sample 0): its ``scheduled_time`` ends the queue time
    queue_taken: bool = False  # its queue time was handed out (take_queue_time)
    first_token: float | None = None
    tokens: list[int] = field(default_factory=list)  # generated tokens per sample
    texts: list[str] | None = None  # per sample, only when its text may be logged
    reasons: list[str | None] = field(default_factory=list)  # per sample, once finished
    finish: float = 0.0
    done: int = 0


@dataclass(frozen=True)
class FinishedRequest:
    """One ended request, as it is counted and logged."""

    model: str
    request_id: str
    finish_reason: str  # stop, length, abort or error
    prompt_len: int
    output_len: int  # generated tokens of all samples
    ttft: float | None  # seconds, None when no token came
    tpot: float | None  # seconds per output token after the first (longest sample), None under 2 tokens
    latency: float  # arrival to the last sample's end
    text: tuple[str, str] | None = None  # (prompt, output) for a request sampled for text logging


class RequestTracker:
    """Requests in flight, keyed by the user's id (ids are unique among requests in flight)."""

    def __init__(self, text_rate: float, tokenizer_of: Any, seed: int | None = None) -> None:
        self.live: dict[str, LiveRequest] = {}
        self.text_rate = text_rate
        self.tokenizer_of = tokenizer_of  # model name -> tokenizer (or None), for sampled text logs
        self._rng = random.Random(seed)

    def track(self, request: Request, model: str) -> None:
        n = request.params.n
        with_text = self.text_rate > 0 and self._rng.random() < self.text_rate
        self.live[request.request_id] = LiveRequest(
            model, request.request_id, n, len(request.prompt_token_ids), request.arrival_time,
            request.prompt_token_ids if with_text else None, request, tokens=[0] * n,
            texts=[""] * n if with_text else None, reasons=[None] * n,
        )

    def observe(self, out: CoreOutput) -> tuple[LiveRequest, FinishedRequest | None] | None:
        """Count one output; returns its request, and the request's summary if this output ended it."""
        live = self.live.get(out.request_id)
        if live is None:
            return None
        live.tokens[out.index] += len(out.token_ids)
        if live.texts is not None:
            live.texts[out.index] += out.text
        if live.first_token is None and out.first_token_time is not None and out.token_ids:
            live.first_token = out.first_token_time
        if out.finish_reason is None:
            return live, None
        live.reasons[out.index] = "error" if out.error is not None else out.finish_reason
        live.finish = max(live.finish, out.finish_time or 0.0)
        live.done += 1
        if live.done < live.n:
            return live, None
        del self.live[out.request_id]
        return live, self.summary(live)

    @staticmethod
    def take_queue_time(live: LiveRequest) -> float | None:
        """Seconds from arrival until a step first scheduled the request, once: None before
        it was scheduled and after it was taken. (The engine sets ``scheduled_time`` on the
        engine thread before any output of the request is handed to the loop.)"""
        scheduled = live.request.scheduled_time
        if live.queue_taken or scheduled is None:
            return None
        live.queue_taken = True
        return max(0.0, scheduled - live.arrival)

    def fail_all(self, now: float) -> list[FinishedRequest]:
        """End every tracked request as an error (the engine died)."""
        ended = []
        for live in self.live.values():
            live.reasons = ["error"] * live.n
            live.finish = now
            ended.append(self.summary(live))
        self.live.clear()
        return ended

    def summary(self, live: LiveRequest) -> FinishedRequest:
        reasons = live.reasons
        reason = "error" if "error" in reasons else (reasons[0] or "abort")
        ttft = None if live.first_token is None else max(0.0, live.first_token - live.arrival)
        longest = max(live.tokens)
        tpot = None
        if live.first_token is not None and longest >= 2:
            tpot = max(0.0, live.finish - live.first_token) / (longest - 1)
        text = None
        if live.texts is not None:
            tokenizer = self.tokenizer_of(live.model)
            prompt = tokenizer.decode(live.prompt_ids) if tokenizer is not None else str(live.prompt_ids)
            text = (prompt, " | ".join(live.texts))
        return FinishedRequest(live.model, live.request_id, reason, live.prompt_len, sum(live.tokens), ttft, tpot,
                               max(0.0, live.finish - live.arrival), text)


def log_finished(done: FinishedRequest) -> None:
    """The request's structured INFO line (``extra={"asyncinfer_request": {...}}`` for JSON formatters).

    Never the prompt or output text, unless the request was sampled for it (``log_request_text_rate``).
    """
    if not request_logger.isEnabledFor(logging.INFO):
        return
    fields = {
        "id": done.request_id, "model": done.model, "finish_reason": done.finish_reason,
        "prompt_tokens": done.prompt_len, "output_tokens": done.output_len,
        "ttft_s": None if done.ttft is None else round(done.ttft, 4), "latency_s": round(done.latency, 4),
    }
    line = " ".join(f"{k}={logged(v)}" for k, v in fields.items())
    if done.text is not None:
        fields["prompt_text"], fields["output_text"] = done.text
        line += f" prompt_text={done.text[0]!r} output_text={done.text[1]!r}"
    request_logger.info("request finished %s", line, extra={"asyncinfer_request": fields})
