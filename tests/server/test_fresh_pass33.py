"""pass33: what a refused request leaves behind, on a server of two generators and an embedding model.

pass32 found a refusal raised in the worker thread kept its whole body until the next full garbage collection (the
error's traceback held the frame that awaited the thread's future, which held the error: a cycle). The same cycle was
left on the loop, wherever an error was raised from a local that the raising frame kept: the 404 for a model the
server does not serve (``_pick``'s ``absent``), the 413 of a body past ``max_body_bytes`` (``_body``'s
``too_large``, its frame holding every chunk read so far: up to 4 MiB), an engine's refusal of a whole answer
(``unless_disconnected``'s task, its result raising the task's error) and of a stream as it starts
(``MergedStreams.prime``'s ``item``). Each held the frames of the call above it, the parsed body with them, until a
full collection: a tenant naming a removed model in 4 MiB bodies grew the server by the body's size each time. Each
such error is raised with no frame keeping it now; the refused body is freed as its answer is sent.
"""

from __future__ import annotations

import gc
import json
import os

import httpx
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app

from .conftest import TINY_OPTIONS, LiveServer

HEADERS = ({"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"})
LONG = "hello world " * 40_000  # a 480 KB text
CASES = {
    "a removed or unknown model": ("/v1/chat/completions", {"model": "gone", "messages": [
        {"role": "user", "content": LONG}]}, 404),
    "a generator named on /v1/embeddings": ("/v1/embeddings", {"model": "tiny", "input": [LONG]}, 400),
    "an embedding model named on /v1/chat/completions": ("/v1/chat/completions", {"model": "minilm", "messages": [
        {"role": "user", "content": LONG}]}, 400),
    "a body past max_body_bytes": ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": LONG * 10}]}, 413),
    "a prompt past max_model_len": ("/v1/completions", {"model": "tiny", "prompt": [LONG[:3000]] * 64,
                                                        "max_tokens": 4}, 400),
    "a streamed prompt past max_model_len": ("/v1/completions", {"model": "tiny2", "prompt": [LONG[:3000]] * 64,
                                                                 "max_tokens": 4, "stream": True}, 400),
    "a streamed long text past max_model_len (refused at its first delta)": ("/v1/completions", {
        "model": "tiny2", "prompt": LONG[:6000], "max_tokens": 4, "stream": True}, 400),
    "max_tokens past the room left": ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": LONG[:1500]}], "max_tokens": 500}, 400),
}


@pytest.fixture(scope="module")
def live(tiny_chat_model, minilm_dir):
    settings = ServerSettings(api_keys=("key-one",), tenants={"key-two": Tenant("two")}, cache_isolation="api-key")
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS),
                      ModelSpec(str(tiny_chat_model), "tiny2", TINY_OPTIONS),
                      ModelSpec(str(minilm_dir), "minilm")], settings)
    with LiveServer(app) as server:
        yield server


def _frames_in_cycles() -> list[str]:
    """The server's frames (a call's, which hold its body) that a full collection finds unreachable (and frees).
    Not the engine's: the siblings of a refused prompt that wait for a worker thread to tokenize theirs, cancelled
    there, are left in a cycle of anyio's own (its capacity limiter's ``WouldBlock`` in their ``CancelledError``),
    each holding its own prompt."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({f"{o.f_code.co_name}" for o in gc.garbage
                       if type(o).__name__ == "frame" and f"asyncinfer{os.sep}server" in o.f_code.co_filename})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_body_is_freed_with_its_answer(live, case: str) -> None:
    """Without a garbage collection, nothing of a refused call's frames (which hold its body) is left in a cycle once
    its error is answered, for each tenant."""
    path, body, status = CASES[case]
    raw = json.dumps(body).encode()
    # one kept-alive connection for all: each body past the limit is answered 413, the one after the other too
    # (tests/server/test_connection_guard.py has the orders in which they reach the connection guard)
    with httpx.Client(base_url=live.url, timeout=60) as http:
        def send(headers: dict[str, str]) -> None:
            response = http.post(path, content=raw, headers={**headers, "Content-Type": "application/json"})
            assert response.status_code == status, response.text[:300]
            if status != 200:
                assert "error" in response.json()
        send(HEADERS[0])  # imports and first-call caches, before counting
        live.wait_idle()
        gc.collect()
        gc.disable()
        try:
            for headers in (*HEADERS, HEADERS[0]):
                send(headers)
            live.wait_idle()
            assert _frames_in_cycles() == []
        finally:
            gc.enable()
