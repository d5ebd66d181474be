"""Errors over HTTP: exact statuses and OpenAI error bodies, and the server keeps serving after each."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from jinja2 import TemplateError

import asyncinfer.server.errors as server_errors
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.errors import EngineOverloadedError
from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.server import create_app
from asyncinfer.server.errors import from_exception
from asyncinfer.server.protocol import ChatRequest

from .conftest import TINY_OPTIONS, LiveServer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
TEXT = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
EMBED = {"model": "minilm", "input": "a text"}
UNSUPPORTED = "unsupported_parameter"

# (route, changes to the valid body, status, param, code)
CASES = [
    ("chat", {"temperature": -1}, 400, "temperature", None),
    ("chat", {"temperature": 2.5}, 400, "temperature", None),  # OpenAI's range, [0, 2], over HTTP
    ("text", {"temperature": 3}, 400, "temperature", None),
    ("chat", {"top_p": -0.5}, 400, "top_p", None),
    ("chat", {"n": 0}, 400, "n", None),
    ("chat", {"max_tokens": 0}, 400, "max_tokens", None),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("chat", {"logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", None),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat", {"stop": [""]}, 400, "stop", None),
    ("chat", {"seed": -1}, 400, "seed", None),
    ("chat", {"presence_penalty": 3}, 400, "presence_penalty", None),
    ("chat", {"frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    ("chat", {"top_k": -5}, 400, "top_k", None),
    ("chat", {"min_p": 2}, 400, "min_p", None),
    ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("chat", {"ignore_eos": "yes"}, 400, "ignore_eos", None),
    ("chat", {"priority": "high"}, 400, "priority", None),
    ("chat", {"user": 5}, 400, "user", None),
    ("chat", {"stream": "yes"}, 400, "stream", None),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("chat", {"messages": []}, 400, "messages", None),
    ("chat", {"messages": None}, 400, "messages", None),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.[0].role", None),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.[0].content", None),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.[0].content.[0]", UNSUPPORTED),
    ("chat", {"messages": [{"role": "function", "content": "4", "name": "f"}]}, 400, "messages.[0]", UNSUPPORTED),
    ("chat", {"functions": [{"name": "f"}]}, 400, "functions", UNSUPPORTED),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.[0].content.[0].text",
     None),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages.[0].content.[0].text", None),
    ("chat", {"logit_bias": {"5": 10}}, 400, "logit_bias", UNSUPPORTED),
    ("chat", {"foo": 1}, 400, "foo", None),
    ("chat", {"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", None),  # OpenAI's limits
    ("chat", {"metadata": {"k" * 65: "v"}}, 400, "metadata", None),
    ("chat", {"metadata": {"k": "v" * 513}}, 400, "metadata", None),
    ("chat", {"metadata": {"k": 1}}, 400, "metadata", None),
    ("chat", {"metadata": ["k", "v"]}, 400, "metadata", None),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 600}]}, 400, "messages", "context_length_exceeded"),
    ("chat", {"model": "ids"}, 400, "messages", None),  # no tokenizer, so no chat template
    ("chat", {"model": "nope"}, 404, "model", "model_not_found"),
    ("chat", {"model": "minilm"}, 400, "model", None),
    ("text", {"prompt": []}, 400, "prompt", None),
    ("text", {"prompt": [1, "a"]}, 400, "prompt", None),
    ("text", {"prompt": ""}, 400, "prompt", None),
    ("text", {"model": "ids", "prompt": [999999]}, 400, "prompt", None),
    ("text", {"prompt": [5] * 600}, 400, "prompt", "context_length_exceeded"),
    ("text", {"prompt": [5] * 600, "stream": True}, 400, "prompt", "context_length_exceeded"),  # before the 200
    ("text", {"prompt": "x" * 20000, "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("text", {"logprobs": 30}, 400, "logprobs", None),
    ("text", {"echo": True}, 400, "echo", UNSUPPORTED),
    ("text", {"suffix": "!"}, 400, "suffix", UNSUPPORTED),
    ("text", {"best_of": 3}, 400, "best_of", UNSUPPORTED),
    ("text", {"messages": MESSAGES}, 400, "messages", None),
    ("text", {"prompt": ["a"] * 5, "n": 64}, 400, "n", None),  # 320 completions in one call
    ("embed", {"input": [1, 2, 3]}, 400, "input", UNSUPPORTED),
    ("embed", {"input": []}, 400, "input", None),
    ("embed", {"input": None}, 400, "input", None),
    ("embed", {"encoding_format": "hex"}, 400, "encoding_format", None),
    ("embed", {"model": "tiny"}, 400, "model", None),
    ("embed", {"model": "nope"}, 404, "model", "model_not_found"),
]
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "text": ("/v1/completions", TEXT), "embed": ("/v1/embeddings", EMBED)}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def check_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(("route", "changes", "status", "param", "code"), CASES,
                         ids=[f"{r}-{'-'.join(c)}" for r, c, *_ in CASES])
def test_bad_request_gets_an_openai_error_then_the_server_serves_on(http, route, changes, status, param, code):
    path, valid = ROUTES[route]
    error = check_error(http.post(path, json={**valid, **changes}), status, param, code)
    if param == "foo":
        assert error["message"] == "Unrecognized request argument supplied: foo"
    assert http.post(path, json=valid).status_code == 200


@pytest.mark.parametrize("temperature", [-1, -0.5, 2.5, 1e5])
def test_a_temperature_out_of_range_names_the_http_range(http, temperature) -> None:
    """Below 0 or above 2, the message gives OpenAI's range, never the Python API's wider one."""
    error = check_error(http.post("/v1/chat/completions", json={**CHAT, "temperature": temperature}),
                        400, "temperature", None)
    assert error["message"] == f"temperature={temperature!r} is invalid: allowed a number in [0, 2] (OpenAI's range; 0 = greedy)"


def test_the_openai_client_raises_its_own_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, top_p=5)
    assert err.value.body["param"] == "top_p"  # a 400 before the stream, not a broken 200
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert err.value.body["code"] == "model_not_found"


def test_neutral_and_ignored_openai_fields_are_accepted(http) -> None:
    body = {**CHAT, "store": False, "metadata": {"a": "b"}, "tools": [], "tool_choice": "none", "logit_bias": {},
            "response_format": {"type": "text"}, "parallel_tool_calls": True, "service_tier": "auto",
            "user": "someone", "stream_options": None}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json={**TEXT, "echo": False, "suffix": None, "best_of": 1}).status_code == 200


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"null"])
def test_a_body_that_is_no_json_object(http, content) -> None:
    r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    check_error(r, 400, None, None)


def test_a_chat_template_refusal_is_the_callers_error() -> None:
    api = from_exception(TemplateError("Conversation roles must alternate"), "id", ChatRequest.rename)
    assert (api.status, api.param) == (400, "messages") and "must alternate" in api.message


def test_an_embedding_fault_is_a_500_with_the_request_id_and_the_next_call_works(server, http) -> None:
    encoder = server.engine._models.embedder("minilm").batcher.encoder  # the engine's own, to break once
    real = encoder.encode_ids

    def fail_once(batch):
        encoder.encode_ids = real
        raise RuntimeError("simulated device failure")

    encoder.encode_ids = fail_once
    r = http.post("/v1/embeddings", json=EMBED)
    error = check_error(r, 500, None, "internal_error")
    assert r.headers["x-request-id"] in error["message"] and "simulated" not in error["message"]
    assert http.post("/v1/embeddings", json=EMBED).status_code == 200


class ExplodingScheduler(FIFOScheduler):
    """FIFO, until a prompt starting with token 317 arrives: then every step raises."""

    def schedule(self):
        if any(r.prompt_token_ids[0] == 317 for r in self.waiting):
            raise RuntimeError("scheduler bug")
        return super().schedule()


def test_a_dead_engine_is_a_500_and_health_says_so(tiny_chat_model) -> None:
    # One failed step is enough to kill it (by default a fault fails only its requests, and the
    # engine dies after max_consecutive_step_failures failed steps in a row).
    engine = AsyncEngine.from_pretrained(tiny_chat_model, name="tiny", scheduler=ExplodingScheduler,
                                         max_consecutive_step_failures=1, **TINY_OPTIONS)
    with LiveServer(create_app(engine)) as live, httpx.Client(base_url=live.url) as http:
        assert http.post("/v1/completions", json={**TEXT, "prompt": [5, 6]}).status_code == 200
        # A stream already answered 200 when the engine dies: the error comes as an event, the stream ends.
        long = {**TEXT, "prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            killer = httpx.post(live.url + "/v1/completions", json={**TEXT, "prompt": [317, 6]})
            events = [line for line in lines if line]
        assert killer.status_code == 500
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert (error["type"], error["code"]) == ("server_error", "internal_error") and "[DONE]" not in events[-1]
        r = http.post("/v1/completions", json={**TEXT, "prompt": [317, 6]})
        error = check_error(r, 500, None, "internal_error")
        assert r.headers["x-request-id"] in error["message"] and "scheduler bug" not in error["message"]
        check_error(http.post("/v1/completions", json=TEXT), 500, None, "internal_error")
        assert http.get("/health").status_code == 503 and http.get("/health").json() == {"status": "dead"}
        assert http.get("/v1/models").status_code == 200  # the HTTP server itself serves on


def test_a_closed_engine_is_a_503_with_retry_after(tiny_chat_model) -> None:
    engine = AsyncEngine.from_pretrained(tiny_chat_model, name="tiny", **TINY_OPTIONS)
    with LiveServer(create_app(engine)) as live, httpx.Client(base_url=live.url) as http:
        live.call(engine.aclose())
        r = http.post("/v1/chat/completions", json=CHAT)
        check_error(r, 503, None, "unavailable")
        assert r.headers["retry-after"] == "1"
        assert http.get("/health").status_code == 503 and http.get("/health").json() == {"status": "closed"}


def test_an_overloaded_engine_is_a_503_with_retry_after(server, http, monkeypatch) -> None:
    """The engine's EngineOverloadedError (its bounded waiting queue full) is a 503 whose Retry-After is its hint."""

    async def overloaded(*args, **kwargs):
        raise EngineOverloadedError("64 requests waiting", retry_after=2.4)

    monkeypatch.setattr(server.engine, "generate", overloaded)
    r = http.post("/v1/chat/completions", json=CHAT)
    check_error(r, 503, None, "overloaded")
    assert r.headers["retry-after"] == "2"
    monkeypatch.undo()
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_completions_max_tokens_defaults_to_16(server, http) -> None:
    """OpenAI's and vLLM's default for /v1/completions (chat's runs to the context: test_default_max_tokens)."""
    prompt = list(range(5, 15))
    r = http.post("/v1/completions", json={"model": "ids", "prompt": prompt, "ignore_eos": True, "temperature": 0})
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = server.call(server.engine.generate(prompt, params, model="ids"))
    assert r.json()["usage"]["completion_tokens"] == 16 == len(want.token_ids)
    assert r.json()["choices"][0]["text"] == want.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/nope", 404, "unknown_url"),
    ("POST", "/v1/nope", 404, "unknown_url"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("DELETE", "/health", 405, "method_not_allowed"),
    ("GET", "/docs", 404, "unknown_url"),  # FastAPI's pages are off: they would answer without a key
    ("GET", "/openapi.json", 404, "unknown_url"),
    ("GET", "/redoc", 404, "unknown_url"),
])
def test_what_no_route_answers_is_an_openai_error_too(http, method, path, status, code) -> None:
    r = http.request(method, path, json=TEXT)
    error = check_error(r, status, None, code)
    assert path in error["message"]
    if status == 405:
        assert r.headers["allow"] in error["message"]


def test_every_answer_has_a_request_id(http) -> None:
    answers = (http.get("/health"), http.get("/metrics"), http.get("/v1/models"),
               http.post("/v1/completions", json=TEXT))
    for r in answers:
        assert r.status_code == 200 and r.headers["x-request-id"]
    ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


@pytest.mark.parametrize("depth", [33, 1000, 200_000])
def test_a_deeply_nested_body_is_a_clean_400(http, depth) -> None:
    nested = b"[" * depth + b"]" * depth
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"'
    for content in (b'{"model": "tiny", "prompt": "hi", "stop": ' + nested + b"}",
                    chat + b'}], "metadata": ' + nested + b"}",
                    chat + b', "tool_calls": ' + nested + b"}]}"):  # inside a message
        r = http.post("/v1/completions" if b"prompt" in content else "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"})
        assert "nested deeper" in check_error(r, 400, None, None)["message"]
    # a body that is no object is refused as such, at its first byte, before its nesting is read
    r = http.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"})
    assert check_error(r, 400, None, None)["message"] == "The request body must be a JSON object."
    ok = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=ok).status_code == 200


def test_a_body_at_the_limit_full_of_ignored_data_is_refused_in_bounded_time() -> None:
    """~4 MiB whose bulk is `metadata` (200k keys) was accepted, and two dozen such bodies at once held the
    workers for seconds: refused now, naming the field, the decode and check measured in this thread's CPU
    time (generous: a loaded machine; the body's decode, in C, is the bulk of it)."""
    from asyncinfer.server.protocol import CHAT_BODY, decode_json, parse_chat
    from asyncinfer.server.settings import ServerSettings

    metadata = {f"{i:06d}": "v" for i in range(200_000)}
    raw = json.dumps({**CHAT, "metadata": metadata}).encode()
    assert 2_500_000 < len(raw) <= ServerSettings().max_body_bytes
    start = time.thread_time()
    with pytest.raises(server_errors.APIError) as refused:
        parse_chat(decode_json(raw, CHAT_BODY))
    assert time.thread_time() - start < 5.0
    assert (refused.value.status, refused.value.param) == (400, "metadata")


def test_edges_name_what_the_client_sent_and_echo_it_bounded(http) -> None:
    parts = [{"type": "text"}, {"type": "text", "text": 5}]
    for part, got in zip(parts, ("got nothing", "got 5.")):
        r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": [part]}]})
        message = check_error(r, 400, "messages.[0].content.[0].text", None)["message"]
        assert "must be a string" in message and got in message and "Only text content parts" not in message
    r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 21})
    assert check_error(r, 400, "top_logprobs", None)["message"].startswith("top_logprobs=21 is invalid")
    name = "m" * 3_000_000
    r = http.post("/v1/chat/completions", json={**CHAT, "model": name})
    message = check_error(r, 404, "model", "model_not_found")["message"]
    assert len(r.content) < 2000 and "(3000000 characters)" in message
    for encoding in ("gzip", "deflate, gzip", "br"):
        r = http.post("/v1/completions", json=TEXT, headers={"content-encoding": encoding})
        assert encoding in check_error(r, 415, None, "unsupported_content_encoding")["message"]
    assert http.post("/v1/completions", json=TEXT, headers={"content-encoding": "identity"}).status_code == 200


def test_a_content_encoding_given_twice_is_read_whole(http) -> None:
    """Two ``Content-Encoding`` lines are one list (RFC 9110): ``identity`` then ``gzip`` is a gzip body, the 415
    naming both (the first line alone was read, and the body answered as malformed JSON)."""
    body = json.dumps(TEXT).encode()
    for lines in ((("content-encoding", "identity"), ("content-encoding", "gzip")),
                  (("content-encoding", "gzip"), ("content-encoding", "identity"))):
        r = http.post("/v1/completions", content=body, headers=[("content-type", "application/json"), *lines])
        message = check_error(r, 415, None, "unsupported_content_encoding")["message"]
        assert ", ".join(value for _, value in lines) in message
    twice = [("content-type", "application/json"), ("content-encoding", "identity"), ("content-encoding", "Identity")]
    assert http.post("/v1/completions", content=body, headers=twice).status_code == 200


def test_a_long_user_is_accepted_where_it_names_no_one(http) -> None:
    """By default ``user`` is OpenAI's end-user label and changes nothing: any length is fine."""
    for user in ("u" * 5000, "a/b", "a%2Fb"):
        assert http.post("/v1/completions", json={**TEXT, "user": user}).status_code == 200


def test_without_temperature_a_request_samples_as_openai_does(server, http) -> None:
    """OpenAI's default temperature is 1: ``n=2`` without it gives two samples, as the engine's at temperature 1."""
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "n": 2, "seed": 5, "ignore_eos": True}
    got = [c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]]
    params = SamplingParams(max_tokens=12, n=2, seed=5, ignore_eos=True, temperature=1.0)
    want = server.call(server.engine.generate("The quick brown fox", params, model="tiny"))
    assert got == [o.text for o in want.outputs] and got[0] != got[1]
    greedy = [c["text"] for c in http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"]]
    assert greedy[0] == greedy[1]  # asked for explicitly


def test_a_max_tokens_past_the_context_speaks_of_http_fields(http) -> None:
    for route, body, field in (("text", {"max_tokens": 600}, "max_tokens"),
                               ("chat", {"max_tokens": 600}, "max_tokens"),
                               ("chat", {"max_completion_tokens": 600}, "max_completion_tokens")):
        path, valid = ROUTES[route]
        error = check_error(http.post(path, json={**valid, **body}), 400, field, "context_length_exceeded")
        assert f"`{field}`" in error["message"] and f"leave `{field}` out" in error["message"]
        assert "SamplingParams" not in error["message"] and "truncate_output_to_model_len" not in error["message"]


MALFORMED = [
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",  # a length that is no number
    b"GET /health HTTP/1.1\r\nHost: x\r\nno colon in this header\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",  # TLS spoken to the HTTP port
]


def exchange(port: int, raw: bytes) -> bytes:
    """``raw`` sent over a fresh connection; everything the server answers until it closes."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_a_request_the_http_parser_refuses_is_an_openai_400(protocol) -> None:
    """uvicorn's parser answers what it cannot parse before any app runs: in OpenAI's shape too."""
    from fastapi import FastAPI

    from asyncinfer.server import guard_app

    pytest.importorskip(protocol)
    with LiveServer(guard_app(FastAPI()), http=protocol) as live:
        port = live.server.servers[0].sockets[0].getsockname()[1]
        for raw in MALFORMED:
            head, _, body = exchange(port, raw).partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            assert lines[0] == "HTTP/1.1 400 Bad Request", head
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            assert headers["content-type"] == "application/json" and headers["x-request-id"].startswith("conn-")
            assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)
            error = json.loads(body)["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None,
                                                                     "invalid_http_request")
            assert "not valid HTTP/1.1" in error["message"]
        assert httpx.get(live.url + "/health").status_code == 404  # no /health in this app: it answers on


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1", "application/jsonx", ""])
def test_a_body_that_is_not_declared_json_is_a_415(http, content_type) -> None:
    """Only JSON is read (what curl -d sends without -H is not): OpenAI's shape, naming the type."""
    for path, valid in ROUTES.values():
        r = http.post(path, content=json.dumps(valid).encode(), headers={"content-type": content_type})
        error = check_error(r, 415, None, "unsupported_media_type")
        assert f"Content-Type {content_type!r}" in error["message"] and "application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                          "application/json;charset=UTF-8", None])
def test_json_with_or_without_a_charset_or_without_a_content_type_is_read(http, content_type) -> None:
    for path, valid in ROUTES.values():
        headers = {} if content_type is None else {"content-type": content_type}
        r = http.post(path, content=json.dumps(valid).encode(), headers=headers)
        assert r.status_code == 200, r.text
        assert ("content-type" in r.request.headers) == (content_type is not None)


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/tiny", "/metrics"])
def test_head_is_answered_as_get_without_a_body(http, path) -> None:
    get, head = http.get(path), http.head(path)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"] and head.headers["x-request-id"]
    if path != "/metrics":  # a scrape's length changes from one to the next
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_a_refused_websocket_handshake_is_an_openai_403(protocol) -> None:
    """No route takes a WebSocket: the refusal (uvicorn's empty 403) is in OpenAI's shape too."""
    from fastapi import FastAPI

    from asyncinfer.server import guard_app

    pytest.importorskip(protocol)
    pytest.importorskip("websockets")  # uvicorn hands the upgrade to it (without one, it is plain HTTP)
    handshake = (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    with LiveServer(guard_app(FastAPI()), http=protocol) as live:
        port = live.server.servers[0].sockets[0].getsockname()[1]
        head, _, body = exchange(port, handshake).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0] == "HTTP/1.1 403 Forbidden", head
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        assert headers["content-type"] == "application/json" and headers["x-request-id"].startswith("req-")
        error = json.loads(body)["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "websocket_refused")
        assert "/v1/realtime" in error["message"]


def test_a_call_of_more_prompts_than_may_ever_be_in_flight_is_a_400_and_queues_none(tiny_chat_model) -> None:
    """With admission control (max_waiting_requests), a /v1/completions call of more prompts than
    max_num_seqs + max_waiting_requests can never be admitted: it used to be a 503 "retry later" after
    part of it had been queued and then aborted, filling the queue for everybody meanwhile. Now a 400
    naming the limit, before anything is queued; a call that fits is served."""
    engine = AsyncEngine.from_pretrained(tiny_chat_model, name="tiny", **TINY_OPTIONS, max_num_seqs=4,
                                         max_waiting_requests=2)
    with LiveServer(create_app(engine)) as live, httpx.Client(base_url=live.url) as http:
        body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
        r = http.post("/v1/completions", json={**body, "prompt": [[5, 6, 7]] * 7})
        error = check_error(r, 400, "prompt", None)
        assert "at most 6 prompts in one call" in error["message"]
        r = http.post("/v1/completions", json={**body, "prompt": [[5, 6, 7]] * 7, "stream": True})
        check_error(r, 400, "prompt", None)
        assert engine.step_stats().scheduled_requests == 0  # nothing of either call was queued
        r = http.post("/v1/completions", json={**body, "prompt": [[5, 6, 7]] * 6})
        assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_temperature_over_http_is_openais_range(http) -> None:
    """[0, 2] over HTTP, as OpenAI (SamplingParams itself takes up to 1e4): 2 is served, above it a 400 naming
    the field and the range."""
    for path, valid in (ROUTES["chat"], ROUTES["text"]):
        error = check_error(http.post(path, json={**valid, "temperature": 2.01}), 400, "temperature", None)
        assert "temperature" in error["message"] and "[0, 2]" in error["message"], error["message"]
        assert http.post(path, json={**valid, "temperature": 2}).status_code == 200
    assert SamplingParams(temperature=5).temperature == 5  # the in-process API keeps its own range
