"""The engine-side request: plain data shared by the core and the schedulers.

One counter rules prefill, chunked prefill and decode alike: ``num_computed_tokens``
catches up with ``num_tokens`` (prompt + generated); there is no separate phase
state. Whether a request's next computation is a decode is :attr:`Request.is_decode`,
the one definition that the core's counters, the lab and the schedulers share.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """A request as the core and schedulers see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Requests with the same salt may share cached prefix blocks; other salts never do.
    cache_salt: str | None = None
    # Sample ``index`` of ``params.n``; the samples after the first are forked
    # from it (``parent_id``) when it has computed the prompt.
    index: int = 0
    parent_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # This request's preemptions (Scheduler.preempt); the engine's total is KVCacheManager.num_preemptions.
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # When a step first scheduled it, on the scheduler's clock (time.time() in the engine): the end of its
    # queue time. Set by asyncinfer.step.scheduled, whatever the metrics setting.
    scheduled_time: float | None = None
    stop_reason: int | str | None = None
    # Owned by the core: sampling state (seeded generator, grammar matcher) and detokenizer.
    sampling_state: Any = None
    detokenizer: Any = None
    # A structured request's grammar compiled for its model (asyncinfer.grammar.CompiledGrammar), set when it
    # is bound to the model (off the event loop); each sample gets its own matcher from it. None otherwise.
    grammar: Any = None
    # Samples 1 .. n-1 not forked from this one yet: the driver forks them when it has
    # computed its prompt (asyncinfer.step.fork_samples). ``n - 1`` for a request as added.
    num_unforked_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_unforked_samples = self.params.n - 1 if self.parent_id is None else 0

    @property
    def num_seqs(self) -> int:
        """Sequences this request takes in the running set: itself and the samples it will fork.

        A scheduler counts it against ``max_num_seqs`` when it admits the request, so the
        running set stays within the limit when the forked samples join it.
        """
        return 1 + self.num_unforked_samples

    @property
    def is_structured(self) -> bool:
        """Whether its output is constrained (``params.structured``): each of its sampled steps computes a
        token mask (a policy may weigh that cost; ``EngineCore.stats.mask_seconds`` has the total)."""
        return self.params.structured is not None

    @property
    def group_id(self) -> str:
        """The id the user gave: shared by all ``n`` samples of one request."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Whether the next computation is a decode: the one uncomputed token is the last one sampled.

        True when it has generated a token and only its last token is left to
        compute, so one step computes that token and samples the next. Anything
        else is prefill work: a prompt or a chunk of one (a one-token chunk
        too, and the last prompt token left after a prefix-cache hit), and the
        recomputation after a preemption until only the last token is left.
        Ask it before the step is applied: schedulers ask it of running
        requests, counters of scheduled ones (a decode is scheduled for its one
        token, since ``num_new_tokens <= num_uncomputed_tokens``).

        The batch layout is another question: the runner puts every one-token
        query first for the batched decode attention, one-token prompt chunks included.
        """
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample ``index`` of request ``request_id``: the id itself, then ``"<id>#<i>"``."""
    return request_id if index == 0 else f"{request_id}#{index}"
