"""pass42: guard_app logs a fault once, under the id its answer carries.

guard_app's answer to an exception group of asyncinfer errors (its most severe member's, 943b7bb) made the answer of
every exception it saw, before it knew whether it would answer it: each 500-class member of a group that held
another fault (a route's bug), and an engine fault raised once a streaming answer had begun, were logged as
"request <id> failed" under an id no answer carried, then raised and logged again as the fault they are (the 500's
own id, or uvicorn's traceback), where docs/serving.md says such a group "is a fault of the route, raised as
itself" and a fault is logged with the id of its answer.
"""

from __future__ import annotations

import logging

from asyncinfer.errors import InvalidParameterError, RequestFailedError

from .conftest import own_routes_app


def _failed_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]


def test_a_group_holding_a_bug_is_logged_once_under_its_answers_id(caplog) -> None:
    from fastapi.testclient import TestClient

    app = own_routes_app([RequestFailedError("the step failed"), RuntimeError("a bug")])
    with caplog.at_level(logging.INFO):
        r = TestClient(app, raise_server_exceptions=False).get("/group")
    assert r.status_code == 500
    assert _failed_lines(caplog) == [f"request {r.headers['x-request-id']} failed"], _failed_lines(caplog)


def test_an_engine_fault_after_the_answer_began_is_logged_once(caplog) -> None:
    from fastapi.testclient import TestClient

    app = own_routes_app([RequestFailedError("the step failed")])
    with caplog.at_level(logging.INFO):
        try:
            TestClient(app).get("/stream")
        except RequestFailedError:
            pass  # raised on up, as any fault once the answer has begun
    assert len(_failed_lines(caplog)) == 1, _failed_lines(caplog)  # the fault's own line, not one more first


def test_a_group_of_refusals_is_still_answered() -> None:
    from fastapi.testclient import TestClient

    r = TestClient(own_routes_app([InvalidParameterError("max_tokens", 0, "an int >= 1")])).get("/group")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_swap_error_from_an_own_route_keeps_its_paths_to_the_log(caplog) -> None:
    """docs/model_swaps.md: a ``SwapError`` a deployment's admin route lets through is a 500 ``internal_error`` whose
    body does not carry its reason (the server's paths), and the reason is in the server's log under the answer's id."""
    from fastapi.testclient import TestClient

    from asyncinfer.errors import SwapError

    app = own_routes_app([SwapError("loading '/srv/models/v3' failed: model path '/srv/models/v3' does not exist")])
    with caplog.at_level(logging.INFO):
        r = TestClient(app, raise_server_exceptions=False).get("/group")
    assert r.status_code == 500
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error") and "/srv" not in error["message"]
    assert _failed_lines(caplog) == [f"request {r.headers['x-request-id']} failed"]
    [record] = [rec for rec in caplog.records if rec.getMessage().startswith("request ")]
    assert record.exc_info is not None and "/srv/models/v3" in str(record.exc_info[1])
