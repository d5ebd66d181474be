"""What the engine hands back: msgspec Structs, cheap to build and to serialise to JSON."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class Logprob(msgspec.Struct, frozen=True):
    """Log-probability of one generated token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class StreamDelta(msgspec.Struct):
    """One piece of a streamed request: the text and token ids new since the last delta.

    The last delta of a request has ``finish_reason`` set (and may carry text
    released at the finish, e.g. characters held back while they could have
    started a stop string).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[Logprob] | None = None
    #: Which of the ``n`` samples this piece belongs to (always 0 when ``n == 1``);
    #: each sample's last delta has ``finish_reason`` set.
    index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct):
    """Wall-clock timestamps (``time.time()``) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class CompletionOutput(msgspec.Struct):
    """One of the ``n`` samples of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[Logprob] | None = None
    stop_reason: int | str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


class RequestOutput(msgspec.Struct):
    """The finished result of ``engine.generate()``.

    ``outputs`` holds all ``n`` samples, in index order (one for ``n == 1``).
    ``token_ids``, ``text``, ``finish_reason``, ``logprobs`` and ``stop_reason``
    are those of ``outputs[0]``, so code written for one sample reads the same.
    ``metrics`` covers the whole request: the first token of any sample, the
    finish of the last one, and the preemptions of all.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    metrics: RequestMetrics
    logprobs: list[Logprob] | None = None
    stop_reason: int | str | None = None
    outputs: list[CompletionOutput] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
