"""A request pipelined behind one in flight gets the same 64 KiB bound on its head as any other.

The connection guard counted a head until its end and left what followed to the parser; httptools (what
uvicorn's "auto" takes where it is installed) bounds no header block, so a client could pipeline a
request of megabytes of headers behind a slow one and have it held in memory and answered 200. Found by
the closing adversarial pass of issue 25.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app

from .conftest import TINY_OPTIONS, LiveServer

pytest.importorskip("httptools")


def test_a_pipelined_head_past_the_limit_is_refused_while_the_first_request_runs(tiny_chat_model) -> None:
    settings = ServerSettings(max_body_bytes=64 * 1024)
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)], settings)
    with LiveServer(app, settings, http="httptools") as live:
        port = int(live.url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}).encode()
        first = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
        pipelined = (b"GET /health HTTP/1.1\r\nHost: x\r\n"
                     + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(1000)) + b"\r\n")  # ~1 MB
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            try:
                conn.sendall(first + pipelined)
            except OSError:  # the server may close before it has read everything
                pass
            answer = b""
            try:
                while chunk := conn.recv(65536):
                    answer += chunk
            except OSError:
                pass
        assert b" 431 " in answer and b"headers_too_large" in answer, answer[-300:]
        assert b'{"status":"ok"}' not in answer  # the pipelined request was never run
        with httpx.Client(base_url=live.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
