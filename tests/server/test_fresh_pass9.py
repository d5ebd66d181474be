"""Adversarial pass 9 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import httpx
import msgspec

from asyncinfer.outputs import StreamDelta

# A stream's reader takes one delta of each sample at a time (pass 8): a client that reads its answer slowly leaves the
# rest in the engine's stream, which merges them, so that the next delta holds everything generated meanwhile, up to
# the context's length. With tools, each delta is read for its calls on the serving loop: a merged delta of a long
# context (130,000 characters of calls: some 40 ms; 64 choices, each its own delta) held every other caller's answers
# meanwhile. A delta longer than the loop's share is read in a worker thread, as a whole answer's calls are.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'


def test_a_long_streamed_delta_with_tools_is_read_off_the_loop(server, monkeypatch) -> None:
    from asyncinfer.server import tools

    from .test_loop_stays_free import answered_while_held, loop_thread

    engine = server.engine
    real = engine.stream

    def merged(*args, **kwargs):  # as the engine's stream merges the pieces of a reader that fell behind
        async def pieces():
            deltas = [delta async for delta in real(*args, **kwargs)]
            yield StreamDelta(deltas[-1].request_id, CALL * 200, [t for d in deltas for t in d.token_ids],
                              deltas[-1].finish_reason)
        return pieces()

    monkeypatch.setattr(engine, "stream", merged)
    function = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": function,
            "max_tokens": 4, "stream": True})

    answer, threads = answered_while_held(server, monkeypatch, tools.CallStream, "feed", send)
    assert answer.status_code == 200, answer.text
    events = [msgspec.json.decode(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {")]
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", ())]
    assert len({c["index"] for c in calls}) == 200
    assert loop_thread(server) not in threads
