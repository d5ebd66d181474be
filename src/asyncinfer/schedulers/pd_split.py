"""Prefill/decode split: decodes first, prompts chunked under their own per-step budget."""

from __future__ import annotations

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig, SchedulerOutput


class PDSplitScheduler(Scheduler):
    """Balances prefill and decode explicitly, so a long prompt never stalls running decodes.

    Every step first gives one token to each decoding request (oldest first),
    then spends at most ``prefill_budget`` tokens on prompt work — chunks of
    running prefills first, then new admissions, in arrival order. A step's
    work, and so the inter-token latency of every running request, is then
    bounded by ``decodes + prefill_budget`` tokens whatever prompt arrives.
    With no request decoding there is nothing to protect and prompt work takes
    the whole ``max_num_batched_tokens``.

    A smaller ``prefill_budget`` gives smoother decodes and slower time to first
    token for new requests; ``max_num_batched_tokens`` comes close to FIFO.
    Under memory pressure the youngest prefilling request is preempted first
    (it has the least work to redo), then the youngest decoding one. Needs
    chunked prefill. Ignores ``priority``.

    Options:
        prefill_budget: prompt tokens per step while any request decodes
            (default ``max(1, max_num_batched_tokens // 4)``).
    """

    uses_priority = False

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, prefill_budget: int | None = None) -> None:
        super().__init__(config, kv)
        if not config.enable_chunked_prefill:
            raise InvalidParameterError("enable_chunked_prefill", False, "True with scheduler='pd-split'")
        if prefill_budget is None:
            prefill_budget = max(1, config.max_num_batched_tokens // 4)
        if isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int) or prefill_budget < 1:
            raise InvalidParameterError("prefill_budget", prefill_budget, "an integer >= 1")
        self.prefill_budget = prefill_budget

    def schedule(self) -> SchedulerOutput:
        # Stable sort: decodes first, each group in admission order.
        self.running.sort(key=lambda r: not r.is_decode)
        decodes = sum(1 for r in self.running if r.is_decode)
        budget = self.config.max_num_batched_tokens
        if decodes:
            budget = min(budget, decodes + self.prefill_budget)
        out = SchedulerOutput()
        budget = self.schedule_running(out, budget)
        if not out.preempted:
            self.admit_waiting(list(self.waiting), budget, out)
        return out
