"""An embedding flood beside a generator keeps to ``max_batch_share`` of the engine thread's time.

Each embedding batch ran between every two generation steps: one caller's flood of long texts (a batch of
2,048 token slots, hundreds of milliseconds on a CPU) made another caller's stream wait for a batch at every
token (12 ms to about 410 ms a token on the default model). Now, while a generator has requests, a batch of
``t`` seconds is followed by ``t * (1 - share) / share`` seconds of other work before the next one.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.embedding import EmbedCall, EmbeddingBatcher, EmbeddingConfig
from tests.helpers import ENGINE_BASE
from tests.test_embedding_batcher import CFG, Clock

LONG_TEXT = " ".join(f"word{i} river mountain" for i in range(200))  # past MiniLM's 256 tokens
SHORT_TEXT = "river mountain"
NEIGHBOUR_TOKENS = 48


class TimedEncoder:
    """Each batch advances the fake clock by ``seconds``."""

    config = CFG
    source = "fake"

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def encode_ids(self, batch: list[list[int]]) -> torch.Tensor:
        self.clock.now += self.seconds
        return torch.zeros(len(batch), CFG.hidden_size)


@pytest.mark.parametrize(("share", "pause"), [(0.2, 0.4), (0.5, 0.1), (1.0, 0.0)])
def test_a_batch_is_followed_by_its_share_of_other_work(share: float, pause: float) -> None:
    clock = Clock()
    config = EmbeddingConfig(device="cpu", max_batch_size=1, max_wait_ms=0, max_busy_share=share)
    batcher = EmbeddingBatcher(TimedEncoder(clock, 0.1), config, clock)  # type: ignore[arg-type]
    assert batcher.busy_wait() == 0.0
    batcher.add(EmbedCall([[1], [2]], arrival=0.0))
    assert batcher.run_batch() == []
    assert batcher.busy_wait() == pytest.approx(pause)
    clock.now += pause / 2
    assert batcher.busy_wait() == pytest.approx(pause / 2)
    clock.now += pause / 2 + 1e-9
    assert batcher.busy_wait() == 0.0
    assert len(batcher.run_batch()) == 1


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan, True, "0.2", None])
def test_max_busy_share_is_a_fraction_in_0_1(bad: object) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EmbeddingConfig(device="cpu", max_busy_share=bad)
    assert err.value.parameter == "max_busy_share" and "(0, 1]" in str(err.value)


async def _batches_during_a_stream(engine: AsyncEngine, text: str = LONG_TEXT, per_call: int = 32) -> tuple[int, int]:
    """Start a flood of embedding calls (four callers, each with a call of ``per_call`` copies of ``text`` at a
    time), then stream a neighbour; the embedding batches run between the neighbour's first and last token, and
    the neighbour's token count. The flood completes afterwards."""
    stop = asyncio.Event()

    async def flood() -> int:
        done = 0
        while not stop.is_set():
            await engine.embed([text] * per_call, model="emb")
            done += 1
        return done

    floods = [asyncio.create_task(flood()) for _ in range(4)]
    while engine.embedding_stats("emb").num_batches < 2:  # the flood is running
        await asyncio.sleep(0.01)
    first = last = None
    tokens = 0
    async for delta in engine.stream([5, 6, 7], SamplingParams(max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)):
        batches = engine.embedding_stats("emb").num_batches
        first = batches if first is None else first
        last = batches
        tokens += len(delta.token_ids)
    stop.set()
    assert all(n >= 1 for n in await asyncio.gather(*floods))  # the flood was served, not starved
    assert first is not None and last is not None
    return last - first, tokens


async def test_an_embedding_flood_takes_its_share_not_a_batch_per_token(tiny_models, minilm_dir) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        await engine.add_model("emb", minilm_dir, max_wait_ms=0, num_threads=1)
        batches, tokens = await _batches_during_a_stream(engine)
        # A batch of 8 x 256 tokens costs tens of times a tiny model's step: at a share of 0.2 a few batches fit
        # in the stream's time; one batch between every two steps would be about one per token.
        assert tokens == NEIGHBOUR_TOKENS
        assert batches <= 6, batches


async def test_a_share_of_1_runs_a_batch_between_every_two_steps(tiny_models, minilm_dir) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        # One short text a batch, four calls of 64 queued: 256 batches a round, far more than the stream's steps.
        # (The calls share the batches in turn, so all four end together; while their callers queue the next
        # ones the queue is empty and steps run without batches. A round shorter than the stream, as with four
        # calls of 32 long texts, 16 batches, left a stream of 48 tokens with as few as 12 on a loaded machine.)
        await engine.add_model("emb", minilm_dir, max_wait_ms=0, num_threads=1, max_busy_share=1.0, max_batch_size=1)
        batches, tokens = await _batches_during_a_stream(engine, SHORT_TEXT, per_call=64)
        assert tokens == NEIGHBOUR_TOKENS
        assert batches >= tokens // 2, (batches, tokens)
