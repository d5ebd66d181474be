"""First come, first served: the default policy."""

from __future__ import annotations

from asyncinfer.request import RequestStatus
from asyncinfer.schedulers.base import Scheduler, SchedulerOutput


class FIFOScheduler(Scheduler):
    """Arrival order. Running requests go first (oldest first); when blocks run
    out the youngest running request is preempted and recomputed later. New
    requests are admitted in arrival order while budget, ``max_num_seqs`` and
    blocks allow; the head of the queue is never overtaken. Ignores ``priority``.
    """

    uses_priority = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self.tokens_to_schedule(request, budget)
            if n == 0:
                i += 1
                continue
            total = request.num_computed_tokens + n
            while not self.kv.allocate_slots(request.request_id, total):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.num_scheduled_tokens[request.request_id] = n
                budget -= n
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # The watermark keeps room for running decodes; with nothing running
            # there is nothing to protect, so the head request may use it all.
            # A cached prompt prefix is taken instead of computed (allocate_new).
            n = self.allocate_new(request, budget, reserve=bool(self.running))
            if n == 0:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
