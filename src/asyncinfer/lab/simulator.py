"""Replay a trace through a real scheduler and a real KV cache manager, with modelled step times.

No model runs. Each step is what the engine core does — ``schedule``, then
apply the plan with the core's own :func:`asyncinfer.step.apply_step`:
``num_computed_tokens`` grows, a request that caught up gets a token (always 0
here), finished requests go back through ``finish_requests`` — except that the
step's duration comes from a :class:`StepCostModel` and the clock is simulated.
The scheduler reads that clock (:attr:`Scheduler.clock`), so aging and waiting
times are simulated too. Same trace, same policy, same numbers: it is deterministic.

With ``check=True`` every step is checked against the scheduler contract
(budget, ``max_num_seqs``, token counts, block coverage, no lost request,
progress) by :func:`asyncinfer.schedulers.testing.check_schedule`, and a breach
raises its :class:`ContractViolation`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager, blocks_for
from asyncinfer.config import MAX_BLOCK_SIZE, check_int
from asyncinfer.errors import AsyncInferError, ConfigurationError, InvalidParameterError, exception_text
from asyncinfer.lab.cost import StepCostModel, StepShape, load_cost_model
from asyncinfer.lab.trace import TraceRequest
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig, SchedulerOutput
from asyncinfer.schedulers.registry import create_scheduler, resolve_scheduler
from asyncinfer.schedulers.testing import ContractViolation, check_schedule
from asyncinfer.step import ENDS_ENGINE, apply_step, scheduled


@dataclass
class RequestRecord:
    """What happened to one trace request (times in simulated seconds)."""

    id: str
    arrival: float
    prompt_len: int
    output_len: int
    priority: int
    first_scheduled: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0  # the request's own count (Request.num_preemptions), set when it finishes

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float:
        assert self.token_times
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        assert self.finish is not None
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (``None`` for a single token)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def wait(self) -> float:
        """Seconds from arrival until the request first ran."""
        assert self.first_scheduled is not None
        return self.first_scheduled - self.arrival

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True)
class StepRecord:
    """One simulated step. ``decodes`` counts the scheduled requests that decode
    (:attr:`Request.is_decode`), ``prefill_tokens`` every other scheduled token.
    ``decode_keys`` is the padded work of the batched decode attention (every
    one-token query, see :class:`StepShape`), ``decode_context`` the part of it that
    is real context (the rest is padding to the longest one)."""

    start: float
    duration: float
    num_seqs: int
    decodes: int
    prefill_tokens: int
    preempted: int
    decode_keys: int
    decode_context: int


@dataclass
class SimResult:
    scheduler: str
    records: list[RequestRecord]
    steps: list[StepRecord]

    @property
    def makespan(self) -> float:
        start = min(r.arrival for r in self.records)
        return max(r.finish for r in self.records if r.finish is not None) - start


#: The most KV blocks a simulated cache holds (about 256 MiB of the lab's block objects; 16M tokens of 16-token blocks).
MAX_SIM_BLOCKS = 2**20


def simulate(
    trace: Sequence[TraceRequest],
    scheduler: str | type[Scheduler] = "fifo",
    *,
    cost_model: StepCostModel | None = None,
    config: SchedulerConfig | None = None,
    num_blocks: int = 4096,
    block_size: int = 16,
    watermark: float = 0.01,
    enable_prefix_caching: bool = True,
    options: Mapping[str, Any] | None = None,
    check: bool = True,
    max_steps: int = 5_000_000,
) -> SimResult:
    """Replay ``trace`` through ``scheduler`` and return every request's timeline.

    The KV cache is set up as the engine's is by default (``watermark``, prefix
    caching on); every request's prompt is distinct, so prefix hits come only
    from a preempted request finding its own blocks still cached. A ``config``
    without ``decode_padding`` gets the one the cost model counts (SDPA's).

    Raises:
        InvalidParameterError: a request longer than ``max_model_len``, bad scheduler options, ``num_blocks``
            outside 1 to :data:`MAX_SIM_BLOCKS` or ``block_size`` outside the engine's 1 to 256.
        ConfigurationError: the cache cannot hold one ``max_model_len`` request.
        ContractViolation: ``check`` found a broken invariant, the replay made no progress, or the
            scheduler's constructor (other than with an ``InvalidParameterError``) or ``schedule()`` raised
            (chained as the cause).
    """
    # the cache is a Python object a block: a billion blocks were 200 GB, killed by the OOM killer
    check_int("num_blocks", num_blocks, 1, MAX_SIM_BLOCKS)
    check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)  # the engine's range
    config = config or SchedulerConfig(max_model_len=4096, max_num_seqs=128, max_num_batched_tokens=1024)
    if config.decode_padding is None:  # the policies see the padding the cost model counts
        config = replace(config, decode_padding=StepShape.decode_padding)
    cost_model = cost_model or load_cost_model()
    if blocks_for(config.max_model_len, block_size) > num_blocks:
        raise ConfigurationError(f"{num_blocks} blocks of {block_size} cannot hold one "
                                 f"max_model_len={config.max_model_len} request")
    if not trace:
        raise InvalidParameterError("trace", [], "at least one request")
    for t in trace:
        if t.prompt_len >= config.max_model_len:
            raise InvalidParameterError(
                "trace", t.id, f"prompts shorter than max_model_len={config.max_model_len} (request {t.id!r} has "
                f"prompt_len={t.prompt_len})")
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark, enable_prefix_caching=enable_prefix_caching)
    try:
        sched = create_scheduler(scheduler, config, kv, options)
    except AsyncInferError:
        raise
    except ENDS_ENGINE:
        raise
    except BaseException as exc:  # the contract: a bad option is an InvalidParameterError naming it
        raise ContractViolation(
            f"{resolve_scheduler(scheduler).__name__} at construction: its constructor raised {exception_text(exc)} "
            f"with options {dict(options or {})} (a bad option is an InvalidParameterError naming it)") from exc
    sim = _Replay(sched, cost_model, check)
    try:
        sched.clock = lambda: sim.now  # type: ignore[method-assign]
    except ENDS_ENGINE:
        raise
    except BaseException as exc:  # a read-only property of the plugin's (AttributeError), or its own __setattr__
        raise ContractViolation(
            f"{type(sched).__name__}: its clock cannot be set ({exception_text(exc)}); the lab replaces "
            "Scheduler.clock with simulated time, so a plugin reads the clock through it and leaves it assignable "
            "(docs/schedulers.md)") from exc
    pending = sorted(trace, key=lambda t: t.arrival)
    records = {t.id: RequestRecord(t.id, t.arrival, t.prompt_len, t.output_len, t.priority) for t in pending}
    if len(records) != len(pending):
        raise InvalidParameterError("trace", "ids", "unique request ids")
    sim.records = records
    name = type(sched).__name__  # every ContractViolation's text starts with it (the CLI reads it from there)
    added: list[RequestRecord] = []

    def unfinished() -> bool:
        """The plugin's ``has_unfinished_requests()``, held to the requests it was given: one that raised, or
        answered False while some had not finished, ended the replay with an internal error (an IndexError past
        the trace's last arrival) or a count of blocks not returned, named as no scheduler's fault."""
        try:
            busy = bool(sched.has_unfinished_requests())
        except ENDS_ENGINE:
            raise
        except BaseException as exc:
            raise ContractViolation(f"{name} at step {len(sim.steps)} ({sim.now:.3f}s): has_unfinished_requests() "
                                    f"raised {exception_text(exc)}") from exc
        if not busy:
            left = [r.id for r in added if r.finish is None]
            if left:
                shown = ", ".join(map(repr, left[:5])) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
                raise ContractViolation(f"{name} at step {len(sim.steps)} ({sim.now:.3f}s): invariant 5 (nothing "
                                        f"lost): has_unfinished_requests() answered False with {len(left)} "
                                        f"unfinished: {shown}")
        return busy

    i = 0
    while i < len(pending) or unfinished():
        if len(sim.steps) >= max_steps:
            raise ContractViolation(f"{name}: invariant 3 (progress): no end after {max_steps} steps")
        while i < len(pending) and pending[i].arrival <= sim.now:
            try:
                sched.add_request(_make_request(pending[i], i))
            except ENDS_ENGINE:
                raise
            except BaseException as exc:  # a plugin's hook (OrderedScheduler's key_of, say), as schedule() below
                raise ContractViolation(
                    f"{type(sched).__name__} at step {len(sim.steps)} ({sim.now:.3f}s): add_request({pending[i].id!r}) "
                    f"raised {exception_text(exc)}") from exc
            added.append(records[pending[i].id])
            i += 1
        if not unfinished():
            sim.now = pending[i].arrival
            continue
        sim.step()
    kept = kv.num_blocks - kv.num_free_blocks
    if check and kept:
        raise ContractViolation(f"{name}: invariant 5 (nothing lost): {kept} block{'s' if kept > 1 else ''} not "
                                "returned at the end")
    return SimResult(scheduler if isinstance(scheduler, str) else scheduler.__name__, list(records.values()),
                     sim.steps)


def _make_request(t: TraceRequest, index: int) -> Request:
    # Token values only matter to the prefix cache's hashes: distinct per request.
    first = (index + 1) << 20
    return Request(
        request_id=t.id,
        prompt_token_ids=list(range(first, first + t.prompt_len)),
        params=SamplingParams(max_tokens=t.output_len, ignore_eos=True),
        arrival_time=t.arrival,
        priority=t.priority,
    )


class _Replay:
    """The simulated core: one ``step`` = schedule, check, advance the clock, apply."""

    def __init__(self, sched: Scheduler, cost: StepCostModel, check: bool) -> None:
        self.sched = sched
        self.cost = cost
        self.check = check
        self.now = 0.0
        self.steps: list[StepRecord] = []
        self.records: dict[str, RequestRecord] = {}

    def step(self) -> None:
        sched = self.sched
        try:
            plan = sched.schedule()
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # a plugin's bug: the contract says schedule() never raises (lack of memory included)
            raise ContractViolation(f"{type(sched).__name__} at step {len(self.steps)} ({self.now:.3f}s): schedule() "
                                    f"raised {exception_text(exc)}") from exc
        sched.kv.commit_step()  # as the core does: this step's blocks now count as computed
        where = f"{type(sched).__name__} at step {len(self.steps)} ({self.now:.3f}s)"
        if self.check or not isinstance(plan, SchedulerOutput) or plan.is_empty:
            try:
                check_schedule(sched, plan, where)
            except ContractViolation:
                raise
            except ENDS_ENGINE:
                raise
            except BaseException as exc:  # what the check reads is the plugin's (num_running, its queues): its fault
                raise ContractViolation(f"{where}: reading its plan and queues raised {exception_text(exc)}") from exc
        batch = scheduled(sched, plan)
        shape = StepShape.from_batch(((r.num_computed_tokens, n, r.num_tokens) for r, n in batch), sched.kv.block_size)
        # The real context of the batched decode attention (one-token queries), beside shape.decode_keys.
        decode_context = sum(r.num_computed_tokens + 1 for r, n in batch if n == 1)
        start = self.now
        self.now += self.cost.cost(shape)
        for request, _ in batch:
            record = self.records[request.request_id]
            if record.first_scheduled is None:
                record.first_scheduled = start
        try:
            result = apply_step(sched, plan, 0)
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # a plugin's hook (finish_requests, add_forked), as schedule() above
            raise ContractViolation(f"{type(sched).__name__} at step {len(self.steps)} ({start:.3f}s): applying the "
                                    f"step (its finish_requests and add_forked hooks) raised {exception_text(exc)}") from exc
        for request, _ in result.sampled:
            self.records[request.request_id].token_times.append(self.now)
        for request in result.finished:
            record = self.records[request.request_id]
            record.finish = self.now
            record.preemptions = request.num_preemptions
        self.steps.append(StepRecord(start, self.now - start, len(batch), result.decode_tokens, result.prefill_tokens,
                                     len(plan.preempted), shape.decode_keys, decode_context))
