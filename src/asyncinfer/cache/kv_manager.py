"""Per-request block tables over the block pool: the verbs schedulers use.

Plain Python. A request's table covers exactly ``ceil(tokens / block_size)``
blocks for the tokens it has asked slots for, so the waste is at most one
partial block per request. A failed allocation changes nothing and returns
``False``; it never raises from inside a step.

Prefix caching (``enable_prefix_caching``): when an allocation makes a block
full, the block is registered under its chained hash (see
:mod:`asyncinfer.cache.prefix`); :meth:`KVCacheManager.lookup_prefix` finds the
longest registered chain for a new request, and ``allocate(..., prefix=hit)``
takes those blocks instead of computing them again. A block is registered when
slots are allocated for the tokens that fill it, i.e. in the step that computes
it: a request admitted later in the same step may already share it, because
the forward pass writes every new key/value before any attention reads them.

Copy-on-write: blocks may be shared (prefix hits, :meth:`KVCacheManager.fork`
for ``n > 1`` samples). A request that is about to write into a block somebody
else also holds gets a fresh copy first; the copies are queued and handed to
the engine core by :meth:`KVCacheManager.commit_step`, which applies them to
the physical K/V tensors before the forward pass.

A step that fails (the scheduler, the forward pass or the sampler raised) is
undone with :meth:`KVCacheManager.discard_step` before its requests are freed:
the blocks it was to compute leave the prefix cache (their contents were never,
or only partly, written) and the copies it queued are dropped.

Sliding windows (``sliding_window=W``, a model whose every layer attends within
its last ``W`` positions: ``ModelConfig.kv_window``): a query at position ``p``
reads the keys ``p - W + 1 .. p`` only, in every layer, so a block whose
positions all lie before ``p - W + 1`` is never read again once the request's
computed tokens reach ``p``. Each allocation for a request whose next query is
at ``p`` (its ``num_computed_tokens``, or the prefix hit's length) gives such
blocks back first: the table drops its reference (a block shared with another
request stays with it; one nobody else holds goes back to the free queue,
still cached if it was) and the entry becomes :data:`RELEASED_BLOCK`. Released
entries are always the table's first ones. While a request decodes it then
holds at most ``ceil((W - 1) / block_size) + 1`` blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncinfer.cache.block_pool import BlockPool
from asyncinfer.cache.prefix import NO_HIT, HashFn, PrefixHit, block_tokens, chain_hash, root_hash, root_link
from asyncinfer.errors import InvalidParameterError

if TYPE_CHECKING:
    from asyncinfer.request import Request


RELEASED_BLOCK = 0
"""What a block table holds in place of a block given back because it lies wholly before the request's
sliding window. A valid block id, so tables stay rectangular for the runner (which pads them with block 0
too): attention reads its slots only under the window's mask, or not at all (the kernels start at the
window). It is not held by the table: ``KVCacheManager.num_released_blocks`` says how many leading entries
are released."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` slots."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the cache's figures (later exported as metrics).

    Block counts: ``used_blocks + free_blocks == num_blocks``; ``cached_free_blocks``
    of the free ones still hold a cached prefix (reusable until evicted).
    Slots: ``allocated_slots`` is every used block's ``block_size`` slots,
    ``filled_slots`` those holding a token (a shared block counts once).
    Prefix cache: ``prefix_queries`` and ``prefix_hits`` count tokens of the
    requests admitted with caching on, and of those, the ones taken from the cache.
    ``window_releases``: block references tables gave back because the blocks lay
    wholly before their request's sliding window.
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    usage: float
    allocated_slots: int
    filled_slots: int
    preemptions: int
    cached_free_blocks: int = 0
    cached_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    cow_copies: int = 0
    evictions: int = 0
    window_releases: int = 0

    @property
    def waste(self) -> float:
        """Fraction of allocated slots that hold no token (partial last blocks)."""
        if self.allocated_slots == 0:
            return 0.0
        return 1.0 - self.filled_slots / self.allocated_slots

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of queried tokens served from the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(slots=True)
class _Table:
    """One request's blocks and, for prefix caching, its hash chain."""

    blocks: list[int]
    num_slots: int = 0
    # The first `released` entries of `blocks` are RELEASED_BLOCK: given back, wholly before the window.
    released: int = 0
    # The request whose tokens fill the table (None when only an id was given:
    # then its blocks are never registered in the prefix cache).
    request: Request | None = None
    # The root of its hash chain: the request's cache salt, with its prefix group where the manager has them.
    salt: Hashable = None
    epoch: int = 0
    # For full block j: its chain hash, and the link a successor uses as parent
    # (None once the chain broke: nothing after it is registered).
    hashes: list[int | None] = field(default_factory=list)
    links: list[Hashable | None] = field(default_factory=list)


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Verbs for schedulers (all return ``False`` and change nothing when memory is short):

    - :meth:`lookup_prefix` (read-only) then :meth:`allocate` for a new request;
    - :meth:`append_slots` for a running one;
    - :meth:`can_allocate` / :meth:`num_blocks_needed` to ask first;
    - :meth:`free` / :meth:`preempt` to give blocks back.

    ``allocate_slots(request_or_id, total_tokens)`` is the older spelling of the
    same growth in absolute token counts. ``watermark_blocks`` free blocks are
    kept back from *new* admissions so that running decodes do not stall at once.
    Free blocks include cached ones: taking them evicts their prefix.

    ``prefix_group``: None, or a request's group, taken when its table is created; requests share cached blocks
    only within one group and one cache salt (a longrope model's requests longer than its original context
    compute other K for the same tokens: ``loading.build_core`` groups them by
    :meth:`asyncinfer.models.layers.RopeRows.long`).

    ``sliding_window``: None, or the window every layer of the model attends within (``ModelConfig.kv_window``):
    blocks wholly before a request's window are given back as it grows (see the module docstring).

    Raises:
        InvalidParameterError: ``sliding_window`` that is not None or a positive int.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        *,
        enable_prefix_caching: bool = False,
        hash_fn: HashFn = hash,
        prefix_group: Callable[[Request], Hashable] | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise InvalidParameterError("sliding_window", sliding_window, "None or an int >= 1")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.watermark_blocks = int(num_blocks * watermark)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        # Requests share cached blocks only within one group (beside the salt): where the model computes other
        # K/V for the same tokens in different requests (a longrope model's long requests, models.layers.RopeRows).
        self.prefix_group = prefix_group
        self.sliding_window = sliding_window
        self._tables: dict[str, _Table] = {}
        self._epoch = 0  # bumped by reset_prefix_cache: older tables stop registering
        self._pending: dict[int, str] = {}  # registered this step, not computed yet -> owner
        self._committed: list[int] = []  # the last commit_step's _pending: computed once its step succeeds
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), for commit_step
        # The engine's one preemption counter: grows in preempt() only. KVCacheStats.preemptions
        # and the core's StepStats.preemptions are read from it; each Request counts its own.
        self.num_preemptions = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_cow_copies = 0
        self.num_window_releases = 0  # block references given back for lying wholly before a window

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (cached ones included: they are evicted on demand)."""
        return self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in order, its first :meth:`num_released_blocks` ones :data:`RELEASED_BLOCK`."""
        table = self._tables.get(request_id)
        return table.blocks if table is not None else []

    def num_released_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table given back because they lie wholly before its window."""
        table = self._tables.get(request_id)
        return table.released if table is not None else 0

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's table holds (its entries less the released ones)."""
        table = self._tables.get(request_id)
        return len(table.blocks) - table.released if table is not None else 0

    def num_slots(self, request_id: str) -> int:
        """Token slots the request has asked for (its table covers them)."""
        table = self._tables.get(request_id)
        return table.num_slots if table is not None else 0

    def request_ids(self) -> list[str]:
        """Ids of the requests that hold a table."""
        return list(self._tables)

    def num_blocks_needed(
        self, request: Request | str, total_tokens: int, *, prefix: PrefixHit | None = None
    ) -> int:
        """Free blocks that growing the table to ``total_tokens`` slots would take.

        New blocks, plus copies of shared blocks the new slots fall in, plus
        (for a new request with a prefix hit) cached blocks taken off the free queue,
        less the blocks the growth gives back to the free queue first (those wholly
        before a sliding window that nobody else holds); never below 0.
        """
        rid = _request_id(request)
        table = self._tables.get(rid)
        start = self._query_start(table, None if isinstance(request, str) else request, prefix)
        return max(0, self._cost(table, total_tokens, prefix, start))

    def can_allocate(
        self,
        request: Request | str,
        total_tokens: int,
        *,
        new_request: bool = False,
        prefix: PrefixHit | None = None,
    ) -> bool:
        """Whether :meth:`allocate_slots` would succeed (new requests respect the watermark)."""
        need = self.num_blocks_needed(request, total_tokens, prefix=prefix)
        return self._fits(need, new_request)

    def _fits(self, need: int, new_request: bool) -> bool:
        reserve = self.watermark_blocks if new_request else 0
        return need + reserve <= self.pool.num_free_blocks

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """The longest cached chain of the request's full blocks (read-only).

        Always leaves the last known token to compute, so the step that runs
        it produces logits. Empty when caching is off or the request already
        holds blocks. Pass the result to :meth:`allocate` right away.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return NO_HIT
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return NO_HIT
        tokens = request.all_token_ids
        salt = self._root_key(request)
        parent_hash = root_hash(salt, self.hash_fn)
        link: Hashable = root_link(salt)
        blocks: list[int] = []
        hashes: list[int] = []
        links: list[Hashable] = []
        for j in range(max_blocks):
            toks = block_tokens(tokens, j, bs)
            parent_hash = chain_hash(parent_hash, toks, self.hash_fn)
            block = self.pool.lookup(parent_hash, toks, link)
            if block is None:
                break
            link = block.prefix_id
            blocks.append(block.block_id)
            hashes.append(parent_hash)
            links.append(link)
        return PrefixHit(tuple(blocks), len(blocks) * bs, tuple(hashes), tuple(links))

    # ---------------------------------------------------------------- mutations
    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        prefix: PrefixHit | None = None,
        new_request: bool = False,
    ) -> bool:
        """Slots for ``num_new_tokens`` more tokens of ``request``; ``False`` changes nothing.

        With ``prefix`` (from :meth:`lookup_prefix`, for a request holding no
        blocks) the table starts with the cached blocks and the new tokens come
        after ``prefix.num_tokens``; the caller then sets
        ``request.num_computed_tokens = prefix.num_tokens``. Without it they come
        after ``request.num_computed_tokens``. ``new_request`` keeps the watermark free.
        """
        start = prefix.num_tokens if prefix else request.num_computed_tokens
        return self.allocate_slots(request, start + num_new_tokens, new_request=new_request, prefix=prefix)

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Slots for a running request's next ``num_new_tokens`` (copying a shared block it writes into)."""
        return self.allocate_slots(request, request.num_computed_tokens + num_new_tokens)

    def allocate_slots(
        self,
        request: Request | str,
        total_tokens: int,
        *,
        new_request: bool = False,
        prefix: PrefixHit | None = None,
    ) -> bool:
        """Grow the request's table to cover ``total_tokens`` slots; ``False`` changes nothing.

        Given a :class:`Request` (rather than its id) the table can register its
        full blocks in the prefix cache. With a sliding window, blocks wholly before
        the window of the request's next query (at its ``num_computed_tokens``, or
        after the prefix hit) are given back first (a request known only by its id,
        whose table was never given the request, gives nothing back).
        """
        rid = _request_id(request)
        req = None if isinstance(request, str) else request
        table = self._tables.get(rid)
        if prefix:
            if table is not None or req is None:
                raise ValueError(f"a prefix hit is for a request that holds no blocks ({rid!r} does)")
            self._check_fresh(prefix)
        start = self._query_start(table, req, prefix)
        if not self._fits(self._cost(table, total_tokens, prefix, start), new_request):
            return False
        dead = self._dead_blocks(start)
        if table is None:
            table = self._new_table(req, prefix or NO_HIT, dead)
            self._tables[rid] = table
        else:
            if req is not None and table.request is None:
                table.request = req
            self._release(table, dead)
        self._copy_on_write(table, total_tokens)
        missing = blocks_for(total_tokens, self.block_size) - len(table.blocks)
        if missing > 0:
            new_blocks = self.pool.allocate(missing)
            assert new_blocks is not None  # can_allocate counted them
            table.blocks.extend(new_blocks)
        table.num_slots = max(table.num_slots, total_tokens)
        self._register_full_blocks(rid, table)
        return True

    def fork(self, parent_id: str, child: Request | str, num_tokens: int | None = None) -> None:
        """Give ``child`` a table sharing the parent's blocks for its first ``num_tokens`` slots.

        For ``n > 1`` samples of one prompt: nothing is copied now; the first
        write into a shared, partly filled block copies it (see :meth:`commit_step`).
        ``num_tokens`` defaults to every slot the parent has.
        """
        parent = self._tables.get(parent_id)
        child_id = _request_id(child)
        if parent is None:
            raise ValueError(f"cannot fork {parent_id!r}: it holds no blocks")
        if child_id in self._tables:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        num_tokens = parent.num_slots if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= parent.num_slots:
            raise ValueError(f"num_tokens must be in [0, {parent.num_slots}], got {num_tokens}")
        blocks = parent.blocks[: blocks_for(num_tokens, self.block_size)]
        released = min(parent.released, len(blocks))
        if released > self._dead_blocks(num_tokens):
            raise ValueError(
                f"cannot fork {parent_id!r} at {num_tokens} tokens: blocks the window of a query there reads "
                "were already given back"
            )
        self.pool.share(blocks[released:])
        full = num_tokens // self.block_size
        self._tables[child_id] = _Table(
            blocks=list(blocks),
            num_slots=num_tokens,
            released=released,
            request=None if isinstance(child, str) else child,
            salt=parent.salt,
            epoch=parent.epoch,
            hashes=parent.hashes[:full],
            links=parent.links[:full],
        )

    def free(self, request_id: str) -> None:
        """Return every block of the request (idempotent: freeing twice is a no-op).

        Blocks it registered in this step and never computed leave the prefix
        cache. Raises ``RuntimeError`` if another request already shares such a
        block: a scheduler freed a request after scheduling it in the same step,
        which the scheduler contract forbids.
        """
        table = self._tables.get(request_id)
        if table is None:
            return
        held = table.blocks[table.released :]
        uncomputed = [b for b in held if self._pending.get(b) == request_id]
        shared = [b for b in uncomputed if self.pool.blocks[b].ref_cnt > 1]
        if shared:
            raise RuntimeError(
                f"request {request_id!r} was freed in the step that scheduled it, but blocks {shared} it was "
                "to compute are already shared by requests admitted after it: preempt before you admit"
            )
        del self._tables[request_id]
        for block_id in uncomputed:
            del self._pending[block_id]
            self.pool.unregister(block_id)
        # Reverse order: a request's last blocks are the least likely to be
        # shared, so they should be the first ones reused (evicted).
        self.pool.free(reversed(held))

    def preempt(self, request_id: str) -> None:
        """Free a running request's blocks so it can be recomputed later; counts one preemption."""
        self.free(request_id)
        self.num_preemptions += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of entries dropped.

        Requests holding tables stop registering blocks (their keys/values may
        come from a model version that is being replaced); new requests start
        a fresh cache. Call it at a step boundary.
        """
        self._epoch += 1
        self._pending.clear()
        return self.pool.reset_prefix_cache()

    def commit_step(self) -> list[tuple[int, int]]:
        """Close this step's scheduling: the copy-on-write pairs to apply before the forward pass.

        The engine core calls it once per step, after ``schedule()``; from then
        on the blocks registered in this step count as computed. Returned pairs
        ``(src, dst)`` all read the blocks' contents as they were before this
        step (a chain ``a -> b -> c`` is returned as ``a -> b, a -> c``) and no
        ``dst`` repeats, so they can be applied in one batched gather/scatter.
        """
        self._committed = list(self._pending)
        self._pending.clear()
        copies, self._copies = self._copies, []
        origin: dict[int, int] = {}
        for src, dst in copies:
            origin[dst] = origin.get(src, src)
        return [(src, dst) for dst, src in origin.items()]

    def discard_step(self, *, committed: bool) -> int:
        """Undo the prefix-cache entries and copies of a step that failed; returns the entries dropped.

        Call it right after the failure, before freeing the step's requests.
        ``committed``: whether :meth:`commit_step` ran for the failed step (the
        failure came in the copies, the forward pass, the sampler or the update)
        or not (``schedule`` itself raised). Either way the blocks the step
        registered and was to compute leave the prefix cache — nothing may hit
        contents that were never written — and copy-on-write pairs not handed
        out yet are dropped (their destination blocks belong to the failed
        requests). The blocks stay with their tables until those are freed.
        """
        blocks = self._committed if committed else list(self._pending)
        for block_id in blocks:
            self.pool.unregister(block_id)
        self._pending.clear()
        self._committed = []
        self._copies.clear()
        return len(blocks)

    def stats(self) -> KVCacheStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        # list() first: the engine reads stats from another thread than the one stepping.
        for table in list(self._tables.values()):
            for j in range(table.released, len(table.blocks)):
                block_id = table.blocks[j]
                filled = min(bs, table.num_slots - j * bs)
                if filled > fill.get(block_id, 0):
                    fill[block_id] = filled
        used = self.pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=self.pool.num_free_blocks,
            usage=used / self.num_blocks,
            allocated_slots=used * bs,
            filled_slots=sum(fill.values()),
            preemptions=self.num_preemptions,
            cached_free_blocks=self.pool.num_cached_free_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            prefix_queries=self.num_prefix_queries,
            prefix_hits=self.num_prefix_hits,
            cow_copies=self.num_cow_copies,
            evictions=self.pool.num_evictions,
            window_releases=self.num_window_releases,
        )

    # ----------------------------------------------------------------- helpers
    def _cost(self, table: _Table | None, total_tokens: int, prefix: PrefixHit | None, start: int | None) -> int:
        """Net free blocks the growth takes: new blocks, copies and revived cached blocks, less the blocks it
        gives back to the free queue first (wholly before the window of a query at ``start``, held by nobody
        else). Negative when it gives back more than it takes."""
        blocks = self.pool.blocks
        dead = self._dead_blocks(start)
        want = blocks_for(total_tokens, self.block_size)
        if table is None:
            hit: tuple[int, ...] = prefix.block_ids if prefix else ()
            revived = sum(1 for b in hit[dead:] if blocks[b].ref_cnt == 0)
            return max(0, want - len(hit)) + revived
        copies = 0
        if total_tokens > table.num_slots:
            for i in range(max(table.num_slots // self.block_size, dead), min(len(table.blocks), want)):
                if blocks[table.blocks[i]].ref_cnt > 1:
                    copies += 1
        given_back = sum(1 for b in table.blocks[table.released : dead] if blocks[b].ref_cnt == 1)
        return max(0, want - len(table.blocks)) + copies - given_back

    def _query_start(self, table: _Table | None, request: Request | None, prefix: PrefixHit | None) -> int | None:
        """The position of the request's next query: after the prefix hit, else its computed tokens (None for a
        request known only by its id)."""
        if prefix:
            return prefix.num_tokens
        if request is None and table is not None:
            request = table.request
        return None if request is None else request.num_computed_tokens

    def _dead_blocks(self, start: int | None) -> int:
        """Leading blocks wholly before the window of a query at ``start``: its keys are ``start - W + 1 ..``."""
        if self.sliding_window is None or start is None:
            return 0
        return max(0, start - self.sliding_window + 1) // self.block_size

    def _release(self, table: _Table, dead: int) -> None:
        """Give back the table's blocks before entry ``dead`` (one reference each); their entries become
        :data:`RELEASED_BLOCK`."""
        end = min(dead, len(table.blocks))
        if end <= table.released:
            return
        gone = table.blocks[table.released : end]
        table.blocks[table.released : end] = [RELEASED_BLOCK] * len(gone)
        table.released = end
        self.num_window_releases += len(gone)
        self.pool.free(reversed(gone))

    def _check_fresh(self, prefix: PrefixHit) -> None:
        for block_id, link in zip(prefix.block_ids, prefix.links):
            if self.pool.blocks[block_id].prefix_id != link:
                raise ValueError("stale prefix hit: look it up again right before allocating")

    def _new_table(self, request: Request | None, prefix: PrefixHit, dead: int) -> _Table:
        """A table starting with the hit's blocks; those wholly before the window (the first ``dead``) are
        never taken: their entries are released from the start."""
        dead = min(dead, len(prefix.block_ids))
        self.pool.share(prefix.block_ids[dead:])
        if request is not None and self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += prefix.num_tokens
        return _Table(
            blocks=[RELEASED_BLOCK] * dead + list(prefix.block_ids[dead:]),
            num_slots=prefix.num_tokens,
            released=dead,
            request=request,
            salt=None if request is None else self._root_key(request),
            epoch=self._epoch,
            hashes=list(prefix.hashes),
            links=list(prefix.links),
        )

    def _root_key(self, request: Request) -> Hashable:
        """What a request's hash chain starts from: its cache salt, and its prefix group where there are some."""
        if self.prefix_group is None:
            return request.cache_salt
        return (request.cache_salt, self.prefix_group(request))

    def _copy_on_write(self, table: _Table, total_tokens: int) -> None:
        """Give the table its own copy of every shared block the new slots fall in."""
        if total_tokens <= table.num_slots:
            return
        bs = self.block_size
        first = max(table.num_slots // bs, table.released)
        for i in range(first, min(len(table.blocks), blocks_for(total_tokens, bs))):
            src = table.blocks[i]
            if self.pool.blocks[src].ref_cnt > 1:
                taken = self.pool.allocate(1)
                assert taken is not None  # can_allocate counted it
                dst = taken[0]
                self.pool.free([src])
                table.blocks[i] = dst
                self._copies.append((src, dst))
                self.num_cow_copies += 1

    def _register_full_blocks(self, request_id: str, table: _Table) -> None:
        """Enter the table's newly full blocks in the prefix cache (chained on the previous one)."""
        request = table.request
        if not self.enable_prefix_caching or request is None or table.epoch != self._epoch:
            return
        bs = self.block_size
        full = min(table.num_slots, request.num_tokens) // bs
        if full <= len(table.hashes):
            return
        tokens = request.all_token_ids
        for j in range(len(table.hashes), full):
            parent_link = table.links[j - 1] if j else root_link(table.salt)
            parent_hash = table.hashes[j - 1] if j else root_hash(table.salt, self.hash_fn)
            if parent_link is None or parent_hash is None or j < table.released:  # released: not ours to enter
                table.hashes.append(None)
                table.links.append(None)
                continue
            toks = block_tokens(tokens, j, bs)
            block_hash = chain_hash(parent_hash, toks, self.hash_fn)
            block = self.pool.blocks[table.blocks[j]]
            if block.is_cached:  # already registered (shared with its registrant)
                same = block.token_ids == toks and block.parent == parent_link
                link = block.prefix_id if same else None
            else:
                link = self.pool.register(block.block_id, block_hash, toks, parent_link)
                if link is not None and link == block.prefix_id:
                    self._pending[block.block_id] = request_id
            table.hashes.append(block_hash)
            table.links.append(link)


def _request_id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id
