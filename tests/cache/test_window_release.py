"""Blocks wholly before a sliding window go back to the pool while a request grows (``KVCacheManager(sliding_window=)``).

At the manager: exact block counts while decoding past the window, the bound of ``ceil((W - 1) / block_size) + 1``
held blocks, shared blocks kept for their other holders, released blocks left in the prefix cache (a hit takes
only the blocks its window reads), fork. Through the engine: Mistral and a Qwen2 whose every layer slides give
back exactly the blocks their requests' windows left behind, with transformers' greedy tokens, the counter in
the Prometheus text; Gemma 2/3 and a Qwen2 with a full layer give back nothing.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer import AsyncEngine, InvalidParameterError
from asyncinfer.cache import RELEASED_BLOCK, KVCacheManager
from asyncinfer.metrics.exposition import exposition
from asyncinfer.models.config import ModelConfig
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from tests.helpers import ENGINE_BASE, TINY_WINDOW, greedy, hf_greedy, random_prompts, tiny_hf_config, tiny_hf_model

PARAMS = SamplingParams(max_tokens=256)


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), PARAMS, arrival_time=0.0)


def prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit ``request`` and compute its whole prompt in one step."""
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def decode(kv: KVCacheManager, request: Request, token: int = 7) -> None:
    """One decode step as the engine runs it: a sampled token, slots for it, then computed."""
    request.output_token_ids.append(token)
    assert kv.append_slots(request, 1)
    request.num_computed_tokens += 1


@pytest.mark.parametrize(("kind", "window"), [
    ("mistral_window", TINY_WINDOW), ("qwen2_window_all", TINY_WINDOW), ("qwen2_window", None),
    ("qwen3_window", None), ("gemma2", None), ("gemma3", None), ("llama", None), ("mistral", None),
    ("phi3", None),
])
def test_kv_window_is_the_window_only_where_every_layer_slides(kind: str, window: int | None) -> None:
    assert ModelConfig.from_hf_config(tiny_hf_config(kind)).kv_window == window
    if kind == "phi3":  # its window, when the config has one, applies to every layer
        assert ModelConfig.from_hf_config(tiny_hf_config(kind, sliding_window=6)).kv_window == 6


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_sliding_window_must_be_none_or_a_positive_int(bad: object) -> None:
    with pytest.raises(InvalidParameterError, match=r"sliding_window=.* is invalid: allowed None or an int >= 1"):
        KVCacheManager(8, 4, sliding_window=bad)  # type: ignore[arg-type]


def test_decoding_past_the_window_holds_exact_block_counts() -> None:
    """W = 8, 4-token blocks: the query at position p reads p - 7 .. p, so before the allocation for p the
    blocks wholly before p - 7 go back; a decode holds 2 or 3 blocks (the bound, ceil(7 / 4) + 1 = 3)."""
    kv = KVCacheManager(32, 4, watermark=0.0, sliding_window=8)
    r = make("a", list(range(1, 11)))
    prefill(kv, r)  # positions 0..9: 3 blocks, nothing before the window of a query at 0
    assert (kv.num_held_blocks("a"), kv.num_released_blocks("a"), kv.num_free_blocks) == (3, 0, 29)
    seen = []
    for _ in range(14):  # queries at 10 .. 23
        decode(kv, r)
        seen.append((kv.num_held_blocks("a"), kv.num_released_blocks("a"), kv.num_free_blocks))
    assert seen == [
        (3, 0, 29),  # 10: reads 3..10, blocks 0..2
        (2, 1, 30),  # 11: reads 4..11, block 0 goes back
        (3, 1, 29), (3, 1, 29), (3, 1, 29),  # 12..14: a fourth block, reads from block 1
        (2, 2, 30),  # 15: reads 8..15, block 1 goes back
        (3, 2, 29), (3, 2, 29), (3, 2, 29),
        (2, 3, 30),  # 19
        (3, 3, 29), (3, 3, 29), (3, 3, 29),
        (2, 4, 30),  # 23
    ]
    table = kv.block_table("a")
    assert len(table) == 6 and table[:4] == [RELEASED_BLOCK] * 4
    stats = kv.stats()
    assert (stats.window_releases, stats.used_blocks, stats.free_blocks) == (4, 2, 30)
    assert stats.filled_slots == 24 - 16  # only the held blocks' slots count
    kv.free("a")
    assert kv.num_free_blocks == 32 and kv.stats().used_blocks == 0


@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16])
def test_a_decode_holds_at_most_the_bound_and_reaches_it(bs: int) -> None:
    for window in range(1, 21):
        kv = KVCacheManager(64, bs, watermark=0.0, sliding_window=window)
        r = make("a", [1])
        prefill(kv, r)
        held = []
        for _ in range(3 * window + 2 * bs):
            decode(kv, r)
            held.append(kv.num_held_blocks("a"))
        bound = -(-(window - 1) // bs) + 1
        assert max(held) == bound, (window, bs)
        assert kv.stats().window_releases == kv.num_released_blocks("a") == max(0, r.num_computed_tokens - 1 - window
                                                                                 + 1) // bs


def test_a_step_of_n_tokens_holds_at_most_its_bound() -> None:
    """A step computing n tokens from position c reads c - W + 1 .. c + n - 1: at most
    ceil((W + n - 2) / block_size) + 1 blocks, reached for some c."""
    for bs in (1, 3, 4, 16):
        for window in (1, 2, 7, 8, 30):
            for n in (1, 2, 5, 16):
                held = []
                for prompt in range(1, n + 1):  # steps start at every position c past the prompt
                    kv = KVCacheManager(128, bs, watermark=0.0, sliding_window=window)
                    r = make("a", [1] * prompt)
                    prefill(kv, r)
                    for _ in range(2 * (window + bs) + 2):
                        r.output_token_ids.extend([7] * n)
                        assert kv.append_slots(r, n)
                        held.append(kv.num_held_blocks("a"))
                        r.num_computed_tokens += n
                assert max(held) == -(-(window + n - 2) // bs) + 1, (bs, window, n)


def test_a_decode_at_the_window_edge_takes_the_block_it_gives_back() -> None:
    """W = 5, 4-token blocks: the query at 8 starts a third block and reads 4..8, so block 0 goes back in the
    same allocation; with no block free it is the one taken (the cost is net of what is given back)."""
    kv = KVCacheManager(2, 4, watermark=0.0, sliding_window=5)
    r = make("a", list(range(1, 9)))
    prefill(kv, r)
    first = kv.block_table("a")[0]
    assert kv.num_free_blocks == 0
    r.output_token_ids.append(7)
    assert kv.num_blocks_needed("a", 9) == 0 and kv.can_allocate("a", 9)
    assert kv.append_slots(r, 1)
    assert kv.block_table("a") == [RELEASED_BLOCK, kv.block_table("a")[1], first]
    assert kv.num_free_blocks == 0 and kv.stats().window_releases == 1
    other = KVCacheManager(2, 4, watermark=0.0)  # without the window the same growth does not fit
    s = make("a", list(range(1, 9)))
    prefill(other, s)
    s.output_token_ids.append(7)
    assert other.num_blocks_needed("a", 9) == 1 and not other.append_slots(s, 1)


def test_a_shared_block_stays_with_its_other_holder() -> None:
    """Two samples share a prompt's blocks (fork): one decoding past the window drops only its reference; the
    block goes back when the second lets go too."""
    kv = KVCacheManager(16, 4, watermark=0.0, sliding_window=8)
    parent = make("p", list(range(1, 13)))
    prefill(kv, parent)
    child = make("c", parent.all_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork("p", child)
    first = kv.block_table("p")[0]
    assert kv.pool.blocks[first].ref_cnt == 2 and kv.num_free_blocks == 13
    for _ in range(3):  # queries at 12..14 (in a fourth block): they read from 5 on, so block 0 goes back
        decode(kv, parent)
    assert kv.num_released_blocks("p") == 1 and kv.block_table("c")[0] == first
    assert kv.pool.blocks[first].ref_cnt == 1 and not kv.pool.is_free(first) and kv.num_free_blocks == 12
    decode(kv, child)  # the child's query at 12: a fourth block of its own, and now nobody holds block 0
    assert kv.pool.blocks[first].ref_cnt == 0 and kv.pool.is_free(first)
    assert kv.num_free_blocks == 12 - 1 + 1
    assert [kv.pool.blocks[x].ref_cnt for x in kv.block_table("c")[1:3]] == [2, 2]  # still shared
    assert kv.stats().window_releases == 2


def test_released_blocks_stay_cached_and_a_hit_takes_only_its_window() -> None:
    kv = KVCacheManager(16, 4, watermark=0.0, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(1, 17))
    a = make("a", prompt)
    prefill(kv, a)
    for _ in range(3):  # queries at 16..18 read from 9 on: blocks 0 and 1 go back (registered: cached, free)
        decode(kv, a)
    assert kv.num_released_blocks("a") == 2
    table_a = list(kv.block_table("a"))
    stats = kv.stats()
    assert (stats.cached_blocks, stats.cached_free_blocks, stats.used_blocks) == (4, 2, 3)
    # B repeats A's first 16 tokens: the hit covers all 4 blocks; its query at 16 reads 9.. so it takes
    # blocks 2 and 3 (shared with A) and leaves 0 and 1 in the free queue.
    b = make("b", [*prompt, 99, 98, 97])
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 16 and len(hit.block_ids) == 4
    assert kv.num_blocks_needed(b, b.num_tokens, prefix=hit) == 1  # just the block for 16..18
    assert kv.allocate(b, 3, prefix=hit)
    b.num_computed_tokens = 16
    tb = kv.block_table("b")
    assert tb[:2] == [RELEASED_BLOCK] * 2 and kv.num_released_blocks("b") == 2
    assert [kv.pool.blocks[x].ref_cnt for x in hit.block_ids] == [0, 0, 2, 2]
    assert kv.stats().window_releases == 2  # B never held 0 and 1: nothing to give back
    # C repeats A's first 9 tokens: its query at 8 reads 1.., so it revives both cached free blocks.
    c = make("c", prompt[:9])
    hit_c = kv.lookup_prefix(c)
    assert hit_c.block_ids == hit.block_ids[:2]
    assert kv.num_blocks_needed(c, c.num_tokens, prefix=hit_c) == 1 + 2
    # Other tokens never hit A's blocks; once the free blocks are taken for other contents, nothing hits.
    assert kv.lookup_prefix(make("d", [5, *prompt])).num_tokens == 0
    assert kv.allocate_slots("hog", kv.num_free_blocks * 4)
    assert kv.lookup_prefix(c).num_tokens == 0
    assert kv.block_table("a") == table_a  # taking the free blocks touched no live table


def test_fork_refuses_a_point_whose_window_was_given_back() -> None:
    kv = KVCacheManager(16, 4, watermark=0.0, sliding_window=8)
    parent = make("p", list(range(1, 11)))
    prefill(kv, parent)
    for _ in range(10):  # queries at 10..19: blocks 0..2 go back
        decode(kv, parent)
    assert kv.num_released_blocks("p") == 3
    free = kv.num_free_blocks
    with pytest.raises(ValueError, match="cannot fork 'p' at 12 tokens"):
        kv.fork("p", "early", 12)  # a query at 12 reads 5..12: blocks 1 and 2 are gone
    assert kv.num_free_blocks == free and "early" not in kv.request_ids()
    kv.fork("p", "late", 20)  # reads 13..20: blocks 3.. are held
    assert kv.block_table("late") == kv.block_table("p") and kv.num_released_blocks("late") == 3
    assert [kv.pool.blocks[x].ref_cnt for x in kv.block_table("p")[3:]] == [2, 2]
    kv.free("p")
    kv.free("late")
    assert kv.num_free_blocks == 16


def test_a_request_known_only_by_its_id_gives_nothing_back() -> None:
    kv = KVCacheManager(16, 4, watermark=0.0, sliding_window=2)
    assert kv.allocate_slots("x", 40)
    assert kv.num_released_blocks("x") == 0 and kv.num_held_blocks("x") == 10


# ---- through the engine ---------------------------------------------------------------------------


def dead_blocks(last_query: int, window: int, block_size: int) -> int:
    return max(0, last_query - window + 1) // block_size


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window_all"])
async def test_the_engine_gives_back_exact_counts_and_keeps_transformers_tokens(kind, tmp_path) -> None:
    hf = tiny_hf_model(kind, 5)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts(3, seed=13, max_len=30, vocab=256)
    lengths = [20, 14, 9]
    engine = AsyncEngine.from_pretrained(tmp_path, **{**ENGINE_BASE, "max_num_batched_tokens": 16}, block_size=4,
                                         enable_prefix_caching=False)
    assert engine.core.kv.sliding_window == TINY_WINDOW
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(n)) for p, n in zip(prompts, lengths)))
        text = exposition(engine).decode()
    for p, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == hf_greedy(hf, p, n)
    # Each request's last step computes position len(prompt) + n - 2: what lies before its window is given back.
    expected = sum(dead_blocks(len(p) + n - 2, TINY_WINDOW, 4) for p, n in zip(prompts, lengths))
    stats = engine.kv_stats()
    assert expected > 10 and stats.window_releases == expected
    assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "asyncinfer_kv_window_releases"]
    assert [s.value for s in family.samples if s.name.endswith("_total")] == [expected]


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen2_window"])
async def test_a_model_with_a_full_layer_gives_back_nothing(kind, tmp_path) -> None:
    hf = tiny_hf_model(kind, 5)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompt = [3 + i * 37 % 250 for i in range(30)]
    engine = AsyncEngine.from_pretrained(tmp_path, **ENGINE_BASE, block_size=4)
    assert engine.core.kv.sliding_window is None
    async with engine:
        out = await engine.generate(prompt, greedy(12))
    assert len(prompt) > 3 * TINY_WINDOW and out.token_ids == hf_greedy(hf, prompt, 12)
    assert engine.kv_stats().window_releases == 0
