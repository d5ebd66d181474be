"""A fresh adversarial pass over the server (issue 25, after the hostile-spec and bulk rounds): each case
here was a fault on main before it was fixed, and is now a typed answer naming the body's field."""

from __future__ import annotations

import threading

import httpx
import msgspec
import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.grammar import GrammarCompiler
from asyncinfer.outputs import Logprob
from asyncinfer.prompts import OFF_LOOP_CHARS
from asyncinfer.server import ModelSpec, ServerSettings, create_app
from asyncinfer.server.errors import APIError, from_exception
from asyncinfer.server.protocol import (
    CHAT_BODY,
    COMPLETION_BODY,
    EMBEDDING_BODY,
    MAX_WHOLE_LOGPROBS,
    decode_json,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from asyncinfer.server.responses import UNLIKELY_LOGPROB, Reply
from asyncinfer.structured import StructuredOutput

from .conftest import TINY_OPTIONS, LiveServer

MESSAGES = '[{"role": "user", "content": "What is the capital of France?"}]'
CHAT = '{"model": "tiny", "messages": ' + MESSAGES + ', "max_tokens": 4, FIELDS}'
TEXT = '{"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, FIELDS}'
EMBED = '{"model": "minilm", "input": "a text", FIELDS}'
ROUTES = {"chat": ("/v1/chat/completions", CHAT, CHAT_BODY, parse_chat),
          "text": ("/v1/completions", TEXT, COMPLETION_BODY, parse_completion),
          "embed": ("/v1/embeddings", EMBED, EMBEDDING_BODY, parse_embedding)}

# A JSON number past a 64-bit float (1e400) in each kind of place a body holds one: msgspec refused it with a
# ValidationError "Number out of range", which was a 500 where the field was skipped raw (a neutral field,
# `metadata`, a content part) and a 400 "must be a JSON object" naming no field where it was decoded.
# It now reads as an infinity (as Python's json reads it), which the field's own check refuses by name.
HUGE = "1e400"
OUT_OF_RANGE = [  # (route, field(s) as JSON text, param, code)
    ("chat", f'"logit_bias": {HUGE}', "logit_bias", "unsupported_parameter"),  # was a 500
    ("chat", f'"metadata": {{"k": {HUGE}}}', "metadata", None),  # was a 500
    ("chat", f'"messages": [{{"role": "user", "content": [{HUGE}]}}]', "messages.[0].content.[0]",
     None),  # was a 500 (then "unsupported": a part that is no object is malformed, as a long integer's below)
    ("chat", f'"messages": [{{"role": "user", "content": [{{"type": "text", "text": {HUGE}}}]}}]',
     "messages.[0].content.[0].text", None),  # was a 500
    ("chat", f'"messages": [{{"role": "user", "content": [{{"type": {HUGE}}}]}}]', "messages.[0].content.[0]",
     "unsupported_parameter"),  # was a 500
    ("chat", f'"messages": [{{"role": {HUGE}, "content": "x"}}]', "messages.[0].role", None),  # was on messages.[0]
    ("chat", f'"temperature": {HUGE}', "temperature", None),  # these were a 400 naming no field
    ("chat", f'"temperature": -{HUGE}', "temperature", None),
    ("chat", f'"top_p": {HUGE}', "top_p", None),
    ("chat", f'"n": {HUGE}', "n", None),
    ("chat", f'"max_completion_tokens": {HUGE}', "max_completion_tokens", None),
    ("chat", f'"logprobs": true, "top_logprobs": {HUGE}', "top_logprobs", None),
    ("chat", f'"presence_penalty": -{HUGE}', "presence_penalty", None),
    ("text", f'"echo": {HUGE}', "echo", "unsupported_parameter"),  # was a 500
    ("text", f'"prompt": [{HUGE}]', "prompt", None),
    ("text", f'"seed": {HUGE}', "seed", None),
    ("text", f'"logprobs": {HUGE}', "logprobs", None),
    ("embed", f'"dimensions": {HUGE}', "dimensions", None),
]
# An integer of more digits than Python reads (sys.get_int_max_str_digits(), 4300): msgspec's "Integer value out
# of range" was a 500 in `metadata` and content parts and a 400 naming no field elsewhere; it is now a 400
# naming the field that holds it, however deep.
LONG_INT = "9" * 5000
OUT_OF_RANGE += [
    ("chat", f'"n": {LONG_INT}', "n", None),
    ("chat", f'"stop": ["a", {LONG_INT}]', "stop.[1]", None),
    ("chat", f'"metadata": {{"k": {LONG_INT}}}', "metadata", None),  # was a 500
    ("chat", f'"messages": [{{"role": "user", "content": [{LONG_INT}]}}]', "messages.[0].content.[0]",
     None),  # was a 500
    ("chat", f'"messages": [{{"role": "user", "content": [{{"type": "text", "text": -{LONG_INT}}}]}}]',
     "messages.[0].content.[0].text", None),  # was a 500
    ("chat", f'"messages": [{{"role": {LONG_INT}, "content": "x"}}]', "messages.[0].role", None),
    ("text", f'"prompt": [1, {LONG_INT}]', "prompt.[1]", None),
    ("embed", f'"dimensions": {LONG_INT}', "dimensions", None),
]


def _refusal(route: str, fields: str) -> APIError:
    """The error the router answers for this body, parsed and mapped as the router does it."""
    _, body, shape, parse = ROUTES[route]
    value = None
    try:
        value = parse(decode_json(body.replace("FIELDS", fields).encode(), shape))
        if route != "embed":
            value.sampling_params(512)  # as the router builds the request's parameters
    except Exception as exc:  # noqa: BLE001 - mapped as the router maps it
        return from_exception(exc, "req-test", value.field if value is not None and route != "embed" else str)
    raise AssertionError(f"accepted: {fields}")


@pytest.mark.parametrize(("route", "fields", "param", "code"), OUT_OF_RANGE,
                         ids=[f"{r}-{f.split(':')[0].strip(chr(34))}-{i}" for i, (r, f, *_) in enumerate(OUT_OF_RANGE)])
def test_a_number_past_a_float_is_refused_by_its_field(route, fields, param, code) -> None:
    error = _refusal(route, fields)
    assert (error.status, error.param, error.code) == (400, param, code), error.body()


def test_a_number_past_a_float_over_http(server) -> None:
    """On the wire: a 400 in OpenAI's shape naming the field (the 500s above), and the server serves on."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route, fields, param, code in OUT_OF_RANGE:
            path, body, *_ = ROUTES[route]
            r = http.post(path, content=body.replace("FIELDS", fields).encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == code, (fields, r.text)
            assert r.headers["x-request-id"]
        ok = http.post("/v1/chat/completions", content=CHAT.replace("FIELDS", '"temperature": 0').encode(),
                       headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_an_embedding_model_removed_as_its_call_ends_still_answers_the_call(minilm_dir, monkeypatch) -> None:
    """The route looked the model up again after its vectors came back (to count the tokens for ``usage``):
    a ``remove_model`` that finished meanwhile made it a StopIteration, a 500 for vectors already computed.
    The count's tokenizer and length are now taken before the await."""
    app = create_app([ModelSpec(str(minilm_dir), "minilm"), ModelSpec(str(minilm_dir), "leaving")])
    with LiveServer(app) as live:
        engine = live.engine
        real_embed = engine.embed
        expected = sum(len(ids) for ids in engine.get_tokenizer("minilm")(["a text", "another"])["input_ids"])

        async def embed_then_removed(texts, *, model=None, tenant=None):
            vectors = await real_embed(texts, model=model, tenant=tenant)
            await engine.remove_model("leaving")  # its calls are done: it goes before the route counts
            return vectors

        monkeypatch.setattr(engine, "embed", embed_then_removed)
        r = httpx.post(live.url + "/v1/embeddings", json={"model": "leaving", "input": ["a text", "another"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2 and r.json()["usage"] == {"prompt_tokens": expected, "total_tokens": expected}
        assert [info.name for info in engine.model_info()] == ["minilm"]


def test_a_tenants_compiled_specs_are_its_own(tiny_chat_model) -> None:
    """The compiled-grammar cache was shared by every caller, whatever ``cache_isolation`` said: a tenant's
    structured request whose spec another tenant had sent found it compiled, so its time to first token told
    it which specs the others used (a GBNF grammar takes seconds to compile). With isolation, the cache is
    keyed by the request's ``cache_salt`` as the prefix cache is; without it, one namespace is shared."""
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    settings = ServerSettings(api_keys=("key-one", "key-two"), cache_isolation="api-key")
    body = {"model": "tiny", "prompt": "Yes or no?", "max_tokens": 40, "temperature": 0,
            "guided_choice": ["yes-fresh-pass", "no-fresh-pass"]}
    with LiveServer(create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        grammars = live.engine.core.grammars
        assert grammars is not None

        def compiles_of(key: str) -> int:
            before = grammars.compiled
            r = http.post("/v1/completions", headers={"authorization": f"Bearer {key}"}, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in ("yes-fresh-pass", "no-fresh-pass")
            return grammars.compiled - before

        assert compiles_of("key-one") == 1
        assert compiles_of("key-one") == 0  # the same tenant finds its own compiled spec
        assert compiles_of("key-two") == 1  # another tenant never finds it
        assert compiles_of("key-two") == 0
    # The compiler itself: one namespace per cache_salt, and one for requests without a salt.
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_chat_model), 320, [2])
    spec = StructuredOutput.choice(["a-fresh", "b-fresh"])
    compiled = compiler.compile(spec, "tenant:a")
    assert compiler.cached(spec, "tenant:a") is compiled and compiler.compile(spec, "tenant:a") is compiled
    assert compiler.cached(spec, "tenant:b") is None and compiler.cached(spec) is None
    assert compiler.compile(spec) is not compiled and compiler.compiled == 2


def test_a_forbidden_alternative_has_openais_unlikely_logprob_not_null() -> None:
    """Tokens a constraint (or the ``min_tokens`` mask) forbids have a log-probability of ``-inf``; among the
    ``top_logprobs`` alternatives it was written as JSON ``null`` (JSON has no infinity), which clients
    reading the field as a number refuse. It is OpenAI's -9999.0 now, in both formats, whole and streamed."""
    forbidden = [Logprob(5, -0.25, [(5, -0.25), (7, float("-inf")), (9, float("-inf"))])]
    chat = Reply(True, "chatcmpl-x", 0, "tiny", None, True)
    content = chat.choice(0, "x", forbidden, "stop")["logprobs"]["content"][0]
    assert content["logprob"] == -0.25
    assert [alt["logprob"] for alt in content["top_logprobs"]] == [-0.25, UNLIKELY_LOGPROB, UNLIKELY_LOGPROB]
    streamed = msgspec.json.decode(chat.delta_chunk(0, "x", forbidden, None).removeprefix(b"data: "))
    assert [alt["logprob"] for alt in streamed["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == \
        [-0.25, UNLIKELY_LOGPROB, UNLIKELY_LOGPROB]
    legacy = Reply(False, "cmpl-x", 0, "tiny", None, True).choice(0, "x", forbidden, "stop")["logprobs"]
    assert legacy["token_logprobs"] == [-0.25]
    assert legacy["top_logprobs"] == [{"token_id:5": -0.25, "token_id:7": UNLIKELY_LOGPROB,
                                       "token_id:9": UNLIKELY_LOGPROB}]


def test_a_constrained_reply_with_top_logprobs_over_http_has_no_null(server) -> None:
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 40,
            "temperature": 0, "logprobs": True, "top_logprobs": 20, "guided_choice": ["yes", "no"]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["content"]
        values = [t["logprob"] for t in tokens] + [a["logprob"] for t in tokens for a in t["top_logprobs"]]
        assert UNLIKELY_LOGPROB in values  # 20 alternatives, of which the constraint allows fewer
        assert all(isinstance(v, float) and v <= 0 for v in values), values


def test_a_burst_of_short_prompts_is_tokenized_off_the_loop_past_its_share(server, monkeypatch) -> None:
    """Each prompt of at most OFF_LOOP_CHARS was tokenized on the event loop, one call at a time, so one HTTP
    call of 64 (up to 256) short prompts held the loop for their sum while every other caller waited. The
    loop now tokenizes at most OFF_LOOP_CHARS of them in one turn (prompts.LoopShare); the rest of the
    burst goes to worker threads. Streamed with usage, the router counts them in one worker thread."""
    tokenizer = server.engine.get_tokenizer("tiny")
    loop = loop_thread(server)
    encoded: list[tuple[bool, int]] = []  # (on the loop, characters) per prompt tokenized
    real_encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        encoded.append((threading.get_ident() == loop, len(text)))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    prompts = [f"{i} " + "Hello world! The quick brown fox. " * 17 for i in range(64)]  # about 600 characters each
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for stream in (False, True):
            encoded.clear()
            body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert len(encoded) >= len(prompts)
            on_loop = sum(chars for loop_side, chars in encoded if loop_side)
            assert on_loop <= OFF_LOOP_CHARS, (stream, on_loop, len(encoded))
    server.wait_idle()


def loop_thread(server) -> int:
    async def ident() -> int:
        return threading.get_ident()

    return server.call(ident())


@pytest.mark.parametrize(("parse", "body", "param"), [
    (parse_chat, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 20, "n": 64},
     "top_logprobs"),  # 64 x 8192 x 21 = 11 M log-probabilities: about 6.6 GB while its answer was built
    (parse_completion, {"prompt": ["a"] * 256, "logprobs": 5, "max_tokens": 1000}, "logprobs"),
])
def test_a_whole_answer_too_big_to_hold_is_refused_and_may_be_streamed(parse, body, param) -> None:
    """A whole answer with logprobs holds every token's alternatives until it is sent (about 600 bytes each
    while built): unbounded, one caller's request could take the process's memory. Past MAX_WHOLE_LOGPROBS
    it is a 400 naming the field, at once; streamed (one chunk at a time), it is served."""
    request = parse(body)
    with pytest.raises(InvalidParameterError) as refused:
        request.sampling_params(8192)
    error = from_exception(refused.value, "req-test", request.field)
    assert (error.status, error.param) == (400, param)
    assert f"at most {MAX_WHOLE_LOGPROBS} log-probabilities" in error.message and "stream" in error.message
    streamed = parse({**body, "stream": True}).sampling_params(8192)
    assert streamed.logprobs == (20 if param == "top_logprobs" else 5)
    smaller = parse({**body, "n": 1} if "n" in body else {**body, "prompt": ["a"] * 4}).sampling_params(8192)
    assert smaller.logprobs is not None


def test_a_whole_answer_too_big_over_http_is_a_400(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a b"] * 200, "logprobs": 20, "max_tokens": 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert server.engine.num_unfinished_requests == 0  # refused before anything was queued
