"""A stranger's first hour (stranger32): an engine error raised in a deployment's own route.

examples/openai_server.py's ``/haiku`` is a route of the app's own next to the OpenAI router, ``guard_app``
answering its errors in OpenAI's shape. A topic too long for the model (``/haiku?topic=`` of 50,000 characters)
was answered right, a 400 ``context_length_exceeded``, and an overloaded engine a 503 with ``Retry-After``; but
``guard_app`` answered them from its handler for every ``Exception``, which Starlette runs in its outermost
middleware and then raises the exception again, so uvicorn logged each client's bad request as
``ERROR: Exception in ASGI application`` with the whole traceback, as it logs a crash, and FastAPI's
``TestClient`` (docs/guides/fastapi.md: how to test such an app) raised the ``PromptTooLongError`` in the test
instead of giving the 400. ``guard_app``'s middleware now answers an asyncinfer error that comes before the answer
started as the router's routes answer theirs, logged only where it is a fault of the server (a 500); one raised
mid-stream goes on up as itself (a handler of ``AsyncInferError`` would have made it Starlette's "Caught handled
exception, but response already started").
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import runpy
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncinfer.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError

from .conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def example(monkeypatch) -> dict:
    """examples/openai_server.py's app, its engine one whose ``generate`` raises what ``engine.raises`` holds."""
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["openai_server.py"])
    module = runpy.run_path(str(ROOT / "examples" / "openai_server.py"), run_name="example")

    class Engine:  # what the lifespan would load, refusing as the real one refuses
        raises: BaseException | None = None

        async def generate(self, prompt, params):
            assert self.raises is not None
            raise self.raises

    module["haiku"].__globals__["engine"] = Engine()
    return module


REFUSALS = [
    (PromptTooLongError("<12537 tokens>", "at most max_model_len - 1 = 8191 tokens"), 400, "context_length_exceeded"),
    (EngineOverloadedError("model 'default' has 130 requests in flight; retry later", retry_after=2.0), 503,
     "overloaded"),
]


@pytest.mark.parametrize(("error", "status", "code"), REFUSALS, ids=["too-long", "overloaded"])
def test_an_engine_refusal_in_an_own_route_is_answered_not_raised(example, error, status, code) -> None:
    """``TestClient(app)`` (which raises what the app raises) gets the OpenAI answer: the error is handled."""
    from fastapi.testclient import TestClient

    example["haiku"].__globals__["engine"].raises = error
    r = TestClient(example["app"]).get("/haiku", params={"topic": "rain"})  # not entered: no lifespan, no model
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.headers["x-request-id"]
    if status == 503:
        assert r.headers["retry-after"] == "2"


@contextlib.asynccontextmanager
async def _no_model(app) -> AsyncIterator[None]:
    yield


def test_a_bad_request_in_an_own_route_logs_no_traceback(example, caplog) -> None:
    """Under uvicorn, as the example serves it: a client's too-long topic is a 400 and no ``ERROR`` in the log; an
    engine that died is a 500 logged once, with its cause, by ``asyncinfer.server``."""
    engine = example["haiku"].__globals__["engine"]
    example["app"].router.lifespan_context = _no_model  # the example's lifespan would load the real one
    live = LiveServer(example["app"])  # configures uvicorn's loggers, which do not propagate to the root's
    uvicorn_log = logging.getLogger("uvicorn.error")  # where uvicorn logs "Exception in ASGI application"
    uvicorn_log.addHandler(caplog.handler)
    try:
        with live, caplog.at_level(logging.INFO):
            engine.raises = PromptTooLongError("<12537 tokens>", "at most max_model_len - 1 = 8191 tokens")
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"{live.url}/haiku?topic=rain", timeout=30)
            assert answer.value.code == 400
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

            engine.raises = EngineDeadError("the engine's step loop failed")
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"{live.url}/haiku?topic=rain", timeout=30)
            assert answer.value.code == 500
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert [r.name for r in errors] == ["asyncinfer.server"], [r.getMessage() for r in errors]
            assert errors[0].exc_info is not None and errors[0].exc_info[0] is EngineDeadError
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def test_an_engine_error_once_the_answer_started_stays_the_route_s_fault(caplog) -> None:
    """An own streaming route whose engine error comes after its first chunk: nothing more can be answered, and the
    log shows that error itself (not Starlette's "Caught handled exception, but response already started")."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from asyncinfer.server import guard_app

    app = FastAPI()

    @app.get("/story")
    async def story() -> StreamingResponse:
        async def text():
            yield "Once"
            raise PromptTooLongError("<9000 tokens>", "at most max_model_len - 1 = 8191 tokens")

        return StreamingResponse(text(), media_type="text/plain")

    guard_app(app)
    live = LiveServer(app)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with live, caplog.at_level(logging.INFO):
            with pytest.raises(http.client.IncompleteRead):
                urllib.request.urlopen(f"{live.url}/story", timeout=30).read()
            deadline = time.monotonic() + 10
            while not any(r.levelno >= logging.ERROR for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert errors[0].exc_info[0] is PromptTooLongError, errors[0].exc_info
