"""The dynamic batcher alone, on a fake clock and a fake encoder: when batches are due, what
goes in them, and that cancelled texts are never computed."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import InvalidParameterError
from asyncinfer.embedding import EmbedCall, EmbeddingBatcher, EmbeddingConfig
from asyncinfer.models.encoder import EncoderConfig

CFG = EncoderConfig(architecture="bert", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=1,
                    num_heads=2, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
                    hidden_act="gelu", max_seq_len=64)


class FakeEncoder:
    """Each text's vector is [first token id, length, 0, ...]; records every batch it ran."""

    config = CFG
    source = "fake"

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.fail_next: Exception | None = None  # raised by the next batch, once

    def encode_ids(self, batch: list[list[int]]) -> torch.Tensor:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.batches.append(batch)
        out = torch.zeros(len(batch), CFG.hidden_size)
        for row, ids in enumerate(batch):
            out[row, 0], out[row, 1] = ids[0], len(ids)
        return out

    def encode_each(self, batch: list[list[int]]) -> torch.Tensor:
        return torch.cat([self.encode_ids([ids]) for ids in batch])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(max_batch_size: int = 4, max_wait_ms: float = 5.0, max_batch_tokens: int = 2048,
         batch_invariant: bool = False) -> tuple[EmbeddingBatcher, FakeEncoder, Clock]:
    encoder, clock = FakeEncoder(), Clock()
    config = EmbeddingConfig(device="cpu", max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                             max_batch_tokens=max_batch_tokens, batch_invariant=batch_invariant)
    return EmbeddingBatcher(encoder, config, clock), encoder, clock  # type: ignore[arg-type]


def call(first_ids: list[int], arrival: float, done: list[EmbedCall]) -> EmbedCall:
    return EmbedCall([[t] * (t % 5 + 1) for t in first_ids], arrival)


def test_a_batch_is_due_when_full_or_when_the_oldest_text_waited_long_enough() -> None:
    batcher, encoder, clock = make(max_batch_size=4, max_wait_ms=5)
    done: list[EmbedCall] = []
    assert batcher.wait_time() is None
    batcher.add(call([10], arrival=0.0, done=done))
    clock.now = 0.002
    assert batcher.wait_time() == pytest.approx(0.003)
    clock.now = 0.0051
    assert batcher.wait_time() == 0.0
    clock.now = 0.0
    batcher.add(call([11, 12, 13], arrival=0.0, done=done))
    assert batcher.wait_time() == 0.0  # 4 texts: a full batch does not wait
    finished = batcher.run_batch()
    assert len(finished) == 2 and encoder.batches == [[[10], [11, 11], [12, 12, 12], [13, 13, 13, 13]]]
    assert batcher.wait_time() is None


def test_waiting_calls_take_turns_and_a_call_completes_with_its_last_text() -> None:
    """One text of each waiting call in turn, the oldest call first: a call of many texts shares its first
    batch with the calls behind it (it used to run all its batches first, oldest text first)."""
    batcher, encoder, _ = make(max_batch_size=3, max_wait_ms=0)
    done: list[EmbedCall] = []
    a = call([1, 2, 3, 4, 5], arrival=0.0, done=done)  # spans two batches
    b = call([6], arrival=0.001, done=done)
    batcher.add(a)
    batcher.add(b)
    assert batcher.run_batch() == [b]  # a's first text, b's only one, a's second
    assert encoder.batches[0] == [[1, 1], [6, 6], [2, 2, 2]]
    assert batcher.run_batch() == [a]
    assert [len(x) for x in encoder.batches] == [3, 3]
    vectors = a.stacked()
    assert vectors[:, 0].tolist() == [1, 2, 3, 4, 5] and vectors[:, 1].tolist() == [2, 3, 4, 5, 1]
    stats = batcher.stats()
    assert (stats.num_calls, stats.num_texts, stats.num_batches, stats.batch_sizes) == (2, 6, 2, {3: 2})
    assert stats.num_tokens == 2 + 3 + 4 + 5 + 1 + 2
    assert stats.num_padded_tokens == 3 * 3 + 3 * 5
    assert stats.mean_batch_size == 3.0


def test_a_batch_invariant_batch_counts_no_padding() -> None:
    """``batch_invariant=True`` runs each text of a batch in a pass of its own, unpadded: the stats' computed tokens
    are the real ones (they counted every text at the batch's longest, padding that never ran: 3 * 5 for 1 + 2 + 5)."""
    batcher, encoder, _ = make(max_batch_size=3, max_wait_ms=0, batch_invariant=True)
    batcher.add(call([10, 11, 14], arrival=0.0, done=[]))
    assert len(batcher.run_batch()) == 1
    assert encoder.batches == [[[10]], [[11, 11]], [[14] * 5]]  # each text alone
    stats = batcher.stats()
    assert (stats.num_tokens, stats.num_padded_tokens) == (8, 8)


def test_a_flood_of_long_texts_neither_holds_back_other_calls_nor_outgrows_the_token_slots() -> None:
    """A call of many long texts used to run all its batches (of max_batch_size texts, however long) before a
    call queued behind it: each batch runs between two generation steps, so both another caller's embeddings
    and every generated token waited for the whole flood. Now the short call rides in the first batch, and no
    batch holds more than max_batch_tokens padded slots (a longer text alone)."""
    batcher, encoder, _ = make(max_batch_size=32, max_wait_ms=0, max_batch_tokens=64)
    flood = EmbedCall([[7] * 20 for _ in range(40)], 0.0)
    short = EmbedCall([[9, 9]], 0.001)
    batcher.add(flood)
    batcher.add(short)
    assert batcher.run_batch() == [short]
    assert encoder.batches[0] == [[7] * 20, [9, 9], [7] * 20]  # 3 x 20 slots: a fourth text would pass 64
    finished = []
    while batcher.wait_time() is not None:
        finished += batcher.run_batch()
    assert finished == [flood] and flood.remaining == 0
    assert all(len(b) * max(map(len, b)) <= 64 for b in encoder.batches)
    huge = EmbedCall([[5] * 100, [6]], 0.0)  # a text longer than the slots runs alone
    batcher.add(huge)
    batcher.run_batch()
    batcher.run_batch()
    assert encoder.batches[-2:] == [[[5] * 100], [[6]]] and huge.remaining == 0


def test_cancelled_calls_are_skipped_and_take_all_returns_the_waiting_ones() -> None:
    batcher, encoder, clock = make(max_batch_size=8, max_wait_ms=1000)
    done: list[EmbedCall] = []
    a, b, c = call([1, 2], 0.0, done), call([3], 0.0, done), call([4, 5], 0.0, done)
    for x in (a, b, c):
        batcher.add(x)
    a.cancelled = True
    clock.now = 10.0
    assert batcher.run_batch() == [b, c]
    assert encoder.batches == [[[3] * 4, [4] * 5, [5]]]  # a's texts never computed
    d, e = call([6], 0.0, done), call([7], 0.0, done)
    batcher.add(d)
    batcher.add(e)
    e.cancelled = True
    assert batcher.take_all() == [d]
    assert batcher.wait_time() is None and len(encoder.batches) == 1


def test_options_are_checked_by_name() -> None:
    for bad in ({"max_batch_size": 0}, {"max_batch_size": True}, {"max_wait_ms": -1}, {"max_wait_ms": 2000},
                {"max_seq_len": 1}, {"num_threads": 0}, {"max_batch_tokens": 0}, {"max_batch_tokens": 1.5},
                {"batch_invariant": "yes"}, {"batch_invariant": 1}):
        with pytest.raises(InvalidParameterError) as err:
            EmbeddingConfig(device="cpu", **bad)
        assert err.value.parameter == next(iter(bad))
    with pytest.raises(InvalidParameterError) as err:
        EmbeddingConfig.from_options({"kv_cache_memory": 1})
    assert err.value.parameter == "kv_cache_memory"


def test_an_encoder_failure_fails_the_batchs_calls_only() -> None:
    batcher, encoder, _ = make(max_batch_size=2, max_wait_ms=0)
    done: list[EmbedCall] = []
    a, b, c = call([1, 2, 3], 0.0, done), call([4], 0.0, done), call([5], 0.0, done)
    for x in (a, b, c):
        batcher.add(x)
    boom = encoder.fail_next = RuntimeError("out of memory")
    assert batcher.run_batch() == [a, b]  # a's first text and b's: both fail, a's other texts are dropped
    assert a.error is boom and a.cancelled and b.error is boom
    assert batcher.run_batch() == [c] and c.error is None
    assert batcher.wait_time() is None


def test_the_rest_of_a_call_whose_texts_have_run_does_not_wait_for_company() -> None:
    """A call of 33 texts at max_batch_size=32 ran its first 32 at once and its last one only after max_wait_ms
    (a second at max_wait_ms=1000), though that call had waited for company already."""
    batcher, encoder, clock = make(max_batch_size=4, max_wait_ms=1000)
    done: list[EmbedCall] = []
    batcher.add(call([1, 2, 3, 4, 5], arrival=0.0, done=done))
    assert batcher.wait_time() == 0.0  # a full batch
    assert batcher.run_batch() == []
    assert batcher.wait_time() == 0.0  # its fifth text: at once, not in a second
    assert len(batcher.run_batch()) == 1 and len(encoder.batches) == 2
    batcher.add(call([6], arrival=clock.now, done=done))
    assert batcher.wait_time() == pytest.approx(1.0)  # a new call still waits for company


def test_the_turns_go_on_across_batches_so_many_calls_cannot_hold_back_a_later_one() -> None:
    """Each batch started again from the oldest call: a caller with max_batch_size calls of many texts queued
    (8 calls of long texts fill 2048 slots) held another caller's one-text call until one of them had finished,
    51 batches here. Now a call that gave a text goes to the back, and the later call rides in the second batch."""
    batcher, encoder, _ = make(max_batch_size=4, max_wait_ms=0)
    floods = [EmbedCall([[7] * 10] * 50, 0.0) for _ in range(4)]
    for flood in floods:
        batcher.add(flood)
    late = EmbedCall([[9]], 0.001)
    batcher.add(late)
    assert batcher.run_batch() == []
    assert batcher.run_batch() == [late]
    assert encoder.batches[1][0] == [9]
    while batcher.wait_time() is not None:
        batcher.run_batch()
    assert all(flood.remaining == 0 for flood in floods)
    assert sum(map(len, encoder.batches)) == 4 * 50 + 1


def test_the_turns_go_tenant_by_tenant_so_many_calls_of_one_tenant_cannot_hold_back_another() -> None:
    """The turns went call by call: a tenant with 500 calls queued had 500 places in every round to another
    tenant's one (over HTTP, another API key's one-text call waited about 500 / 8 batches behind a key's 500
    concurrent calls of long texts). Now each waiting tenant gives one text in turn, and its calls take its
    turns in turn: the other tenant's call rides in the first batch."""
    batcher, encoder, _ = make(max_batch_size=4, max_wait_ms=0)
    floods = [EmbedCall([[7] * 10] * 3, 0.0, tenant="a") for _ in range(500)]
    for flood in floods:
        batcher.add(flood)
    late = EmbedCall([[9]], 0.001, tenant="b")
    batcher.add(late)
    assert batcher.run_batch() == [late]
    assert encoder.batches[0] == [[7] * 10, [9], [7] * 10, [7] * 10]
    while batcher.wait_time() is not None:
        batcher.run_batch()
    assert all(flood.remaining == 0 for flood in floods) and sum(map(len, encoder.batches)) == 500 * 3 + 1


def test_each_tenants_calls_take_its_turns_in_turn_carried_over_between_batches() -> None:
    batcher, encoder, _ = make(max_batch_size=4, max_wait_ms=0)
    a1, a2, a3 = (EmbedCall([[10 + c, i] for i in range(3)], 0.0, tenant="a") for c in range(3))
    b1, b2 = EmbedCall([[20, 0], [20, 1]], 0.0, tenant="b"), EmbedCall([[21, 0]], 0.0, tenant="b")
    none = EmbedCall([[30, 0]], 0.0)  # the calls without a tenant are one tenant of their own
    for c in (a1, a2, a3, b1, b2, none):
        batcher.add(c)
    assert batcher.run_batch() == [none]
    assert batcher.run_batch() == [b2, b1]
    assert batcher.run_batch() == [a1, a2]
    assert batcher.run_batch() == [a3]
    assert encoder.batches == [
        [[10, 0], [20, 0], [30, 0], [11, 0]],  # a, b, none, then a again (its second call)
        [[21, 0], [12, 0], [20, 1], [10, 1]],  # from where the turns stopped: b (its second call), a (its third)...
        [[11, 1], [12, 1], [10, 2], [11, 2]],  # only a is left: its calls take every turn, in turn
        [[12, 2]],
    ]
