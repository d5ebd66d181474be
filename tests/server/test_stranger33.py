"""A stranger's first hour as an operator (stranger33): what the HTTP side says during a model swap."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer, held_drain_swap

DOCS = Path(__file__).resolve().parents[2] / "docs"


# While a drain-mode swap loads the default model's next version, a request naming no model is a 503 whose message
# said "retry shortly, or name a model." On a server with one generator (asyncinfer serve with --embedding-model, the
# usual deployment) there is no model to name: the embedding model is a 400 on this route, and the default model's own
# name is the same 503. The hint now names the generators that would answer, and is left out where there are none.
@pytest.mark.parametrize("other", [False, True])
def test_the_503_of_a_drain_swap_names_only_models_that_would_answer(tiny_chat_model, monkeypatch, other) -> None:
    specs = [ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)]
    if other:
        specs.append(ModelSpec(str(tiny_chat_model), "other", TINY_OPTIONS))
    app = create_app(specs)
    with (LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http,
          held_drain_swap(live, tiny_chat_model, "tiny", monkeypatch)):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        named = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == named.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert "between versions" in message and "name a model" not in message  # was: "..., or name a model."
    # stranger67: it said the swap was loading the next version, most of the wait being the old one's requests
    assert "(a drain-mode swap lets the old version's requests finish, then loads the next)" in message
    assert named.json()["error"]["message"].startswith("The model `tiny` is between versions (a drain-mode swap lets ")
    if other:
        assert message.endswith("retry shortly, or name another generator: `other`."), message
    else:
        assert message.endswith("retry shortly."), message


# docs/serving.md said `asyncinfer serve` writes, at --log-level info, "an access line and an asyncinfer.requests line
# per request". An operator reading the log found none for embeddings calls or refused requests, and three for one
# call of three prompts. The docs now say which requests have the line; this checks that they say what it does.
def test_the_request_log_lines_are_what_the_docs_say(server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="asyncinfer.requests")

    def lines() -> list[str]:
        out = [r.getMessage() for r in caplog.records if r.name == "asyncinfer.requests"]
        caplog.clear()
        return out

    with httpx.Client(base_url=server.url, timeout=60) as http:
        lines()
        two = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert two.status_code == 200 and len(two.json()["choices"]) == 4
        assert len(logged := lines()) == 2 and all(line.startswith("request finished") for line in logged), logged
        assert http.post("/v1/embeddings", json={"model": "minilm", "input": ["a", "b"]}).status_code == 200
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 10**6})
        assert refused.status_code == 400
        assert lines() == []
    serving = " ".join((DOCS / "serving.md").read_text().split())
    assert ("an access line per answered request, and an `asyncinfer.requests` line per generation request the engine "
            "ran (one per prompt of a call, its `n` samples in one; none for an embeddings call or a request refused "
            "before it was queued") in serving
    monitoring = " ".join((DOCS / "monitoring" / "README.md").read_text().split())
    assert "one line per finished generation request (one per prompt of a call, its `n` samples in one;" in monitoring


# `asyncinfer serve --no-enable-metrics` listed /metrics at start and served it, every counter and histogram at 0 for
# ever: after requests were answered, asyncinfer_requests_total and asyncinfer_generation_tokens_total still read 0.0,
# a server answering nobody to Prometheus and to the dashboard (and no request ever an error). Those families now carry
# no sample (no data), the gauges read live as before, and the start-up lines say that the engine's figures are off.
def test_metrics_off_leaves_counters_without_samples_rather_than_zeros(tiny_chat_model) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from asyncinfer.commands.serve import describe_serving

    spec = ModelSpec(str(tiny_chat_model), "tiny", {**TINY_OPTIONS, "enable_metrics": False})
    with LiveServer(create_app([spec])) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("asyncinfer_requests", "asyncinfer_generation_tokens", "asyncinfer_time_to_first_token_seconds"):
        assert name in families and families[name].samples == [], families[name].samples  # were 0.0 samples
    assert [s.value for s in families["asyncinfer_requests_in_flight"].samples] == [0.0]
    assert families["asyncinfer_kv_blocks"].samples and families["asyncinfer_prefix_cache_queried_tokens"].samples
    answers = {(s.labels["route"], s.labels["status"]) for s in families["asyncinfer_http_responses"].samples}
    assert ("/v1/completions", "200") in answers
    lines = describe_serving([spec], [], host="127.0.0.1", port=8000, api_keys=0).splitlines()
    assert lines[-1].startswith("  engine metrics: off (--no-enable-metrics: /metrics has gauges and HTTP answers")
    on = ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)
    assert "engine metrics" not in describe_serving([on], [], host="127.0.0.1", port=8000, api_keys=0)


# stranger83: a drain-mode swap whose new version failed to load, and whose reload of the old version failed too (its
# directory overwritten in place by the deploy), left the model with no version: over HTTP every request was still the
# "between versions ... retry shortly" 503 with Retry-After: 1 (3,714 of them in 8 s), and the log had only the swap's
# WARNING, which reads as if the old version served on. The 503 now says no version serves and how one is loaded,
# without Retry-After and with x-should-retry: false; an ERROR line says so.
def test_a_model_left_without_a_version_is_not_answered_retry_shortly(tiny_chat_model, monkeypatch, caplog) -> None:
    import asyncio

    from asyncinfer import swaps

    def no_load(*args, **kwargs):
        raise RuntimeError("out of memory")

    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)])
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        assert engine.loop is not None
        monkeypatch.setattr(swaps, "load", no_load)
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **TINY_OPTIONS), engine.loop)
        with caplog.at_level(logging.WARNING, logger="asyncinfer"), pytest.raises(RuntimeError):
            swap.result(60)
        answers = [http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                   http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                   http.get("/v1/models/tiny")]
    for r, named in zip(answers, ("The default model", "The model `tiny`", "The model `tiny`")):
        assert r.status_code == 503, r.text
        assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
        error = r.json()["error"]
        assert error["code"] == "model_not_serving" and error["param"] == "model"
        assert error["message"] == (
            f"{named} has no version serving: a drain-mode swap failed to load its new version and the reload of "
            "the old one failed too: remove_model('tiny'), then add_model('tiny', model) loads one; a retry gets "
            "this answer until one is loaded."), error
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage().startswith(
        "model has no version serving model=tiny source="), [record.getMessage() for record in caplog.records]
