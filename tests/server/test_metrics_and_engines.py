"""/metrics serves the engine's own registry (and the HTTP answers); two engines (and two apps) share one process without sharing anything."""

from __future__ import annotations

import asyncio
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_are_the_engines_figures(server) -> None:
    server.wait_idle()
    http = httpx.Client(base_url=server.url)
    assert http.post("/v1/completions", json={"model": "ids", "prompt": [5, 6, 7], "max_tokens": 3}).status_code == 200
    assert http.post("/v1/embeddings", json={"model": "minilm", "input": ["a", "b"]}).status_code == 200
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    got = scrape(server.url)
    engine = server.engine
    kv, emb, snap = engine.kv_stats("ids"), engine.embedding_stats("minilm"), engine.metrics.snapshot()
    ids, minilm = (("model", "ids"),), (("model", "minilm"),)
    assert got[("asyncinfer_kv_blocks", ids)] == kv.num_blocks
    assert got[("asyncinfer_kv_blocks_used", ids)] == 0
    assert got[("asyncinfer_prefix_cache_queried_tokens_total", ids)] == snap.models["ids"].prefix_cache_queried_tokens
    assert got[("asyncinfer_generation_tokens_total", ids)] == snap.models["ids"].generation_tokens >= 3
    assert got[("asyncinfer_step_duration_seconds_count", ids)] == snap.models["ids"].step_duration.count > 0
    assert got[("asyncinfer_embedding_texts_total", minilm)] == emb.num_texts >= 2
    assert got[("asyncinfer_requests_in_flight", ())] == 0
    assert ("asyncinfer_kv_blocks", minilm) not in got  # an embedding model has no KV cache
    assert got[("process_resident_memory_bytes", ())] > 100 * 2**20
    answers = {labels: v for (name, labels), v in got.items() if name == "asyncinfer_http_responses_total"}
    assert answers[(("route", "/v1/completions"), ("status", "404"))] >= 1
    assert answers[(("route", "/v1/embeddings"), ("status", "200"))] >= 1


async def test_two_engines_in_one_process_are_independent(tiny_models, hf_greedy) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engines = {kind: AsyncEngine.from_pretrained(tiny_models[kind][0], **TINY_OPTIONS) for kind in ("llama", "qwen2")}
    async with engines["llama"] as llama, engines["qwen2"] as qwen:
        outs = await asyncio.gather(*(e.generate(p, params) for p in prompts for e in (llama, qwen)))
        for i, p in enumerate(prompts):
            assert outs[2 * i].token_ids == hf_greedy(tiny_models["llama"][1], p, 10)
            assert outs[2 * i + 1].token_ids == hf_greedy(tiny_models["qwen2"][1], p, 10)
        long = llama.stream(prompts[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(long)
        assert llama.kv_stats().used_blocks > 0 and qwen.kv_stats().used_blocks == 0
        await long.aclose()
        await llama.aclose()  # closing one leaves the other serving
        assert (await qwen.generate(prompts[1], params)).token_ids == outs[3].token_ids
        assert qwen.step_stats().steps != llama.step_stats().steps


def test_two_apps_in_one_process_each_with_its_engine(tiny_models) -> None:
    apps = [create_app(ModelSpec(str(tiny_models[kind][0]), kind, TINY_OPTIONS)) for kind in ("llama", "qwen2")]
    with LiveServer(apps[0]) as one, LiveServer(apps[1]) as two:
        for live, kind in ((one, "llama"), (two, "qwen2")):
            r = httpx.post(live.url + "/v1/completions", json={"model": kind, "prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 200
            models = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
            assert models == [kind]
            assert {labels for (name, labels) in scrape(live.url) if name == "asyncinfer_kv_blocks"} == {
                (("model", kind),)}
        assert one.engine is not two.engine and one.engine.loop is not two.engine.loop
