"""The scheduler conformance suite's rules, shipped: the checks every built-in policy passes, for your class.

The whole suite, with the real engine's check, is :mod:`asyncinfer.conformance` (it sits
above the engine; ``schedulers/`` never imports the engine). In any project, with plain
pytest (or no test runner at all)::

    from asyncinfer.conformance import check_scheduler
    from mypkg.policies import ShortestFirst

    def test_shortest_first_conforms():
        report = check_scheduler(ShortestFirst, options={"max_wait": 2.0})
        assert report.preempted > 0  # optional: the tight-memory paths really ran

A failure raises :class:`ContractViolation` (an ``AssertionError``) whose message
says which check, which seed and limits, and which step. The parts here, usable alone:

- :func:`check_schedule` — one ``schedule()`` result against the contract of
  :mod:`asyncinfer.schedulers.base`: budget and ``max_num_seqs``, token counts,
  slots for every scheduled token, running/waiting partitioning the live requests,
  preempted requests back in waiting, progress. (The policy lab checks every
  simulated step with it too.)
- :func:`drive_random_load` — random arrivals (30 requests), random aborts and, at
  the tight :data:`LIMITS`, memory pressure and preemption, without a model (also
  with ``n > 1`` samples forked as the engine forks them and prefix-cache hits): every
  step checked, every request ends (by length or abort), every block comes back,
  and the preemption counts of the plans, the cache and the requests agree.
- :func:`check_flags` — ``uses_priority`` and ``starvation_free`` are declared bools.
- :func:`check_no_starvation` — a scheduler declaring ``starvation_free`` serves the oldest
  request while a stream of new ones outruns its seats.
- :func:`check_rules` — all of the above (the suite without a model).

``check_scheduler``, ``check_matches_fifo``, ``engine_tokens`` and ``tiny_model`` run the
engine or build a model: they are in :mod:`asyncinfer.conformance` (importing them from here
still works, with a ``DeprecationWarning`` that says where they are now).

The checks construct your scheduler through the registry exactly as the engine
does (a class, a registered or entry-point name, or ``"module:Class"``, with
``options`` as ``scheduler_options``). Like all of ``schedulers/``, this module
imports neither torch nor the engine.
"""

from __future__ import annotations

import importlib
import random
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import AsyncInferError, exception_text
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig, SchedulerOutput, count_type_fault
from asyncinfer.schedulers.registry import create_scheduler
from asyncinfer.step import ENDS_ENGINE, apply_step, fork_samples

__all__ = [
    "LIMITS",
    "ConformanceReport",
    "ContractViolation",
    "LoadReport",
    "check_flags",
    "check_no_starvation",
    "check_rules",
    "check_schedule",
    "drive_random_load",
]

SchedulerSpec = str | type[Scheduler]

#: (num_blocks, block_size, max_num_seqs, max_num_batched_tokens): roomy, tight memory, tiny budget.
LIMITS: tuple[tuple[int, int, int, int], ...] = ((256, 4, 8, 64), (26, 4, 6, 48), (40, 2, 3, 7))


#: The invariants of the contract, numbered and named as docs/schedulers.md ("The contract") has them.
INVARIANTS: dict[int, str] = {1: "budget", 2: "each scheduled request", 3: "progress", 4: "no starvation",
                              5: "nothing lost", 6: "no queued request holds blocks"}
LIMIT_NAMES = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")


def limits_text(limits: tuple[int, int, int, int]) -> str:
    """``(256, 4, 8, 64)`` as ``num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64``."""
    return ", ".join(f"{name}={value}" for name, value in zip(LIMIT_NAMES, limits))


def _hint(exc: BaseException) -> str:
    """What a plugin's AttributeError or TypeError usually means."""
    if isinstance(exc, (AttributeError, TypeError)):
        return " (do its methods keep the base class's signatures?)"
    return ""


def _rule(number: int) -> str:
    return f"invariant {number} ({INVARIANTS[number]}): "


class ContractViolation(AssertionError):
    """A scheduler broke the contract of :mod:`asyncinfer.schedulers.base`; the message names the
    invariant by its number and name in docs/schedulers.md (``invariant 1 (budget): ...``)."""


def check_schedule(sched: Scheduler, plan: SchedulerOutput, where: str = "") -> None:
    """Check one ``schedule()`` result against the contract; raise :class:`ContractViolation` if broken.

    Call it right after ``schedule`` and before the step is applied.
    """
    where = where or type(sched).__name__
    if not isinstance(plan, SchedulerOutput):
        raise ContractViolation(f"{where}: schedule() returned {type(plan).__name__}, not a SchedulerOutput")
    if not isinstance(plan.num_scheduled_tokens, Mapping):  # as the engine refuses it (read as one: AttributeError)
        raise ContractViolation(f"{where}: schedule() returned a SchedulerOutput whose num_scheduled_tokens is "
                                f"{type(plan.num_scheduled_tokens).__name__}, not a dict of request ids to token counts")
    cfg = sched.config
    scheduled = {}
    for rid, n in plan.num_scheduled_tokens.items():  # counts by type first (the engine's rule), then as plain ints
        fault = count_type_fault(rid, n)
        if fault is not None:
            raise ContractViolation(f"{where}: {_rule(2)}{fault}")
        scheduled[rid] = int.__index__(n)  # an int subclass is held to the int it holds, as the engine reads it
    total = sum(scheduled.values())
    if total > cfg.max_num_batched_tokens:
        raise ContractViolation(f"{where}: {_rule(1)}{total} tokens > max_num_batched_tokens={cfg.max_num_batched_tokens}")
    if len(scheduled) > cfg.max_num_seqs or sched.num_running > cfg.max_num_seqs:
        raise ContractViolation(f"{where}: {_rule(1)}more than max_num_seqs={cfg.max_num_seqs} requests")
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    if running & waiting or running | waiting != set(sched.requests) or len(sched.waiting) != len(waiting):
        raise ContractViolation(f"{where}: {_rule(5)}running/waiting do not partition the live requests")
    if set(plan.preempted) & set(scheduled) or not set(plan.preempted) <= waiting:
        raise ContractViolation(f"{where}: {_rule(2)}a preempted request is scheduled or not back in waiting")
    bs = sched.kv.block_size
    for rid, n in scheduled.items():
        request = sched.requests.get(rid)
        if request is None or rid not in running:
            raise ContractViolation(f"{where}: {_rule(2)}{rid} is scheduled but not running")
        if not 1 <= n <= request.num_uncomputed_tokens:
            raise ContractViolation(f"{where}: {_rule(2)}{rid} scheduled for {n} of {request.num_uncomputed_tokens} tokens")
        if len(sched.kv.block_table(rid)) * bs < request.num_computed_tokens + n:
            raise ContractViolation(f"{where}: {_rule(2)}{rid} has no slots for its tokens")
    if plan.is_empty and sched.has_unfinished_requests():
        raise ContractViolation(
            f"{where}: {_rule(3)}scheduled nothing with {sched.num_running} running and {sched.num_waiting} waiting requests"
        )


# --------------------------------------------------------------------------- without a model


class _SimClock:
    """The simulated time a scheduler under test reads as its ``clock``: ``now`` seconds, moved on by the check."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class LoadReport:
    """What one :func:`drive_random_load` run went through."""

    steps: int
    preempted: int
    aborted: int
    finished: int
    forked: int = 0  # samples forked (``samples=True``)
    prefix_hits: int = 0  # prompt tokens the prefix cache served (``samples=True``)


def drive_random_load(
    scheduler: SchedulerSpec,
    seed: int,
    limits: tuple[int, int, int, int] = LIMITS[1],
    options: Mapping[str, Any] | None = None,
    *,
    num_requests: int = 30,
    max_model_len: int = 48,
    max_steps: int = 20_000,
    samples: bool = False,
) -> LoadReport:
    """Random arrivals and aborts through ``schedule``, every step checked; see the module docstring.

    Requests arrive over the first 60 steps with prompts of 1-29 tokens and
    ``max_tokens`` up to what fits ``max_model_len``; ids are ``"<tenant>/<n>"``
    (tenants "a" and "b") and priorities 0-3, so per-tenant and priority policies
    have something to work on. Each step a live request is aborted with
    probability 0.04. The simulated clock advances 0.05 s a step.

    ``samples=True``: requests of up to 3 samples (``n``), forked as the engine
    forks them (they join the running set holding the prompt's blocks), and
    prompts that mostly start with one shared system prompt, with prefix caching
    on; forked samples must stay within ``max_num_seqs`` and no queued request
    may hold blocks.

    Raises:
        ContractViolation: a broken invariant, a lost request, a block not given
            back, disagreeing preemption counts, or no end after ``max_steps`` steps.
    """
    num_blocks, block_size, max_seqs, budget = limits
    where = f"{getattr(scheduler, '__name__', scheduler)} (seed {seed}, limits {limits_text(limits)})"
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, watermark=0.05, enable_prefix_caching=samples)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    sched = _construct(scheduler, config, kv, options)
    clock = sched.clock = _SimClock()
    arrivals = sorted((rng.randrange(60), i) for i in range(num_requests))
    added: list[Request] = []
    ended: dict[str, str] = {}
    system = [rng.randrange(3, 300) for _ in range(12)]
    forks: list[Request] = []
    preempted = aborted = step = 0

    def call(what: str, method: Any, *args: Any) -> Any:
        """One call into the scheduler; its own exception is named with the seed, limits and step that replay it."""
        try:
            return method(*args)
        except (ContractViolation, *ENDS_ENGINE):
            raise
        except BaseException as exc:  # a class of the plugin's own or asyncio.CancelledError included
            raise ContractViolation(f"{where} step {step}: {what} raised {exception_text(exc)}{_hint(exc)}") from exc

    def sample(caught_up: list[Request]) -> list[tuple[Request, int]]:
        pairs = []
        for request in caught_up:
            pairs.append((request, 5))
            for child in fork_samples(kv, request):  # as the engine: samples share the prompt's blocks
                added.append(child)
                forks.append(child)
                pairs.append((child, 5))
        return pairs

    while arrivals or sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            size = rng.randrange(1, min(30, max_model_len))
            shared = samples and rng.random() < 0.7
            prompt = [*system, *(rng.randrange(3, 300) for _ in range(size))][:size] if shared else [1] * size
            params = SamplingParams(max_tokens=rng.randrange(1, max_model_len - len(prompt) + 1), ignore_eos=True,
                                    n=rng.choice([1, 1, 2, 3]) if samples else 1)
            added.append(Request(f"{rng.choice('ab')}/{i}", prompt, params, arrival_time=clock.now,
                                 priority=rng.randrange(4)))
            call(f"add_request({added[-1].request_id!r})", sched.add_request, added[-1])
        if sched.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(sched.requests))
            if call(f"abort_request({victim!r})", sched.abort_request, victim).status is not RequestStatus.FINISHED_ABORTED:
                raise ContractViolation(f"{where}: {_rule(5)}abort_request({victim!r}) did not mark it aborted")
            ended[victim] = "abort"
            aborted += 1
        step += 1
        clock.now += 0.05
        if not sched.has_unfinished_requests():
            continue
        plan = call("schedule()", sched.schedule)
        kv.commit_step()
        check_schedule(sched, plan, f"{where} step {step}")
        preempted += len(plan.preempted)
        for request in call("applying the step (finish_requests, add_forked)", apply_step, sched, plan,
                            sample).finished:
            if request.num_output_tokens != request.params.max_tokens:
                raise ContractViolation(f"{where}: {_rule(2)}{request.request_id} finished with "
                                        f"{request.num_output_tokens} of {request.params.max_tokens} tokens")
            ended[request.request_id] = "length"
        if sched.num_running > max_seqs:
            raise ContractViolation(f"{where} step {step}: {_rule(1)}{sched.num_running} running, past max_num_seqs={max_seqs}")
        holding = [r.request_id for r in sched.waiting if kv.block_table(r.request_id)]
        if holding:
            raise ContractViolation(f"{where} step {step}: {_rule(6)}queued requests hold blocks: {holding}")
        if step >= max_steps:
            raise ContractViolation(f"{where}: {_rule(3)}no end after {max_steps} steps")
    lost = sorted({r.request_id for r in added} - set(ended))
    if lost:
        raise ContractViolation(f"{where}: {_rule(5)}requests lost (never finished nor aborted): {lost}")
    if kv.num_free_blocks != num_blocks or sched.requests:
        raise ContractViolation(f"{where}: {_rule(5)}{num_blocks - kv.num_free_blocks} blocks not given back at the end")
    if not kv.num_preemptions == preempted == sum(r.num_preemptions for r in added):
        raise ContractViolation(f"{where}: preemptions disagree: plans {preempted}, cache {kv.num_preemptions}, "
                                f"requests {sum(r.num_preemptions for r in added)}")
    return LoadReport(step, preempted, aborted, len(ended) - aborted, len(forks), kv.num_prefix_hits)


def _construct(scheduler: SchedulerSpec, config: SchedulerConfig, kv: KVCacheManager,
               options: Mapping[str, Any] | None) -> Scheduler:
    """``create_scheduler`` as every check calls it: a bad spec or option is the registry's
    :class:`InvalidParameterError`; anything else the constructor raises (any ``BaseException`` but
    :data:`~asyncinfer.step.ENDS_ENGINE`'s, a class of the plugin's own or ``asyncio.CancelledError`` included)
    is the plugin's fault, a :class:`ContractViolation` naming it (it went through bare, as the plugin raised it)."""
    try:
        return create_scheduler(scheduler, config, kv, options)
    except (AsyncInferError, *ENDS_ENGINE):  # a bad spec or option, named (InvalidParameterError); or the process ends
        raise
    except BaseException as exc:  # e.g. a plain ValueError for an option: the plugin's fault
        name = getattr(scheduler, "__name__", scheduler)
        raise ContractViolation(f"{name} cannot be constructed as the engine constructs it "
                                f"(scheduler(config, kv, **options)): its constructor raised {exception_text(exc)} "
                                f"with options {dict(options or {})} (a bad option is an InvalidParameterError "
                                "naming it)") from exc


def check_flags(scheduler: SchedulerSpec, options: Mapping[str, Any] | None = None) -> type[Scheduler]:
    """The class's ``uses_priority`` and ``starvation_free`` are declared as bools; returns the class."""
    cls = type(_construct(scheduler, SchedulerConfig(), KVCacheManager(8, 4), options))
    for flag in ("uses_priority", "starvation_free"):
        if not isinstance(getattr(cls, flag, None), bool):
            raise ContractViolation(f"{cls.__name__}.{flag} must be declared True or False")
    return cls


def check_no_starvation(
    scheduler: SchedulerSpec, options: Mapping[str, Any] | None = None, *, steps: int = 2000
) -> int | None:
    """A scheduler that declares ``starvation_free`` serves an old request while new ones keep coming.

    Two seats, and one new short request every step (more than two seats can serve,
    so the queue only grows) for ``steps`` simulated steps of 0.05 s; the request that
    arrived first (a longer prompt, twice: with the lowest and with the highest
    priority) must finish before the arrivals stop. Returns the latest step at which
    one finished, or None when the scheduler declares ``starvation_free = False``.

    Raises:
        ContractViolation: the first request was still unfinished when the arrivals stopped.
    """
    latest = 0
    for victim_priority, others in ((3, 0), (0, 3)):
        kv = KVCacheManager(4096, 4, watermark=0.0)
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
        sched = _construct(scheduler, config, kv, options)
        if not sched.starvation_free:
            return None
        clock = sched.clock = _SimClock()
        first = Request("first", [1] * 24, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0,
                        priority=victim_priority)
        sched.add_request(first)
        for i in range(4):  # the seats are contested from the start
            sched.add_request(Request(f"early/{i}", [2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                      arrival_time=0.0, priority=others))
        for step in range(1, steps + 1):
            sched.add_request(Request(f"new/{step}", [2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                      arrival_time=clock.now, priority=others))
            clock.now += 0.05
            apply_step(sched, sched.schedule(), 5)
            if first.status.finished:
                latest = max(latest, step)
                break
        else:
            name = getattr(scheduler, "__name__", scheduler)
            raise ContractViolation(
                f"{name}: {_rule(4)}it declares starvation_free but the first request (priority {victim_priority}, "
                f"newer ones {others}) was still {first.status.name.lower()} after {steps} steps of new arrivals; age it, "
                "or declare starvation_free = False")
    return latest


# --------------------------------------------------------------------------- all of it


@dataclass(frozen=True)
class ConformanceReport:
    """What :func:`check_rules` (or :func:`asyncinfer.conformance.check_scheduler`) ran: the load runs'
    totals and the engine run's preemptions (None without it)."""

    scheduler: str
    load_runs: int
    steps: int
    preempted: int
    aborted: int
    engine_preemptions: int | None


def check_rules(
    scheduler: SchedulerSpec,
    options: Mapping[str, Any] | None = None,
    *,
    seeds: Iterable[int] = range(4),
    limits: Iterable[tuple[int, int, int, int]] = LIMITS,
) -> ConformanceReport:
    """The suite without a model: flags, :func:`drive_random_load` for every seed and limit (with
    and without parallel samples and prefix hits) and :func:`check_no_starvation`.
    ``engine_preemptions`` is None: :func:`asyncinfer.conformance.check_scheduler` adds the engine check.

    Raises:
        ContractViolation: the first check that failed, with what, where and when.
        InvalidParameterError: ``scheduler`` or ``options`` cannot be constructed.
    """
    cls = check_flags(scheduler, options)
    try:
        runs = [drive_random_load(scheduler, seed, lim, options, samples=samples)
                for seed in seeds for lim in limits for samples in (False, True)]
        check_no_starvation(scheduler, options)
    except (ContractViolation, AsyncInferError, *ENDS_ENGINE):
        raise
    except BaseException as exc:  # the plugin's own fault in a hook: named as its, never bare
        # (a constructor without super().__init__(config, kv) is refused when built: create_scheduler)
        raise ContractViolation(f"{cls.__name__} failed while scheduling: {exception_text(exc)}{_hint(exc)}") from exc
    return ConformanceReport(cls.__name__, len(runs), sum(r.steps for r in runs), sum(r.preempted for r in runs),
                             sum(r.aborted for r in runs), None)


#: The names that drive the engine, and where they are (asyncinfer.conformance, above the engine).
_MOVED = ("check_scheduler", "check_matches_fifo", "engine_tokens", "tiny_model", "ENGINE_OPTIONS")


def __getattr__(name: str) -> Any:
    """The old names stay importable from here, resolved on first access (so importing this module never
    imports the engine), with a DeprecationWarning naming the new place."""
    if name in _MOVED:
        warnings.warn(f"asyncinfer.schedulers.testing.{name} moved to asyncinfer.conformance (schedulers/ never "
                      f"imports the engine): use 'from asyncinfer.conformance import {name}'", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module("asyncinfer.conformance"), name)
    raise AttributeError(f"module 'asyncinfer.schedulers.testing' has no attribute {name!r}")
