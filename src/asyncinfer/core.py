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
``index``. Only the user's id is abortable: a sample ends with its request.

Faults, from the narrowest to the widest (docs/reliability.md, "Isolation"):

- *Attributable to one request*: its detokenizer raising (the tokenizer's ``decode``
  on its tokens), a scheduler hook raising for it (``add_request``,
  ``abort_request``, ``finish_requests``, ``add_forked``), or the scheduler dropping it
  from its queues without the engine ending it (:meth:`EngineCore._lost`). That request (all its
  samples) fails alone with ``RequestFailedError`` (the cause chained), a hook's fault
  is logged, the engine removes the request from the base class's queues itself and
  frees its blocks; the step's other requests get their tokens as if nothing happened,
  and such a fault never counts as a failed step.
- *A step*: the forward pass, the sampler or ``schedule`` raising. The step is undone
  by :meth:`EngineCore.fail_step`, which fails the requests of that step (every
  request the scheduler holds when ``schedule`` raised) and leaves the others serving.

Either way the failure is an output (``CoreOutput.error``), never an exception out
of the core's inputs. A fault is any ``BaseException`` but :data:`~asyncinfer.step.ENDS_ENGINE`'s
(``SystemExit``, ``KeyboardInterrupt``), which pass through and end the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.detokenizer import IncrementalDetokenizer, StopMatcher
from asyncinfer.errors import InvalidParameterError, RequestFailedError, exception_text
from asyncinfer.grammar import GrammarCompiler
from asyncinfer.outputs import CoreOutput, Logprob
from asyncinfer.plain import plain_value
from asyncinfer.request import Request, RequestStatus, sample_id
from asyncinfer.runner import ModelOutput, ModelRunner
from asyncinfer.sampler import Sampler, SamplingState, TokenLogprobs
from asyncinfer.schedulers.base import Scheduler, SchedulerOutput, count_type_fault
from asyncinfer.step import ENDS_ENGINE, SchedulerHookError, StepResult, apply_step, fork_samples, scheduled

logger = logging.getLogger("asyncinfer")

#: How often the scheduler's queues are compared request by request even when their counts agree (_unqueued): a
#: request a plugin dropped from them while it put another in both is found within this many seconds.
QUEUE_SCAN_SECONDS = 1.0


class SchedulerPlanError(RuntimeError):
    """A scheduler's plan broke the contract for one request: the cause of that request's ``RequestFailedError``."""

#: How many ids of requests a scheduler planned but does not hold are remembered as logged (logged once each).
MAX_GHOSTS_LOGGED = 1024

#: How many recent steps :attr:`StepStats.batch_sizes` keeps.
BATCH_SIZE_HISTORY = 1024


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
    ``batch_sizes`` holds the number of requests of each of the last
    :data:`BATCH_SIZE_HISTORY` (1024) steps that ran, oldest first: bounded, so that a
    long-running engine does not grow it; ``scheduled_requests / steps`` is the mean
    over every step. ``failed_steps`` counts steps that raised (their requests failed),
    ``idle_steps`` steps that scheduled nothing while requests were unfinished.
    ``mask_seconds``: time spent on structured requests' grammars (computing and applying their
    token masks, advancing their matchers), over ``masked_tokens`` tokens sampled under a grammar.
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    scheduled_requests: int = 0
    failed_steps: int = 0
    idle_steps: int = 0
    mask_seconds: float = 0.0
    masked_tokens: int = 0


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
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # Structured output's compiler for this model's vocabulary (None: a model without a tokenizer).
        self.grammars = grammars
        self.stats = StepStats()
        self._groups: dict[str, _Group] = {}
        # Every request (a sample) handed to the scheduler and not ended yet, by id: a plugin that drops one from its
        # queues without the engine ending it is found at the next step (_lost), never left waiting.
        self._held: dict[str, Request] = {}
        self._next_queue_scan = 0.0  # time.monotonic() from which _unqueued compares the queues one by one again
        self._ghosts_logged: set[Any] = set()  # ids planned but not held, logged once each (_check_plan)
        # The kinds of fault the scheduler's has_unfinished_requests raised, each logged once (asked every pass)
        self._unfinished_faults: set[type[BaseException]] = set()
        self._count_faults: set[type[BaseException]] = set()  # the same for num_running and num_waiting
        # The running step's requests once it is scheduled (None before): what fail_step fails.
        self._batch: list[tuple[Request, int]] | None = None
        # Called on this thread after each step that ran: (batch, inputs, result, perf_counter at its start).
        # asyncinfer.metrics sets it; it must only hand the figures on, never do real work here.
        self.on_step: Callable[[list[tuple[Request, int]], Any, StepResult, float], None] | None = None

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    # ------------------------------------------------------------------ inputs
    def add_request(self, request: Request) -> list[CoreOutput]:
        """Queue a new request (sample 0 of its ``n``); returns ``[]``, or its failure.

        A request the core cannot take fails alone, with one error output per sample
        (:attr:`CoreOutput.error`), never an exception: an id the core holds already
        (its own or a sample's ``"<id>#<i>"``: :class:`InvalidParameterError`), more
        samples than ``max_num_seqs`` (they could never run together: the same), or
        the scheduler raising as it takes it (:class:`RequestFailedError`, cause chained).
        """
        refusal = self._refusal(request)
        if refusal is not None:
            return self._refused(request, refusal)
        if request.params.structured is not None and request.grammar is None:
            try:  # added to the core directly (tests, benchmarks); the engine compiles it off its threads first
                request.grammar = self.compile_grammar(request.params.structured, request.cache_salt)
            except InvalidParameterError as exc:
                return self._refused(request, exc)
        try:
            self._prepare(request)
            if request.params.n > 1:
                self._groups[request.request_id] = _Group(request.params.n, {0: request})
            self._held[request.request_id] = request
            self.scheduler.add_request(request)
            if self.scheduler.requests.get(request.request_id) is not request:  # else it would wait forever
                raise SchedulerHookError(f"add_request returned without adding {request.request_id!r} to the "
                                         "scheduler's requests")
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # noqa: BLE001 - a plugin's fault fails this request only
            self._groups.pop(request.request_id, None)
            _log_fault(f"the scheduler ({type(self.scheduler).__name__}) raised in add_request", request, exc)
            self._drop(request)
            return self._refused(request, _failure(request.request_id, "adding it to the scheduler", exc))
        return []

    def _refusal(self, request: Request) -> InvalidParameterError | None:
        if any(self._holds(sample_id(request.request_id, i)) for i in range(request.params.n)):
            return InvalidParameterError(
                "request_id", request.request_id, "an id whose samples' ids are not in flight in this engine core"
            )
        max_seqs = self.scheduler.config.max_num_seqs
        if request.params.n > max_seqs:
            return InvalidParameterError("n", request.params.n, f"at most max_num_seqs={max_seqs} (samples run together)")
        return None

    def compile_grammar(self, spec: Any, namespace: str | None = None) -> Any:
        """``spec`` (a :class:`~asyncinfer.structured.StructuredOutput`) compiled for this model's vocabulary
        (cached per ``namespace``, a request's ``cache_salt``). Blocking. Raises :class:`InvalidParameterError`
        on ``structured``."""
        if self.grammars is None:
            raise InvalidParameterError("structured", spec.kind, "None: this model has no tokenizer")
        return self.grammars.compile(spec, namespace)

    def _holds(self, rid: str) -> bool:
        """Whether ``rid`` is the id of a sample in this core, forked or still to fork."""
        if rid in self.scheduler.requests or rid in self._groups:
            return True
        parent, sep, _ = rid.rpartition("#")
        group = self._groups.get(parent) if sep else None
        return group is not None and any(sample_id(parent, i) == rid for i in range(1, group.n))

    def _prepare(self, request: Request, stops: StopMatcher | None = None) -> None:
        """Give ``request`` its sampling state and detokenizer (``stops``: its stop strings'
        matcher, when its parent's is shared; else built here from its parameters)."""
        request.sampling_state = SamplingState(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=None,
            matcher=None if request.grammar is None else request.grammar.matcher(),  # its own, per sample
        )
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params, stops=stops
            )

    def abort_request(self, request_id: str) -> list[CoreOutput]:
        """Abort a request (all its samples) at a step boundary; returns their final outputs.

        Each final output carries the text its detokenizer still held back. Empty
        when the id is unknown or already finished, and for a sample's internal id
        (``"<id>#<i>"``): samples end with their request, by the user's id.
        """
        if request_id not in self._groups:
            request = self.scheduler.requests.get(request_id)
            if request is None or request.parent_id is not None:
                return []
        return self._end(request_id)

    def abort_all(self) -> list[CoreOutput]:
        """Abort every unfinished request."""
        return self.fail_all(lambda _: None)

    def fail_all(self, error: Callable[[str], BaseException | None]) -> list[CoreOutput]:
        """End every unfinished request, each with ``error(request_id)`` (``None``: a plain abort)."""
        group_ids = dict.fromkeys(r.group_id for r in self.scheduler.requests.values())
        return [out for group_id in group_ids for out in self._end(group_id, error(group_id))]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (call between steps); returns the entries dropped."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether the scheduler holds work. A plugin's ``has_unfinished_requests`` that raises (or answers with
        something that has no truth value) is logged, once per kind of fault, and answered from the requests the
        scheduler holds (``scheduler.requests``): its fault, asked by the engine thread's loop between steps,
        ended the engine for everyone (``EngineDeadError``)."""
        try:
            return bool(self.scheduler.has_unfinished_requests()) or bool(self._held)
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # a plugin's fault: logged, and the engine serves on
            if type(exc) not in self._unfinished_faults:
                self._unfinished_faults.add(type(exc))
                logger.error("the scheduler (%s) raised in has_unfinished_requests: %s (answered from the requests "
                             "it holds; the engine serves on)", type(self.scheduler).__name__,
                             exception_text(exc), exc_info=exc)
            return bool(self.scheduler.requests) or bool(self._groups) or bool(self._held)

    def queue_counts(self) -> tuple[int, int]:
        """``(running, waiting)`` as the scheduler counts them (``num_running``, ``num_waiting``). A plugin whose
        count raises or is no int is logged, once per kind of fault, and answered from its base queues
        (``running``, ``waiting``): read by ``/metrics`` and by the stall check's message, its fault failed every
        scrape, and, in a stall, ended the engine thread."""
        sched = self.scheduler
        try:
            return int.__index__(sched.num_running), int.__index__(sched.num_waiting)
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # a plugin's fault: logged, and the counts come from its base queues
            if type(exc) not in self._count_faults:
                self._count_faults.add(type(exc))
                logger.error("the scheduler (%s) raised reading num_running or num_waiting: %s (counted from its "
                             "queues; the engine serves on)", type(sched).__name__, exception_text(exc), exc_info=exc)
            return len(sched.running), len(sched.waiting)

    # -------------------------------------------------------------------- step
    def step(self) -> list[CoreOutput]:
        """One engine iteration: schedule, run the model, sample, update the requests.

        If it raises, hand the exception to :meth:`fail_step` before anything else
        touches the core (the engine thread does): that undoes the step and fails its requests.
        """
        started = time.perf_counter()
        self._batch = None
        planned = self.scheduler.schedule()
        lost = self._lost(planned)  # before the plan is read: their samples leave it
        plan, misplanned = self._check_plan(planned, {out.request_id for out in lost})  # misplanned: fail alone
        misplanned = lost + misplanned
        batch = scheduled(self.scheduler, plan)
        copies = self.kv.commit_step()
        self._batch = batch  # from here on a fault fails these requests
        self.stats.preemptions = self.kv.num_preemptions
        if copies:  # copy-on-write: shared blocks this step writes into
            self.runner.copy_blocks(copies)
        if not batch:
            self.stats.idle_steps += 1  # nothing to run: the engine thread backs off and times the stall
            return misplanned
        inputs = self.runner.prepare(batch, {r.request_id: self.kv.block_table(r.request_id) for r, _ in batch})
        tokens = _StepTokens(self, inputs.sampled, self.runner.run(inputs))
        result = apply_step(self.scheduler, plan, tokens.sample, tokens.check_stop, isolate=tokens.hook_failed)
        self._check_finished(result.finished)
        result.mask_seconds = tokens.mask_seconds
        self._switch_rope(result)
        self._count(result)
        outputs = self._outputs(result, tokens)
        if self.on_step is not None:
            self.on_step(batch, inputs, result, started)
        return misplanned + outputs

    def _check_plan(self, plan: SchedulerOutput, ended: set[str] = frozenset()) -> tuple[SchedulerOutput, list[CoreOutput]]:
        """Hold ``plan`` to the contract's rule for each scheduled request (docs/schedulers.md, invariant 2):
        one the scheduler holds, running, ``1 <= n <= its uncomputed tokens`` (an int), with its slots
        allocated. An entry that breaks it is logged and leaves the plan, and its request (all its samples)
        fails alone with :class:`RequestFailedError` (its blocks freed, a slot the step registered for it
        dropped from the prefix cache); an entry naming no request the scheduler holds just leaves the plan.
        So a plugin's wrong count for one request never fails the step, and so its neighbours, nor reaches
        the forward pass. Returns the plan the step runs, a plain copy of the entries that hold (ids and
        counts read as the plain ``str`` and ``int`` they hold, once: an ``int`` subclass whose comparisons
        lie passed the range and ran its real count; the plugin's dict is not read again), and the failed
        requests' final outputs."""
        sched = self.scheduler
        if not isinstance(plan, SchedulerOutput):  # nothing of it can be read: the step fails, naming the plugin
            raise TypeError(f"the scheduler {type(sched).__name__}'s schedule() returned {type(plan).__name__}, not "
                            "a SchedulerOutput (docs/schedulers.md)")
        held = plan.num_scheduled_tokens
        if not isinstance(held, Mapping):  # read as one, it failed as the engine's own AttributeError
            raise TypeError(f"the scheduler {type(sched).__name__}'s schedule() returned a SchedulerOutput whose "
                            f"num_scheduled_tokens is {type(held).__name__}, not a dict of request ids to token "
                            "counts (docs/schedulers.md)")
        pairs = list(dict.items(held) if isinstance(held, dict) else held.items())
        entries = {plain_value(rid): plain_value(n) for rid, n in pairs}
        faults: dict[str, tuple[Request, str]] = {}
        for rid, n in list(entries.items()):
            request = sched.requests.get(rid)
            if request is None and isinstance(rid, str) and (rid in ended or rid.rpartition("#")[0] in ended):
                # a sample of a request failed as lost above: it left the scheduler with it
                del entries[rid]
                continue
            if request is None:
                # Once per id: a plugin that plans the same stray id at every step logged an ERROR line per step.
                level = logging.DEBUG if rid in self._ghosts_logged else logging.ERROR
                if len(self._ghosts_logged) >= MAX_GHOSTS_LOGGED:
                    self._ghosts_logged.clear()
                self._ghosts_logged.add(rid)  # a key of the plan's dict: hashable
                logger.log(level, "the scheduler (%s) planned %r tokens for %r, a request it does not hold: left out"
                           "%s", type(sched).__name__, n, rid,
                           "" if level == logging.DEBUG else " (logged once for this id)")
                del entries[rid]
                self._drop_ghost(rid)
                continue
            fault = self._plan_fault(request, n)
            if fault is not None:
                faults.setdefault(request.group_id, (request, fault))
        outputs: list[CoreOutput] = []
        for group_id, (request, fault) in faults.items():
            exc = SchedulerPlanError(f"the scheduler ({type(sched).__name__}) planned {fault}")
            _log_fault("its scheduler's plan broke the contract", request, exc)
            outputs += self._end(group_id, _failure(group_id, "its scheduler's plan", exc), alone=request)
        if faults:  # its samples left with it
            for rid in [rid for rid in entries if rid not in sched.requests]:
                del entries[rid]
        return SchedulerOutput(entries), outputs

    def _lost(self, planned: object = None) -> list[CoreOutput]:
        """Fail every request the engine handed to the scheduler and never ended that the scheduler lost: one it
        dropped from ``requests``, or one it keeps in ``requests`` but in neither ``running`` nor ``waiting`` and
        does not schedule in ``planned`` (a plugin's ``schedule`` or hook that dropped it from a queue; invariant 5).
        Each is logged, its blocks freed, its whole request failed with :class:`RequestFailedError` (a
        :class:`SchedulerHookError` naming the scheduler as the cause). Such a request never ran again and never
        ended: its caller waited forever (or until the stall timeout), through ``aclose(abort=True)`` too. Costs
        two counts per step (the requests handed over against ``requests``, and ``running`` plus ``waiting``
        against ``requests``); the requests are compared one by one when a count differs, and the queues once every
        :data:`QUEUE_SCAN_SECONDS` (a request dropped while another is in two queues keeps the counts equal)."""
        sched = self.scheduler
        lost = [r for rid, r in self._held.items() if sched.requests.get(rid) is not r] \
            if len(self._held) != len(sched.requests) else []
        unqueued = self._unqueued(planned)
        outputs: list[CoreOutput] = []
        for request, what in [*((r, "its requests") for r in lost), *((r, "its queues") for r in unqueued)]:
            if self._held.get(request.request_id) is not request:  # ended with a sample lost before it
                continue
            exc = SchedulerHookError(f"the scheduler ({type(sched).__name__}) dropped {request.request_id!r} from "
                                     f"{what} without the engine ending it")
            _log_fault("its scheduler lost it", request, exc)
            self._evict(request)
            outputs += self._end(request.group_id, _failure(request.group_id, "its scheduler", exc), alone=request)
        return outputs

    def _unqueued(self, planned: object) -> list[Request]:
        """The requests the engine holds that the scheduler keeps in ``requests`` but in neither ``running`` nor
        ``waiting``, and does not schedule in ``planned``: in no queue it reports, none of them would ever be
        scheduled. Only when ``running`` and ``waiting`` together count other than ``requests`` (a request in
        neither makes them differ unless another is in both, which the conformance suite refuses), and once every
        :data:`QUEUE_SCAN_SECONDS` whatever the counts: a plugin that put one request in both queues while it dropped
        another (the counts equal) left that one waiting behind everybody's traffic, for ever while the engine was
        busy (the stall timeout only runs when nothing is planned)."""
        sched = self.scheduler
        now = time.monotonic()
        if len(sched.running) + len(sched.waiting) == len(sched.requests) and now < self._next_queue_scan:
            return []
        self._next_queue_scan = now + QUEUE_SCAN_SECONDS
        self._drop_stale()
        queued = {id(r) for r in sched.running}
        queued.update(id(r) for r in sched.waiting)
        plan = planned.num_scheduled_tokens if isinstance(planned, SchedulerOutput) else None
        scheduled = plan if isinstance(plan, dict) else {}
        return [r for rid, r in self._held.items()
                if id(r) not in queued and sched.requests.get(rid) is r and not dict.__contains__(scheduled, rid)]

    def _drop_stale(self) -> None:
        """Take out of ``running`` and ``waiting`` every entry that is no request the engine holds (one that has
        ended, kept there a second time by a plugin that put it in both queues): left there, the scheduler had
        unfinished requests for ever, so the engine thread never went idle and ``aclose()`` never returned.
        Logged; the engine serves on."""
        sched = self.scheduler
        for queue in (sched.running, sched.waiting):
            stale = [r for r in queue if not isinstance(r, Request) or self._held.get(r.request_id) is not r]
            if not stale:
                continue
            logger.error("the scheduler (%s) kept %d entries in its queues that are no request the engine holds (ended "
                         "ones, or a second copy of one): taken out (the engine serves on)",
                         type(sched).__name__, len(stale))
            gone = {id(r) for r in stale}
            kept = [r for r in queue if id(r) not in gone]
            queue.clear()  # a list or a deque: both
            queue.extend(kept)

    def _check_finished(self, finished: list[Request]) -> None:
        """Take out of the scheduler's base queues, and free the blocks of, every request of ``finished`` that the
        scheduler still holds after ``finish_requests`` (an override that did not call the base class's for it):
        logged, and the engine serves on. Left there, it held its blocks for good (a plugin that plans no finished
        request never ran into it: the blocks of each such request leaked until none were left for anybody), kept
        its id taken, and kept the engine thread stepping an engine with nothing to do."""
        sched = self.scheduler
        for request in finished:
            rid = request.request_id
            if self._held.get(rid) is request:
                del self._held[rid]
            if self._still_queued(request):
                logger.error("the scheduler (%s) kept finished request %r after finish_requests: taken out of its "
                             "queues and its blocks freed (the engine serves on)", type(sched).__name__, rid)
                self._evict(request)

    def _switch_rope(self, result: StepResult) -> None:
        """Preempt each request of a longrope model that has just grown past the model's original context: its K
        were rotated with the short factors, every token of it rotates with the long ones from now on, so it is
        computed again (as transformers' Phi-3 ``generate()`` computes the whole sequence again at that token;
        :class:`asyncinfer.models.layers.RopeRows`). Counted as a preemption."""
        rows = self.runner.rope_rows
        if not rows.original:
            return
        for request, _ in result.sampled:
            if request.status == RequestStatus.RUNNING and rows.switches(request.num_tokens):
                self.scheduler.preempt(request)

    def _plan_fault(self, request: Request, n: object) -> str | None:
        """What is wrong with a plan's entry of ``n`` tokens for ``request`` (None: nothing)."""
        rid = request.request_id
        fault = count_type_fault(rid, n)
        if fault is not None:
            return fault
        if request.status is not RequestStatus.RUNNING:
            return f"{n} tokens for {rid!r}, which is {request.status.value}, not running"
        uncomputed = request.num_tokens - request.num_computed_tokens
        if not 1 <= n <= uncomputed:
            return f"{n} tokens for {rid!r}, which has {uncomputed} to compute"
        needed, slots = request.num_computed_tokens + n, self.kv.num_slots(rid)
        if slots < needed:
            return f"{n} tokens for {rid!r}, whose allocated slots cover {slots} of the {needed} it needs"
        return None

    def fail_step(self, exc: BaseException) -> list[CoreOutput]:
        """Undo the step that raised ``exc`` and fail its requests; returns their final outputs.

        A fault after ``schedule`` returned (the copies, the forward pass, the sampler,
        the update) fails every user request with a sample in the step's batch, all
        its samples. A fault in ``schedule`` fails every request the scheduler holds:
        its queues may be half updated (blocks it left allocated for an id it does not hold are freed).
        Each failed sample ends with ``finish_reason="abort"`` and a :class:`RequestFailedError` whose cause is
        ``exc``; the requests' blocks are freed, and the prefix-cache entries and
        copy-on-write copies of the step are dropped (:meth:`KVCacheManager.discard_step`).
        Requests the step did not run carry on.
        """
        batch, self._batch = self._batch, None
        self.stats.failed_steps += 1
        self.kv.discard_step(committed=batch is not None)
        if batch is None:
            where = f"the scheduler ({type(self.scheduler).__name__})"
            outputs = self.fail_all(lambda request_id: _failure(request_id, where, exc))
            self._free_strays()
            return outputs
        victims = {request.group_id: request for request, _ in batch}
        return [
            out for request_id, request in victims.items()
            for out in self._end(request_id, _failure(request_id, "the step that ran it", exc), alone=request)
        ]

    # ----------------------------------------------------------------- helpers
    def _drop_ghost(self, rid: Any) -> None:
        """Take out of the scheduler's base queues every request of id ``rid``, which it planned but does not hold,
        and free that id's blocks (:meth:`_free_stray`): a policy admitting from a queue of its own with
        ``allocate_new`` took blocks for a request cancelled while it waited and moved it to ``running`` itself; left
        there, it was planned at every step and never ran, its blocks and seats taken for good (with
        ``max_num_seqs`` taken, nobody else ever ran; pass40). Only on this fault's path: the queues are scanned."""
        sched = self.scheduler
        for queue in (sched.running, sched.waiting):
            for ghost in [r for r in queue if isinstance(r, Request) and r.request_id == rid]:
                queue.remove(ghost)
        if isinstance(rid, str) and self.kv.block_table(rid):
            self._free_stray(rid)

    def _free_strays(self) -> None:
        """Free the blocks of every id that holds a block table but no request of the scheduler (:meth:`_free_stray`):
        a ``schedule()`` that raised after allocating for a request it no longer held (one a queue of its own kept
        after it was aborted) left them allocated for good, as nothing would ever end that id."""
        held = self.scheduler.requests
        for rid in self.kv.request_ids():
            if rid not in held:
                self._free_stray(rid)

    def _free_stray(self, rid: str) -> None:
        """Free the blocks of ``rid``, an id the scheduler does not hold, and log it; blocks another request admitted
        after it in this step shares cannot be freed (``KVCacheManager.free`` raises): logged as such."""
        try:
            self.kv.free(rid)
            outcome = "freed"
        except RuntimeError as exc:
            outcome = f"not freed: {exc}"
        logger.error("the scheduler (%s) left blocks allocated for %r, a request it does not hold: %s",
                     type(self.scheduler).__name__, rid, outcome)

    def _end(self, request_id: str, error: BaseException | None = None, alone: Request | None = None) -> list[CoreOutput]:
        """End every unfinished sample of the user's request ``request_id``, each with one final output.

        Drops its samples from the scheduler and frees their blocks. ``alone``: the
        request itself when it has one sample and the scheduler may no longer hold
        it (it finished in a step that then failed).
        """
        group = self._groups.pop(request_id, None)
        if group is None:
            request = self.scheduler.requests.get(request_id, alone)
            group = _Group(1, {} if request is None else {0: request})
        outputs: list[CoreOutput] = []
        for index in range(group.n):
            if index in group.finished:
                continue
            member = group.members.get(index)  # None: a sample never forked (its prompt had not run)
            if member is not None:
                self._drop(member)
            outputs.append(self._aborted(member, request_id, index, error))
        return outputs

    def _drop(self, request: Request) -> None:
        """Take a request out of the scheduler and free its blocks, wherever it is.

        A scheduler whose ``abort_request`` raises, or returns with the request still queued (an override that
        does not call the base class's), is logged and survived: the request leaves the base class's queues all
        the same (:meth:`_evict`). Left queued, it was scheduled again with its blocks freed: that step failed
        for every request in it, and three such steps ended the engine.
        """
        sched = self.scheduler
        if self._held.get(request.request_id) is request:
            del self._held[request.request_id]
        try:
            held = sched.abort_request(request.request_id) is not None
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # noqa: BLE001 - a plugin's fault for one request: that request only
            _log_fault(f"the scheduler ({type(sched).__name__}) raised in abort_request", request, exc)
            self._evict(request)
            held = True
        else:
            if self._still_queued(request):
                logger.error("the scheduler (%s) kept request %r queued after abort_request: taken out of its queues "
                             "(the engine serves on)", type(sched).__name__, request.request_id)
                self._evict(request)
                held = True
        if not held:
            self.kv.free(request.request_id)  # a sample forked in a failed step: never handed to the scheduler
        if not request.status.finished:
            request.status = RequestStatus.FINISHED_ABORTED

    def _still_queued(self, request: Request) -> bool:
        """Whether the scheduler still holds ``request`` (in ``requests``, ``running`` or ``waiting``) after a hook
        that should have let it go. ``waiting`` may hold any number of requests (one caller may queue thousands),
        so it is scanned only when the base queues' counts no longer add up to ``requests``': a request left in it
        alone makes them differ. Scanned at every abort and finish, 20,000 waiting requests cancelled together held
        the engine thread, and every running neighbour's stream, for 6.7 s, and each finishing request cost every
        step a pass over the queue."""
        sched = self.scheduler
        if sched.requests.get(request.request_id) is request or request in sched.running:
            return True
        if len(sched.running) + len(sched.waiting) == len(sched.requests):
            return False
        return request in sched.waiting

    def _evict(self, request: Request) -> None:
        """Remove ``request`` from the scheduler's base queues and free its blocks, without its hooks:
        what the engine does for a request whose own scheduler hook raised."""
        sched = self.scheduler
        rid = request.request_id
        if self._held.get(rid) is request:
            del self._held[rid]
        if sched.requests.get(rid) is request:
            del sched.requests[rid]
        for queue in (sched.running, sched.waiting):
            if request in queue:
                queue.remove(request)
        self.kv.free(rid)
        if not request.status.finished:
            request.status = RequestStatus.FINISHED_ABORTED

    @staticmethod
    def _refused(request: Request, error: BaseException) -> list[CoreOutput]:
        return [EngineCore._aborted(None, request.request_id, i, error) for i in range(request.params.n)]

    @staticmethod
    def _aborted(request: Request | None, request_id: str, index: int, error: BaseException | None) -> CoreOutput:
        now = time.time()
        text = ""
        if request is not None:
            request.finish_time = now
            if error is None and request.detokenizer is not None:
                try:
                    text = request.detokenizer.flush()  # what it held back (e.g. a possible stop string's start)
                except ENDS_ENGINE:
                    raise
                except BaseException as exc:  # noqa: BLE001 - its detokenizer's fault: this request's error
                    _log_fault("its detokenizer raised", request, exc)
                    error = _failure(request_id, "its detokenizer", exc)
        return CoreOutput(
            request_id=request_id,
            token_ids=[],
            text=text,
            finish_reason="abort",
            first_token_time=None if request is None else request.first_token_time,
            finish_time=now,
            num_preemptions=0 if request is None else request.num_preemptions,
            index=index,
            error=error,
        )

    def _fork_samples(self, sampled: list[Request]) -> tuple[list[Request], list[int]]:
        """Add samples ``1 .. n-1`` of every ``n > 1`` request that just computed its prompt."""
        requests = list(sampled)
        rows = list(range(len(sampled)))
        for row, request in enumerate(sampled):
            stops = request.detokenizer.stops if request.detokenizer is not None else None
            for child in fork_samples(self.kv, request):
                self._prepare(child, stops)  # the samples share one stop matcher (it holds no state)
                self._groups[request.request_id].members[child.index] = child
                self._held[child.request_id] = child  # apply_step hands it to the scheduler (add_forked)
                requests.append(child)
                rows.append(row)
        return requests, rows

    def _count(self, result: StepResult) -> None:
        stats = self.stats
        stats.steps += 1
        stats.batch_sizes.append(result.num_scheduled)
        if len(stats.batch_sizes) > BATCH_SIZE_HISTORY:
            del stats.batch_sizes[0]
        stats.scheduled_requests += result.num_scheduled
        stats.decode_tokens += result.decode_tokens
        stats.prefill_tokens += result.prefill_tokens
        stats.mask_seconds += result.mask_seconds
        stats.masked_tokens += sum(1 for request, _ in result.sampled if request.is_structured)

    def _outputs(self, result: StepResult, tokens: _StepTokens) -> list[CoreOutput]:
        """The step's outputs: one per sampled request, and one final error output per sample of
        every request that failed alone in this step (:meth:`_StepTokens.fail`)."""
        now = time.time()
        outputs: list[CoreOutput] = []
        for request, token_id in result.sampled:
            if request.group_id in tokens.failed:
                continue
            try:
                outputs.append(self._output(request, token_id, tokens, now))
            except ENDS_ENGINE:
                raise
            except BaseException as exc:  # noqa: BLE001 - its detokenizer's flush: this request only
                tokens.fail(request, "its detokenizer", exc)
        failed = tokens.failed
        if failed:  # a sample's output built before its sibling failed: the request's failure replaces it
            outputs = [out for out in outputs if out.request_id not in failed]
        # Only once every output is built: a failure above leaves the groups as fail_step expects them.
        for request, _ in result.sampled:
            if request.status.finished and request.group_id not in failed:
                self._group_member_done(request)
        for group_id, (request, error) in failed.items():
            outputs.extend(self._end(group_id, error, alone=request))
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
        a stop token id or EOS, once it has ``min_tokens``; or its grammar is complete (nothing but EOS
        may follow, or EOS was taken: whatever ``min_tokens`` and ``ignore_eos`` say, no other token could
        come). Length is :func:`apply_step`'s rule."""
        params = request.params
        matcher = request.sampling_state.matcher if request.sampling_state is not None else None
        complete = matcher is not None and matcher.is_stopped
        if request.num_output_tokens < params.min_tokens and not complete:
            return
        if stop_hit:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = request.detokenizer.stop_reason if request.detokenizer else None
        elif params.stop_token_ids and token_id in request.sampling_state.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif (not params.ignore_eos and token_id in self.eos_token_ids) or complete:
            request.status = RequestStatus.FINISHED_STOPPED


@dataclass
class _StepTokens:
    """One step's token source for :func:`apply_step`: the sampler (with ``n > 1`` forks) and the stop checks.

    Keeps what the outputs need besides each token: its logprobs and its new text.
    """

    core: EngineCore
    rows: list[Request]  # the requests whose logits the runner returned, in row order
    output: ModelOutput  # logits [len(rows), vocab] float32, and each row's greedy token when computed
    logprobs: dict[Request, TokenLogprobs | None] = field(default_factory=dict)
    texts: dict[Request, str] = field(default_factory=dict)
    # The user's requests that failed alone in this step: their id -> (the sample that failed, the error).
    failed: dict[str, tuple[Request, RequestFailedError]] = field(default_factory=dict)
    # Seconds spent on grammars in this step: the sampler's masks and the matchers' advances.
    mask_seconds: float = 0.0

    def sample(self, caught_up: list[Request]) -> list[tuple[Request, int]]:
        # The runner returned a row for exactly the requests that catch up (decodes first).
        assert len(caught_up) == len(self.rows)
        requests, rows = self.core._fork_samples(self.rows)
        # Forked samples draw from their parent's row.
        forked = len(requests) != len(self.rows)
        logits = self.output.logits[rows] if forked else self.output.logits
        states = [r.sampling_state for r in requests]
        greedy_ids = None if forked else self.output.greedy_ids  # one per row of the runner's logits
        drawn = self.core.sampler(logits, states, greedy_ids=greedy_ids)
        self.mask_seconds += drawn.mask_seconds
        self.logprobs = dict(zip(requests, drawn.logprobs))
        return list(zip(requests, drawn.token_ids))

    def check_stop(self, request: Request, token_id: int) -> None:
        matcher = request.sampling_state.matcher if request.sampling_state is not None else None
        if matcher is not None:  # advance its grammar by the token (its mask allowed it)
            start = time.perf_counter()
            accepted = matcher.accept(token_id)
            self.mask_seconds += time.perf_counter() - start
            if not accepted:
                spec = request.params.structured
                assert spec is not None  # a matcher is made for a structured request only
                self.fail(request, "its grammar", matcher.refusal(spec, token_id, request.num_output_tokens))
                request.status = RequestStatus.FINISHED_ABORTED  # apply_step hands it to finish_requests
                return
        text, stop_hit = ("", False)
        if request.detokenizer is not None:
            try:
                text, stop_hit = request.detokenizer.add(token_id)
            except ENDS_ENGINE:
                raise
            except BaseException as exc:  # noqa: BLE001 - its tokenizer's fault on its tokens: this request only
                self.fail(request, "its detokenizer", exc)
                request.status = RequestStatus.FINISHED_ABORTED  # apply_step hands it to finish_requests
                return
        self.texts[request] = text
        self.core._check_stop(request, token_id, stop_hit)

    def hook_failed(self, request: Request, hook: str, exc: BaseException) -> None:
        """:func:`apply_step`'s ``isolate``: the scheduler's ``hook`` raised for ``request`` alone."""
        where = f"the scheduler ({type(self.core.scheduler).__name__}) in {hook}"
        self.core._evict(request)
        self.fail(request, where, exc)

    def fail(self, request: Request, where: str, exc: BaseException) -> None:
        """Fail ``request``'s user request (all its samples) alone; the core ends it after the update."""
        if request.group_id not in self.failed:
            _log_fault(f"{where} raised", request, exc)
            self.failed[request.group_id] = (request, _failure(request.group_id, where, exc))


def _log_fault(what: str, request: Request, exc: BaseException) -> None:
    """A fault the engine did not expect: an error with its traceback. The request's own input refused on the
    way (an ``InvalidParameterError``: a grammar that gives up mid-reply): one warning line, no traceback, so
    that a caller sending such input cannot fill the log with tracebacks."""
    if isinstance(exc, InvalidParameterError):
        logger.warning("request %r fails alone: %s: %s (the engine serves on)",
                       request.group_id, what, exception_text(exc))
        return
    logger.error("request %r fails alone: %s: %s (the engine serves on)",
                 request.group_id, what, exception_text(exc), exc_info=exc)


def _failure(request_id: str, where: str, cause: BaseException) -> RequestFailedError:
    """The error a request fails with (``cause`` chained); its message never raises, whatever ``cause`` is."""
    error = RequestFailedError(f"request {request_id!r} failed: {where} raised {exception_text(cause)}")
    error.__cause__ = cause
    return error


def default_eos_ids(config_eos: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    ids = set(config_eos)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))

