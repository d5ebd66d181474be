"""The scheduler contract.

A scheduler decides, once per engine step, which requests run and how many of
their tokens are computed. It is plain Python: it never imports torch or a
model, and talks to memory only through the :class:`KVCacheManager` verbs
``can_allocate``, ``allocate_slots``, ``preempt``/``free`` and ``num_free_blocks``.

What it receives:
- :meth:`Scheduler.add_request` — a new request (status ``WAITING``);
- :meth:`Scheduler.finish_requests` — requests the core finished after a step
  (stop, length or abort); the scheduler drops them and frees their blocks;
- :meth:`Scheduler.abort_request` — a request cancelled by the user, at a step boundary.

What it returns from :meth:`Scheduler.schedule`: a :class:`SchedulerOutput`,
plain data — ``{request_id: num_new_tokens}`` in execution order, and the ids it
preempted this step. A request scheduled for ``k`` tokens has slots for
``num_computed_tokens + k`` tokens in its block table when ``schedule`` returns.

Invariants every scheduler keeps:
- the sum of scheduled tokens is at most ``max_num_batched_tokens`` and at most
  ``max_num_seqs`` requests are scheduled;
- a request is scheduled at most once per step, for at least one token, and
  never past its known tokens (``num_new_tokens <= num_uncomputed_tokens``);
- progress: if any request is runnable and the cache is not full of *other*
  requests' blocks, something is scheduled (preempting if it must);
- no request is lost: every added request ends in ``finish_requests`` or
  ``abort_request``; preempted requests go back to waiting and are recomputed.

Raises: ``schedule`` raises nothing for lack of memory — a failed allocation
changes nothing and the request simply waits.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits a scheduler must respect each step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


@dataclass
class SchedulerOutput:
    """What runs this step: plain data, in execution order."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler(abc.ABC):
    """Base class: queues, bookkeeping and preemption; subclasses write :meth:`schedule`."""

    #: Whether the policy looks at ``Request.priority`` (schedulers that ignore it say so).
    uses_priority: bool = False

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # ------------------------------------------------------------------ inputs
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, requests: Iterable[Request]) -> None:
        """Drop finished requests (the core has set their final status) and free their blocks."""
        done = {r.request_id for r in requests}
        if not done:
            return
        self.running = [r for r in self.running if r.request_id not in done]
        for request_id in done:
            self.requests.pop(request_id, None)
            self.kv.free(request_id)

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; returns it, or ``None`` if unknown/finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    # ------------------------------------------------------------------ output
    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring for the contract)."""

    # ----------------------------------------------------------------- helpers
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it at the head of the waiting queue."""
        self.running.remove(request)
        self.kv.preempt(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def tokens_to_schedule(self, request: Request, budget: int) -> int:
        """Tokens a request would run with ``budget`` left: all it lacks, or a chunk of it."""
        want = request.num_uncomputed_tokens
        if want <= budget:
            return want
        return budget if self.config.enable_chunked_prefill else 0
