"""Length buckets: admit requests of similar length together, shortest bucket first."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.request import Request, RequestStatus
from asyncinfer.schedulers.base import SchedulerConfig, SchedulerOutput
from asyncinfer.schedulers.ordered import Entry, OrderedScheduler, option_float

_LENGTHS = ("total", "prompt", "output")
#: The lane of preempted requests (buckets are 0, 1, ...).
_PREEMPTED = -1


class LengthBucketScheduler(OrderedScheduler):
    """Groups requests by length: shortest bucket admitted first, short and long decodes in turns.

    Admission: a request's length is known before it runs only as its prompt
    plus its ``max_tokens`` (capped at ``max_model_len``); ``by`` picks which of
    the two count. Buckets are the intervals between ``bucket_edges``; waiting
    requests are admitted shortest bucket first, in arrival order within one.
    Short requests then no longer queue behind long ones (head-of-line blocking).

    Decoding: an attention backend that pads every decode of a step to the
    longest decode context (SDPA does) makes every short decode beside a long
    one pay for the long one's attention. The backend says what a batch costs
    (``config.decode_padding``); when splitting the step's decodes (sorted by
    context) would save more than ``split_padding`` padded keys, the short group
    and the long group decode on alternate steps. A backend that pads nothing
    (``decode_padding`` None) never splits. Prompt chunks run every step.

    Starvation bound: a request that has waited ``max_wait`` seconds, and any
    preempted request, leaves the buckets and goes ahead of every unaged request,
    in arrival order; the head of that order is never overtaken. A resting
    decode group runs the next step. Running requests are otherwise served, and
    preempted (youngest first), as FIFO does. Ignores ``priority``.

    Each bucket's waiting requests are kept in arrival order as they arrive, so a step reads the order from the
    buckets' heads as far as it admits, never sorting every waiting request.

    Options:
        bucket_edges: ascending bucket upper bounds in tokens
            (default 64, 128, 256, 512, 1024, 2048, 4096; longer lengths share the last bucket).
        max_wait: seconds before a waiting request is served in arrival order (default 30).
        by: "total" (prompt + max_tokens, default), "prompt" or "output" (max_tokens).
        split_padding: padded decode keys a split must save to alternate the groups
            (default 4096; ``None`` never splits). It pays when the saving costs more
            than one step's fixed cost: about ``const / decode_keys`` of the lab's
            cost model (~2900 keys for SmolLM2-135M on a CPU).
    """

    uses_priority = False

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        bucket_edges: Sequence[int] = (64, 128, 256, 512, 1024, 2048, 4096),
        max_wait: float = 30.0,
        by: str = "total",
        split_padding: int | None = 4096,
    ) -> None:
        super().__init__(config, kv)
        edges = list(bucket_edges)
        if not edges or any(not isinstance(e, int) or e < 1 for e in edges) or edges != sorted(set(edges)):
            raise InvalidParameterError("bucket_edges", bucket_edges, "strictly increasing positive integers")
        if not 0 < option_float("max_wait", max_wait, "a finite number of seconds > 0") < math.inf:
            # an infinite one never served a request in arrival order: no bound, under starvation_free = True
            raise InvalidParameterError("max_wait", max_wait, "a finite number of seconds > 0")
        if by not in _LENGTHS:
            raise InvalidParameterError("by", by, f"one of {_LENGTHS}")
        if split_padding is not None and (isinstance(split_padding, bool) or not isinstance(split_padding, int)
                                          or split_padding < 0):
            raise InvalidParameterError("split_padding", split_padding, "an integer >= 0, or None")
        self.split_padding = split_padding
        self._short_turn = True
        self.bucket_edges = edges
        self.max_wait = float(max_wait)
        self.by = by

    def expected_length(self, request: Request) -> int:
        """The length ``by`` measures, known before the request runs."""
        if self.by == "prompt":
            return request.num_prompt_tokens
        output = request.params.max_tokens
        if self.by == "output":
            return output
        return min(request.num_prompt_tokens + output, self.config.max_model_len)

    def bucket_of(self, request: Request) -> int:
        return bisect.bisect_left(self.bucket_edges, self.expected_length(request))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.config.max_num_batched_tokens, skip=self._resting_decodes())
        if not out.preempted:
            self.admit_waiting(self._waiting_order(self.clock()), budget, out)
        return out

    def lane_of(self, request: Request) -> int:
        return _PREEMPTED if request.status is RequestStatus.PREEMPTED else self.bucket_of(request)

    def key_of(self, request: Request) -> float:
        return request.arrival_time

    def _waiting_order(self, now: float) -> Iterator[Request]:
        """The waiting requests in admission order, read lazily: first the preempted ones and those that waited
        ``max_wait`` (each bucket's head, in arrival order; on equal times preempted ones first, as at the waiting
        queue's head), then each bucket from the shortest, in arrival order."""
        lanes = self.lanes()
        buckets = sorted(b for b in lanes if b != _PREEMPTED)

        def aged(lane: Iterable[Entry]) -> Iterator[Entry]:
            for entry in lane:
                if not now - entry[0] >= self.max_wait:
                    return
                yield entry

        def young(lane: Iterable[Entry]) -> Iterator[Entry]:
            return (entry for entry in lane if not now - entry[0] >= self.max_wait)

        first = heapq.merge(self.live(lanes.get(_PREEMPTED, [])), *(aged(self.live(lanes[b])) for b in buckets))
        for entry in itertools.chain(first, *(young(self.live(lanes[b])) for b in buckets)):
            yield entry[2]

    def _resting_decodes(self) -> set[str]:
        """Decodes that sit this step out so that short and long contexts take turns.

        Split the decodes, sorted by context, where that saves the most padding
        (as the backend counts it); if the saving exceeds ``split_padding`` keys,
        the two groups run on alternate steps.
        """
        pad = self.config.decode_padding
        if self.split_padding is None or pad is None:
            return set()
        decodes = sorted((r for r in self.running if r.is_decode), key=lambda r: r.num_tokens)
        saved, k = self._best_split([r.num_tokens for r in decodes], pad, self.split_padding)
        if saved <= self.split_padding:
            self._short_turn = True
            return set()
        group = decodes[k:] if self._short_turn else decodes[:k]
        self._short_turn = not self._short_turn
        return {r.request_id for r in group}

    def _best_split(
        self, contexts: list[int], pad: Callable[[Sequence[int], int], int], threshold: int
    ) -> tuple[int, int]:
        """``(keys saved, k)`` of the split of sorted ``contexts`` into ``[:k]`` and ``[k:]`` that saves
        the most padding; ``(0, 0)`` when even all of the padding is at most ``threshold``."""
        bs = self.kv.block_size
        whole = pad(contexts, bs)
        if whole <= threshold:  # no split can save more than all the padding there is
            return 0, 0
        splits = ((whole - pad(contexts[:i], bs) - pad(contexts[i:], bs), i) for i in range(1, len(contexts)))
        return max(splits, default=(0, 0))
