"""The engine core: a synchronous step loop, ``schedule -> execute -> update``.

No asyncio here. The core owns the scheduler (and through it the block
manager), the model runner and the sampler. ``AsyncEngine`` drives it from a
dedicated thread so that model work never runs on the application's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.detokenizer import IncrementalDetokenizer
from asyncinfer.outputs import Logprob
from asyncinfer.request import Request, RequestStatus
from asyncinfer.runner import ModelRunner
from asyncinfer.sampler import Sampler, SamplingState, TokenLogprobs
from asyncinfer.schedulers.base import Scheduler


@dataclass
class CoreOutput:
    """What one step produced for one request (new tokens/text, and the finish if it ended)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass
class StepStats:
    """Counters of the core since start (plain numbers for metrics and tests)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)


class EngineCore:
    """One model version's step loop."""

    def __init__(
        self,
        *,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        max_model_len: int,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.stats = StepStats()

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    # ------------------------------------------------------------------ inputs
    def add_request(self, request: Request) -> None:
        request.sampling_state = SamplingState(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=None,
        )
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> CoreOutput | None:
        """Abort at a step boundary; returns the request's final output, or ``None`` if unknown."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        request.finish_time = time.time()
        return CoreOutput(
            request_id=request_id,
            token_ids=[],
            text="",
            finish_reason="abort",
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            num_preemptions=request.num_preemptions,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[CoreOutput]:
        """One engine iteration: schedule, run the model, sample, update the requests."""
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if plan.is_empty:
            return []
        requests = self.scheduler.requests
        batch = [(requests[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
        inputs = self.runner.prepare(batch, {rid: self.kv.block_table(rid) for rid in plan.num_scheduled_tokens})
        logits = self.runner.execute(inputs)
        self._count(batch)
        for request, n in batch:
            request.num_computed_tokens += n
        if not inputs.sampled:
            return []
        sampled = self.sampler(logits, [r.sampling_state for r in inputs.sampled])
        return self._update(inputs.sampled, sampled.token_ids, sampled.logprobs)

    def _count(self, batch: list[tuple[Request, int]]) -> None:
        self.stats.steps += 1
        self.stats.batch_sizes.append(len(batch))
        for request, n in batch:
            # A decode extends generated text by one token; anything else (prompt
            # chunks, recomputation after preemption) is prefill work.
            is_decode = n == 1 and request.num_output_tokens > 0 and request.num_uncomputed_tokens == 1
            if is_decode:
                self.stats.decode_tokens += n
            else:
                self.stats.prefill_tokens += n

    def _update(
        self, requests: list[Request], token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[CoreOutput]:
        now = time.time()
        outputs: list[CoreOutput] = []
        finished: list[Request] = []
        for request, token_id, lp in zip(requests, token_ids, logprobs):
            outputs.append(self._append_token(request, token_id, lp, now))
            if request.status.finished:
                finished.append(request)
        self.scheduler.finish_requests(finished)
        return outputs

    def _append_token(self, request: Request, token_id: int, lp: TokenLogprobs | None, now: float) -> CoreOutput:
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        text, stop_hit = ("", False)
        if request.detokenizer is not None:
            text, stop_hit = request.detokenizer.add(token_id)
        self._check_stop(request, token_id, stop_hit)
        out = CoreOutput(
            request_id=request.request_id,
            token_ids=[token_id],
            text=text,
            logprobs=None if lp is None else [Logprob(lp.token_id, lp.logprob, list(lp.top))],
            first_token_time=request.first_token_time,
            num_preemptions=request.num_preemptions,
        )
        if request.status.finished:
            if request.detokenizer is not None:
                out.text += request.detokenizer.flush()
            request.finish_time = now
            out.finish_reason = request.finish_reason
            out.stop_reason = request.stop_reason
            out.finish_time = now
        return out

    def _check_stop(self, request: Request, token_id: int, stop_hit: bool) -> None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if stop_hit:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = request.detokenizer.stop_reason if request.detokenizer else None
                return
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
            if not params.ignore_eos and token_id in self.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH


def default_eos_ids(config_eos: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    ids = set(config_eos)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))

