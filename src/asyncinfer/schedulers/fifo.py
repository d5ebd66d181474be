"""First come, first served: the default policy."""

from __future__ import annotations

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
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # memory is short: admitting now would preempt again
            self.admit_waiting(list(self.waiting), budget, out)
        return out
