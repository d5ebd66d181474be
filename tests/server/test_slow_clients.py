"""Slow and surplus clients against a running server, over real sockets: a client that sends its
headers or its body a byte at a time is answered 408 and closed once its time is up, a connection
over the cap is answered 503 at once, and everyone else is served all the while.

The issue's trial held 300 such connections open for ever; here 120 (and a one-second limit) show
the same in a few seconds, and benchmarks/slow_clients.py sends the 300.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app

from .conftest import TINY_OPTIONS, LiveServer

LIMIT = 1.0  # header_timeout and body_timeout of these servers
SLACK = 4.0  # a shared two-core machine may be late to close; a server without the limits never closes
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2}'
ROOT = Path(__file__).resolve().parents[2]


def _script():
    """benchmarks/slow_clients.py, whose slow connections these tests make."""
    spec = importlib.util.spec_from_file_location("slow_clients", ROOT / "benchmarks" / "slow_clients.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


slow_clients = _script()


def error_of(outcome) -> dict:
    """The OpenAI error body of a slow connection's answer (with its X-Request-Id checked)."""
    head, _, body = outcome.answer.partition(b"\r\n\r\n")
    assert b"\r\nx-request-id: " in head.lower()
    error = msgspec.json.decode(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def dribble(port: int, at_once: bytes, slowly: bytes, give_up: float):
    return await slow_clients.dribble("127.0.0.1", port, at_once, slowly, 0.05, give_up)


def a_request_meanwhile(url: str) -> float:
    """An ordinary request while the slow ones hold their connections: its seconds (it must be answered)."""
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def tiny_server(tiny_models, settings: ServerSettings) -> LiveServer:
    return LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings), settings)


@pytest.fixture(scope="module", autouse=True)
def no_long_gc_pauses():
    """Clients and server share this process, whose heap (torch, transformers, the models) makes a full
    garbage collection take seconds on a loaded machine: long enough to make every client look slow to
    the server. The objects made so far are set aside from collection while these tests run."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def limited(tiny_models, no_long_gc_pauses):
    settings = ServerSettings(header_timeout=LIMIT, body_timeout=LIMIT, max_connections=512)
    with tiny_server(tiny_models, settings) as live:
        yield live


def port_of(live: LiveServer) -> int:
    return int(live.url.rsplit(":", 1)[1])


async def crowd(live: LiveServer, count: int, at_once: bytes, slowly: bytes) -> tuple[list, float]:
    outcomes = asyncio.gather(*(dribble(port_of(live), at_once, slowly, LIMIT + SLACK) for _ in range(count)))
    await asyncio.sleep(LIMIT / 2)  # all of them are dribbling now
    meanwhile = await asyncio.to_thread(a_request_meanwhile, live.url)
    return await outcomes, meanwhile


def test_headers_sent_byte_by_byte_are_cut_off(limited) -> None:
    outcomes, meanwhile = asyncio.run(crowd(limited, 120, b"", HEAD + b"X-Padding: " + b"a" * 4000))
    assert meanwhile < LIMIT + SLACK
    assert all(o.closed_after is not None for o in outcomes), "the server kept slow connections open"
    assert max(o.closed_after for o in outcomes) < LIMIT + SLACK
    assert min(o.closed_after for o in outcomes) >= LIMIT * 0.9  # not before their time
    for o in outcomes:
        assert o.status == 408 and error_of(o)["code"] == "request_timeout"


def test_a_body_sent_byte_by_byte_is_cut_off(limited) -> None:
    head = HEAD + b"Content-Length: 4000\r\n\r\n"
    outcomes, meanwhile = asyncio.run(crowd(limited, 120, head, b" " * 4000))
    assert meanwhile < LIMIT + SLACK
    assert all(o.closed_after is not None for o in outcomes), "the server kept slow connections open"
    assert max(o.closed_after for o in outcomes) < LIMIT + SLACK
    for o in outcomes:
        assert o.status == 408 and error_of(o)["code"] == "request_timeout"
        assert b"connection: close" in o.answer.lower()


def test_a_quiet_keep_alive_connection_is_closed_without_an_answer(limited) -> None:
    async def run() -> slow_clients.Outcome:
        # One whole request, answered; then nothing: uvicorn's own keep-alive (5 s) or the header limit closes it.
        start = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(limited))
        writer.write(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
        answer = bytearray()
        while chunk := await asyncio.wait_for(reader.read(65536), LIMIT + SLACK + 5):
            answer.extend(chunk)
        writer.close()
        return slow_clients.Outcome(time.monotonic() - start, bytes(answer))

    outcome = asyncio.run(run())
    assert outcome.status == 200 and outcome.answer.count(b"HTTP/1.1 ") == 1  # its answer, and no 408 after it
    assert outcome.closed_after < LIMIT + SLACK


def test_connections_over_the_cap_get_a_503_at_once(tiny_models) -> None:
    cap = 24
    settings = ServerSettings(header_timeout=LIMIT * 3, body_timeout=LIMIT, max_connections=cap)
    with tiny_server(tiny_models, settings) as live:
        async def run() -> list:
            return await asyncio.gather(*(dribble(port_of(live), b"", HEAD + b"X-Padding: " + b"a" * 4000,
                                                  LIMIT * 3 + SLACK) for _ in range(cap + 16)))

        outcomes = asyncio.run(run())
        refused = [o for o in outcomes if o.status == 503]
        held = [o for o in outcomes if o.status == 408]
        assert len(refused) + len(held) == cap + 16
        assert len(refused) >= 16 and len(held) <= cap
        for o in refused:
            error = error_of(o)
            assert (error["type"], error["code"]) == ("server_error", "too_many_connections")
            assert b"retry-after: 1" in o.answer.lower() and o.closed_after < LIMIT * 3
        assert min(o.closed_after for o in held) >= LIMIT * 3 * 0.9
        a_request_meanwhile(live.url)  # once they are gone, a connection is welcome again


@pytest.mark.parametrize("mode", ["headers", "body"])
def test_the_load_script_300_slow_connections(limited, tmp_path, mode) -> None:
    """The issue's trial, as benchmarks/slow_clients.py runs it: 300 connections, every one closed on time."""
    out = tmp_path / "slow.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slow_clients.py"), "--url", limited.url,
                           "--connections", "300", "--mode", mode, "--interval", "0.1",
                           "--give-up", str(LIMIT + 2 * SLACK), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["closed"], result["held_until_give_up"], result["statuses"]) == (300, 0, {"408": 300})
    assert result["closed_after_s"]["max"] < LIMIT + 2 * SLACK and result["ordinary_request_s"] is not None


def test_a_request_head_past_the_limit_is_answered_431_and_the_server_keeps_its_memory(limited) -> None:
    """Headers have a size limit of their own (the body's does not cover them): a head past
    MAX_HEADER_BYTES gets an OpenAI-shaped 431 at once, sent in one piece or split at any point, and a
    head just under it is served."""
    import socket

    from asyncinfer.server.connections import MAX_HEADER_BYTES

    def send(head: bytes, pieces: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port_of(limited)), timeout=LIMIT + SLACK) as sock:
            step = -(-len(head) // pieces)
            try:
                for i in range(0, len(head), step):
                    sock.sendall(head[i:i + step])
            except OSError:
                pass  # refused mid-way: the answer is already there
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer

    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    padding = b"X-Padding: " + b"a" * 1000 + b"\r\n"
    big = health + padding * (MAX_HEADER_BYTES // len(padding) + 2) + b"\r\n"
    for pieces in (1, 7, 300):
        answer = send(big, pieces)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"x-request-id:" in answer.lower() and b'"code":"headers_too_large"' in answer
    fits = health + padding * (MAX_HEADER_BYTES // len(padding) - 2) + b"\r\n"
    assert send(fits, 5).startswith(b"HTTP/1.1 200 ")
