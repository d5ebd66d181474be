"""A deployment's own route that calls the engine from a task group (``asyncio.TaskGroup``, anyio's, ``gather`` in
one): an engine refusal comes out wrapped in an exception group, which ``guard_app`` let through as a crash, a 500
logged as "Exception in ASGI application". A group of nothing but asyncinfer errors is answered as its most severe
member is (the highest status; the first of equals, such as a 400 naming the parameter), whatever order its tasks
failed in; a group holding any other fault is still a fault."""

from __future__ import annotations

import logging

import pytest

from asyncinfer.errors import EngineOverloadedError, InvalidParameterError
from asyncinfer.server import app as server_app

from .conftest import LiveServer, own_routes_app


@pytest.mark.parametrize(("errors", "status", "param"), [
    ([InvalidParameterError("max_tokens", 0, "an int >= 1")], 400, "max_tokens"),
    ([InvalidParameterError("temperature", -1, "a float >= 0"), InvalidParameterError("top_p", 2, "(0, 1]")], 400,
     "temperature"),
    ([EngineOverloadedError("model 'default' has 4 requests in flight; retry later.", retry_after=2.0)], 503, None),
])
def test_a_group_of_engine_errors_is_answered_as_its_most_severe(errors, status, param) -> None:
    from fastapi.testclient import TestClient

    r = TestClient(own_routes_app(errors)).get("/group")
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.headers["x-request-id"]


@pytest.mark.parametrize("overload_first", [True, False])
def test_the_answer_does_not_depend_on_which_task_failed_first(overload_first) -> None:
    """A refusal of the caller's input (400) beside the engine's overload (503), in either order, and nested one
    group down: the server's 503 with its Retry-After, never a 400 that tells the client its input was at fault
    because its task happened to fail first."""
    from fastapi.testclient import TestClient

    overloaded = EngineOverloadedError("model 'default' has 4 requests in flight; retry later.", retry_after=2.0)
    refused = InvalidParameterError("max_tokens", 0, "an int >= 1")
    errors: list[BaseException] = [overloaded, refused] if overload_first else [refused, overloaded]
    for app in (own_routes_app(errors), own_routes_app([refused, server_app._Group("inner", errors)])):
        r = TestClient(app).get("/group")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "2"


def test_a_group_with_another_fault_is_a_fault() -> None:
    from fastapi.testclient import TestClient

    app = own_routes_app([InvalidParameterError("max_tokens", 0, "an int >= 1"), RuntimeError("a bug")])
    with pytest.raises(Exception) as caught:  # TestClient raises what the app raises: the group itself
        TestClient(app).get("/group")
    assert isinstance(caught.value, server_app._Group)
    assert sorted(type(e).__name__ for e in caught.value.exceptions) == ["InvalidParameterError", "RuntimeError"]


def test_under_uvicorn_a_group_of_refusals_logs_no_error(caplog) -> None:
    live = LiveServer(own_routes_app([InvalidParameterError("max_tokens", 0, "an int >= 1")]))
    uvicorn_log = logging.getLogger("uvicorn.error")  # where uvicorn logs "Exception in ASGI application"
    uvicorn_log.addHandler(caplog.handler)
    try:
        import httpx

        with live, caplog.at_level(logging.INFO):
            r = httpx.get(f"{live.url}/group", timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    finally:
        uvicorn_log.removeHandler(caplog.handler)
