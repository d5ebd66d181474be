"""Embedding models in the engine: options, memory plan, and the dynamic batcher.

``AsyncEngine.embed`` tokenizes on the event loop and posts one :class:`EmbedCall`
per call to the engine thread, where the model's :class:`EmbeddingBatcher`
queues its texts. A batch runs when ``max_batch_size`` texts are waiting, or
when the oldest has waited ``max_wait_ms`` (dynamic batching: trade a few
milliseconds of latency for a batch that costs little more than one text).
``max_batch_size=1`` turns batching off.

Batches run on the engine thread between generation steps, so an embedding
model and a generator share the device without competing for its cores; while
a generator is busy, a ready batch waits at most for the step in progress, and
the batches take no more than ``max_busy_share`` of the thread's time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncinfer.config import (
    FASTER_FOR_AN_ENCODER,
    MAX_THREADS,
    check_int,
    from_options,
    plain_fields,
    resolve_device,
    resolve_dtype,
    warn_slow_cpu_dtype,
)
from asyncinfer.errors import InvalidParameterError
from asyncinfer.memory import MiB
from asyncinfer.models.encoder import EncoderConfig, LoadedEncoder


@dataclass(frozen=True)
class EmbeddingConfig:
    """Options of an embedding model (keywords of ``add_model`` / ``from_pretrained`` for one).

    - ``dtype``, ``device``: as for generators ("auto" = float32 on CPU, bf16 on CUDA).
    - ``max_batch_size``: texts per forward pass, 1..1024 (1 = no batching; default 32).
    - ``max_batch_tokens``: token slots per forward pass (texts x the longest, as the pass pads them), 1..1048576
      (default 2048); a text longer than it runs alone. One batch runs between two generation steps of the
      engine, so this bounds what a flood of long texts adds to every generated token's wait.
    - ``max_wait_ms``: how long the oldest waiting text may wait for more, in [0, 1000]
      (default 5; 0 = run whatever is queued at once).
    - ``max_busy_share``: while a generator has requests, the largest share of the engine thread's time this
      model's batches take, in (0, 1] (default 0.2): after a batch of ``t`` seconds the next one waits for
      ``t * (1 - share) / share`` seconds of other work, so a flood's batches slow a stream's tokens by
      ``1 / (1 - share)`` on average (1.25x; 1.31x measured with the flood's tokenizing and answers,
      docs/models_and_embeddings.md), while any one token still waits for at most one batch.
      1 = a batch between every two steps, as soon as one is due. With no generator busy, batches run at once.
    - ``max_seq_len``: tokens read per text, [CLS]/[SEP] included; longer texts are
      truncated as sentence-transformers does (default: the model's, 256 for MiniLM). 2 to the model's
      positions (512 for MiniLM), and at most 8192 whatever the model.
    - ``num_threads``: torch intra-op threads for the CPU, 1..``MAX_THREADS`` (4096; default: leave torch's setting).
    - ``batch_invariant``: compute each text of a batch alone, at its own length, so that its vector depends on
      the text only, bit for bit, never on what shared its batch (default False: a batch's texts run together,
      and a text's vector moves in its last bits, about 1e-7, with the others' count and lengths, which a caller
      can read from its own vectors as it can read the batches' timing). Costs batching's speed-up (
      docs/models_and_embeddings.md).
    """

    dtype: Any = "auto"
    device: Any = "auto"
    max_batch_size: int = 32
    max_batch_tokens: int = 2048
    max_wait_ms: float = 5.0
    max_busy_share: float = 0.2
    max_seq_len: int | None = None
    num_threads: int | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        plain_fields(self)
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device))
        warn_slow_cpu_dtype(self.dtype, device, FASTER_FOR_AN_ENCODER)
        check_int("max_batch_size", self.max_batch_size, 1, 1024)
        check_int("max_batch_tokens", self.max_batch_tokens, 1, 1 << 20)
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1000:
            raise InvalidParameterError("max_wait_ms", wait, "a number of milliseconds in [0, 1000]")
        share = self.max_busy_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise InvalidParameterError("max_busy_share", share, "a fraction of the engine thread's time in (0, 1]")
        check_int("max_seq_len", self.max_seq_len, 2, 8192, optional=True)
        check_int("num_threads", self.num_threads, 1, MAX_THREADS, optional=True)
        if not isinstance(self.batch_invariant, bool):
            raise InvalidParameterError("batch_invariant", self.batch_invariant, "True or False")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EmbeddingConfig:
        """Build from ``add_model`` keywords, rejecting unknown ones by name."""
        return from_options(cls, options, "an embedding-model option")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def apply_max_seq_len(encoder_config: EncoderConfig, config: EmbeddingConfig) -> EncoderConfig:
    """The encoder config with the user's ``max_seq_len`` (checked against the model's positions)."""
    if config.max_seq_len is None:
        return encoder_config
    limit = encoder_config.max_position_embeddings
    if config.max_seq_len > limit:
        raise InvalidParameterError("max_seq_len", config.max_seq_len, f"an integer in [2, {limit}] for this model")
    return dataclasses.replace(encoder_config, max_seq_len=config.max_seq_len)


@dataclass(frozen=True)
class EmbeddingPlan:
    """Memory of an embedding model: its weights plus the activations of its largest batch.

    ``max_batch_size`` and ``max_seq_len`` are the options; the largest batch the batcher can run is
    ``largest_batch`` (texts, tokens each): at most ``max_batch_size`` texts in ``max_batch_tokens`` padded
    slots, or one text of ``max_seq_len`` alone, the one whose activations are the most (with ``batch_invariant``,
    whose passes hold one text each, always the latter)."""

    weight_bytes: int
    activation_bytes: int
    max_batch_size: int
    max_seq_len: int
    largest_batch: tuple[int, int] | None = None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes

    def describe(self) -> str:
        texts, tokens = self.largest_batch or (self.max_batch_size, self.max_seq_len)
        return (
            f"weights {self.weight_bytes / MiB:.1f} MiB, activations {self.activation_bytes / MiB:.1f} MiB "
            f"(batch {texts} x {tokens} tokens)"
        )


def largest_batch(cfg: EncoderConfig, config: EmbeddingConfig, dtype_bytes: int) -> tuple[int, int]:
    """The batch (texts, tokens each) of the most activation memory the batcher can form: at most
    ``max_batch_size`` texts whose padded slots fit ``max_batch_tokens``, or one text alone (up to the model's
    ``max_seq_len``). With ``batch_invariant`` every pass holds one text, so its largest is one of ``max_seq_len``."""
    best = (1, cfg.max_seq_len)
    if config.batch_invariant:
        return best
    most = -1
    for tokens in range(1, cfg.max_seq_len + 1):
        texts = min(config.max_batch_size, max(1, config.max_batch_tokens // tokens))
        nbytes = cfg.activation_bytes(texts, tokens, dtype_bytes)
        if nbytes >= most:
            best, most = (texts, tokens), nbytes
    return best


def plan_embedding(encoder_config: EncoderConfig, config: EmbeddingConfig) -> EmbeddingPlan:
    """The memory an embedding model needs, from its config alone (before loading)."""
    cfg = apply_max_seq_len(encoder_config, config)
    nbytes = config.dtype_bytes
    texts, tokens = largest_batch(cfg, config, nbytes)
    return EmbeddingPlan(
        weight_bytes=cfg.num_params * nbytes,
        activation_bytes=cfg.activation_bytes(texts, tokens, nbytes),
        max_batch_size=config.max_batch_size,
        max_seq_len=cfg.max_seq_len,
        largest_batch=(texts, tokens),
    )


@dataclass(eq=False)
class EmbedCall:
    """One ``embed()`` call: its texts' token ids, filled in by the engine thread."""

    ids: list[list[int]]
    arrival: float  # time.monotonic() when it was submitted
    tenant: str | None = None  # whom it is for: the batcher's turns go tenant by tenant (None: one group of its own)
    results: list[torch.Tensor | None] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False  # set by the event loop when the caller went away; its texts are skipped
    error: Exception | None = None  # the encoder failed on a batch holding one of its texts

    def __post_init__(self) -> None:
        self.results = [None] * len(self.ids)
        self.remaining = len(self.ids)

    def stacked(self) -> torch.Tensor:
        return torch.stack([r for r in self.results if r is not None])


@dataclass(frozen=True)
class EmbeddingStats:
    """What an embedding model's batcher did: calls, texts, batches and their sizes."""

    num_calls: int
    num_texts: int
    num_batches: int
    batch_sizes: dict[int, int]  # batch size -> how many batches had it
    num_tokens: int  # real tokens embedded
    num_padded_tokens: int  # tokens computed, padding included (none with batch_invariant: num_tokens)

    @property
    def mean_batch_size(self) -> float:
        return self.num_texts / self.num_batches if self.num_batches else 0.0


class EmbeddingBatcher:
    """The queue and the forward passes of one embedding model (engine thread only).

    ``add`` queues a call's texts; ``wait_time`` says how long until a batch is
    due; ``run_batch`` embeds up to ``max_batch_size`` texts and ``max_batch_tokens``
    token slots, one text of each waiting tenant in turn (the first to queue first),
    that tenant's calls taking its turns in turn (the oldest call first), and returns
    the calls it completed. Taking the calls in turn keeps one caller's many texts
    from holding the others back: a call of 2048 long texts shares every batch with
    the calls queued behind it, rather than running its 64 batches first. Taking the
    tenants in turn does the same for many calls: a tenant with 500 calls waiting
    gets one text in a round, as a tenant with one call does, rather than 500.
    ``busy_wait`` says how long a due batch must wait while generators are busy, so
    that the batches keep to ``max_busy_share`` of the engine thread's time.
    """

    def __init__(
        self, encoder: LoadedEncoder, config: EmbeddingConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.encoder = encoder
        self.config = config
        self.plan = plan_embedding(encoder.config, config)
        self._clock = clock
        # [call, index of its next text] by tenant, each tenant's calls in the order of their turns within its own
        self._queues: dict[str | None, deque[list[Any]]] = {}
        self._turns: deque[str | None] = deque()  # the tenants with calls queued, in the order of their turns
        self._waiting = 0  # texts of the queued calls not run yet
        self._calls = 0
        self._texts = 0
        self._batches = 0
        self._sizes: Counter[int] = Counter()
        self._tokens = 0
        self._padded = 0
        self._paced_until = -math.inf  # beside busy generators, no batch before this (max_busy_share)
        self._snapshot = self._stats()  # what other threads read: replaced whole, never mutated

    def add(self, call: EmbedCall) -> None:
        self._calls += 1
        if call.ids:
            queue = self._queues.get(call.tenant)
            if queue is None:  # a tenant with nothing queued: its turn comes after those of the tenants waiting
                queue = self._queues[call.tenant] = deque()
                self._turns.append(call.tenant)
            queue.append([call, 0])
            self._waiting += len(call.ids)
        self._snapshot = self._stats()

    def _entries(self) -> list[list[Any]]:
        """Every queued [call, index of its next text], all tenants'."""
        return [entry for queue in self._queues.values() for entry in queue]

    def _drop_cancelled(self) -> None:
        if any(call.cancelled for call, _ in self._entries()):
            for tenant in list(self._turns):
                queue = self._queues[tenant]
                for entry in [e for e in queue if e[0].cancelled]:
                    queue.remove(entry)
                    self._waiting -= len(entry[0].ids) - entry[1]
                if not queue:
                    del self._queues[tenant]
                    self._turns.remove(tenant)

    def wait_time(self) -> float | None:
        """Seconds until a batch is due: None when nothing waits, 0 when one is due now."""
        self._drop_cancelled()
        entries = self._entries()
        if not entries:
            return None
        if self._waiting >= self.config.max_batch_size:
            return 0.0
        if any(done for _, done in entries):  # the rest of a call some of whose texts ran: it waited once
            return 0.0
        waited = self._clock() - min(call.arrival for call, _ in entries)  # the turns reorder the queue
        return max(0.0, self.config.max_wait_ms / 1000.0 - waited)

    def busy_wait(self) -> float:
        """Seconds until a batch may run beside busy generators: 0 once the last batch's time has been
        matched by ``(1 - max_busy_share) / max_busy_share`` times as much of other work."""
        return max(0.0, self._paced_until - self._clock())

    def _pace(self, started: float) -> None:
        now = self._clock()
        share = self.config.max_busy_share
        self._paced_until = now + (now - started) * (1.0 - share) / share

    def _next_batch(self) -> list[tuple[EmbedCall, int]]:
        """Up to ``max_batch_size`` texts in ``max_batch_tokens`` padded slots (at least one text), one of each
        waiting tenant in turn, the tenant's text from its calls in turn (oldest call first), the turns going on
        from where the last batch stopped (each tenant that gave a text goes to the back, and so does its call
        within the tenant's own queue); taken off the queue."""
        self._drop_cancelled()
        size, slots = self.config.max_batch_size, self.config.max_batch_tokens
        batch: list[tuple[EmbedCall, int]] = []
        longest = 0
        while self._turns and len(batch) < size:
            tenant = self._turns[0]
            queue = self._queues[tenant]
            entry = queue[0]
            call, i = entry
            length = max(longest, len(call.ids[i]))
            if batch and length * (len(batch) + 1) > slots:
                return batch  # this tenant and call stay first: the next batch starts with them
            self._turns.popleft()
            queue.popleft()
            batch.append((call, i))
            longest = length
            self._waiting -= 1
            entry[1] += 1
            if entry[1] < len(call.ids):
                queue.append(entry)  # its next text waits for its tenant's other calls' turns
            if queue:
                self._turns.append(tenant)  # its next text waits for every other tenant's turn
            else:
                del self._queues[tenant]
        return batch

    def run_batch(self) -> list[EmbedCall]:
        """Embed the next batch (:meth:`_next_batch`); the calls this completed.

        If the encoder raises, every call with a text in the batch completes
        with ``error`` set (and its other queued texts are dropped)."""
        batch = self._next_batch()
        if not batch:
            return []
        ids = [call.ids[i] for call, i in batch]
        started = self._clock()
        try:
            # each text alone (batch_invariant: its vector depends on it only), or the batch's texts in one pass
            vectors = self.encoder.encode_each(ids) if self.config.batch_invariant else self.encoder.encode_ids(ids)
        except Exception as exc:  # noqa: BLE001 - the batch's calls fail, the engine keeps serving
            self._pace(started)
            failed = list(dict.fromkeys(call for call, _ in batch))
            for call in failed:
                call.error = exc
                call.cancelled = True  # its texts still queued are skipped
            return failed
        self._pace(started)
        self._batches += 1
        self._texts += len(batch)
        self._sizes[len(batch)] += 1
        tokens = sum(len(x) for x in ids)
        self._tokens += tokens
        # what ran: each text at its own length (batch_invariant), else every text at the batch's longest
        self._padded += tokens if self.config.batch_invariant else len(ids) * max(len(x) for x in ids)
        self._snapshot = self._stats()
        done: list[EmbedCall] = []
        for row, (call, i) in enumerate(batch):
            call.results[i] = vectors[row]
            call.remaining -= 1
            if call.remaining == 0:
                done.append(call)
        return done

    def take_all(self) -> list[EmbedCall]:
        """Empty the queue; the distinct calls that were waiting (to fail them)."""
        calls = [call for call, _ in self._entries() if not call.cancelled]
        self._queues.clear()
        self._turns.clear()
        self._waiting = 0
        return calls

    def stats(self) -> EmbeddingStats:
        """The figures as of the last call queued or batch run (safe to read from any thread)."""
        return self._snapshot

    def _stats(self) -> EmbeddingStats:
        return EmbeddingStats(
            num_calls=self._calls,
            num_texts=self._texts,
            num_batches=self._batches,
            batch_sizes=dict(sorted(self._sizes.items())),
            num_tokens=self._tokens,
            num_padded_tokens=self._padded,
        )
