"""One caller's off-loop work takes its few worker threads, never the pool: a key's (tenant's) large bodies are
decoded, and an engine tenant's long prompts tokenized, at most ``WORK_THREADS_PER_PARTY`` at once, the rest in turn,
and another caller's work runs beside them. All shared one pool, first come first served: a flood of large
bodies from one key (each decoded in a thread) made another key's plain calls wait behind it (0.14 s became
2.5-7 s on two cores). The pool is made small here so that a flood fills it at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from asyncinfer import threads
from asyncinfer.prompts import OFF_LOOP_CHARS
from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app, router
from asyncinfer.threads import WORK_THREADS_PER_PARTY

from .conftest import TINY_OPTIONS, LiveServer

POOL = WORK_THREADS_PER_PARTY + 1  # the pool's threads in these tests: one more than a party's share
FLOOD = 6
PAD = " " * 6000  # JSON's whitespace, past the loop's share: the body is decoded in a worker thread


@pytest.mark.parametrize("who", ["key", "tenant"])
def test_one_keys_flood_of_large_bodies_leaves_another_key_a_thread(tiny_models, monkeypatch, who) -> None:
    """``who="tenant"``: the flood comes through two keys of one tenant, whose calls share the tenant's threads."""
    settings = ServerSettings(api_keys=("sk-a", "sk-b"), tenants={"sk-t": Tenant("t"), "sk-t2": Tenant("t")})
    flooders = ["sk-a"] if who == "key" else ["sk-t", "sk-t2"]
    release, entered = threading.Event(), []
    real = router.decode_json

    def held(raw, shape):
        if b"[1,2,4]" in raw:  # the flood's prompt
            entered.append(1)
            assert release.wait(30)
        return real(raw, shape)

    monkeypatch.setattr(router, "decode_json", held)
    monkeypatch.setattr(threads, "_work_executor", ThreadPoolExecutor(POOL))  # a small pool of work threads
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            ThreadPoolExecutor(FLOOD) as pool:


        def send(key: str, prompt: str) -> httpx.Response:
            return httpx.post(live.url + "/v1/completions", timeout=60, content=(
                f'{{"model":"ids","prompt":{prompt},"max_tokens":2,"temperature":0}}' + PAD).encode(),
                headers={"authorization": f"Bearer {key}", "content-type": "application/json"})

        try:
            flood = [pool.submit(send, flooders[i % len(flooders)], "[1,2,4]") for i in range(FLOOD)]
            deadline = time.monotonic() + 30
            while len(entered) < WORK_THREADS_PER_PARTY:
                assert time.monotonic() < deadline, "the flood's bodies were never decoded"
                time.sleep(0.01)
            other = send("sk-b", "[1,2,3]")  # its body decoded in a thread too: the pool had one for it
            assert other.status_code == 200, other.text
            assert len(entered) == WORK_THREADS_PER_PARTY  # the flood's others wait their turn
        finally:
            release.set()
        answers = [f.result(60) for f in flood]
        assert [a.status_code for a in answers] == [200] * FLOOD and len(entered) == FLOOD


def test_an_engine_tenants_long_prompts_take_its_threads_not_the_pool(tiny_chat_model, monkeypatch) -> None:
    """In-process: ``generate(tenant=...)`` calls of long prompts are tokenized in the tenant's threads (else the
    cache salt's), another tenant's long prompt beside them (each prompt counted long here)."""
    from asyncinfer import AsyncEngine, SamplingParams, catalog

    release, entered = threading.Event(), []
    real = catalog.prompt_token_ids

    def held(prompt, version):
        if "HOLD" in prompt:
            entered.append(1)
            assert release.wait(30)
        return real(prompt, version)

    monkeypatch.setattr(catalog, "prompt_token_ids", held)
    # room for the tenant's and the salt's shares and one more
    monkeypatch.setattr(threads, "_work_executor", ThreadPoolExecutor(2 * WORK_THREADS_PER_PARTY + 1))
    monkeypatch.setattr(catalog, "prompt_cost", lambda prompt: OFF_LOOP_CHARS + 1)  # each tokenized off the loop
    long = "Hello world! " * 10
    params = SamplingParams(max_tokens=2, temperature=0)

    async def scenario() -> None:
        async with await AsyncEngine.load(str(tiny_chat_model), **TINY_OPTIONS) as engine:
            flood = [asyncio.ensure_future(engine.generate(long + "HOLD", params, tenant="a")) for _ in range(FLOOD)]
            salted = [asyncio.ensure_future(engine.generate(long + "HOLD", params, cache_salt="s")) for _ in range(2)]
            while len(entered) < 2 * WORK_THREADS_PER_PARTY:
                await asyncio.sleep(0.01)
            try:  # the pool's one free thread is for it: the flood takes only its own two and the salt's two
                out = await asyncio.wait_for(engine.generate(long, params, tenant="b"), 10)
            finally:
                release.set()
            assert len(out.outputs[0].token_ids) == 2
            assert len(await asyncio.gather(*flood, *salted)) == FLOOD + 2

    try:
        asyncio.run(scenario())
    finally:
        release.set()
