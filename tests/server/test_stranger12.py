"""A twelfth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveServer

EMBED_HOW = ("an embedding model: /v1/embeddings needs one, which the server's operator adds with `asyncinfer serve "
             "--embedding-model all-MiniLM-L6-v2` (or a ModelSpec of a sentence encoder in create_app).")
GENERATE_HOW = ("a generation model: the chat and completions routes need one, which the server's operator adds with "
                "`asyncinfer serve MODEL` (or a ModelSpec of a generator in create_app).")


def _error(server: LiveServer, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 404 and r.headers["x-request-id"], r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    return error


def test_embeddings_on_a_server_without_an_encoder_say_how_to_add_one(generator_only) -> None:
    """A new user ran ``asyncinfer serve`` (no ``--embedding-model``), then the README's embeddings call: the
    404 said "This server has no embedding model." (no model named) or "The model `all-MiniLM-L6-v2` does not
    exist" (named), and nothing of the flag that serves one."""
    error = _error(generator_only, "/v1/embeddings", {"input": "a text"})
    assert error["message"] == f"This server has no {EMBED_HOW.removeprefix('an ')}"
    error = _error(generator_only, "/v1/embeddings", {"input": "a text", "model": "all-MiniLM-L6-v2"})
    assert error["message"] == ("The model `all-MiniLM-L6-v2` does not exist. This server serves: `ids`. None of them "
                                f"is {EMBED_HOW}")


def test_generation_on_a_server_of_encoders_only_says_how_to_add_a_generator(encoder_only) -> None:
    error = _error(encoder_only, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert error["message"] == f"This server has no {GENERATE_HOW.removeprefix('a ')}"
    error = _error(encoder_only, "/v1/completions", {"prompt": "Hi", "model": "gpt-4o"})
    assert error["message"] == f"The model `gpt-4o` does not exist. This server serves: `minilm`. None of them is {GENERATE_HOW}"


def test_an_unknown_model_beside_one_of_the_right_kind_is_the_plain_404(server) -> None:
    """Where a model of the endpoint's kind is served, the 404 names the served models only, as before."""
    error = _error(server, "/v1/embeddings", {"input": "a", "model": "nope"})
    assert error["message"] == "The model `nope` does not exist. This server serves: `tiny`, `ids`, `minilm`."


ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, GET /v1/models, GET /health and "
          "GET /metrics (docs/serving.md)")


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/"])
def test_the_servers_root_lists_its_routes(server, path) -> None:
    """``asyncinfer serve`` prints ``serving the OpenAI API at http://127.0.0.1:8000/v1``; opened in a browser (or
    curled), that URL and ``/`` said only "No route GET /v1 on this server."."""
    r = httpx.get(server.url + path, timeout=60)
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req-")
    assert r.json()["error"] == {"message": f"No route GET {path} on this server: its routes are {ROUTES}.",
                                 "type": "invalid_request_error", "param": None, "code": "unknown_url"}


def test_the_model_lists_url_with_a_trailing_slash_is_no_model_named_nothing(server) -> None:
    """``GET /v1/models/`` answered "The model `` does not exist.", a model of no name, where every other route's
    URL with a trailing slash is the unknown-URL 404."""
    for method in ("GET", "HEAD"):
        r = httpx.request(method, server.url + "/v1/models/", timeout=60)
        assert r.status_code == 404 and r.headers["x-request-id"]
    error = httpx.get(server.url + "/v1/models/", timeout=60).json()["error"]
    assert (error["message"], error["param"], error["code"]) == (
        ("No route /v1/models/ on this server: the list of models is GET /v1/models (no trailing slash), one model "
        "GET /v1/models/NAME."), None, "unknown_url")
    assert httpx.get(server.url + "/v1/models/minilm", timeout=60).json()["id"] == "minilm"


def _empty(example: str) -> str:
    return (f"The request body is not valid JSON: it is empty. Send a JSON object, e.g. {example} (curl: -H "
            "'Content-Type: application/json' -d '{...}').")


CHAT_EXAMPLE = '{"messages": [{"role": "user", "content": "Hi"}]}'
COMPLETION_EXAMPLE = '{"prompt": "Hi"}'
EMBEDDING_EXAMPLE = '{"input": "Hi"}'
BOM = ("The request body is not valid JSON: it begins with a UTF-8 byte-order mark (EF BB BF), which JSON does not "
       "allow: send the text without it.")


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/chat/completions", b"", _empty(CHAT_EXAMPLE)),
    ("/v1/completions", b"  \n", _empty(COMPLETION_EXAMPLE)),
    ("/v1/embeddings", b"", _empty(EMBEDDING_EXAMPLE)),
    ("/v1/completions", b'\xef\xbb\xbf{"model": "tiny", "prompt": "a", "max_tokens": 1}', BOM),
])
def test_a_body_that_is_no_json_says_why_in_a_clients_words(server, path, body, message) -> None:
    """``curl -X POST .../v1/chat/completions`` (no ``-d``) was answered "The request body is not valid JSON: Input
    data was truncated", the decoder's words; a body a Windows tool wrote with a byte-order mark, "JSON is
    malformed: invalid character (byte 0)". An empty body's example is one its route takes: every route showed a
    chat's ``messages``, which /v1/embeddings and /v1/completions refuse as an unrecognized field."""
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"]
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": None}


@pytest.mark.parametrize(("path", "example"), [
    ("/v1/chat/completions", CHAT_EXAMPLE), ("/v1/completions", COMPLETION_EXAMPLE),
    ("/v1/embeddings", EMBEDDING_EXAMPLE),
])
def test_an_empty_bodys_example_is_served_by_its_route(server, path, example) -> None:
    """The body an empty body's 400 shows is answered 200 by its route (the server's default models)."""
    r = httpx.post(server.url + path, content=example, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_other_malformed_json_keeps_the_decoders_words(server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"},
                   timeout=60)
    assert r.json()["error"]["message"] == "The request body is not valid JSON: Input data was truncated"


# ------------------------------------------------------------------------- tenants that would go unused
@pytest.mark.parametrize("source", ["header", "request"])
def test_keys_tenants_with_another_tenant_source_are_refused(source) -> None:
    """``asyncinfer serve --tenant sk-acme=acme --tenant-from header`` served, its key accepted and its tenant and
    priority never read: the header (or the body) named every request's tenant."""
    from asyncinfer.errors import InvalidParameterError
    from asyncinfer.server import ServerSettings, Tenant

    with pytest.raises(InvalidParameterError) as refused:
        ServerSettings(tenants={"sk-acme": Tenant("acme", priority=-5)}, tenant_from=source)
    assert (refused.value.parameter, refused.value.value) == ("tenant_from", source)
    assert str(refused.value) == (
        f"tenant_from='{source}' is invalid: allowed 'api-key' when tenants give keys a Tenant (with 'header' or "
        "'request' the tenant and priority come from the header or the body, and a key's Tenant would go unused: give "
        "those keys as plain API keys, the priorities of tenant names as tenant_priorities)")
    ServerSettings(api_keys=("sk-acme",), tenant_priorities={"acme": -5}, tenant_from=source)  # what to give instead
    ServerSettings(tenants={"sk-acme": Tenant("acme", priority=-5)})  # the key's tenant, read


def test_serve_says_it_in_its_flags(capsys, monkeypatch) -> None:
    from asyncinfer import cli
    from asyncinfer.commands import serve

    def no_port(*_args: object) -> None:
        raise AssertionError("the settings were taken: serve went on to listen")

    monkeypatch.setattr(serve, "listening_socket", no_port)  # (cli imports it from there when it serves)
    assert cli.main(["serve", "--port", "0", "--tenant", "sk-acme=acme", "--tenant-from", "header"]) == 2
    assert capsys.readouterr().err == (
        "asyncinfer: error: --tenant-from 'header' is invalid: allowed 'api-key' when --tenant gives keys a tenant "
        "(with 'header' or 'request' the tenant and priority come from the header or the body, and a key's tenant "
        "would go unused: give those keys as --api-key)\n")
