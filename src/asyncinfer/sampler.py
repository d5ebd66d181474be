"""Turn one step's logits into next tokens, one row per live request.

Pipeline for a batch (row ``i`` belongs to ``states[i]``)::

    logits ─► penalties (repetition, frequency, presence) ─► min_tokens mask ─► grammar mask (structured rows)
           ├─► [logprobs are taken here: log_softmax of these "processed" logits]
           ├─► greedy rows: argmax (one batched call)
           └─► sampling rows: / temperature ─► top_k ─► top_p ─► min_p ─► draw

* **Fast path.** When every row is greedy with no penalties, no logprobs and no
  ``min_tokens``, the whole call is the step's own ``greedy_ids`` when the caller passes
  them (the kernels' one-call decode step computes them), else ``logits.argmax(-1).tolist()``:
  no copy of the logits, one device sync, no per-row tensor work.
* **Penalties** follow transformers / vLLM exactly: the repetition penalty (over
  prompt and output tokens) divides positive logits and multiplies negative ones
  (``RepetitionPenaltyLogitsProcessor``); then OpenAI's
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over
  output tokens only. They apply to greedy rows too, and are computed sparsely
  (gather/scatter over the (row, token) pairs that occur, not rows x vocab).
* **Structured rows** (a state with a grammar ``matcher``, ``SamplingParams.structured``) are sampled
  apart from the others: each matcher writes its row of one int32 bitmask (the tokens its grammar
  allows next), and :func:`asyncinfer.grammar.apply_token_bitmask` sets the rest of those rows to
  ``-inf`` after the penalties and the min_tokens mask, before logprobs, temperature and the filters
  (which so act on the allowed tokens only). Greedy structured rows take the argmax of their masked
  row, never the step's ``greedy_ids``. The other rows of the batch take exactly the path they would
  take without them (the fast path included), so their tokens do not change. The time spent on the
  masks is :attr:`SamplerOutput.mask_seconds` (and ``asyncinfer.structured_mask`` in a profile).
* **min_tokens.** While a request has fewer than ``min_tokens`` output tokens,
  the sampler's ``eos_token_ids`` and the request's ``stop_token_ids`` get ``-inf``.
* **ignore_eos** is *not* handled here: EOS stays sampleable, the engine core
  simply does not finish the request on it.
* **Drawing** uses the exponential-race (Gumbel-max) trick:
  ``argmax(logits - log(q))`` with ``q ~ Exp(1)`` of shape ``[vocab]``, which picks
  token ``i`` with probability ``softmax(logits)[i]``. A seeded request draws its
  ``q`` from its *own* generator (created lazily from ``params.seed`` on the
  sampler's device), exactly one ``[vocab]`` draw per sampled step, so its tokens
  depend only on its own history, not on the batch it lands in or its row.
  Unseeded rows share one sampler-wide generator. Temperatures below 1e-6 are
  raised to 1e-6 so the scaled logits stay finite.
* **Filtering** matches transformers' ``TopKLogitsWarper``, ``TopPLogitsWarper``
  and ``MinPLogitsWarper`` applied in that order (top_p on the distribution
  renormalised after top_k; min_p relative to the most likely survivor).
* **Logprobs** (when ``params.logprobs`` is not ``None``) are ``log_softmax`` of the
  logits *after* penalties and the min_tokens mask but *before* temperature and
  top-k/top-p/min-p filtering, i.e. the model's distribution as adjusted by the
  request's logit processors, independent of how it is sampled. The sampled
  token's logprob is always returned, plus the ``logprobs`` most likely tokens, equal logprobs
  ordered by token id (a grammar's forbidden tokens are all ``-inf``: the lowest ids among them), so
  a row's alternatives never depend on its neighbours' ``logprobs``.

The sampler never modifies the ``logits`` tensor it is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncinfer import kernels
from asyncinfer.errors import InvalidParameterError
from asyncinfer.grammar import GrammarMatcher, apply_token_bitmask, bitmask_words
from asyncinfer.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "TokenLogprobs"]

_NEG_INF = float("-inf")
# Temperatures below this are raised to it, so logits / temperature stays finite
# in float32 (such a row is argmax in all but exact ties).
_MIN_TEMPERATURE = 1e-6
#: The largest ``top_k`` found by ``torch.topk`` (its ``top_p`` among those candidates); a larger one alone is
#: found by its k-th value, and a ``top_p`` without one sorts the row (``Sampler._filter``).
SELECT_MAX_K = 1024


@dataclass(eq=False)
class SamplingState:
    """Per-request sampling state; one per live request, owned by the engine core.

    ``output_token_ids`` is appended to by the engine after each step.
    ``generator`` is created lazily by the sampler from ``params.seed`` (on the
    sampler's device) the first time a seeded request is sampled; leave it ``None``.
    ``plain_greedy`` (used by the fast path) is derived from ``params`` once, at
    construction: build a new state rather than replacing ``params``.
    ``matcher``: a structured request's grammar state (its own per sample), advanced by the
    engine with each token it accepts; the sampler only asks it for the next mask.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: GrammarMatcher | None = None
    # True when the row needs nothing but argmax (decided once, from the params).
    plain_greedy: bool = field(init=False, repr=False, default=False)
    #: ``params.stop_token_ids`` as a set, built once: a stop check per token that costs the same for any list.
    stop_token_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())
    # The prompt's and the output's token ids and counts, kept up to date a step at a time (penalties only).
    _counts: _TokenCounts | None = field(init=False, repr=False, default=None)
    # The columns min_tokens masks (EOS and stop token ids below the vocabulary), a tensor built once on the
    # sampler's device: each step masks them with it, never reading the ids as Python ints again.
    _blocked: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (p.greedy and not p.has_penalties and p.logprobs is None and p.min_tokens == 0
                             and self.matcher is None)
        self.stop_token_ids = frozenset(p.stop_token_ids or ())


class _TokenCounts:
    """One request's token ids for its penalties, brought up to date with only the tokens sampled since the last
    step (a step's cost for a request does not grow with its output):

    - ``ids`` / ``counts``: each distinct output token once, with how often it occurs (frequency / presence);
    - ``seen``: each distinct token of the prompt (within the vocabulary) and of the output once (repetition).

    Tensors on the sampler's device, grown by doubling; ``sync`` reads the output past ``counted`` (the engine only
    appends to it; :meth:`Sampler._counts` starts again from the prompt were it ever shorter)."""

    def __init__(self, prompt: Sequence[int], dev: torch.device, vocab: int) -> None:
        self.dev, self.vocab = dev, vocab
        self.in_prompt = {t for t in prompt if 0 <= t < vocab}
        self.slot: dict[int, int] = {}  # output token -> its index in ids / counts
        self.counted = 0
        self.n_ids = 0
        self._ids = torch.empty(16, dtype=torch.long, device=dev)
        self._counts = torch.zeros(16, dtype=torch.float32, device=dev)
        first = sorted(self.in_prompt)
        self.n_seen = len(first)
        self._seen = torch.empty(max(16, 2 * self.n_seen), dtype=torch.long, device=dev)
        self._seen[: self.n_seen] = torch.tensor(first, dtype=torch.long, device=dev)

    @staticmethod
    def _grown(buf: torch.Tensor, need: int, zero: bool) -> torch.Tensor:
        if need <= buf.numel():
            return buf
        bigger = (torch.zeros if zero else torch.empty)(max(need, 2 * buf.numel()), dtype=buf.dtype, device=buf.device)
        bigger[: buf.numel()] = buf
        return bigger

    def sync(self, output: Sequence[int]) -> None:
        new = output[self.counted :]
        if not new:
            return
        self.counted = len(output)
        slots: list[int] = []
        fresh: list[int] = []
        unseen: list[int] = []
        for t in new:
            at = self.slot.get(t)
            if at is None:
                at = self.slot[t] = self.n_ids + len(fresh)
                fresh.append(t)
                if t not in self.in_prompt:
                    unseen.append(t)
            slots.append(at)
        if fresh:
            end = self.n_ids + len(fresh)
            self._ids = self._grown(self._ids, end, zero=False)
            self._counts = self._grown(self._counts, end, zero=True)
            self._ids[self.n_ids : end] = torch.tensor(fresh, dtype=torch.long, device=self.dev)
            self.n_ids = end
        if unseen:
            end = self.n_seen + len(unseen)
            self._seen = self._grown(self._seen, end, zero=False)
            self._seen[self.n_seen : end] = torch.tensor(unseen, dtype=torch.long, device=self.dev)
            self.n_seen = end
        index = torch.tensor(slots, dtype=torch.long, device=self.dev)
        self._counts.index_add_(0, index, torch.ones(len(slots), dtype=torch.float32, device=self.dev))

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: self.n_ids]

    @property
    def counts(self) -> torch.Tensor:
        return self._counts[: self.n_ids]

    @property
    def seen(self) -> torch.Tensor:
        return self._seen[: self.n_seen]


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One step's result: ``token_ids[i]`` and ``logprobs[i]`` belong to ``states[i]``; ``mask_seconds``:
    the time spent computing and applying the structured rows' grammar masks (0 without any)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    mask_seconds: float = 0.0


class Sampler:
    """Batched sampler. See the module docstring for the exact semantics.

    ``vocab_size`` is the number of real tokens: logits columns beyond it (padded
    embeddings) are never chosen. ``eos_token_ids`` are masked while a request is
    below its ``min_tokens``. ``seed`` seeds the generator shared by unseeded
    sampling rows (``None``: seeded from the OS).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: tuple[int, ...] = (),
        *,
        seed: int | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # Shared generator for unseeded sampling rows; ``seed=None`` seeds it randomly.
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # The structured rows' bitmasks (int32, CPU), grown to the most rows a step has had.
        self._bitmask = torch.zeros((0, bitmask_words(self.vocab_size)), dtype=torch.int32)

    # ------------------------------------------------------------------ public

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState], *,
                 greedy_ids: Sequence[int] | None = None) -> SamplerOutput:
        """One token for each row of ``logits`` [len(states), vocab], as each state's parameters say.

        ``greedy_ids``: each row's argmax over all of its columns when the step computed it
        (:attr:`asyncinfer.runner.ModelOutput.greedy_ids`), else None. A batch of plain greedy rows
        (:attr:`SamplingState.plain_greedy`) takes them as they are; any other row is sampled from
        ``logits`` as if they were not given.

        Raises:
            ValueError: ``logits`` is not [len(states), >= vocab_size].
            InvalidParameterError: ``greedy_ids`` is not a list (or tuple) of ``len(states)`` ids. Its values
                are the runner's own argmax and are taken as they are (the sampler does not re-check them).
        """
        n = len(states)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [len(states)={n}, vocab], got {tuple(logits.shape)}")
        if greedy_ids is not None and (not isinstance(greedy_ids, (list, tuple)) or len(greedy_ids) != n):
            what = f"{len(greedy_ids)} ids" if isinstance(greedy_ids, (list, tuple)) else type(greedy_ids).__name__
            raise InvalidParameterError("greedy_ids", what, f"None or a list of one id a row ({n})")
        if n == 0:
            return SamplerOutput([], [])
        vocab = logits.shape[1]
        if vocab > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif vocab < self.vocab_size:
            raise ValueError(f"logits have {vocab} columns, fewer than vocab_size={self.vocab_size}")

        if all(s.plain_greedy for s in states):
            # Hot path: no copy, no per-row tensor work, one sync (asyncinfer's one-pass kernel where a
            # block-format model has loaded it: torch's argmax took ~40 us a row of 49,152 here).
            return SamplerOutput(self._greedy(logits, greedy_ids if vocab == self.vocab_size else None), [None] * n)
        structured = [i for i, s in enumerate(states) if s.matcher is not None]
        if not structured:
            return self._sample_general(logits, states)
        return self._split(logits, states, structured, greedy_ids if vocab == self.vocab_size else None)

    @staticmethod
    def _greedy(logits: torch.Tensor, greedy_ids: Sequence[int] | None) -> list[int]:
        """Each row's argmax: the step's own (over all columns: only when they are the real ones), else computed."""
        if greedy_ids is not None:
            return list(greedy_ids)
        if kernels.loaded() and kernels.argmax_takes(logits):
            return kernels.argmax(logits)
        return logits.argmax(dim=-1).tolist()

    def _split(self, logits: torch.Tensor, states: Sequence[SamplingState], structured: list[int],
               greedy_ids: Sequence[int] | None) -> SamplerOutput:
        """A batch with structured rows: those sampled on their own with their masks, the others as if alone."""
        n = len(states)
        dev = logits.device
        token_ids = [0] * n
        logprobs: list[TokenLogprobs | None] = [None] * n
        others = [i for i in range(n) if states[i].matcher is None]
        if others:
            if all(states[i].plain_greedy for i in others):
                ids = self._greedy(logits, greedy_ids)  # the rows' own argmax: the structured rows' are unused
                for i in others:
                    token_ids[i] = ids[i]
            else:
                rest = self._sample_general(logits[self._index(others, dev)], [states[i] for i in others], fresh=True)
                for j, i in enumerate(others):
                    token_ids[i], logprobs[i] = rest.token_ids[j], rest.logprobs[j]
        whole = len(structured) == n
        rows = logits if whole else logits[self._index(structured, dev)]
        done = self._sample_general(rows, [states[i] for i in structured], fresh=not whole)
        for j, i in enumerate(structured):
            token_ids[i], logprobs[i] = done.token_ids[j], done.logprobs[j]
        return SamplerOutput(token_ids, logprobs, done.mask_seconds)

    # ------------------------------------------------------------------ general path

    def _sample_general(self, logits: torch.Tensor, states: Sequence[SamplingState], *,
                        fresh: bool = False) -> SamplerOutput:
        """``fresh``: ``logits`` is a copy the sampler made (rows picked out of the step's): changed in place."""
        n = len(states)
        dev = logits.device
        x = logits if fresh and logits.dtype == torch.float32 else logits.to(dtype=torch.float32, copy=True)

        pen_rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        if pen_rows:
            self._apply_penalties(x, pen_rows, states)
        self._apply_min_tokens(x, states)
        mask_rows = [i for i, s in enumerate(states) if s.matcher is not None]
        mask_seconds = self._apply_grammars(x, mask_rows, states) if mask_rows else 0.0

        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        logp = None
        if lp_rows:
            logp = torch.log_softmax(x[self._index(lp_rows, dev)] if len(lp_rows) < n else x, dim=-1)

        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        if len(greedy_rows) == n:
            tokens = x.argmax(dim=-1)
        elif not greedy_rows:
            tokens = self._sample_rows(x, list(states))
        else:
            tokens = torch.empty(n, dtype=torch.long, device=dev)
            gi = self._index(greedy_rows, dev)
            tokens[gi] = x[gi].argmax(dim=-1)
            sample_rows = [i for i, s in enumerate(states) if not s.params.greedy]
            si = self._index(sample_rows, dev)
            tokens[si] = self._sample_rows(x[si], [states[i] for i in sample_rows])

        if logp is None:
            return SamplerOutput(tokens.tolist(), [None] * n, mask_seconds)
        out = self._with_logprobs(tokens, logp, lp_rows, states)
        out.mask_seconds = mask_seconds
        return out

    def _apply_grammars(self, x: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> float:
        """Mask ``x``'s structured ``rows`` to the tokens their grammars allow next, in place; returns the seconds."""
        start = time.perf_counter()
        with torch.profiler.record_function("asyncinfer.structured_mask"):
            if self._bitmask.shape[0] < len(rows):
                self._bitmask = torch.zeros((len(rows), self._bitmask.shape[1]), dtype=torch.int32)
            bitmask = self._bitmask
            for j, i in enumerate(rows):
                matcher = states[i].matcher
                assert matcher is not None
                matcher.fill(bitmask, j)
            if len(rows) == x.shape[0]:
                apply_token_bitmask(x, bitmask)
            else:
                index = self._index(rows, x.device)
                part = x[index]
                apply_token_bitmask(part, bitmask)
                x[index] = part
        return time.perf_counter() - start

    @staticmethod
    def _index(rows: list[int], dev: torch.device) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=dev)

    def _apply_penalties(self, x: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
        """Repetition, then frequency/presence penalties, in place on ``x``.

        Sparse: only the (row, token) pairs that occur are gathered, changed and written back, from each
        request's :class:`_TokenCounts` (kept up to date with the step's new tokens only), so the cost grows
        with the distinct tokens of the penalized rows, not rows * vocab, and nothing is sorted or rebuilt
        from the whole output at every step.
        """
        dev, vocab = x.device, x.shape[1]
        counts = {i: self._counts(states[i], dev, vocab) for i in rows}

        rep_rows = [i for i in rows if states[i].params.repetition_penalty != 1.0 and counts[i].n_seen]
        if rep_rows:  # over prompt + output, each distinct token once
            r = torch.cat([torch.full((counts[i].n_seen,), i, dtype=torch.long, device=dev) for i in rep_rows])
            t = torch.cat([counts[i].seen for i in rep_rows])
            penalty = self._per_row([s.params.repetition_penalty for s in states], dev)[r]
            vals = x[r, t]
            x[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)

        freq_rows = [i for i in rows if (states[i].params.frequency_penalty or states[i].params.presence_penalty)
                     and counts[i].n_ids]
        if freq_rows:
            r = torch.cat([torch.full((counts[i].n_ids,), i, dtype=torch.long, device=dev) for i in freq_rows])
            t = torch.cat([counts[i].ids for i in freq_rows])
            occurrences = torch.cat([counts[i].counts for i in freq_rows])
            freq = self._per_row([s.params.frequency_penalty for s in states], dev)[r]
            pres = self._per_row([s.params.presence_penalty for s in states], dev)[r]
            x[r, t] -= freq * occurrences + pres

    @staticmethod
    def _per_row(values: list[float], dev: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev)

    @staticmethod
    def _counts(state: SamplingState, dev: torch.device, vocab: int) -> _TokenCounts:
        counts = state._counts
        if (counts is None or counts.dev != dev or counts.vocab != vocab
                or len(state.output_token_ids) < counts.counted):  # the engine only appends; else count again
            counts = state._counts = _TokenCounts(state.prompt_token_ids, dev, vocab)
        counts.sync(state.output_token_ids)
        return counts

    def _apply_min_tokens(self, x: torch.Tensor, states: Sequence[SamplingState]) -> None:
        """Mask EOS and the stop token ids of each row still below its ``min_tokens``, in place. Each row's columns
        are a tensor built at its first masked step: a step's mask costs one fill per row, whatever its ids (their
        lists, 4096 ids a row, were built and turned into index tensors again at every step: 2.7 ms a row on the
        default model's vocabulary, as much as sampling it, and 64 times that for ``n = 64``)."""
        vocab = x.shape[1]
        for i, s in enumerate(states):
            p = s.params
            if p.min_tokens and len(s.output_token_ids) < p.min_tokens:
                blocked = s._blocked
                if blocked is None or blocked.device != x.device:
                    cols = sorted(t for t in s.stop_token_ids.union(self.eos_token_ids) if t < vocab)
                    blocked = s._blocked = torch.tensor(cols, dtype=torch.long, device=x.device)
                if blocked.numel():
                    x[i].index_fill_(0, blocked, _NEG_INF)

    def _sample_rows(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Sample one token per row of ``x`` (a fresh tensor, modified in place)."""
        dev = x.device
        params = [s.params for s in states]
        temps = [max(float(p.temperature), _MIN_TEMPERATURE) for p in params]
        x.div_(torch.tensor(temps, dtype=torch.float32, device=dev)[:, None])
        x = self._filter(x, params)

        noise = torch.empty_like(x)
        unseeded: list[int] = []
        for j, s in enumerate(states):
            if s.params.seed is None:
                unseeded.append(j)
                continue
            gen = s.generator
            if gen is None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(s.params.seed)
                s.generator = gen
            noise[j].exponential_(generator=gen)
        if len(unseeded) == len(states):
            noise.exponential_(generator=self._generator)
        elif unseeded:
            ui = self._index(unseeded, dev)
            noise[ui] = torch.empty(len(unseeded), x.shape[1], device=dev).exponential_(generator=self._generator)
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        # argmax(p / q) == argmax(logits - log q): the exponential race / Gumbel-max trick.
        return (x - noise.log_()).argmax(dim=-1)

    @staticmethod
    def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """top_k, then top_p (on the renormalised survivors), then min_p; removed logits -> -inf.

        A row is sorted whole only when it needs the order of its whole vocabulary: ``top_p`` with no ``top_k``
        of at most :data:`SELECT_MAX_K`, whose nucleus is not within its first :data:`SELECT_MAX_K` tokens. A
        row's ``top_k`` up to that is found with ``torch.topk`` (its ``top_p`` among those candidates, already in
        order), a ``top_p`` alone among that many candidates first, a larger ``top_k`` alone by its k-th value
        (``torch.kthvalue``, one pass). A sort of every row cost 5 to 6 ms a row of 49,152 columns on one thread
        (half a decode step of the default model) for any ``top_k``: ``top_k=50`` took 25 times what it needs.
        """
        _, vocab = x.shape
        dev = x.device
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        need_m = any(p.min_p > 0.0 for p in params)
        picked = [i for i, k in enumerate(ks) if k <= SELECT_MAX_K and k < vocab]
        by_kth = [i for i, (k, p) in enumerate(zip(ks, params)) if SELECT_MAX_K < k < vocab and p.top_p >= 1.0]
        chosen = set(picked) | set(by_kth)
        sorted_rows = [i for i, p in enumerate(params) if i not in chosen and p.top_p < 1.0]
        if not (picked or by_kth or sorted_rows):
            return Sampler._min_p(x, params) if need_m else x
        out = x
        if sorted_rows and vocab > SELECT_MAX_K:
            sorted_rows = Sampler._small_nuclei(out, [i for i in sorted_rows if ks[i] == vocab], params) + [
                i for i in sorted_rows if ks[i] < vocab]
        if by_kth:  # keep what is at least the k-th largest value (transformers' TopKLogitsWarper: ties stay)
            for k in sorted({ks[i] for i in by_kth}):
                rows = Sampler._index([i for i in by_kth if ks[i] == k], dev)
                part = out[rows]
                kth = torch.kthvalue(part, vocab - k + 1, dim=-1, keepdim=True).values
                out[rows] = part.masked_fill_(part < kth, _NEG_INF)
        # One call per top_k (a row's candidates among equal values must not depend on its neighbours' k).
        groups = [([i for i in picked if ks[i] == k], False) for k in sorted({ks[i] for i in picked})]
        for group, whole in [*groups, (sorted_rows, True)]:
            if not group:
                continue
            rows = Sampler._index(group, dev)
            part = out[rows]
            gk = [ks[i] for i in group]
            width = vocab if whole else max(gk)
            if whole:
                sorted_x, order = torch.sort(part, dim=-1, descending=True)
            else:
                sorted_x, order = torch.topk(part, width, dim=-1, sorted=True)
            if any(k < width for k in gk):
                k_t = torch.tensor(gk, dtype=torch.long, device=dev)
                ranks = torch.arange(width, device=dev)
                sorted_x.masked_fill_(ranks[None, :] >= k_t[:, None], _NEG_INF)
            if any(params[i].top_p < 1.0 for i in group):
                # Keep a token while the mass strictly before it is < top_p; rows with
                # top_p == 1 use +inf so float rounding of the cumsum can't drop the tail.
                # (A row's columns past its candidates are removed, so its softmax over them is the row's.)
                p_t = torch.tensor([float(params[i].top_p) if params[i].top_p < 1.0 else float("inf")
                                    for i in group], dtype=torch.float32, device=dev)
                probs = sorted_x.softmax(dim=-1)
                Sampler._cut_nucleus(sorted_x, probs.cumsum(dim=-1) - probs, p_t)
            out[rows] = torch.full_like(part, _NEG_INF).scatter_(1, order, sorted_x)
        return Sampler._min_p(out, params) if need_m else out

    @staticmethod
    def _cut_nucleus(sorted_x: torch.Tensor, before: torch.Tensor, p_t: torch.Tensor) -> None:
        """Remove (-inf, in place) each token of rows sorted most likely first whose mass ``before`` it reaches the
        row's ``top_p``; the first token always stays."""
        remove = before >= p_t[:, None]
        remove[:, 0] = False
        sorted_x.masked_fill_(remove, _NEG_INF)

    @staticmethod
    def _small_nuclei(x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> list[int]:
        """Apply ``top_p`` in place to the ``rows`` (no ``top_k``) whose nucleus lies within their
        :data:`SELECT_MAX_K` most likely tokens (``torch.topk``'s candidates, in order: the mass before each is
        that of the row's sorted prefix); returns the others, for a sort of the whole row."""
        if not rows:
            return []
        dev = x.device
        index = Sampler._index(rows, dev)
        part = x[index]
        cand_x, order = torch.topk(part, SELECT_MAX_K, dim=-1, sorted=True)
        probs = (cand_x - torch.logsumexp(part, dim=-1, keepdim=True)).exp()
        p_t = torch.tensor([float(params[i].top_p) for i in rows], dtype=torch.float32, device=dev)
        cum = probs.cumsum(dim=-1)
        fits = (cum[:, -1] >= p_t).tolist()  # what follows the candidates has at least this much before it
        if not any(fits):
            return rows
        Sampler._cut_nucleus(cand_x, cum - probs, p_t)
        done = [j for j, fit in enumerate(fits) if fit]
        pick = Sampler._index(done, dev)
        x[Sampler._index([rows[j] for j in done], dev)] = torch.full_like(part[pick], _NEG_INF).scatter_(
            1, order[pick], cand_x[pick])
        return [i for i, fit in zip(rows, fits) if not fit]

    @staticmethod
    def _min_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        m_t = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=x.device)
        probs = x.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        return x.masked_fill_(probs < m_t[:, None] * top, _NEG_INF)

    @staticmethod
    def _top_alternatives(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """Each row's ``k`` most likely tokens, ``(id, logprob)`` by logprob and, among equal ones, by id.

        ``torch.topk`` orders ties as its kernel meets them, which depends on ``k`` (the largest ``logprobs``
        of the step's rows) and on the rows: a structured row's forbidden tokens are all ``-inf``, and the
        alternatives it reported among them changed with a neighbour's ``logprobs``. Each row's list is a
        prefix of one total order (logprob descending, id ascending), so it depends on the row alone. One more
        column than asked shows where the k-th value's ties go past the cut; a cut among ``-inf`` ties (a
        grammar's forbidden tokens) takes the lowest ids outside the row's finite ones, with no pass over the
        vocabulary; only a cut among equal finite values (rare) looks at the whole row.
        """
        vocab = logp.shape[1]
        vals, idx = torch.topk(logp, min(k + 1, vocab), dim=-1)
        vals_list, idx_list = vals.tolist(), idx.tolist()
        rows: list[list[tuple[int, float]]] = []
        finite_cuts: list[int] = []
        for j, (vs, ids) in enumerate(zip(vals_list, idx_list)):
            last = vs[k - 1]
            ordered = sorted(zip(vs[:k], ids[:k]), key=lambda p: (-p[0], p[1]))
            if len(vs) == k or vs[k] != last:  # every column of the k-th value is in: only their order to fix
                rows.append([(t, v) for v, t in ordered])
                continue
            above = [(t, v) for v, t in ordered if v > last]
            if last == -torch.inf:
                taken = {t for t, _ in above}
                lowest = (t for t in range(vocab) if t not in taken)
                rows.append(above + [(next(lowest), last) for _ in range(k - len(above))])
            else:
                rows.append(above)
                finite_cuts.append(j)
        if finite_cuts:
            cut = torch.tensor(finite_cuts, dtype=torch.long, device=logp.device)
            part = logp[cut]
            equal = part == vals[cut, k - 1:k]
            key = torch.arange(vocab, 0, -1, dtype=torch.int64, device=logp.device)  # the lowest id, the largest key
            _, lowest_ids = torch.topk(equal * key, k, dim=-1)
            for j, ids in zip(finite_cuts, lowest_ids.tolist()):
                last = vals_list[j][k - 1]
                rows[j] += [(t, last) for t in ids[:k - len(rows[j])]]
        return rows

    @staticmethod
    def _with_logprobs(
        tokens: torch.Tensor, logp: torch.Tensor, lp_rows: list[int], states: Sequence[SamplingState]
    ) -> SamplerOutput:
        n = len(states)
        dev = tokens.device
        lp_tokens = tokens if len(lp_rows) == n else tokens[Sampler._index(lp_rows, dev)]
        chosen = logp.gather(1, lp_tokens[:, None]).squeeze(1)
        top_n = min(max(states[i].params.logprobs or 0 for i in lp_rows), logp.shape[1])
        token_list = tokens.tolist()
        chosen_list = chosen.tolist()
        tops = Sampler._top_alternatives(logp, top_n) if top_n > 0 else []
        out: list[TokenLogprobs | None] = [None] * n
        for j, i in enumerate(lp_rows):
            want = states[i].params.logprobs or 0
            top = tops[j][:want] if want else []
            out[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen_list[j], top=top)
        return SamplerOutput(token_list, out)
