"""A tenth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server.errors import from_exception, json_terms, shown

MESSAGES = [{"role": "user", "content": "Hi"}]


def _error(server, path: str, body: dict, status: int = 400) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(("changes", "param", "message"), [
    ({"seed": -5}, "seed", "seed=-5 is invalid: allowed null or an integer in [0, 9223372036854775807]"),
    ({"stop": [None]}, "stop", "stop=[null] is invalid: allowed null, a non-empty string or a list of them"),
    ({"max_tokens": "3"}, "max_tokens", 'max_tokens="3" is invalid: allowed an integer >= 1'),
    ({"ignore_eos": "no"}, "ignore_eos", 'ignore_eos="no" is invalid: allowed a boolean (true or false)'),
    ({"top_p": 1.5}, "top_p", ("top_p=1.5 is invalid: allowed a number in [0, 1] (OpenAI's range; 0 = the most "
                              "likely token only)")),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs",
     "top_logprobs=30 is invalid: allowed null or an integer in [0, 20]"),
    ({"stream": "yes"}, "stream", '`stream` must be a boolean, got "yes".'),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.[0].role",
     '`messages.[0].role` must be one of ["assistant", "developer", "system", "tool", "user"], got "bot".'),
])
def test_a_400_speaks_json_not_python(server, changes, param, message) -> None:
    """An HTTP client sent JSON, and the 400s answered in Python: ``allowed None or an int in [0, 2**63 - 1]``,
    ``max_tokens='3'``, ``a bool (True or False)``, ``got 'yes'``. The value is echoed as the client wrote it and
    the range is in JSON's words (null, true, an integer, the number itself)."""
    error = _error(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **changes})
    assert (error["param"], error["message"]) == (param, message)


def test_an_embeddings_encoding_format_is_named_in_json(server) -> None:
    error = _error(server, "/v1/embeddings", {"model": "minilm", "input": "a", "encoding_format": "hex"})
    assert error["message"] == '`encoding_format` must be "float" or "base64", got "hex".'


def test_a_prompt_past_the_context_is_refused_in_openais_words(server) -> None:
    """``messages='<9031 tokens>' is invalid: allowed at most max_model_len - 1 = 8191 tokens`` named an engine
    option and quoted a placeholder as if it were the client's text; OpenAI says what the context is and by how
    much the prompt is over it."""
    error = _error(server, "/v1/completions", {"model": "tiny", "prompt": list(range(1, 601)), "max_tokens": 1})
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"] == (
        "This model's maximum context length is 512 tokens (prompt and output together), and the prompt may take "
        "at most 511 of them. However, your `prompt` resulted in 600 tokens. Please reduce the length of `prompt`.")
    error = _error(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200_000}]})
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert error["message"].startswith("This model's maximum context length is 512 tokens") and (
        "However, your `messages` has 200004 characters, more than 511 tokens can hold.")  # roles counted in error["message"], error


def test_shown_values_are_json_and_bounded() -> None:
    assert shown(None) == "null" and shown(True) == "true" and shown("a\"b") == '"a\\"b"'
    assert shown(float("inf")) == "Infinity" and shown(1e30) == "1e+30" and shown(7) == "7"
    assert shown({"k": [1, None]}) == '{"k": [1, null]}'
    long = shown("x" * 10_000)
    assert long.endswith('..." (10000 characters)') and len(long) < 300
    assert shown(list(range(1000))).endswith(", 31, ...]")
    assert shown([[[[[[1]]]]]]) == "[[[[[...]]]]]"
    assert json_terms("None or a list of ints >= 0") == "null or a list of integers >= 0"


def test_an_engine_message_of_its_own_is_kept() -> None:
    exc = InvalidParameterError("model", "x", "a served model", message="no model was named and none serves")
    assert from_exception(exc, "req-1").message == "no model was named and none serves"
    exc = InvalidParameterError("temperature", None, "a float", message="custom words")
    assert from_exception(exc, "req-1").message == "custom words"


@pytest.mark.parametrize(("changes", "param", "message"), [
    ({"guided_regex": "["}, "guided_regex", ("`guided_regex` is invalid: allowed a regular expression llguidance accepts: "
                                            "invalid regex")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format.json_schema.schema",
     "`response_format.json_schema.schema` is invalid: allowed a JSON schema llguidance accepts: Unsatisfiable schema"),
])
def test_a_spec_the_grammar_library_refuses_is_named_by_its_field_not_the_engines_summary(server, changes, param,
                                                                                          message) -> None:
    """``guided_regex='regex: ['`` echoed the engine's summary of the spec as if the client had sent it (and, in JSON,
    a schema's every quote escaped): the field names what was sent, the library says what is wrong with it."""
    error = _error(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **changes})
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_spec_this_model_cannot_take_says_so_by_field() -> None:
    exc = InvalidParameterError("structured", "regex: a+", "None: this model's tokenizer cannot be used for it (E)")
    error = from_exception(exc, "req-1", lambda p: "guided_regex" if p == "structured" else p)
    assert (error.status, error.param) == (400, "guided_regex")
    assert error.message == "`guided_regex` cannot be used with this model: this model's tokenizer cannot be used for it (E)"


def test_vllms_min_tokens_and_stop_token_ids_are_served(server) -> None:
    """A vLLM client's ``extra_body={"min_tokens": ..., "stop_token_ids": [...]}`` was a 400 "Unrecognized request
    argument", though the engine has both (and docs/serving.md spoke of what ``min_tokens`` forbids)."""
    body = {"model": "ids", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "logprobs": 0}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in plain["logprobs"]["tokens"]]
    assert len(ids) == 6 and plain["finish_reason"] == "length"
    stop = ids[2]
    first = ids.index(stop)  # where that id first comes
    stopped = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [stop]}, timeout=60).json()
    got = [int(t.removeprefix("token_id:")) for t in stopped["choices"][0]["logprobs"]["tokens"]]
    assert stopped["choices"][0]["finish_reason"] == "stop" and got == ids[:first + 1]
    held = httpx.post(server.url + "/v1/completions",
                      json={**body, "stop_token_ids": [stop], "min_tokens": 6}, timeout=60).json()["choices"][0]
    assert held["finish_reason"] == "length" and len(held["logprobs"]["tokens"]) == 6
    assert stop not in [int(t.removeprefix("token_id:")) for t in held["logprobs"]["tokens"]]  # masked until the 6th
    error = _error(server, "/v1/completions", {**body, "min_tokens": 7})
    assert (error["param"], error["message"]) == ("min_tokens", "min_tokens=7 is invalid: allowed an integer in [0, max_tokens=6]")
    error = _error(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stop_token_ids": [-1]})
    assert (error["param"], error["message"]) == (
        "stop_token_ids", "stop_token_ids=[-1] is invalid: allowed null or a list of integers >= 0")


def test_ollamas_routes_and_the_responses_api_get_a_404_that_says_what_to_call(server) -> None:
    """An Ollama user's first ``curl /api/generate`` (and a new openai client's ``/v1/responses``) got "No route
    POST /api/generate on this server." and nothing about where the API is."""
    r = httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": "Hi"}, timeout=60)
    assert r.status_code == 404 and r.headers["x-request-id"]
    assert r.json()["error"] == {
        "message": "No route POST /api/generate on this server: it serves OpenAI's API under /v1, not Ollama's "
                   "(/api/chat is POST /v1/chat/completions, /api/generate is POST /v1/completions, /api/tags is GET "
                   "/v1/models, /api/embed is POST /v1/embeddings, /api/embeddings is POST /v1/embeddings).",
        "type": "invalid_request_error", "param": None, "code": "unknown_url"}
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi"}, timeout=60)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == ("No route POST /v1/responses on this server: OpenAI's Responses API is not "
                                            "served; send the conversation to POST /v1/chat/completions.")
    r = httpx.get(server.url + "/nope", timeout=60)
    assert r.json()["error"]["message"] == "No route GET /nope on this server."


def test_a_client_whose_base_url_lacks_v1_is_told_where_the_api_is(server) -> None:
    """``OpenAI(base_url="http://127.0.0.1:8000")`` (no /v1) posts to /chat/completions: the 404 said only "No
    route POST /chat/completions on this server."; llama.cpp's /completion the same."""
    import openai

    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as bare, \
            pytest.raises(openai.NotFoundError) as err:
        bare.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert err.value.body["message"] == (
        "No route POST /chat/completions on this server: the API is under /v1, at POST /v1/chat/completions (an "
        "OpenAI client's base_url ends in /v1: http://HOST:PORT/v1).")
    r = httpx.post(server.url + "/completion", json={"prompt": "Hi"}, timeout=60)
    assert r.status_code == 404 and "at POST /v1/completions" in r.json()["error"]["message"]
