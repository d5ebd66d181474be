"""Priority with aging: urgent first, but every request's priority improves as it waits."""

from __future__ import annotations

import math
from collections.abc import Iterator

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.request import Request, RequestStatus
from asyncinfer.schedulers.base import SchedulerConfig, SchedulerOutput
from asyncinfer.schedulers.ordered import OrderedScheduler, option_float


def _check_seconds(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    allowed = "a finite number > 0" + (" or None" if allow_none else "")
    seconds = option_float(name, value, allowed)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidParameterError(name, value, allowed)


class AgingPriorityScheduler(OrderedScheduler):
    """Lower ``priority`` = more urgent; waiting earns one level per ``aging_interval`` seconds.

    A request's effective priority is ``priority - (now - arrival_time) / aging_interval``.
    Every request ages at the same rate, so the order between two requests never
    changes over time: it is the order of ``arrival_time + priority * aging_interval``.
    Hence the bound: a request of priority ``p`` is overtaken only by requests of
    priority ``q`` that arrived less than ``(p - q) * aging_interval`` seconds after
    it, so under any stream of more urgent requests its wait is at most that
    window plus the time to serve what arrived in it.

    Each step visits running and waiting requests together in that order, so the
    step's token budget goes to the most urgent first — except one token per
    running decode, which prompt work never takes. A waiting request that
    does not fit (``max_num_seqs`` seats for all its samples, or blocks) preempts the least urgent running
    request that has not run this step, if it outranks it by at least
    ``preempt_margin`` levels; otherwise it waits and nothing less urgent is
    admitted past it. When a running request needs a block, the least urgent
    running request is the one preempted.

    The waiting queue is kept in that order as requests arrive (and come back from preemption), so a step reads
    it from its head, as far as it admits, never ranking every waiting request: a queue of 20,000 costs a step no
    more than a queue of 10.

    Options:
        aging_interval: seconds of waiting worth one priority level (default 10.0);
            ``None`` is strict priority, which may starve (``starvation_free`` is then False).
        preempt: whether urgent waiting requests may preempt running ones (default True).
        preempt_margin: levels by which a request must outrank a running one to preempt it (default 1.0).
    """

    uses_priority = True

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        aging_interval: float | None = 10.0,
        preempt: bool = True,
        preempt_margin: float = 1.0,
    ) -> None:
        super().__init__(config, kv)
        _check_seconds("aging_interval", aging_interval, allow_none=True)
        if not isinstance(preempt, bool):
            raise InvalidParameterError("preempt", preempt, "True or False")
        if not option_float("preempt_margin", preempt_margin, "a number >= 0") >= 0:
            raise InvalidParameterError("preempt_margin", preempt_margin, "a number >= 0")
        self.aging_interval = None if aging_interval is None else float(aging_interval)
        self.preempt_urgent = preempt
        self.preempt_margin = float(preempt_margin)
        self.starvation_free = aging_interval is not None
        self._stop_waiting = False

    def effective_priority(self, request: Request, now: float) -> float:
        if self.aging_interval is None:
            return float(request.priority)
        return request.priority - (now - request.arrival_time) / self.aging_interval

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        """Sort key: most urgent first, ties in arrival order."""
        return (self.effective_priority(request, now), request.arrival_time)

    def order_key(self, request: Request) -> tuple[float, float]:
        """The order :meth:`rank` gives at every moment, as a key that does not change while a request waits:
        ``arrival_time + priority * aging_interval`` (strict priority: ``priority``), ties in arrival order."""
        if self.aging_interval is None:
            return (float(request.priority), request.arrival_time)
        return (request.arrival_time + request.priority * self.aging_interval, request.arrival_time)

    def lane_of(self, request: Request) -> int:
        return 0  # one lane: order_key orders every waiting request

    def key_of(self, request: Request) -> tuple[float, float]:
        return self.order_key(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        # One token per running decode is kept back from prompt work, however urgent:
        # a decode is cheap, and skipping it stalls a stream for a whole step.
        decodes = {r.request_id for r in self.running if r.is_decode}
        admitting = True
        for request in self._in_order():
            if budget <= 0:
                break
            rid = request.request_id
            if rid in out.preempted:
                continue
            room = budget if rid in decodes else budget - len(decodes)
            decodes.discard(rid)
            if request.status is RequestStatus.RUNNING:
                n = self.tokens_to_schedule(request, room) if room > 0 else 0
                preempted_before = len(out.preempted)
                if n and self.allocate_or_preempt(request, n, out, lambda: self._least_urgent_idle(out, now)):
                    budget -= n
                if len(out.preempted) > preempted_before:
                    decodes.difference_update(out.preempted)
                    admitting = False  # memory pressure: admitting now would thrash
            elif admitting and room > 0:
                n = self._admit_or_preempt(request, room, out, now)
                decodes.difference_update(out.preempted)
                budget -= n
                # The most urgent waiting request that does not fit is not overtaken.
                admitting = n > 0
            if not admitting:
                self._stop_waiting = True
        return out

    def _in_order(self) -> Iterator[Request]:
        """Running and waiting requests together in order_key's order (the running ones sorted each step, the
        waiting ones read from their lane's head); once the step stops admitting (``_stop_waiting``), only the
        running ones are still met. On equal keys a running request comes first."""
        running = sorted(self.running, key=self.order_key)
        waiting = self.live(self.lanes().get(0, ()))
        self._stop_waiting = False
        head = next(waiting, None)
        r = 0
        while r < len(running) or head is not None:
            if head is not None and self._stop_waiting:
                head = None
                continue
            if head is not None and (r == len(running) or head[0] < self.order_key(running[r])):
                request = head[2]
                head = next(waiting, None)
            else:
                request = running[r]
                r += 1
            yield request

    def _least_urgent_idle(self, out: SchedulerOutput, now: float) -> Request | None:
        """The least urgent running request not scheduled yet this step."""
        idle = (r for r in self.running if r.request_id not in out.num_scheduled_tokens)
        return max(idle, key=lambda r: self.rank(r, now), default=None)

    def _admit_or_preempt(self, request: Request, budget: int, out: SchedulerOutput, now: float) -> int:
        while True:
            if self.has_seats(request):
                n = self.admit(request, budget, out)
                if n or self.tokens_to_schedule(request, budget) == 0:
                    return n
            victim = self._least_urgent_idle(out, now) if self.preempt_urgent else None
            if victim is None or not self._outranks(request, victim, now):
                return 0
            self.preempt(victim)
            out.preempted.append(victim.request_id)

    def _outranks(self, request: Request, victim: Request, now: float) -> bool:
        mine, theirs = self.rank(request, now), self.rank(victim, now)
        return mine < theirs and theirs[0] - mine[0] >= self.preempt_margin
