"""``max_requests_per_tenant`` counts a call's samples: a prompt of ``n=4`` runs as four sequences, each a seat of
``max_num_seqs``, and counted as one request it let a tenant limited to L hold L x n seats (with the fifo
scheduler every other tenant waited out its samples: 5.5 s for a 5-token answer that took 0.15 s alone). A call of
more samples than the limit is a 400 naming ``n``; samples in flight hold their places until the answer ends."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.schedulers.base import SchedulerOutput
from asyncinfer.server import ModelSpec, ServerSettings, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer

KEY = "sk-samples"
HEADERS = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "temperature": 1, "seed": 1}
HOLD = threading.Event()


class Holding(FIFOScheduler):
    """Schedules nothing while ``HOLD`` is set: a call's samples stay in flight (a long answer of the tiny model could
    end before the next call was sent)."""

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput() if HOLD.is_set() else super().schedule()
SHORT = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def limited(tiny_models):
    settings = ServerSettings(api_keys=(KEY,), max_requests_per_tenant=2)
    options = dict(TINY_OPTIONS, max_num_seqs=4, max_waiting_requests=4, scheduler=Holding)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live:
        yield live


def test_more_samples_than_the_limit_is_a_400_naming_n(limited) -> None:
    with httpx.Client(base_url=limited.url, timeout=120) as http:
        refused = http.post("/v1/completions", json={**SHORT, "n": 3, "temperature": 1}, headers=HEADERS)
        two_prompts = http.post("/v1/completions", json={**SHORT, "prompt": [[5, 6], [7, 8]], "n": 2,
                                                          "temperature": 1}, headers=HEADERS)
        three_prompts = http.post("/v1/completions", json={**SHORT, "prompt": [[5], [6], [7]]}, headers=HEADERS)
        within = http.post("/v1/completions", json={**SHORT, "n": 2, "temperature": 1}, headers=HEADERS)
    assert refused.status_code == 400, refused.text  # was 200: three seats for a tenant limited to two
    assert refused.json()["error"] == {
        "message": "This call makes 3 requests (1 prompt of n=3 samples, one a sample), more than the 2 this server "
                   "lets one tenant have in flight (max_requests_per_tenant=2).",
        "type": "invalid_request_error", "param": "n", "code": "tenant_requests_exceeded"}
    assert two_prompts.status_code == 400 and two_prompts.json()["error"]["param"] == "n"
    assert three_prompts.status_code == 400 and three_prompts.json()["error"]["param"] == "prompt"
    assert within.status_code == 200 and len(within.json()["choices"]) == 2
    limited.wait_idle(60)


def test_samples_in_flight_hold_their_places(limited) -> None:
    done: list[httpx.Response] = []

    def hold() -> None:
        with httpx.Client(base_url=limited.url, timeout=120) as http:
            done.append(http.post("/v1/completions", json={**LONG, "n": 2}, headers=HEADERS))

    HOLD.set()
    holder = threading.Thread(target=hold)
    try:
        holder.start()
        deadline = time.monotonic() + 30
        while limited.engine.num_unfinished_requests < 1:  # its places are taken before it is submitted
            assert time.monotonic() < deadline and not done, "the held call neither ran nor was refused"
            time.sleep(0.002)
        with httpx.Client(base_url=limited.url, timeout=120) as http:
            refused = http.post("/v1/completions", json=SHORT, headers=HEADERS)
    finally:
        HOLD.clear()
        holder.join(120)
    assert done[0].status_code == 200 and len(done[0].json()["choices"]) == 2
    limited.wait_idle(60)  # its answer ended: its places given back
    with httpx.Client(base_url=limited.url, timeout=120) as http:
        after = http.post("/v1/completions", json=SHORT, headers=HEADERS)
    assert refused.status_code == 429, refused.text  # was 200: the two samples counted as one request
    assert refused.json()["error"]["message"] == (
        "This API key (which has no tenant) has 2 requests in flight, the most this server allows one tenant "
        "(max_requests_per_tenant=2): retry when one has ended.")
    assert after.status_code == 200
