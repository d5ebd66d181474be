"""The scheduler contract (plugin API version :data:`SCHEDULER_API_VERSION`).

A scheduler decides, once per engine step, which requests run and how many of
their tokens are computed. It is plain Python: it never imports torch or a
model, and talks to memory only through the :class:`KVCacheManager` verbs
``can_allocate``, ``allocate_slots`` (or ``allocate``/``append_slots``),
``lookup_prefix``, ``preempt``/``free`` and the read-only queries
``num_free_blocks``, ``num_blocks_needed`` and ``block_table``.

Construction: ``cls(config, kv, **options)``; ``options`` are the engine's
``scheduler_options`` (unknown keywords are rejected by the registry, bad
values should raise :class:`~asyncinfer.errors.InvalidParameterError`).

What it receives:
- :meth:`Scheduler.add_request` — a new request (status ``WAITING``), with its
  ``priority`` (lower = more urgent; policies that ignore it set
  ``uses_priority = False``) and ``arrival_time`` on the :attr:`Scheduler.clock`;
- each step's outputs, applied by the core to the :class:`Request` objects it
  scheduled before the next ``schedule`` call: ``num_computed_tokens`` grows by
  the scheduled count, and a request that caught up gets one sampled token
  (:func:`asyncinfer.step.apply_step` does it; a test drives a scheduler with it too);
- :meth:`Scheduler.add_forked` — a sample forked from a running ``n > 1`` request
  in the step just applied (``"<id>#<i>"``, ``parent_id`` set). It already holds
  blocks (shared with its parent) and its first token, so it joins ``running`` at
  once: a request that holds blocks must never wait behind the queue's head, which
  may need those very blocks (the engine would stop). The base class appends it to
  ``running``; a policy that overrides it must keep it running;
- :meth:`Scheduler.finish_requests` — requests the core finished after a step
  (stop, length or abort); the scheduler drops them and frees their blocks;
- :meth:`Scheduler.abort_request` — a request cancelled by the user, at a step boundary.

What it returns from :meth:`Scheduler.schedule`: a :class:`SchedulerOutput`,
plain data — ``{request_id: num_new_tokens}`` in execution order, and the ids it
preempted this step. A request scheduled for ``k`` tokens has slots for
``num_computed_tokens + k`` tokens in its block table when ``schedule`` returns.

Invariants every scheduler keeps:
- budget: the sum of scheduled tokens is at most ``max_num_batched_tokens`` and at
  most ``max_num_seqs`` requests are scheduled (and running). A request of ``n > 1``
  samples takes ``n`` of those seats from its admission (:attr:`Request.num_seqs`:
  its samples join ``running`` when they fork), so admit it only when
  :meth:`Scheduler.has_seats` says so (:meth:`Scheduler.admit` checks it);
- a request is scheduled at most once per step, for at least one token, and
  never past its known tokens (``num_new_tokens <= num_uncomputed_tokens``);
- progress: if any request is runnable and the cache is not full of *other*
  requests' blocks, something is scheduled (preempting if it must). The engine
  thread backs off while nothing is scheduled and fails the stuck requests with
  ``RequestStalledError`` after ``stall_timeout`` seconds;
- no starvation: every request is scheduled within a bounded time unless the
  policy says otherwise by setting ``starvation_free = False``;
- no request is lost: every added request ends in ``finish_requests`` or
  ``abort_request``; preempted requests go back to waiting and are recomputed
  (``preempt`` frees their blocks and sets ``num_computed_tokens = 0``).

Memory (prefix cache, copy-on-write): start waiting requests through
:meth:`Scheduler.admit` or :meth:`Scheduler.allocate_new`, which look the
request up in the prefix cache (``kv.lookup_prefix``) and allocate with the
hit (``kv.allocate(..., prefix=hit)``), so a cached prompt prefix is not
computed again (``num_computed_tokens`` starts past it) and needs no free
block (``kv.can_allocate(..., prefix=hit)`` counts only what the hit lacks). Grow running requests
with ``kv.allocate_slots`` / ``kv.append_slots``; a write into a block shared
with another request copies it first, transparently. One rule follows from
blocks being shared within a step: never preempt or free a request after
scheduling it in the same ``schedule`` call (``kv.free`` raises
``RuntimeError`` if requests admitted after it already share its new blocks).

Time: policies that look at waiting time read :attr:`Scheduler.clock` (wall time
in the engine; the policy lab replaces it with simulated time), never
``time.time()`` directly.

Raises: ``schedule`` raises nothing for lack of memory — a failed allocation
changes nothing and the request simply waits. If ``schedule`` raises anyway (a
bug), its queues may be half updated, so the engine fails *every* request the
scheduler holds with ``RequestFailedError`` (through :meth:`Scheduler.abort_request`,
which frees their blocks) and serves the next ones; ``max_consecutive_step_failures``
failures in a row declare the engine dead. An exception from a per-request hook
(``add_request``, ``abort_request``, ``finish_requests``, ``add_forked``) is logged and
fails only that request: the engine takes it out of ``requests``, ``running`` and
``waiting`` itself and frees its blocks (``finish_requests`` is called again one request
at a time to find which one it was about); it is not a failed step. Any ``BaseException`` counts
as such an exception except ``SystemExit`` and ``KeyboardInterrupt``, which end the engine
(``asyncinfer.step.ENDS_ENGINE``).
"""

from __future__ import annotations

import abc
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.cache.prefix import PrefixHit
from asyncinfer.request import Request, RequestStatus

#: Version of this contract. A plugin may set ``api_version`` on its class; the
#: registry refuses one written for a newer contract than this engine speaks.
SCHEDULER_API_VERSION = 1

#: The statuses of a request in ``waiting``: never started, or preempted.
WAITING_STATUSES = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED})


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits a scheduler must respect each step, and what the attention backend's padding costs.

    ``decode_padding(context_lens, block_size)``: keys the attention backend computes
    beyond the real contexts when these decodes run in one step (plain Python; the
    engine passes its backend's ``decode_padding``). ``None``: the backend pads
    nothing, so no policy needs to split decodes to save padding.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    decode_padding: Callable[[Sequence[int], int], int] | None = None

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


def count_type_fault(request_id: object, n: object) -> str | None:
    """What is wrong with the type of a plan's count ``n`` for ``request_id`` (None: an ``int``, of a subclass
    too, read as the plain int it holds). A ``bool`` (``True`` is no count of 1) or any other type is refused by
    its type, naming the id and the value: the one rule the engine holds every plan to and the conformance
    suite's :func:`~asyncinfer.schedulers.testing.check_schedule` checks."""
    if isinstance(n, int) and not isinstance(n, bool):
        return None
    return f"{n!r} tokens for {request_id!r} (a {type(n).__name__}, not an int)"


class Scheduler(abc.ABC):
    """Base class: queues, bookkeeping and preemption; subclasses write :meth:`schedule`."""

    #: Whether the policy looks at ``Request.priority`` (schedulers that ignore it say so).
    uses_priority: bool = False
    #: Whether every request is scheduled within a bounded time (see the contract).
    starvation_free: bool = True
    #: The contract version the class was written for.
    api_version: int = SCHEDULER_API_VERSION
    #: Seconds on the clock that ``Request.arrival_time`` uses; the lab swaps in simulated time.
    clock: Callable[[], float] = staticmethod(time.time)

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

    def add_forked(self, request: Request) -> None:
        """A sample forked from a running request: it holds blocks, so it runs at once (see the contract)."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

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
    def is_waiting(self, request: Request) -> bool:
        """Whether ``request`` waits in this scheduler now (held in ``requests`` and not started, or preempted):
        false for one aborted or finished since (``abort_request`` and ``finish_requests`` drop it), or running."""
        return request.status in WAITING_STATUSES and self.requests.get(request.request_id) is request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_running_seqs(self) -> int:
        """Seats the running requests take: each one, plus the samples they will fork (:attr:`Request.num_seqs`)."""
        return sum(r.num_seqs for r in self.running)

    def has_seats(self, request: Request) -> bool:
        """Whether admitting ``request`` (all its samples) keeps the running set within ``max_num_seqs``."""
        return self.num_running_seqs + request.num_seqs <= self.config.max_num_seqs

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it at the head of the waiting queue.

        Counted twice, once per level: on the request (``num_preemptions``) and in
        ``kv.preempt`` (the engine's total, ``KVCacheManager.num_preemptions``).
        """
        self.running.remove(request)
        self.kv.preempt(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def allocate_or_preempt(
        self,
        request: Request,
        num_new_tokens: int,
        out: SchedulerOutput,
        pick_victim: Callable[[], Request] | None = None,
    ) -> bool:
        """Schedule a running request for ``num_new_tokens``, preempting others until its slots fit.

        ``pick_victim`` names the running request to give up next (default: the
        last of ``self.running``); it must not return one already in ``out``
        other than ``request`` itself. Returns ``False`` when ``request`` itself
        was preempted (then it is not scheduled).
        """
        total = request.num_computed_tokens + num_new_tokens
        while not self.kv.allocate_slots(request.request_id, total):
            victim = pick_victim() if pick_victim is not None else self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        out.num_scheduled_tokens[request.request_id] = num_new_tokens
        return True

    def schedule_running(self, out: SchedulerOutput, budget: int, skip: Container[str] = ()) -> int:
        """Schedule ``self.running`` in list order (but ``skip``), preempting from its end.

        Each request gets all it lacks or a chunk of what is left of ``budget``;
        reorder ``self.running`` first to set the policy's order (the last one is
        the first preempted). Returns the budget left.
        """
        for request in list(self.running):
            if budget <= 0:
                break
            if request.request_id in skip or request.request_id in out.preempted:
                continue
            n = self.tokens_to_schedule(request, budget)
            if n and self.allocate_or_preempt(request, n, out):
                budget -= n
        return budget

    def admit_waiting(self, order: Iterable[Request], budget: int, out: SchedulerOutput) -> int:
        """Admit waiting requests in ``order`` while budget, ``max_num_seqs`` and blocks allow.

        Stops at the first that does not fit: a request behind it would take the
        memory (or the seats) it waits for. Passes over a request that no longer waits
        (:meth:`is_waiting`): a queue of the policy's own may still hold one aborted, finished
        or admitted since, and one user's cancelled request must not fail the step for
        everybody. Returns the budget left.
        """
        for request in order:
            if budget <= 0:
                break
            if not self.is_waiting(request):
                continue
            n = self.admit(request, budget, out)
            if n == 0:
                break
            budget -= n
        return budget

    def admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Start a waiting request with up to ``budget`` tokens if its seats and slots fit.

        Only a request whose every known token would fit in the free blocks now
        starts, even if this step computes a chunk of it: a long prompt started
        without room to finish would need blocks halfway, be preempted, start
        again, and so on. Tokens found in the prefix cache need no free block
        (the request shares the cached ones). Keeps the watermark back while
        others run, and ``max_num_seqs`` for all its samples (:meth:`has_seats`);
        moves the request from waiting to running and records it in ``out``.
        Returns the tokens scheduled, or 0 with nothing changed. A request that does not
        wait here (:meth:`is_waiting`) is a ``ValueError`` naming it, raised before any
        block is allocated (it was raised after: its blocks were never freed).
        """
        if not self.is_waiting(request):
            held = self.requests.get(request.request_id) is request
            raise ValueError(
                f"admit() was given request {request.request_id!r}, which does not wait in this scheduler "
                f"(status {request.status.value}" + ("" if held else ", no longer held: aborted or finished")
                + "): a queue of the policy's own still holds it; admit_waiting() passes such requests over"
            )
        if not self.has_seats(request):
            return 0
        reserve = bool(self.running)
        hit = self.kv.lookup_prefix(request)
        if not self.kv.can_allocate(request, request.num_tokens, new_request=reserve, prefix=hit or None):
            return 0
        n = self.allocate_new(request, budget, reserve=reserve, prefix=hit)
        if n == 0:
            return 0
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.num_scheduled_tokens[request.request_id] = n
        return n

    def allocate_new(
        self, request: Request, budget: int, *, reserve: bool, prefix: PrefixHit | None = None
    ) -> int:
        """Slots for a waiting request's next tokens, reusing its longest cached prefix.

        Looks the request up in the prefix cache (if it holds no blocks yet; pass
        ``prefix``, a ``kv.lookup_prefix`` made just before, to skip that), then
        allocates for up to ``budget`` of the tokens the cache does not
        cover (all of them, or a chunk with chunked prefill). On success
        ``request.num_computed_tokens`` already counts the cached tokens and the
        tokens to schedule are returned; 0 means it cannot start now and nothing
        changed. ``reserve`` keeps the watermark free (pass ``bool(self.running)``).
        Does not move the request between queues (:meth:`admit` does).
        """
        hit = self.kv.lookup_prefix(request) if prefix is None else prefix
        start = hit.num_tokens if hit else request.num_computed_tokens
        want = request.num_tokens - start
        n = want if want <= budget else (budget if self.config.enable_chunked_prefill else 0)
        if n <= 0 or not self.kv.allocate(request, n, prefix=hit or None, new_request=reserve):
            return 0
        request.num_computed_tokens = start
        return n

    def tokens_to_schedule(self, request: Request, budget: int) -> int:
        """Tokens a request would run with ``budget`` left: all it lacks, or a chunk of it."""
        want = request.num_uncomputed_tokens
        if want <= budget:
            return want
        return budget if self.config.enable_chunked_prefill else 0
