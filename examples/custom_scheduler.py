"""A third-party scheduler: per-tenant fair share, in one file, used through the registry.

A request's tenant is the part of its ``request_id`` before the first "/"
(``engine.generate(prompt, request_id="acme/42")``); requests whose id has no "/" are
one tenant together, "". Each step the tenant that
has been served the fewest tokens so far goes first, so one tenant flooding the
engine cannot starve another. Run it:

    python examples/custom_scheduler.py

Packaged, it would name itself in its ``pyproject.toml``::

    [project.entry-points."asyncinfer.schedulers"]
    fair-share = "custom_scheduler:FairShareScheduler"
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

from asyncinfer.cache import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.request import Request
from asyncinfer.schedulers import Scheduler, SchedulerConfig, SchedulerOutput, register_scheduler


@register_scheduler("fair-share")
class FairShareScheduler(Scheduler):
    """Least-served tenant first; within a tenant, arrival order. Ignores ``priority``.

    Starvation-free: a waiting tenant's usage stays put while the others' grows,
    so it becomes the least served within a bounded number of steps.
    """

    uses_priority = False
    api_version = 1

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, weights: dict[str, float] | None = None):
        super().__init__(config, kv)
        # A tenant with weight 2 may use twice the tokens. Checked here, as every option should be: a weight of 0
        # made schedule() divide by zero (every request it held failed, then the engine), a negative, NaN or
        # infinite one put its tenant first for good (starving the others) or made the order meaningless.
        weights = {} if weights is None else weights
        if not isinstance(weights, dict) or not all(
            isinstance(t, str) and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
            for t, w in weights.items()
        ):
            raise InvalidParameterError("weights", weights, "a dict of tenant names to finite numbers > 0, or None")
        self.weights = dict(weights)
        self.usage: dict[str, float] = defaultdict(float)

    @staticmethod
    def tenant(request: Request) -> str:
        """The id's part before its first "/"; "" (one tenant) for every id without one: a request with no tenant,
        such as the HTTP server's calls made with a key that has none. Read as a tenant of its own, each of them
        would be new and never served, so would go before every real tenant (a flood of them starving all)."""
        tenant, slash, _ = request.request_id.partition("/")
        return tenant if slash else ""

    def share(self, request: Request) -> tuple[float, float]:
        tenant = self.tenant(request)
        return (self.usage[tenant] / self.weights.get(tenant, 1.0), request.arrival_time)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Running requests keep their blocks and go first (most-served tenant last, so it
        # is the one preempted when blocks run out); then admissions, least-served first.
        self.running.sort(key=self.share)
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # after preempting for memory, admitting would thrash
            self.admit_waiting(sorted(self.waiting, key=self.share), budget, out)
        for request_id, n in out.num_scheduled_tokens.items():
            self.usage[self.tenant(self.requests[request_id])] += n
        return out


async def main() -> None:
    from asyncinfer import AsyncEngine, SamplingParams

    engine = await AsyncEngine.load(scheduler="fair-share", max_num_seqs=2, max_model_len=1024)
    params = SamplingParams(max_tokens=24)
    async with engine:
        def chat(text: str) -> list[dict[str, str]]:
            return [{"role": "user", "content": text}]

        # Tenant "bulk" queues six requests before "interactive" sends its one.
        jobs = [engine.generate(chat(f"Name {i + 2} colours."), params, request_id=f"bulk/{i}") for i in range(6)]
        jobs.append(engine.generate(chat("Say hello."), params, request_id="interactive/0"))
        outs = await asyncio.gather(*jobs)
    for out in sorted(outs, key=lambda o: o.metrics.finish_time):
        print(f"{out.request_id:>14}: finished {out.metrics.finish_time - out.metrics.arrival_time:5.1f}s "
              f"after arrival: {out.text.strip()[:40]!r}")


if __name__ == "__main__":
    asyncio.run(main())
