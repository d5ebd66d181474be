"""Adversarial pass 7 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import asyncio

from asyncinfer.outputs import StreamDelta
from asyncinfer.server.streaming import MergedStreams


# A stream's reader that falls behind (a client reading its answer slowly, or not at all until send_timeout)
# left the engine's backpressure unused: MergedStreams read every engine stream as fast as the engine produced and
# queued one object per token (its text, ids and logprobs) for the reader, where the engine's own stream merges a
# sample's unread pieces into one. A caller streaming 256 samples to the context length could so hold the whole
# output, piece by piece, in the server's memory for as long as it kept the connection.
def test_a_stream_is_read_at_most_one_delta_ahead_of_its_reader() -> None:
    asked = [0, 0]

    async def stream(index: int):
        for i in range(1000):
            asked[index] += 1
            yield StreamDelta(f"r{index}", "x", [i])
            await asyncio.sleep(0)

    async def main() -> list[int]:
        merged = MergedStreams([stream(0), stream(1)])
        await merged.prime()
        for _ in range(200):  # the reader takes nothing more for a while
            await asyncio.sleep(0)
        held = list(asked)
        got = 0
        async for _index, _delta in merged:
            got += 1
        assert got == 2000 and asked == [1000, 1000]
        return held

    held = asyncio.run(main())
    assert max(held) <= 3, f"the streams were read {held} deltas ahead of a reader that took 2"
