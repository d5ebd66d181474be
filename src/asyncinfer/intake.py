"""From a call's arguments to a validated :class:`Request` bound to a model version.

Two halves, so that ``engine.stream()`` raises at the call: :meth:`RequestIntake.check`
does every check that needs no await (arguments, id, model name, and the prompt's
token ids when the generator serves and the text is short), and
:meth:`RequestIntake.bind` awaits admission (a drain-mode swap may hold it), binds
the request to the version that serves, and reuses the ids computed at the call
when that version still serves. Nothing awaits between ``bind`` returning and the
request being posted to the engine thread. A structured request's grammar
(``SamplingParams.structured``) is compiled for the bound version in ``bind`` too: from
the version's cache, or in a worker thread (never on the loop), so that a spec the
grammar library refuses is an :class:`InvalidParameterError` before anything is queued. At most
:data:`MAX_CONCURRENT_COMPILES` compiles run at once per engine, in threads of their own limiter, and one
at a time per ``tenant`` (else per ``cache_salt``): a caller sending many costly specs queues behind itself, holds
one of those places at most (a caller cancelled while its spec compiles ends when the compile does:
:func:`asyncinfer.threads.run_sync_to_end`),
and never holds the worker threads (anyio's shared pool) that other callers' tokenizing and body decoding use.

Two kinds of request wait their turn in ``bind`` (:class:`Turns`, a token bucket each, first come, first served),
so that a flood of them waits instead of its neighbours: a request whose stop strings come to more than
:data:`STOP_BUILD_FREE_CHARS` characters (the engine thread builds each request's stop automaton, 11 ms of CPU for a
list at both limits, and such a flood, each request with a list of its own, held every neighbour's tokens for as
long as their automata took: a decode step of the default model per request), at :data:`STOP_BUILD_CHARS_PER_S`;
and a chat of more than :data:`CHAT_FREE_MESSAGES` messages and tool calls together (:func:`chat_turn_size`;
templated in a worker thread, ~23 us of CPU a message, holding the interpreter's lock against the engine thread
and the loop meanwhile: a flood of 4096-message chats, each refused for its length once rendered, made a
neighbour's tokens 1.5-2.3x slower), at :data:`CHAT_MESSAGES_PER_S`. Shorter lists and chats never wait.

An :class:`IntakeObserver` (``engine.metrics``), handed in at construction, hears of
every refusal and of every request bound; it never changes what the intake does.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import anyio

from asyncinfer.catalog import ModelCatalog
from asyncinfer.errors import EngineOverloadedError, InvalidParameterError, ModelChangedError
from asyncinfer.holder import ModelHolder, ModelVersion
from asyncinfer.plain import plain_value
from asyncinfer.prompts import (
    MAX_CHAT_MESSAGES,
    Prompt,
    check_prompt_chars,
    check_prompt_len,
    check_request_args,
    check_request_id,
    check_room_for_max_tokens,
    check_stop_token_ids,
    check_tenant,
    is_chat,
    make_request,
)
from asyncinfer.request import Request
from asyncinfer.sampling_params import MAX_STOP_CHARS, SamplingParams
from asyncinfer.streams import StreamTable, sample_ids
from asyncinfer.threads import run_sync_to_end


@dataclass(frozen=True)
class RequestArgs:
    """A request's checked arguments, and its prompt's ids if they were computed at the call."""

    params: SamplingParams
    request_id: str
    priority: int
    cache_salt: str | None
    early: tuple[ModelVersion, list[int]] | None
    version_id: int | None = None  # the version of the model the prompt was made for (None: any)
    tenant: str | None = None  # whom it is for: its structured-output compile takes that tenant's turns


class IntakeObserver(Protocol):
    """What :class:`RequestIntake` tells (``asyncinfer.metrics.EngineMetrics`` listens)."""

    def count_rejected(self, model: str | None, reason: str) -> None: ...  # "invalid" or "overloaded"

    def track(self, request: Request, version_id: int) -> None: ...  # bound; posted before the next await

    # aborted while it waited its turn: ended with no request made, as an abort (counted and logged as one)
    def count_aborted_waiting(self, model: str | None, request_id: str, n: int, prompt_len: int,
                              arrival: float) -> None: ...


#: Grammar compiles (cache misses) running at once in one engine; the others wait their turn.
MAX_CONCURRENT_COMPILES = 2

#: Stop lists of at most this many characters together (0.1 ms of automaton to build: benchmarks/intake_costs.py)
#: never wait their turn.
STOP_BUILD_FREE_CHARS = 256
#: Characters of longer stop lists an engine admits a second (a token bucket that holds two lists at the limits,
#: ``sampling_params.MAX_STOP_CHARS`` each): what the engine thread spends building their automata stays near 2%.
STOP_BUILD_CHARS_PER_S = 32768
#: Chats of at most this many messages (~6 ms of template) never wait their turn.
CHAT_FREE_MESSAGES = 256
#: Messages of longer chats an engine admits a second (a token bucket that holds two chats at the limit,
#: ``prompts.MAX_CHAT_MESSAGES`` each): their templating takes about 5% of one core (benchmarks/intake_costs.py).
CHAT_MESSAGES_PER_S = 2048


def chat_turn_size(messages: Any) -> int:
    """What a chat's turn counts: its messages, and the tool calls its assistant messages hold (a template renders
    each call as it renders a message: one message of 30,000 calls took 2.6 s of Mistral's template, a turn's
    worth of 5,000 messages, and took no turn; pass39). 0 for a prompt that is not a chat."""
    if not is_chat(messages):
        return 0
    calls = 0
    for message in messages:
        tool_calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(tool_calls, (list, tuple)):
            calls += len(tool_calls)
    return len(messages) + calls


#: How often a waiter for its turn looks whether it may still wait (the engine closed: it stops at once).
TURN_CHECK_S = 0.25


class Turns:
    """A token bucket in virtual time: :meth:`wait` for ``amount`` returns once the amounts before it have passed at
    ``rate`` a second, at once while the bucket (``burst``) holds it; a waiter that gives up (cancelled, or ``check``
    raising: the engine closed) gives its turn back wherever it stands in line: the next to come may take it, those
    behind it keep theirs (given back only by the last in line, a caller keeping two waiting and giving up the
    earlier as it sent the next moved the clock a turn on each time, nothing admitted: others' turns hours away)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = -math.inf  # when the amounts admitted so far will have passed, at the rate

    async def wait(self, amount: float, check: Callable[[], None] = lambda: None) -> None:
        """Wait for the turn of ``amount``, calling ``check`` every :data:`TURN_CHECK_S` meanwhile (what it raises
        ends the wait)."""
        now = time.monotonic()
        cost = amount / self.rate
        self._clock = turn = max(self._clock, now - self.burst / self.rate) + cost
        try:
            while (left := turn - time.monotonic()) > 0:
                await anyio.sleep(min(left, TURN_CHECK_S))
                check()
        except BaseException:
            self._clock -= cost  # its turn, never taken, is free for the next to come
            raise


class AbortedWhileWaiting(Exception):
    """Raised by :meth:`RequestIntake.bind` when the request was aborted (``aborted()`` came true) while it waited
    its turn: nothing was made for it (its turn given back), nothing posted; it ends as an abort at once."""


def _party(tenant: str | None, salt: str | None) -> tuple[str, str] | None:
    """Whom a request's costly work (its long prompt's tokenizing, its spec's compile) takes turns as: its tenant,
    else its cache salt, else nobody (it takes what comes)."""
    return ("tenant", tenant) if tenant is not None else ("salt", salt) if salt is not None else None


class RequestIntake:
    """Checks and binds new requests for one engine (loop side)."""

    def __init__(self, models: ModelCatalog, streams: StreamTable, observer: IntakeObserver | None = None) -> None:
        self.models = models
        self.streams = streams
        self._observer = observer
        self._ids = itertools.count()
        self.compiles = anyio.CapacityLimiter(MAX_CONCURRENT_COMPILES)  # not anyio's shared pool
        # per tenant (else per cache_salt), one compile at a time in self.compiles, with how many hold or await it
        # (dropped at 0): a tenant's costly specs queue behind each other, not ahead of every other tenant's
        # (_compile_turn)
        self._compile_turns: dict[tuple[str, str], tuple[anyio.Lock, list[int]]] = {}
        self._stop_turns = Turns(STOP_BUILD_CHARS_PER_S, 2 * MAX_STOP_CHARS)  # the rates as set now (a deployment
        self._chat_turns = Turns(CHAT_MESSAGES_PER_S, 2 * MAX_CHAT_MESSAGES)  # may raise them before making engines)
        # Requests in bind (waiting their turn, tokenized or compiled off the loop), by generator: in flight for
        # admission control as much as those already posted, so that a flood waiting its turns is refused at once
        # past the limit rather than after its wait.
        self._binding: dict[ModelHolder, int] = {}
        # The sample ids of the requests in bind: held from the start of their bind, so that a later call with the
        # same id is refused at its call (or a stream at its first read), not bound ahead of the earlier one while
        # that one waits (its compile, its turn, a drain-mode swap), which was then refused for the later one's id.
        self._binding_ids: set[str] = set()

    def check(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        model: str | None,
        check_running: Callable[[], None],
        version_id: int | None = None,
        tenant: str | None = None,
    ) -> RequestArgs:
        """Every check that needs no await; raises :class:`InvalidParameterError` (or the engine's state error, or
        :class:`ModelChangedError` when ``version_id`` names a version of ``model`` that no longer serves)."""
        try:
            # the tenant and version_id before the load, as every check no retry could pass: checked after it,
            # a bad one was refused as overloaded (a 503 with Retry-After) whenever the engine was full
            tenant = check_tenant(tenant)
            if version_id is not None:
                version_id = plain_value(version_id)  # the int it holds: a subclass's == and != may answer as any version
                if not isinstance(version_id, int) or isinstance(version_id, bool) or version_id < 0:
                    raise InvalidParameterError("version_id", version_id, "None or a model version's id (an int >= 0)")
            args = self._check(prompt, params, request_id, priority, cache_salt, model, check_running, version_id)
        except (InvalidParameterError, EngineOverloadedError) as exc:
            self._refused(model, exc)
            raise
        return replace(args, tenant=tenant, version_id=version_id)

    def _check(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        model: str | None,
        check_running: Callable[[], None],
        version_id: int | None = None,
    ) -> RequestArgs:
        check_running()
        params, priority, cache_salt = check_request_args(params, priority, cache_salt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        request_id = check_request_id(request_id)
        early = self.check_valid(prompt, params, model, version_id)
        # after what no retry could pass (a 400), before the prompt is tokenized: checked first, an `n` over
        # max_num_seqs (a bad tenant, a prompt past max_model_len, a token id past the vocabulary) was refused as
        # overloaded (a 503 with Retry-After) whenever the engine was full
        self._check_load(model)
        if early is None and (isinstance(prompt, str) or is_chat(prompt)):
            early = self._tokenize_now(prompt, params, model)  # token ids deferred by the loop's share stay so
        self._check_id_free(request_id, params.n)
        return RequestArgs(params, request_id, priority, cache_salt, early)

    def check_valid(self, prompt: Prompt, params: SamplingParams, model: str | None,
                    version_id: int | None = None) -> tuple[ModelVersion, list[int]] | None:
        """Every check of a request that no retry could pass (its 400), none of its load (a 503) nor of its id:
        ``params`` against the serving version (stop token ids in its vocabulary, ``n`` within ``max_num_seqs``, stop
        strings with a tokenizer, ``version_id``), a prompt of token ids whole, and a text or chat by its size alone and
        by a ``max_tokens`` no prompt leaves room for (a text is tokenized only once the load admits it). The token-id
        prompt's (version, ids), else None."""
        holder = self.models.generator(model)
        serving = holder.current
        if serving is None:
            return None
        check_stop_token_ids(params, serving.model_config.vocab_size)
        _check_runnable(params, serving)
        if version_id is not None:
            _check_version(version_id, serving, holder.served)
        if isinstance(prompt, str) or is_chat(prompt):
            check_prompt_chars(prompt, serving)
            # a max_tokens that no prompt leaves room for: refused once tokenized, past the load (a 503 when full,
            # and over HTTP a 429 at the tenant's limit) though no retry could run it
            check_room_for_max_tokens(serving.max_model_len, params)
            return None
        # token ids (or what is no text nor chat, refused here): checked whole, as their length is (no tokenizing)
        return self._tokenize_now(prompt, params, model)

    def _tokenize_now(self, prompt: Prompt, params: SamplingParams,
                      model: str | None) -> tuple[ModelVersion, list[int]] | None:
        """The serving version and the prompt's ids when they take no await (:meth:`ModelCatalog.tokenize_now`),
        checked against its ``max_model_len`` and ``params.max_tokens``; None when deferred."""
        early = self.models.tokenize_now(model, prompt)
        if early is not None:
            check_prompt_len(early[1], early[0].max_model_len, params)
        return early

    async def bind(
        self, prompt: Prompt, args: RequestArgs, model: str | None, check_running: Callable[[], None],
        aborted: Callable[[], bool] = lambda: False,
    ) -> tuple[Request, ModelVersion, ModelHolder]:
        """The request, the version it is bound to and its generator; post it before the next await.
        :class:`AbortedWhileWaiting` when ``aborted()`` comes true while it waits its turn (or its compile's)."""
        arrival = time.time()
        held: tuple[str, ...] = ()
        try:
            self._check_id_free(args.request_id, args.params.n)  # a stream's second read, or another call of its id
            held = sample_ids(args.request_id, args.params.n)
            self._binding_ids.update(held)
            # a place taken as it is checked again: a stream is checked at its call but bound when first read, and
            # streams made together, none counted yet, then read together, all waited their turns past the limit
            with self.taking_in(model):
                try:
                    await self._take_turns(prompt, args.params, check_running, aborted)
                    version, ids, grammar = await self._bind(prompt, args, model, check_running, aborted)
                except AbortedWhileWaiting:
                    # it ends as an abort with nothing made for it: counted and logged as the abort it would have
                    # been once bound (it was, before the wait ended at the abort)
                    if self._observer is not None:
                        self._observer.count_aborted_waiting(model if isinstance(model, str) else None,
                                                             args.request_id, args.params.n,
                                                             len(args.early[1]) if args.early else 0, arrival)
                    raise
                # The engine may have been closed (or died) while the prompt was made off the loop: its thread would
                # never take the request, and its caller would wait for ever.
                check_running()
                if args.version_id is not None:  # a swap may have come since the call
                    _check_version(args.version_id, version, self.models.generator(model).served)
                check_stop_token_ids(args.params, version.model_config.vocab_size)  # a swap may have changed the vocabulary
                _check_runnable(args.params, version)  # and max_num_seqs, and the tokenizer
                self._check_id_free(args.request_id, args.params.n, binding=False)
            # its place given back: from here on it is counted by its stream, opened with no await between
            self._check_load(model)
            request = make_request(ids, args.params, args.request_id, args.priority, args.cache_salt,
                                   version.max_model_len)
            request.grammar = grammar
        except (InvalidParameterError, EngineOverloadedError) as exc:
            self._refused(model, exc)
            if isinstance(exc, InvalidParameterError) and exc.parameter == "model" and exc.value is not None:
                # The call found it loaded: remove_model came while its prompt was made off the loop, its grammar
                # compiled or a drain-mode swap held its admission (the refusal read as if it had never been loaded).
                raise InvalidParameterError("model", exc.value, "a loaded generator (it was removed meanwhile)") from None
            raise
        finally:  # bound (its stream opens before the next await, holding the ids from there) or refused
            self._binding_ids.difference_update(held)
        if self._observer is not None:
            self._observer.track(request, version.version_id)
        return request, version, self.models.generator(model)

    async def _bind(self, prompt: Prompt, args: RequestArgs, model: str | None, check_running: Callable[[], None],
                    aborted: Callable[[], bool]) -> tuple[ModelVersion, list[int], Any]:
        """The version, the prompt's ids for it and, for a structured request, its grammar compiled for it. A
        request aborted (:class:`AbortedWhileWaiting`) or whose engine closed while it waited its compile turn is not
        compiled: each of a tenant's queued specs was compiled in turn after its abort or the engine's close (five
        aborted 1.5 s grammars held the tenant's next request 7.5 s)."""

        def compile_spec(core: Any, spec: Any, salt: str | None) -> Any:  # in a worker thread, given a place
            if aborted():  # a flag's read: the abort may come while it waits for a place
                raise AbortedWhileWaiting
            return core.compile_grammar(spec, salt)

        spec = args.params.structured
        # a long prompt tokenized in one of its tenant's (salt's) worker threads, as its spec compiles in its turn
        party = _party(args.tenant, args.cache_salt)
        while True:
            version, ids = await self.models.bind_prompt(model, prompt, check_running, args.early, party)
            if spec is None:
                return version, ids, None
            core = version.core
            assert core is not None
            salt = args.cache_salt  # a tenant's compiled specs are its own, as its cached prefixes are
            grammar = core.grammars.cached(spec, salt) if core.grammars is not None else None
            if grammar is not None:
                return version, ids, grammar
            async with self._compile_turn(party):
                check_running()  # it may have waited its tenant's other compiles
                if aborted():
                    raise AbortedWhileWaiting
                # a cancel while it compiles waits for the compile: its place and its tenant's turn held till then
                grammar = await run_sync_to_end(compile_spec, core, spec, salt, limiter=self.compiles)
            check_running()
            if self.models.serving(model) is version:  # else a swap moved it on (or holds admission): bind again
                return version, ids, grammar

    @contextlib.asynccontextmanager
    async def _compile_turn(self, key: tuple[str, str] | None) -> AsyncIterator[None]:
        """A request with a ``tenant`` (else a ``cache_salt``; :func:`_party`'s ``key``) compiles its spec once no
        other request of that tenant (salt) is compiling: the engine's :data:`MAX_CONCURRENT_COMPILES` places are taken in turn, first come first
        served, and one tenant's many costly specs held them all (six GBNF grammars of 1,500 rules kept another
        tenant's regular expression, 6 ms alone, waiting 4.5 s). The tenant goes first: a server shares cached
        prefixes (no salt) unless told otherwise, and its callers all took the places as they came. Requests with
        neither take the places as they come."""
        if key is None:
            yield
            return
        lock, users = self._compile_turns.setdefault(key, (anyio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._compile_turns[key]

    async def _take_turns(self, prompt: Prompt, params: SamplingParams, check_running: Callable[[], None],
                          aborted: Callable[[], bool]) -> None:
        """Wait, for a stop list over :data:`STOP_BUILD_FREE_CHARS` characters or a chat over
        :data:`CHAT_FREE_MESSAGES` messages, for its turn (the module's docstring); the engine closing meanwhile ends
        the wait (``check_running`` raises), and so does an abort of the request (:class:`AbortedWhileWaiting`: it
        waited its whole turn, under a flood minutes, to end as an abort; pass39)."""

        def check() -> None:
            check_running()
            if aborted():
                raise AbortedWhileWaiting

        chars = sum(map(len, params.stop_strings))
        if chars > STOP_BUILD_FREE_CHARS:
            await self._stop_turns.wait(chars, check)
        size = chat_turn_size(prompt)
        if size > CHAT_FREE_MESSAGES:
            await self._chat_turns.wait(size, check)

    @contextlib.contextmanager
    def counting_refusals(self, model: str | None) -> Iterator[None]:
        """Count a refusal raised in the block (:class:`InvalidParameterError`, :class:`EngineOverloadedError`) as
        :meth:`check` counts its own, by ``model``: for the engine's checks a caller makes before it submits
        (``check_request``, ``check_admission``, ``taking_in``), once a call."""
        try:
            yield
        except (InvalidParameterError, EngineOverloadedError) as exc:
            self._refused(model, exc)
            raise

    def _refused(self, model: str | None, exc: Exception) -> None:
        if self._observer is not None:
            reason = "overloaded" if isinstance(exc, EngineOverloadedError) else "invalid"
            self._observer.count_rejected(model if isinstance(model, str) else None, reason)

    def check_room(self, model: str | None, count: int) -> None:
        """Whether ``count`` more requests would be admitted now (admission control, ``max_waiting_requests``):
        InvalidParameterError on ``prompt`` when ``count`` exceeds what may ever be in flight (no retry can
        succeed), EngineOverloadedError when they do not fit beside the requests in flight now."""
        self._check_load(model, count)

    @contextlib.contextmanager
    def taking_in(self, model: str | None) -> Iterator[None]:
        """One request being taken in (waiting its turn, its prompt made, in :meth:`bind`; or a caller's own line and
        render before it submits, the HTTP server's long chats): refused at once as :meth:`check_room` refuses one,
        then in flight for admission control until the block ends (uncounted, any number of them waited while the
        engine was empty, each refused only after its wait)."""
        self._check_load(model)
        holder = self.models.generator(model)
        self._binding[holder] = self._binding.get(holder, 0) + 1
        try:
            yield
        finally:
            left = self._binding.pop(holder) - 1
            if left:
                self._binding[holder] = left

    def _check_load(self, model: str | None, count: int = 1) -> None:
        """Admission control: refuse at once past ``max_num_seqs + max_waiting_requests`` in flight."""
        holder = self.models.generator(model)
        # the serving version's bound, or while a drain-mode swap loads the next one, the last one's: with none
        # serving nothing was checked, and every request of the load waited, those past the bound refused after it
        config = holder.config
        if config.max_waiting_requests is None:
            return
        limit = config.max_num_seqs + config.max_waiting_requests
        if count > limit:
            raise InvalidParameterError(
                "prompt", f"<{count} prompts>",
                f"at most {_counted(limit, 'prompt')} in one call: at most max_num_seqs={config.max_num_seqs} + "
                f"max_waiting_requests={config.max_waiting_requests} requests may be in flight")
        if self.streams.count(holder) + self._binding.get(holder, 0) + count > limit:
            raise EngineOverloadedError(
                f"model {self.models.name_of(holder)!r} has {_counted(limit, 'request')} in flight "
                f"(max_num_seqs={config.max_num_seqs} + max_waiting_requests="
                f"{config.max_waiting_requests}); retry later."
            )

    def _check_id_free(self, request_id: str, n: int, *, binding: bool = True) -> None:
        """Refuse an id held by a request in flight, or (``binding``) by a call still being bound."""
        held = binding and not self._binding_ids.isdisjoint(sample_ids(request_id, n))
        if held or not self.streams.is_free(request_id, n):
            allowed = "an id not used by a request in flight"
            if self.streams.is_abandoned(request_id):
                allowed += (" (a request with this id was cancelled and is still being aborted: its id is free once the "
                            "engine has stopped it, at its next step)")
            raise InvalidParameterError("request_id", request_id, allowed)


def _check_runnable(params: SamplingParams, version: ModelVersion) -> None:
    """What ``version`` could never run, checked at the call: ``n`` samples run together, so more than
    ``max_num_seqs`` never could (the core checks it again; it refused them only once posted: ``stream()`` raised at
    its first delta, not at the call); stop strings need the model's tokenizer (no text is made to match them in)."""
    max_seqs = version.config.max_num_seqs
    if params.n > max_seqs:
        raise InvalidParameterError("n", params.n, f"at most max_num_seqs={max_seqs} (samples run together)")
    if params.stop_strings and version.core is not None and version.core.tokenizer is None:
        # no text is made to match them in: they were ignored without a word, every answer running to max_tokens
        raise InvalidParameterError("stop", params.stop_strings[0], "no stop strings: this model has no tokenizer, "
                                    "so its answers have no text to match them in (stop_token_ids stop on token ids)")


def _check_version(version_id: int, serving: ModelVersion, served: set[int]) -> None:
    """:class:`ModelChangedError` unless ``serving`` is the version ``version_id`` a prompt was made for; ``served``
    holds the ids of the model's versions that have served it."""
    if serving.version_id != version_id:
        # An id that never served this model (a typo, another model's version, a version still loading): no swap
        # came in between, and the id to use is the serving one. Ids are the engine's, shared by all its models.
        why = ("a swap_model came in between" if version_id in served else
               "no version of that id has served this model")
        raise ModelChangedError(f"the prompt was made for version {version_id} of the model, and version "
                                f"{serving.version_id} serves it now ({why}): make the prompt again with the serving "
                                "version (model_info()'s version_id)", version_id, serving.version_id)


def _counted(n: int, noun: str) -> str:
    """``1 request``, ``2 requests``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
