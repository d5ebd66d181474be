"""Following the client: cancel what it no longer waits for, and stream engine deltas as SSE.

``engine.stream()`` reports a bad request when it is first iterated, so a stream
is *primed* (its first delta awaited) before the 200 and its headers go out: an
error then still becomes a proper 4xx. Every wait watches the connection; a
client that goes away cancels its requests, which aborts them in the engine
and returns their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from asyncinfer.outputs import StreamDelta

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it and raise :class:`ClientGone`."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
    if work.done() and not work.cancelled():
        try:
            return work.result()
        finally:  # its error, raised here, holds this frame in its traceback: a frame holding the task that holds
            # the error is a cycle, and the call's frames above (its body) with it, until a full garbage collection
            del work, watch
    await asyncio.gather(work, return_exceptions=True)  # its abort is posted before we answer
    raise ClientGone


async def gather_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """All results, in order; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        del tasks  # as in unless_disconnected: a failed task's error, raised here, would hold this frame holding it


_END = object()


class MergedStreams:
    """Several engine streams read concurrently, as one sequence of ``(stream index, delta)``.

    :meth:`prime` waits until each stream has produced its first delta and raises
    the first error; iterating then yields everything in arrival order;
    :meth:`close` cancels what is still running (which aborts those requests).

    Each stream is read at most one delta ahead of the reader: the next is asked of it only once
    the reader has taken the last. A reader that falls behind (a client reading its answer slowly)
    so leaves the pieces in the engine's stream, which merges a sample's unread pieces into one,
    instead of one queued object per token here, for as long as the client keeps the connection.
    """

    def __init__(self, streams: Sequence[AsyncIterator[StreamDelta]]) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._taken = [asyncio.Event() for _ in streams]  # per stream: the reader took its last item
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]
        self._early: list[tuple[int, Any]] = []

    async def _pump(self, index: int, stream: AsyncIterator[StreamDelta]) -> None:
        taken = self._taken[index]
        try:
            async for delta in stream:
                taken.clear()
                self._queue.put_nowait((index, delta))
                await taken.wait()  # one delta of this stream waits here at a time; the engine merges the rest
        except Exception as exc:  # noqa: BLE001 - not swallowed: handed to the reader, which raises it
            self._queue.put_nowait((index, exc))
        else:
            self._queue.put_nowait((index, _END))
        finally:
            # cancelled while it waited for the reader (close(): the client is gone), the stream is still open: its
            # request is aborted now, not whenever the garbage collector finalizes it
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    async def _get(self) -> tuple[int, Any]:
        index, item = await self._queue.get()
        self._taken[index].set()
        return index, item

    async def prime(self) -> None:
        started: set[int] = set()
        while len(started) < len(self._tasks):
            index, item = await self._get()
            if isinstance(item, Exception):
                try:  # held by no local as raised (a cycle through this frame, as unless_disconnected's)
                    raise item
                finally:
                    del item
            started.add(index)
            self._early.append((index, item))

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        open_streams = len(self._tasks)
        early, self._early = self._early, []
        for index, item in early:
            if item is _END:
                open_streams -= 1
            else:
                yield index, item
        while open_streams:
            index, item = await self._get()
            if isinstance(item, Exception):
                try:  # as in prime
                    raise item
                finally:
                    del item
            if item is _END:
                open_streams -= 1
            else:
                yield index, item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class EventStream(StreamingResponse):
    """``text/event-stream`` whose ``on_close`` runs however the response ends (done, error, disconnect); it asks
    proxies not to buffer it (``x-accel-buffering: no``, which nginx obeys per response)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
