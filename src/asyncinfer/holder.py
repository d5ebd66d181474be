"""The model holder: the versions of one named generator, and which one new requests go to.

A *version* is one loaded model with everything that depends on it: its
:class:`EngineCore` (runner with the weights and its own KV tensors, block
manager with its own prefix cache, scheduler, sampler), its tokenizer and its
memory plan. Versions never share KV blocks, so a prefix cached by one is
never read by another.

Two views, each owned by one side:

- ``current`` (event loop): the version a request is bound to at admission.
  ``AsyncEngine.swap_model`` moves it when it posts the switch command, so
  every request posted before the switch is bound to the old version and
  every request after it to the new one (the inbox is FIFO).
- ``live`` (engine thread): the versions with a core that is stepped. The
  switch command appends the new version and marks the others draining; a
  draining version is dropped (its weights and KV tensors with it) at the
  first step boundary where it holds no request.

Stepping a core is also where the engine thread's two safety rules live
(:meth:`ModelHolder.step`): a step that raises fails only its own requests
(``EngineCore.fail_step``) unless ``max_consecutive_step_failures`` steps of that
version failed in a row, which kills the thread (every waiter then gets
``EngineDeadError``); and a core whose requests stay unscheduled for
``stall_timeout`` seconds fails them with ``RequestStalledError``. Until then the
engine thread (and a load's warm-up) retries after a growing wait, :func:`idle_backoff`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.config import EngineConfig
from asyncinfer.core import EngineCore
from asyncinfer.embedding import EmbeddingPlan
from asyncinfer.errors import EngineDeadError, RequestStalledError, exception_text
from asyncinfer.memory import MemoryPlan
from asyncinfer.models import ModelConfig
from asyncinfer.outputs import CoreOutput
from asyncinfer.step import ENDS_ENGINE

#: Seconds the engine thread (and a load's warm-up) waits at most between two tries while every core with
#: requests schedules nothing.
MAX_IDLE_WAIT = 0.05


def idle_backoff(wait: float) -> float:
    """The wait before the next try after ``wait`` (0.0 for the first) while nothing could be scheduled:
    1 ms, doubling up to :data:`MAX_IDLE_WAIT`: a stuck scheduler is soon retried, and nothing spins."""
    return min(max(2 * wait, 0.001), MAX_IDLE_WAIT)


class VersionState(enum.Enum):
    CURRENT = "current"  # new requests are bound to it
    DRAINING = "draining"  # finishes the requests it holds, then is dropped
    RETIRED = "retired"  # dropped: its core is gone


@dataclass(frozen=True)
class ModelVersionInfo:
    """One live version of a named model, as ``AsyncEngine.model_info()`` reports it.

    ``kind`` is "generate" (``memory_plan`` is a :class:`MemoryPlan`) or "embed"
    (an :class:`EmbeddingPlan`); ``requests_in_flight`` counts requests, or
    ``embed()`` calls, bound to it.
    """

    version_id: int
    source: str
    state: str
    requests_in_flight: int
    memory_plan: MemoryPlan | EmbeddingPlan
    name: str = "default"
    kind: str = "generate"
    embedding_dim: int | None = None  # the vector size of an embedding model
    compile_seconds: float | None = None  # torch_compile=True: how long the load spent compiling


@dataclass(eq=False)
class ModelVersion:
    """One loaded model and the engine core that serves it."""

    version_id: int
    source: str  # "safetensors:<dir>" or "gguf:<file>"
    path: str  # what it was loaded from (a drain-mode swap that fails loads it again)
    config: EngineConfig
    options: dict[str, Any]
    model_config: ModelConfig
    tokenizer: Any
    plan: MemoryPlan
    core: EngineCore | None
    state: VersionState = VersionState.CURRENT
    # Called on the engine thread once the version is dropped.
    on_retired: list[Callable[[ModelVersion], None]] = field(default_factory=list)
    # Engine thread: steps of this version that failed in a row, and since when (time.monotonic())
    # its steps have scheduled nothing (None while they run something).
    failures_in_a_row: int = 0
    stalled_since: float | None = None

    _max_token_chars: int | None = field(default=None, repr=False)

    @property
    def max_model_len(self) -> int:
        assert self.core is not None, "a retired version has no core"
        return self.core.max_model_len

    @property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for (an upper bound; computed once)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            self._max_token_chars = max((len(piece) for piece in vocab), default=1)
        return self._max_token_chars


#: :attr:`ModelHolder.vacancy` from a drain-mode swap's call until its next version serves.
LOADING_NEXT = "a drain-mode swap lets the old version's requests finish, then loads the next"


class ModelHolder:
    """The versions of one engine's model (see the module docstring for who touches what)."""

    def __init__(self, first: ModelVersion) -> None:
        self._current: ModelVersion | None = first
        #: The options of the version that serves, or of the last one that did while none does (a drain-mode swap
        #: loading the next one): admission control's bound (``max_waiting_requests``) holds then too.
        self.config: EngineConfig = first.config
        #: The ids of every version that has served this model (ModelChangedError blames a swap only for one of them).
        self.served: set[int] = {first.version_id}
        self.live: list[ModelVersion] = [first]
        #: Why no version serves while ``current`` is None (the EngineClosedError's words): a drain-mode swap loading
        #: the next one, or, once its new version and the reload of the old one both failed, how to load one again.
        self.vacancy = LOADING_NEXT
        # Engine thread: whether the last step() ran (or failed) anything; False when every
        # core with requests scheduled nothing, and the thread should back off.
        self.progressed = False

    @property
    def current(self) -> ModelVersion | None:
        return self._current

    @current.setter
    def current(self, version: ModelVersion | None) -> None:
        self._current = version
        self.vacancy = LOADING_NEXT
        if version is not None:
            self.config = version.config
            self.served.add(version.version_id)

    # ------------------------------------------------------------ engine thread
    def switch(self, version: ModelVersion) -> None:
        """Make ``version`` the one that takes new requests; the others drain."""
        for other in self.live:
            other.state = VersionState.DRAINING
        version.state = VersionState.CURRENT
        self.live = [*self.live, version]

    def drain(self, version: ModelVersion, *, abort: bool) -> list[CoreOutput]:
        """Mark ``version`` draining (no successor yet); with ``abort``, end its requests now."""
        version.state = VersionState.DRAINING
        if abort and version.core is not None:
            return version.core.abort_all()
        return []

    def drain_all(self, *, abort: bool) -> list[CoreOutput]:
        """Mark every live version draining (the model is being removed): the serving one and any still draining
        after an overlapping swap; with ``abort``, end all their requests now."""
        outputs: list[CoreOutput] = []
        for version in self.live:
            outputs.extend(self.drain(version, abort=abort))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(v.core is not None and v.core.has_unfinished_requests() for v in self.live)

    def step(self) -> list[CoreOutput]:
        """One step of every live core that has work (overlapping versions share the iteration).

        Sets :attr:`progressed`. Raises :class:`EngineDeadError` (the cause chained) once
        a version's steps failed ``max_consecutive_step_failures`` times in a row.
        """
        outputs: list[CoreOutput] = []
        self.progressed = False
        for version in self.live:
            core = version.core
            if core is not None and core.has_unfinished_requests():
                outputs.extend(self._step(version, core))
        return outputs

    def _step(self, version: ModelVersion, core: EngineCore) -> list[CoreOutput]:
        ran = core.stats.steps
        try:
            outputs = core.step()
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # fault isolation: the step's requests fail, not the engine
            version.failures_in_a_row += 1
            limit = version.config.max_consecutive_step_failures
            if version.failures_in_a_row >= limit:
                raise EngineDeadError(
                    f"{limit} consecutive steps of model version {version.version_id} failed "
                    f"(max_consecutive_step_failures={limit}); the last one raised {exception_text(exc)}"
                ) from exc
            self.progressed = True
            return core.fail_step(exc)
        version.failures_in_a_row = 0
        if core.stats.steps > ran:
            version.stalled_since = None
            self.progressed = True
            return outputs
        return outputs + self._stalled(version, core)

    @staticmethod
    def _stalled(version: ModelVersion, core: EngineCore) -> list[CoreOutput]:
        """A step of ``version`` scheduled nothing: fail its requests once that lasted ``stall_timeout``."""
        now = time.monotonic()
        if version.stalled_since is None:
            version.stalled_since = now
        timeout = version.config.stall_timeout
        waited = now - version.stalled_since
        if timeout is None or waited < timeout:
            return []
        version.stalled_since = None
        sched, kv = core.scheduler, core.kv
        running, waiting = core.queue_counts()
        why = (
            f"the scheduler ({type(sched).__name__}) of model version {version.version_id} scheduled nothing for "
            f"{waited:.1f} s (stall_timeout={timeout}) with {running} running and {waiting} "
            f"waiting requests and {kv.num_free_blocks} of {kv.num_blocks} KV blocks free"
        )
        return core.fail_all(lambda request_id: RequestStalledError(f"request {request_id!r} failed: {why}"))

    def abort(self, request_id: str) -> list[CoreOutput]:
        """Abort a request on whichever version holds it (ids are unique across versions)."""
        outputs: list[CoreOutput] = []
        for version in self.live:
            if version.core is not None:
                outputs.extend(version.core.abort_request(request_id))
        return outputs

    def abort_all(self) -> list[CoreOutput]:
        outputs: list[CoreOutput] = []
        for version in self.live:
            if version.core is not None:
                outputs.extend(version.core.abort_all())
        return outputs

    def reset_prefix_cache(self) -> None:
        for version in self.live:
            if version.core is not None:
                version.core.reset_prefix_cache()

    def retire_idle(self) -> None:
        """Drop every draining version that holds no request (at a step boundary)."""
        idle = [
            v for v in self.live
            if v.state is VersionState.DRAINING and (v.core is None or not v.core.has_unfinished_requests())
        ]
        if not idle:
            return
        self.live = [v for v in self.live if v not in idle]
        for version in idle:
            version.state = VersionState.RETIRED
            # Dropping the core drops the runner, the weights and the KV tensors
            # (nothing else holds them), and the block manager with its prefix cache.
            version.core = None
            callbacks, version.on_retired = version.on_retired, []
            for callback in callbacks:
                callback(version)
