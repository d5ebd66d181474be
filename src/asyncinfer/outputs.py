"""What the engine hands back, and how it is assembled.

The public results are msgspec Structs, cheap to build and to serialise to JSON.
:class:`CoreOutput` is what one engine step produced for one request; the event
loop turns a request's core outputs into :class:`StreamDelta` pieces
(:func:`stream_delta`) or one :class:`RequestOutput` (:class:`OutputAssembler`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import msgspec

if TYPE_CHECKING:
    from asyncinfer.request import Request

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


@dataclass
class CoreOutput:
    """What one step produced for one request (new tokens/text, and the finish if it ended).

    ``request_id`` is the user's id (shared by all ``n`` samples); ``index`` is the sample.
    ``error`` is set when the engine failed the request (a
    :class:`~asyncinfer.errors.RequestFailedError`, or an ``InvalidParameterError`` the
    core found): the output then ends its sample (``finish_reason="abort"``), the core
    has dropped the request, and its stream raises the error. The core sends one for
    every sample that had not finished, all in one batch.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    index: int = 0
    error: BaseException | None = None


def stream_delta(out: CoreOutput) -> StreamDelta:
    """The public piece of one core output."""
    return StreamDelta(
        request_id=out.request_id,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=cast("FinishReason | None", out.finish_reason),
        logprobs=out.logprobs,
        index=out.index,
    )


class OutputAssembler:
    """Collects the core outputs of one request (all ``n`` samples) into its :class:`RequestOutput`."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], arrival_time: float, n: int, want_logprobs: bool
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.want_logprobs = want_logprobs
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._pieces: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[Logprob]] = [[] for _ in range(n)]
        self._last: list[CoreOutput | None] = [None] * n

    @classmethod
    def for_request(cls, request: Request) -> OutputAssembler:
        params = request.params
        return cls(request.request_id, request.prompt_token_ids, request.arrival_time, params.n,
                   params.logprobs is not None)

    def add(self, out: CoreOutput) -> None:
        i = out.index
        self._token_ids[i].extend(out.token_ids)
        self._pieces[i].append(out.text)
        if out.logprobs:
            self._logprobs[i].extend(out.logprobs)
        self._last[i] = out

    def result(self) -> RequestOutput:
        """The whole result; every sample must have delivered its finishing output."""
        finals = [out for out in self._last if out is not None and out.finish_reason is not None]
        if len(finals) != len(self._last):
            raise RuntimeError(f"request {self.request_id!r} ended before all its samples finished")
        completions = [
            CompletionOutput(
                index=i,
                token_ids=self._token_ids[i],
                text="".join(self._pieces[i]),
                finish_reason=cast("FinishReason", out.finish_reason),
                logprobs=self._logprobs[i] if self.want_logprobs else None,
                stop_reason=out.stop_reason,
            )
            for i, out in enumerate(finals)
        ]
        first_times = [out.first_token_time for out in finals if out.first_token_time is not None]
        finish_times = [out.finish_time for out in finals if out.finish_time is not None]
        head = completions[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=head.token_ids,
            text=head.text,
            finish_reason=head.finish_reason,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=min(first_times, default=None),
                finish_time=max(finish_times, default=None),
                num_preemptions=sum(out.num_preemptions for out in finals),
            ),
            logprobs=head.logprobs,
            stop_reason=head.stop_reason,
            outputs=completions,
        )
