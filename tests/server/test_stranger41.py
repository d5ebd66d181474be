"""What the HTTP side says while a drain-mode swap waits for the old version's requests (stranger41)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from asyncinfer import AsyncEngine, EngineClosedError
from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.schedulers.base import SchedulerOutput
from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer

GATE = threading.Event()


class Gated(FIFOScheduler):
    """Schedules nothing until ``GATE`` is set: a request stays in flight on its version."""

    def schedule(self) -> SchedulerOutput:
        return super().schedule() if GATE.is_set() else SchedulerOutput()


def between_versions(engine: AsyncEngine) -> bool:
    try:
        engine.get_tokenizer()
    except EngineClosedError:
        return True
    return False


# While a drain-mode swap waited for the default model's old version to finish its requests, a request naming no model
# was the 503 "The default model is between versions ...: retry shortly, or name another generator: `tiny`", `tiny`
# being that very model, whose own name is the same 503. Only a generator that would answer is named now.
def test_a_drain_swap_waiting_on_old_requests_names_not_the_model_itself(tiny_chat_model) -> None:
    GATE.set()  # the load's warm-up request runs
    options = {**TINY_OPTIONS, "scheduler": Gated}
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", options)])
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        GATE.clear()
        first: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: first.append(
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})))
        sender.start()
        engine = live.engine
        deadline = time.monotonic() + 30
        while engine.num_unfinished_requests == 0:  # the first request is in flight, on the old version
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.loop is not None
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **options), engine.loop)
        try:
            # admission paused from the call on; the drain begun once the old version is listed draining
            while not between_versions(engine) or [i.state for i in engine.model_info()] != ["draining"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert [(i.name, i.state) for i in engine.model_info()] == [("tiny", "draining")]
        finally:
            GATE.set()
        swap.result(60)
        sender.join(60)
    message = r.json()["error"]["message"]
    assert message.endswith("retry shortly."), message   # was: "retry shortly, or name another generator: `tiny`."
    assert first[0].status_code == 200, first[0].text
