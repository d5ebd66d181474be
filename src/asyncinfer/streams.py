"""The event loop's table of requests in flight: one output queue per request.

The engine thread's outputs arrive in :meth:`StreamTable.dispatch` (on the
loop); each goes to its request's queue, and a request leaves the table when
its last sample has finished. Ids are checked against every sample id in
flight, so two live requests never share one. A request whose consumer went
away keeps its ids until the engine thread has confirmed it gone: an id reused
at once waits for nothing, it is refused, and no output of the old request can
reach a new one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from asyncinfer.outputs import CoreOutput


def sample_ids(request_id: str, n: int) -> tuple[str, ...]:
    """The core's ids of a request's samples: the request's own, then ``"<id>#<i>"`` (see ``core``)."""
    return (request_id, *(f"{request_id}#{i}" for i in range(1, n)))


class RequestStream:
    """One request's outputs on the event loop side, waiting for its consumer (all ``n`` samples).

    Backpressure: a consumer that reads slower than tokens arrive does not grow a
    queue. A new output of a sample whose previous output is still undelivered is
    merged into it (token ids, text and logprobs appended), so at most one pending
    piece per sample (plus errors) waits, whatever the consumer's pace.
    """

    __slots__ = ("abandoned", "ids", "n", "num_done", "owner", "pending", "version_id", "wake")

    def __init__(self, n: int, ids: tuple[str, ...], version_id: int, owner: object) -> None:
        self.pending: deque[CoreOutput | BaseException] = deque()
        self.wake = asyncio.Event()
        self.n = n
        self.num_done = 0  # samples whose last output was delivered to the queue
        self.ids = ids  # the core's request ids of the samples
        self.version_id = version_id  # the model version the request is bound to
        self.owner = owner  # the named model (its holder) it was sent to
        self.abandoned = False  # its consumer went away; its ids stay reserved until the abort is confirmed

    def put(self, item: CoreOutput | BaseException) -> None:
        if isinstance(item, CoreOutput):
            for queued in reversed(self.pending):
                if isinstance(queued, CoreOutput) and queued.index == item.index:
                    if queued.finish_reason is None:
                        _merge(queued, item)
                        return
                    break
        self.pending.append(item)
        self.wake.set()

    async def get(self) -> CoreOutput | BaseException:
        while not self.pending:
            self.wake.clear()
            await self.wake.wait()
        return self.pending.popleft()


def _merge(into: CoreOutput, out: CoreOutput) -> None:
    """Append ``out`` (a later output of the same sample) to the undelivered ``into``."""
    into.token_ids.extend(out.token_ids)
    into.text += out.text
    if out.logprobs:
        into.logprobs = (into.logprobs or []) + out.logprobs
    into.first_token_time = into.first_token_time or out.first_token_time
    into.finish_reason, into.stop_reason, into.finish_time = out.finish_reason, out.stop_reason, out.finish_time
    into.num_preemptions = out.num_preemptions
    into.error = into.error or out.error  # a failure must reach the consumer even when merged


class StreamObserver(Protocol):
    """Sees what the table hands out (``engine.metrics`` counts tokens, finishes and latencies from it)."""

    def outputs(self, outputs: list[CoreOutput]) -> None: ...  # every batch, before it is dispatched

    def failed(self) -> None: ...  # fail_all: every request in flight ends with an error


class StreamTable:
    """Requests in flight, by the user's request id."""

    def __init__(self, observer: StreamObserver | None = None) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._ids: set[str] = set()  # every sample's core id, for collision checks
        self.observer = observer

    def __len__(self) -> int:
        return len(self._streams)

    def is_free(self, request_id: str, n: int) -> bool:
        """Whether no sample id of a request ``request_id`` with ``n`` samples is in flight."""
        return not any(rid in self._ids for rid in sample_ids(request_id, n))

    def is_abandoned(self, request_id: str) -> bool:
        """Whether ``request_id`` is held by a request whose consumer went away, its abort not yet confirmed."""
        stream = self._streams.get(request_id)
        return stream is not None and stream.abandoned

    def open(self, request_id: str, n: int, version_id: int, owner: object) -> RequestStream:
        stream = RequestStream(n, sample_ids(request_id, n), version_id, owner)
        self._streams[request_id] = stream
        self._ids.update(stream.ids)
        return stream

    def abandon(self, stream: RequestStream) -> None:
        """The consumer went away: drop the request's outputs from now on, but keep its ids
        reserved until :meth:`release` (once the engine thread confirmed the abort)."""
        stream.abandoned = True

    def release(self, request_id: str, stream: RequestStream) -> None:
        """Forget ``stream`` if it is still the one in flight under ``request_id``."""
        if self._streams.get(request_id) is stream:
            self.forget(request_id)

    def forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._ids.difference_update(stream.ids)

    def count(self, owner: object) -> int:
        """Requests in flight sent to one named model (all its versions)."""
        return sum(1 for s in self._streams.values() if s.owner is owner)

    def in_flight(self, version_id: int) -> int:
        """Requests bound to one model version."""
        return sum(1 for s in self._streams.values() if s.version_id == version_id)

    def dispatch(self, outputs: list[CoreOutput]) -> None:
        """Hand each output to its request's queue; a request ends with its last sample's finish."""
        if self.observer is not None:
            self.observer.outputs(outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.abandoned:
                continue
            if out.finish_reason is not None:
                stream.num_done += 1
                if stream.num_done == stream.n:
                    self.forget(out.request_id)
            stream.put(out)

    def fail_all(self, make_error: type[BaseException], message: str, cause: BaseException) -> None:
        """End every request with ``make_error(message)`` (the cause chained) and empty the table."""
        if self.observer is not None:
            self.observer.failed()
        streams, self._streams = self._streams, {}
        self._ids.clear()
        for stream in streams.values():
            err = make_error(message)
            err.__cause__ = cause
            stream.put(err)
