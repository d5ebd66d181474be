"""A waiting queue kept in a policy's order as requests join it, read from the head (for plugins too: a policy
whose order is a key fixed while a request waits subclasses :class:`OrderedScheduler`, names the key, and reads
:meth:`OrderedScheduler.waiting_in`; docs/schedulers.md, "Writing one").

A policy that sorted every waiting request at every step paid for the whole queue on every step, and so on every
running request's tokens (1-1.5 us a waiting request in Python: one caller's 20,000 queued requests took a
neighbour's 0.8 ms token to 20-27 ms). :class:`OrderedScheduler` keeps the waiting requests in sorted *lanes*
instead, each request entered once, when it arrives or comes back from preemption, under a key that does not
change while it waits; a step reads the lanes from their heads as far as it admits.

Entries of requests that were admitted or went away are not searched for: they are skipped when met, trimmed from
the lanes' heads, and dropped in bulk once they outnumber the live ones. If ``waiting`` and the lanes ever disagree
in size (a subclass moved requests past these methods) the lanes are rebuilt from ``waiting``.
"""

from __future__ import annotations

import abc
import bisect
import itertools
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.request import Request, RequestStatus
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig, SchedulerOutput

#: One lane's entry: (the request's key, its entry number, the request). Entry numbers are unique: they break ties
#: in the order requests joined, preempted ones (negative, each below the last) ahead of the rest, as at the head
#: of ``waiting``.
Entry = tuple[Any, int, Request]


def option_float(name: str, value: object, allowed: str) -> float:
    """A built-in policy's number option ``value`` as a float; not a number, or an int past a float's range
    (``10**400``), is refused naming ``name``: float()'s ``OverflowError`` failed the load as the model file's fault
    ("loading 'model.gguf' failed: int too large to convert to float")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, value, allowed)
    try:
        return float(value)
    except OverflowError:
        raise InvalidParameterError(name, value, f"{allowed}, within a float's range (about 1.8e308)") from None


class OrderedScheduler(Scheduler):
    """A scheduler whose waiting requests are also held in sorted lanes (:meth:`lane_of`, :meth:`key_of`)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        # The base's signature, not (*args, **kwargs): a subclass without an __init__ of its own is checked by it,
        # so an option it does not take is refused before the weights are read (check_scheduler_options).
        super().__init__(config, kv)
        self._lanes: dict[Hashable, list[Entry]] = {}
        self._live: dict[str, int] = {}  # each waiting request's entry number
        self._returning: list[Request] = []  # preempted this step: they join at the next read
        self._entries = itertools.count()
        self._front = itertools.count(-1, -1)
        self._size = 0  # entries in all lanes, stale ones included

    @abc.abstractmethod
    def lane_of(self, request: Request) -> Hashable:
        """The lane a waiting request joins (a preempted one's status is ``PREEMPTED`` when asked)."""

    @abc.abstractmethod
    def key_of(self, request: Request) -> Any:
        """Its order within the lane: a key that does not change while the request waits."""

    # ------------------------------------------------------------------ the queue's moves
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._enter(request, front=False)

    def preempt(self, request: Request) -> None:
        super().preempt(request)
        self._returning.append(request)  # this step met it as running: it joins its lane at the next read

    def abort_request(self, request_id: str) -> Request | None:
        self._live.pop(request_id, None)
        return super().abort_request(request_id)

    def finish_requests(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        for request in requests:
            self._live.pop(request.request_id, None)
        super().finish_requests(requests)

    def admitted(self, request: Request) -> None:
        """``request`` left ``waiting`` for the running set: its entry is stale (:meth:`admit` calls this)."""
        self._live.pop(request.request_id, None)

    def admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        n = super().admit(request, budget, out)
        if n:
            self.admitted(request)
        return n

    # ------------------------------------------------------------------ reading
    def lanes(self) -> dict[Hashable, list[Entry]]:
        """The lanes, brought up to date (the preempted requests in; stale entries trimmed from the heads, or
        everywhere once they are half of all, and all of them when nothing waits): read each with :meth:`live`."""
        for request in self._returning:
            if self.requests.get(request.request_id) is request and request.status is RequestStatus.PREEMPTED:
                self._enter(request, front=True)
        self._returning.clear()
        live = self._live
        if len(live) != len(self.waiting):
            self._rebuild()
        elif not live:  # nothing waits: no entry (nor the request it holds) outlives the queue
            self._lanes.clear()
            self._size = 0
        elif self._size > 2 * len(live) + 64:
            for lane in self._lanes.values():
                lane[:] = [e for e in lane if live.get(e[2].request_id) == e[1]]
            self._size = sum(map(len, self._lanes.values()))
        else:
            for lane in self._lanes.values():
                head = 0
                while head < len(lane) and live.get(lane[head][2].request_id) != lane[head][1]:
                    head += 1
                del lane[:head]
                self._size -= head
        return self._lanes

    def waiting_in(self, lane: Hashable) -> Iterator[Request]:
        """The requests still waiting in ``lane``, in order, read lazily from its head (nothing if it is empty)."""
        return (entry[2] for entry in self.live(self.lanes().get(lane, ())))

    def live(self, entries: Iterable[Entry]) -> Iterator[Entry]:
        """The entries of ``entries`` whose requests still wait (checked as each is reached)."""
        live = self._live
        for entry in entries:
            if live.get(entry[2].request_id) == entry[1]:
                yield entry

    # ------------------------------------------------------------------ internals
    def _enter(self, request: Request, *, front: bool) -> None:
        number = next(self._front if front else self._entries)
        self._live[request.request_id] = number
        bisect.insort(self._lanes.setdefault(self.lane_of(request), []), (self.key_of(request), number, request))
        self._size += 1

    def _rebuild(self) -> None:
        self._live.clear()
        self._lanes.clear()
        self._size = 0
        for request in self.waiting:  # in queue order: preempted ones at its head keep their place among equals
            self._enter(request, front=False)
