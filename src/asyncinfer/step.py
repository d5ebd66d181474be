"""Applying one step's results: the part that the engine core, the policy lab and the tests share.

After ``schedule()``, ``kv.commit_step()`` and the forward pass, every driver
of a scheduler does the same: advance each scheduled request's
``num_computed_tokens`` by its count, give the requests that caught up with all
their known tokens a token, finish those that reached their length, and hand
the finished ones to ``scheduler.finish_requests``, and the ``n > 1`` samples
forked in the step to ``scheduler.add_forked``. :func:`apply_step` is that,
once (and :func:`fork_samples` the forking). What differs is where the tokens come from (the sampler in the core, a
constant in the lab and the tests) and which stops there are besides length
(the core's stop strings, stop token ids, EOS and ``min_tokens``): the caller
passes those in.

Why a module of its own, at the top of the package: the core imports the runner
(torch), so the lab cannot import the core; ``schedulers/`` holds policies, and
applying a step is what the caller of a policy does, not the policy. This
module imports only :mod:`asyncinfer.request` (and the scheduler types for
annotations), so the core, the lab and the tests import it without cycles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncinfer.request import Request, RequestStatus, sample_id

if TYPE_CHECKING:
    from asyncinfer.cache.kv_manager import KVCacheManager
    from asyncinfer.schedulers.base import Scheduler, SchedulerOutput

#: ``sample(caught_up) -> [(request, token_id), ...]``: see :func:`apply_step`.
TokenSource = Callable[[list[Request]], Iterable[tuple[Request, int]]]
#: ``check_stop(request, token_id)``: may finish the request that just got ``token_id``.
StopCheck = Callable[[Request, int], object]
#: ``isolate(request, hook, exc)``: the scheduler's per-request ``hook`` raised ``exc`` for ``request``.
FaultSink = Callable[[Request, str, BaseException], object]

#: What fault isolation never catches: the interpreter's own exit and interrupt. Raised on the engine
#: thread (a plugin calling ``sys.exit()``), they end it, and every waiter gets ``EngineDeadError`` with
#: the cause chained. Anything else raised for one request, a ``BaseException`` subclass of a plugin's
#: own or ``asyncio.CancelledError`` included (the engine thread is no asyncio task: the engine stops it
#: with a command, never by cancelling), is that request's fault; raised in a step, that step's.
ENDS_ENGINE: tuple[type[BaseException], ...] = (SystemExit, KeyboardInterrupt)


@dataclass
class StepResult:
    """What :func:`apply_step` did, for counters and records."""

    num_scheduled: int = 0
    decode_tokens: int = 0  # tokens of scheduled requests that were decodes (Request.is_decode)
    prefill_tokens: int = 0  # every other scheduled token: prompts, chunks, recomputation
    sampled: list[tuple[Request, int]] = field(default_factory=list)  # each request that got a token, with it
    finished: list[Request] = field(default_factory=list)  # handed to scheduler.finish_requests
    mask_seconds: float = 0.0  # structured requests' grammar time in the step (set by the engine core; 0 elsewhere)


def scheduled(scheduler: Scheduler, plan: SchedulerOutput) -> list[tuple[Request, int]]:
    """``plan`` as ``[(request, num_new_tokens)]``, in execution order.

    A request scheduled for the first time gets its ``scheduled_time`` here, on
    ``scheduler.clock`` (the clock of its ``arrival_time``): the driver calls this
    right after ``schedule()`` returned, so that is when its wait in the queue ended.
    """
    batch = [(scheduler.requests[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
    now: float | None = None
    for request, _ in batch:
        if request.scheduled_time is None:
            if now is None:
                now = scheduler.clock()
            request.scheduled_time = now
    return batch


def advance(batch: Iterable[tuple[Request, int]]) -> list[Request]:
    """Count each request's scheduled tokens as computed; returns those that caught up with all their tokens."""
    caught_up = []
    for request, n in batch:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            caught_up.append(request)
    return caught_up


def apply_step(
    scheduler: Scheduler,
    plan: SchedulerOutput,
    sample: TokenSource | int,
    check_stop: StopCheck | None = None,
    *,
    isolate: FaultSink | None = None,
) -> StepResult:
    """Apply the executed step ``plan`` to its requests and to ``scheduler``.

    Call it after ``scheduler.schedule()`` returned ``plan``, after
    ``kv.commit_step()`` and after the forward pass. In order:

    1. count the step's decode and prefill tokens (:attr:`Request.is_decode`, asked before 2);
    2. advance every scheduled request's ``num_computed_tokens`` by its count;
    3. give a token to each request that caught up with all its known tokens:
       ``sample(caught_up)`` returns ``(request, token_id)`` pairs, one for
       each of them in any order, plus any request the caller adds (the core's
       forked ``n > 1`` samples); an int gives every caught-up request that
       token. ``sample`` is not called when none caught up;
    4. append each token to its request; then ``check_stop(request, token_id)``,
       if given, may finish the request (set a finished status); if it did
       not, the request finishes with ``FINISHED_LENGTH`` once it has
       ``params.max_tokens`` output tokens or ``scheduler.config.max_model_len`` tokens;
    5. hand the finished requests to ``scheduler.finish_requests`` (also when none finished);
    6. hand every forked sample that got a token and did not finish (a request with a
       ``parent_id`` that the scheduler does not hold yet) to ``scheduler.add_forked``: it
       holds blocks, so it joins the running set rather than the back of the queue.

    ``isolate``: without it, an exception from the scheduler's ``finish_requests`` or
    ``add_forked`` propagates. With it (the engine core), a fault of those per-request hooks
    (any exception but :data:`ENDS_ENGINE`'s) is attributed to its request: ``add_forked`` is called per request already, and a
    ``finish_requests`` call that raised is made again one request at a time; each request
    whose own call raises goes to ``isolate(request, hook, exc)``, and the update carries on
    for the others.
    """
    batch = scheduled(scheduler, plan)
    result = StepResult(num_scheduled=len(batch))
    for request, n in batch:
        if request.is_decode:
            result.decode_tokens += n
        else:
            result.prefill_tokens += n
    caught_up = advance(batch)
    if caught_up:
        result.sampled = list(_tokens(sample, caught_up))
    max_model_len = scheduler.config.max_model_len
    for request, token_id in result.sampled:
        request.output_token_ids.append(token_id)
        if check_stop is not None:
            check_stop(request, token_id)
        if not request.status.finished and (
            request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.status.finished:
            result.finished.append(request)
    _finish(scheduler, result.finished, isolate)
    for request, _ in result.sampled:
        if request.parent_id is not None and not request.status.finished and request.request_id not in scheduler.requests:
            if isolate is None:
                scheduler.add_forked(request)
                continue
            try:
                scheduler.add_forked(request)
                if scheduler.requests.get(request.request_id) is not request:  # it would never run, never end
                    raise SchedulerHookError(f"add_forked returned without adding {request.request_id!r} to the "
                                             "scheduler's requests")
            except ENDS_ENGINE:
                raise
            except BaseException as exc:  # noqa: BLE001 - attributed to this sample (see isolate)
                isolate(request, "add_forked", exc)
    return result


class SchedulerHookError(RuntimeError):
    """A scheduler's hook returned without doing what the contract asks of it for one request (``add_request`` or
    ``add_forked`` that did not add it to ``requests``): the cause of that request's ``RequestFailedError``."""


def _finish(scheduler: Scheduler, finished: list[Request], isolate: FaultSink | None) -> None:
    """``scheduler.finish_requests(finished)``; with ``isolate``, a call that raised is made again
    one request at a time, and each request whose own call raises is handed to ``isolate``."""
    if isolate is None:
        scheduler.finish_requests(finished)
        return
    try:
        scheduler.finish_requests(finished)
    except ENDS_ENGINE:
        raise
    except BaseException as exc:  # find the request it was about
        if not finished:
            raise  # about no request: a fault of the step
        if len(finished) == 1:
            isolate(finished[0], "finish_requests", exc)
            return
        for request in finished:
            try:
                scheduler.finish_requests([request])
            except ENDS_ENGINE:
                raise
            except BaseException as own:  # noqa: BLE001
                isolate(request, "finish_requests", own)


def fork_samples(kv: KVCacheManager, request: Request) -> list[Request]:
    """Fork the samples ``1 .. n-1`` of ``request`` if it has not yet (else ``[]``).

    Call it when ``request`` has just computed its prompt, before its first token is
    appended: each sample shares its blocks (copy-on-write, :meth:`KVCacheManager.fork`),
    has computed as much, and samples its first token from the same logits row. Give
    them their tokens through :func:`apply_step`'s ``sample``, which hands them to
    the scheduler.
    """
    n = request.params.n
    if not request.num_unforked_samples:
        return []
    request.num_unforked_samples = 0
    children = []
    for index in range(1, n):
        child = Request(
            request_id=sample_id(request.request_id, index),
            prompt_token_ids=request.prompt_token_ids,
            params=request.params.for_sample(index),
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            index=index,
            parent_id=request.request_id,
            num_computed_tokens=request.num_computed_tokens,
            grammar=request.grammar,  # each sample gets its own matcher from it
        )
        kv.fork(request.request_id, child, request.num_computed_tokens)
        children.append(child)
    return children


def _tokens(sample: TokenSource | int, caught_up: list[Request]) -> Iterable[tuple[Request, int]]:
    if isinstance(sample, int):
        return [(request, sample) for request in caught_up]
    return sample(caught_up)
