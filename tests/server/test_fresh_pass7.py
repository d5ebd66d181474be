"""Adversarial pass 7 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from asyncinfer import SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.lab import TraceRequest, simulate
from asyncinfer.outputs import StreamDelta
from asyncinfer.request import Request
from asyncinfer.schedulers import SchedulerConfig
from asyncinfer.server import ModelSpec, ServerSettings, create_app, router
from asyncinfer.server.connections import MAX_HEADER_BYTES
from asyncinfer.server.errors import MAX_SHOWN_NAME, APIError
from asyncinfer.server.protocol import (
    CHAT_BODY,
    COMPLETION_BODY,
    EMBEDDING_BODY,
    decode_json,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from asyncinfer.server.streaming import MergedStreams

from .conftest import TINY_OPTIONS, LiveServer
from .test_loop_stays_free import answered_while_held, loop_thread


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


def test_a_stream_closed_while_it_waits_for_its_reader_is_ended_at_once() -> None:
    """Its request is aborted when the client goes, not when the garbage collector finds the stream."""
    ended: list[int] = []

    async def stream(index: int):
        try:
            for i in range(1000):
                yield StreamDelta(f"r{index}", "x", [i])
                await asyncio.sleep(0)
        finally:
            ended.append(index)

    async def main() -> None:
        merged = MergedStreams([stream(0), stream(1)])
        await merged.prime()
        for _ in range(20):
            await asyncio.sleep(0)
        merged.close()
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(ended) == [0, 1]  # (asyncio.run closes what is left when it ends: checked before)

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


# An embeddings answer was built on the serving loop: its token count (2048 one-character texts cost 2048
# characters by their length alone, within the loop's share, though the tokenizer's work is per text) and its
# JSON, 2048 vectors written out as floats (tens of milliseconds for a 384-wide model, ten times that for a
# 4096-wide one), held every other caller's stream for that long, per call.
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_an_embeddings_answer_is_built_off_the_loop(server, monkeypatch, encoding) -> None:
    def wrap(real, hold):
        def json_answer(body, *args, **kwargs):
            if isinstance(body, dict) and body.get("object") == "list" and "usage" in body:
                hold()
            return real(body, *args, **kwargs)
        return json_answer

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/embeddings", timeout=120,
                          json={"model": "minilm", "input": ["hello", "world"], "encoding_format": encoding})

    answer, threads = answered_while_held(server, monkeypatch, router, "_json", send, wrap)
    assert answer.status_code == 200, answer.text
    assert [d["index"] for d in answer.json()["data"]] == [0, 1]
    assert loop_thread(server) not in threads


def test_many_short_texts_are_counted_off_the_loop(server, monkeypatch) -> None:
    def wrap(real, hold):
        def counter(engine, model):
            count = real(engine, model)

            def held(texts):
                hold()
                return count(texts)
            return held
        return counter

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": ["a"] * 2048}, timeout=120)

    answer, threads = answered_while_held(server, monkeypatch, router._engine, "embedding_token_counter", send,
                                          wrap)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2048 and answer.json()["usage"]["prompt_tokens"] == 3 * 2048
    assert loop_thread(server) not in threads


# `stream_options` was read for `include_usage is True` and nothing else: `{"include_usage": "yes"}` or a misspelt
# `{"include_usgae": true}` was answered 200 without the usage the client asked for, where every other field the
# server does not know is a 400 naming it (as `response_format`'s unknown keys are).
@pytest.mark.parametrize(("options", "param"), [
    ({"include_usage": "yes"}, "stream_options.include_usage"),
    ({"include_usage": 1}, "stream_options.include_usage"),
    ({"include_usgae": True}, "stream_options.include_usgae"),
    ({"include_usage": True, "x" * 5000: 1}, "stream_options." + "x" * (MAX_SHOWN_NAME - len("stream_options."))),
])
@pytest.mark.parametrize("route", ["chat", "text"])
def test_stream_options_unknown_or_mistyped_are_a_400_naming_them(route, options, param) -> None:
    body = {"stream": True, "stream_options": options}
    parse, body = ((parse_chat, {**body, "messages": [{"role": "user", "content": "hi"}]}) if route == "chat" else
                   (parse_completion, {**body, "prompt": "hi"}))
    with pytest.raises(APIError) as refused:
        parse(decode_json(msgspec.json.encode(body), CHAT_BODY if route == "chat" else COMPLETION_BODY))
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message
    assert len(refused.value.message) < 400


def test_stream_options_as_openai_takes_them_are_read() -> None:
    for options, usage in (({"include_usage": True}, True), ({"include_usage": False}, False),
                           ({"include_usage": None}, False), ({}, False)):
        body = {"stream": True, "stream_options": options, "prompt": "hi"}
        assert parse_completion(decode_json(msgspec.json.encode(body), COMPLETION_BODY)).include_usage is usage


# A 400 for a field of the wrong type or value echoed the value whole (its repr): a megabyte string as a message's
# `role`, a content part's `type`, `response_format.type`, a schema's or a tool's `name` or `encoding_format`, or
# a list of a million items as `model` or `parallel_tool_calls`, came back as an error of megabytes (1.5x the body
# for a list of short strings), where the engine's own errors, and an unknown model's name, are shown elided.
BIG = "x" * 1_000_000
MANY = ["x"] * 300_000
MESSAGES = [{"role": "user", "content": "hi"}]
ECHOES = [  # (route, body, param)
    ("chat", {"model": MANY, "messages": MESSAGES}, "model"),
    ("chat", {"messages": [{"role": BIG, "content": "hi"}]}, "messages.[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": BIG}]}]}, "messages.[0].content.[0]"),
    ("chat", {"messages": MESSAGES, "response_format": {"type": BIG}}, "response_format.type"),
    ("chat", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": BIG}}},
     "response_format.json_schema.name"),
    ("chat", {"messages": MESSAGES, "parallel_tool_calls": MANY}, "parallel_tool_calls"),
    ("chat", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": BIG}}]},
     "tools.[0].function.name"),
    ("text", {"prompt": "hi", "user": MANY}, "user"),
    ("embed", {"input": "hi", "encoding_format": BIG}, "encoding_format"),
]


@pytest.mark.parametrize(("route", "body", "param"), ECHOES, ids=[e[2] for e in ECHOES])
def test_a_refused_value_is_echoed_bounded(route, body, param) -> None:
    parse, shape = {"chat": (parse_chat, CHAT_BODY), "text": (parse_completion, COMPLETION_BODY),
                    "embed": (parse_embedding, EMBEDDING_BODY)}[route]
    with pytest.raises(APIError) as refused:
        parse(decode_json(msgspec.json.encode(body), shape))
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message[:300]
    assert len(refused.value.message) < 1000, refused.value.message[:300]


# A Content-Length of more digits than Python's int() reads (4,300), leading zeros before a small value, which the
# HTTP parser accepts as that value, made the router's own size check raise ValueError: a 500 internal_error,
# logged as a server fault, for what is a well-formed request.
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_a_content_length_of_many_leading_zeros_is_read_as_its_value(tiny_chat_model, http_parser) -> None:
    pytest.importorskip(http_parser)
    body = msgspec.json.encode({"model": "tiny", "prompt": "hi", "max_tokens": 1})
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http=http_parser) as live:
        port = int(live.url.rsplit(":", 1)[1])
        for declared in ("0" * 4400 + str(len(body)), str(len(body))):
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {declared}\r\nConnection: close\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(head + body)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            status = answer.split(b" ", 2)[1]
            assert status in (b"200", b"400"), answer[:600]  # a parser may refuse the digits itself (its own 400)
            if status == b"400":
                assert b"invalid_http_request" in answer
            assert b"x-request-id" in answer.lower()


# The server heads a call's engine request id with its tenant (`<tenant>/<call id>`, the convention of the per-tenant
# scheduler in examples/custom_scheduler.py) and leaves a call without one its bare call id (a key with no Tenant,
# a request without the tenant header). The example read the part before the first "/" of such an id as its tenant:
# the whole id, a tenant new with every call and never served, so each went before every real tenant, and a caller
# with a plain key flooding the server starved them all (and each left an entry in the scheduler's usage for good).
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_scheduler.py"


def test_calls_without_a_tenant_are_one_tenant_to_the_example_scheduler() -> None:
    spec = importlib.util.spec_from_file_location("custom_scheduler_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers "fair-share"

    def waits(name: str) -> dict[str, float]:
        # tenant "acme" sends one; a caller without a tenant floods 40 calls, ids as the server makes them
        trace = [TraceRequest("acme/0", 0.0, 64, 64)]
        trace += [TraceRequest(router.new_request_id("cmpl"), 0.001, 64, 64) for _ in range(40)]
        trace.append(TraceRequest("acme/1", 0.01, 64, 64))
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
        return {r.id: r.wait for r in simulate(trace, name, config=config, num_blocks=512).records}

    fair, fifo = waits("fair-share"), waits("fifo")
    assert fair["acme/1"] < 0.2 * fifo["acme/1"], (fair["acme/1"], fifo["acme/1"])
    sched = module.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4))
    bare = [Request(router.new_request_id("chatcmpl"), [1], SamplingParams(), arrival_time=0.0) for _ in range(2)]
    assert sched.tenant(bare[0]) == sched.tenant(bare[1]) != sched.tenant(Request("acme/2", [1], SamplingParams(), arrival_time=0.0))


# An answer sent before its request's body was all in (a 401 for a wrong key, a 413 for a body over the limit, a 415)
# left the rest of that body, still arriving, to the connection guard as the next request's head: past 64 KiB of it
# the guard wrote a second answer, "431 headers_too_large", for one request, and closed the connection, so a
# request pipelined behind the body was never answered. The parser skips that body; the guard now counts it as what
# follows a head (bounded as before), and the next request is served.
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
@pytest.mark.parametrize("case", ["wrong key", "too large"])
def test_an_answer_before_the_body_is_in_is_the_only_answer_and_the_connection_serves_on(tiny_chat_model, case,
                                                                                          http_parser) -> None:
    pytest.importorskip(http_parser)
    settings = ServerSettings(api_keys=("sk-right",), max_body_bytes=256 * 1024)
    key = "sk-wrong" if case == "wrong key" else "sk-right"
    body = b'{"model": "tiny", "prompt": "' + b"x" * (200_000 if case == "wrong key" else 400_000) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    after = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    with LiveServer(app, settings, http=http_parser) as live:
        port = int(live.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head)
            time.sleep(0.3)  # the answer goes before the body
            for at in range(0, len(body), 16384):
                sock.sendall(body[at:at + 16384])
            sock.sendall(after)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"401" if case == "wrong key" else b"413", b"200"], answer[:2000]


# With uvicorn's h11 parser (`http="h11"`, and "auto" where httptools is not installed) a request head over h11's own
# buffer limit, 16 KiB, was refused as unparseable (400 invalid_http_request) before the connection guard's documented
# limit of 64 KiB (MAX_HEADER_BYTES): a head of 16 to 64 KiB, served by httptools, was refused, and a longer one was
# never the documented 431.
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_a_head_up_to_the_documented_limit_is_served_by_either_parser(tiny_chat_model, http_parser) -> None:
    pytest.importorskip(http_parser)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http=http_parser) as live:
        port = int(live.url.rsplit(":", 1)[1])
        for size, status in ((40_000, b"200"), (MAX_HEADER_BYTES - 200, b"200"), (MAX_HEADER_BYTES + 10_000, b"431")):
            head = f"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * size}\r\nConnection: close\r\n\r\n".encode()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with contextlib.suppress(OSError):  # a refusal may close the connection before all is sent
                    for at in range(0, len(head), 4096):  # as a slow link delivers it: a head read in several pieces
                        sock.sendall(head[at:at + 4096])
                        time.sleep(0.005)
                answer = b""
                with contextlib.suppress(OSError):
                    while chunk := sock.recv(65536):
                        answer += chunk
            assert answer.split(b" ", 2)[1] == status, (size, answer[:300])
            assert b"x-request-id" in answer.lower()


# An assistant message's tool call of a `type` other than "function" (a "custom" tool's call, or any string) was
# read as a function call all the same, where every other field the server cannot serve is a 400 naming it.
def test_a_history_tool_call_of_another_type_is_a_400_naming_it() -> None:
    def body(call_type):
        call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
        if call_type is not None:
            call["type"] = call_type
        return msgspec.json.encode({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": None, "tool_calls": [call]}]})

    for call_type in ("custom", "y" * 100_000, 5):
        with pytest.raises(APIError) as refused:
            parse_chat(decode_json(body(call_type), CHAT_BODY))
        assert (refused.value.status, refused.value.param) == (400, "messages.[1].tool_calls.[0].type")
        assert len(refused.value.message) < 1000
    for call_type in ("function", None):
        history = parse_chat(decode_json(body(call_type), CHAT_BODY)).history
        assert history[1]["tool_calls"][0]["type"] == "function"


async def _big_answer(scope: dict, receive: Any, send: Any) -> None:
    """An app whose every answer is 20 MiB in one body, as a non-streamed answer is sent."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    body = b"x" * (20 << 20)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def test_a_client_trickle_reading_a_large_answer_is_cut_off_after_send_timeout() -> None:
    """A client that reads a large non-streamed answer a few bytes at a time keeps its send buffer full (a few bytes
    read never let the buffer drain to where writing resumes): the connection is dropped after ``send_timeout``,
    the answer freed, though the client reads all the while."""
    settings = ServerSettings(header_timeout=2.0, send_timeout=1.0)
    with LiveServer(_big_answer, settings) as live:
        host, port = live.url.removeprefix("http://").split(":")
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        try:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            start = time.monotonic()
            while time.monotonic() - start < 30 and (time.monotonic() - start < 0.5
                                                     or live.server.server_state.connections):
                time.sleep(0.25)
                client.recv(64)  # a trickle: never an empty read, the server's data keeps coming
            assert not live.server.server_state.connections, "the trickle reader still holds its connection"
            assert time.monotonic() - start < 10
        finally:
            client.close()


def test_model_specs_of_one_name_or_a_bad_name_are_refused_by_create_app(tiny_models) -> None:
    """Two ModelSpecs of one name (or a name of 0 or 300 characters) failed the app's start-up, after the first model
    had loaded; create_app refuses them, naming the field, before anything loads."""
    path = str(tiny_models["llama"][0])
    with pytest.raises(InvalidParameterError) as err:
        create_app([ModelSpec(path, "a"), ModelSpec(path, "b"), ModelSpec(path, "a")])
    assert err.value.parameter == "models" and err.value.value == "a"
    for bad in ("", "x" * 300, 7):
        with pytest.raises(InvalidParameterError) as err:
            create_app([ModelSpec(path, "ok"), ModelSpec(path, bad)])
        assert err.value.parameter == "models[1].name"


def test_a_model_chat_completions_will_refuse_is_named_at_start_up(tiny_models, tiny_chat_model, caplog) -> None:
    """``asyncinfer serve`` of a model without a chat template said nothing of it: its banner is printed before the
    model loads, and the first chat request learnt it from a 400. The app warns once the models are loaded."""
    from fastapi.testclient import TestClient

    caplog.set_level("WARNING", logger="asyncinfer.server.app")
    app = create_app([ModelSpec(str(tiny_models["llama"][0]), "plain", TINY_OPTIONS),
                      ModelSpec(str(tiny_chat_model), "chatty", TINY_OPTIONS)])
    with TestClient(app):
        pass
    said = [r.getMessage() for r in caplog.records if r.name == "asyncinfer.server.app"]
    assert len(said) == 1 and said[0].startswith("model 'plain' has no ")
    assert "/v1/chat/completions" in said[0]
