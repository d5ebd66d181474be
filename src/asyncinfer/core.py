"""The engine core: a synchronous step loop, ``schedule -> execute -> update``.

No asyncio here. The core owns the scheduler (and through it the block
manager), the model runner and the sampler. ``AsyncEngine`` drives it from a
dedicated thread so that model work never runs on the application's event loop.

The update is :func:`asyncinfer.step.apply_step`, the one the policy lab and
the scheduler tests call too; the core gives it the sampler's tokens and its
stop checks (stop strings, stop token ids, EOS, ``min_tokens``), and turns
what it did into :class:`CoreOutput`s.

Parallel samples (``SamplingParams.n > 1``): the request added is sample 0. In
the step where it computes its prompt and samples its first token, the core
forks samples ``1 .. n-1`` from it: each gets a block table sharing sample 0's
blocks (copy-on-write), its own sampling state (seed ``seed + i``), and its
first token drawn from the same logits row. From then on each sample is an
ordinary request to the scheduler (id ``"<id>#<i>"``), running at once
(``Scheduler.add_forked``); outputs carry the user's id and the sample's
``index``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.detokenizer import IncrementalDetokenizer
from asyncinfer.outputs import CoreOutput, Logprob
from asyncinfer.request import Request, RequestStatus
from asyncinfer.runner import ModelRunner
from asyncinfer.sampler import Sampler, SamplingState, TokenLogprobs
from asyncinfer.schedulers.base import Scheduler
from asyncinfer.step import StepResult, apply_step, fork_samples, scheduled


@dataclass
class _Group:
    """The samples of one ``n > 1`` request that have not finished yet."""

    n: int
    members: dict[int, Request]
    finished: set[int] = field(default_factory=set)


@dataclass
class StepStats:
    """Counters of the core since start (plain numbers for metrics and tests).

    ``preemptions`` is the block manager's count (:attr:`KVCacheManager.num_preemptions`,
    the engine's one preemption counter), copied here after every ``schedule``.
    """

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
        self._groups: dict[str, _Group] = {}

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    # ------------------------------------------------------------------ inputs
    def add_request(self, request: Request) -> None:
        self._prepare(request)
        if request.params.n > 1:
            self._groups[request.request_id] = _Group(request.params.n, {0: request})
        self.scheduler.add_request(request)

    def _prepare(self, request: Request) -> None:
        request.sampling_state = SamplingState(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=None,
        )
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)

    def abort_request(self, request_id: str) -> list[CoreOutput]:
        """Abort a request (all its samples) at a step boundary; returns their final outputs.

        Empty when the id is unknown or already finished.
        """
        group = self._groups.pop(request_id, None)
        if group is None:
            request = self.scheduler.abort_request(request_id)
            return [] if request is None else [self._aborted(request, request.group_id, request.index)]
        outputs: list[CoreOutput] = []
        leader = group.members.get(0)
        for index in range(group.n):
            if index in group.finished:
                continue
            member = group.members.get(index)
            if member is not None:
                self.scheduler.abort_request(member.request_id)
            # A sample never forked (the prompt was not computed yet) ends too.
            outputs.append(self._aborted(member or leader, request_id, index))
        return outputs

    def abort_all(self) -> list[CoreOutput]:
        """Abort every unfinished request."""
        group_ids = dict.fromkeys(r.group_id for r in self.scheduler.requests.values())
        outputs: list[CoreOutput] = []
        for group_id in group_ids:
            outputs.extend(self.abort_request(group_id))
        return outputs

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (call between steps); returns the entries dropped."""
        return self.kv.reset_prefix_cache()

    @staticmethod
    def _aborted(request: Request | None, request_id: str, index: int) -> CoreOutput:
        now = time.time()
        if request is not None:
            request.finish_time = now
        return CoreOutput(
            request_id=request_id,
            token_ids=[],
            text="",
            finish_reason="abort",
            first_token_time=None if request is None else request.first_token_time,
            finish_time=now,
            num_preemptions=0 if request is None else request.num_preemptions,
            index=index,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[CoreOutput]:
        """One engine iteration: schedule, run the model, sample, update the requests."""
        plan = self.scheduler.schedule()
        copies = self.kv.commit_step()
        if copies:  # copy-on-write: shared blocks this step writes into
            self.runner.copy_blocks(copies)
        self.stats.preemptions = self.kv.num_preemptions
        if plan.is_empty:
            return []
        batch = scheduled(self.scheduler, plan)
        inputs = self.runner.prepare(batch, {r.request_id: self.kv.block_table(r.request_id) for r, _ in batch})
        logits = self.runner.execute(inputs)
        tokens = _StepTokens(self, inputs.sampled, logits)
        result = apply_step(self.scheduler, plan, tokens.sample, tokens.check_stop)
        self._count(result)
        return self._outputs(result, tokens)

    def _fork_samples(self, sampled: list[Request]) -> tuple[list[Request], list[int]]:
        """Add samples ``1 .. n-1`` of every ``n > 1`` request that just computed its prompt."""
        requests = list(sampled)
        rows = list(range(len(sampled)))
        for row, request in enumerate(sampled):
            for child in fork_samples(self.kv, request):
                self._prepare(child)
                self._groups[request.request_id].members[child.index] = child
                requests.append(child)
                rows.append(row)
        return requests, rows

    def _count(self, result: StepResult) -> None:
        self.stats.steps += 1
        self.stats.batch_sizes.append(result.num_scheduled)
        self.stats.decode_tokens += result.decode_tokens
        self.stats.prefill_tokens += result.prefill_tokens

    def _outputs(self, result: StepResult, tokens: _StepTokens) -> list[CoreOutput]:
        now = time.time()
        outputs: list[CoreOutput] = []
        for request, token_id in result.sampled:
            outputs.append(self._output(request, token_id, tokens, now))
            if request.status.finished:
                self._group_member_done(request)
        return outputs

    def _group_member_done(self, request: Request) -> None:
        group = self._groups.get(request.group_id)
        if group is None:
            return
        group.finished.add(request.index)
        group.members.pop(request.index, None)
        if len(group.finished) == group.n:
            del self._groups[request.group_id]

    @staticmethod
    def _output(request: Request, token_id: int, tokens: _StepTokens, now: float) -> CoreOutput:
        if request.first_token_time is None:
            request.first_token_time = now
        lp = tokens.logprobs[request]
        out = CoreOutput(
            request_id=request.group_id,
            token_ids=[token_id],
            text=tokens.texts[request],
            logprobs=None if lp is None else [Logprob(lp.token_id, lp.logprob, list(lp.top))],
            first_token_time=request.first_token_time,
            num_preemptions=request.num_preemptions,
            index=request.index,
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
        """Finish ``request`` if ``token_id`` (just appended) stops it: a stop string (``stop_hit``),
        a stop token id or EOS, once it has ``min_tokens``. Length is :func:`apply_step`'s rule."""
        params = request.params
        if request.num_output_tokens < params.min_tokens:
            return
        if stop_hit:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = request.detokenizer.stop_reason if request.detokenizer else None
        elif params.stop_token_ids and token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED


@dataclass
class _StepTokens:
    """One step's token source for :func:`apply_step`: the sampler (with ``n > 1`` forks) and the stop checks.

    Keeps what the outputs need besides each token: its logprobs and its new text.
    """

    core: EngineCore
    rows: list[Request]  # the requests whose logits the runner returned, in row order
    logits: Any  # [len(rows), vocab] float32
    logprobs: dict[Request, TokenLogprobs | None] = field(default_factory=dict)
    texts: dict[Request, str] = field(default_factory=dict)

    def sample(self, caught_up: list[Request]) -> list[tuple[Request, int]]:
        # The runner returned a row for exactly the requests that catch up (decodes first).
        assert len(caught_up) == len(self.rows)
        requests, rows = self.core._fork_samples(self.rows)
        # Forked samples draw from their parent's row.
        logits = self.logits if len(requests) == len(self.rows) else self.logits[rows]
        drawn = self.core.sampler(logits, [r.sampling_state for r in requests])
        self.logprobs = dict(zip(requests, drawn.logprobs))
        return list(zip(requests, drawn.token_ids))

    def check_stop(self, request: Request, token_id: int) -> None:
        text, stop_hit = ("", False)
        if request.detokenizer is not None:
            text, stop_hit = request.detokenizer.add(token_id)
        self.texts[request] = text
        self.core._check_stop(request, token_id, stop_hit)


def default_eos_ids(config_eos: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    ids = set(config_eos)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))

