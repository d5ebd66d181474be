"""A forty-fourth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx

from tests.server.conftest import LiveServer
from tests.server.test_stranger12 import EMBED_HOW, GENERATE_HOW


def _error(server: LiveServer, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"], r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", None)
    return error


def test_the_served_generator_named_on_embeddings_says_how_to_add_an_encoder(generator_only) -> None:
    """On a default ``asyncinfer serve`` (no ``--embedding-model``), a client that names the one model the server
    serves on ``/v1/embeddings`` was told only to use the chat routes: nothing said the server has no embedding
    model, nor the flag that adds one, as the 404 for an unnamed or unknown model says."""
    error = _error(generator_only, "/v1/embeddings", {"input": "a text", "model": "ids"})
    assert error["message"] == ("The model `ids` does not support this endpoint: use /v1/chat/completions or "
                                f"/v1/completions. This server has no {EMBED_HOW.removeprefix('an ')}")


def test_the_served_encoder_named_on_chat_says_how_to_add_a_generator(encoder_only) -> None:
    error = _error(encoder_only, "/v1/chat/completions",
                   {"model": "minilm", "messages": [{"role": "user", "content": "Hi"}]})
    assert error["message"] == ("The model `minilm` does not support this endpoint: use /v1/embeddings. This server "
                                f"has no {GENERATE_HOW.removeprefix('a ')}")


def test_a_model_of_the_other_kind_beside_one_of_the_right_kind_only_names_the_route(server) -> None:
    """Where the server serves a model of the endpoint's kind, the 400 names the route, as before."""
    error = _error(server, "/v1/embeddings", {"input": "a", "model": "tiny"})
    assert error["message"] == ("The model `tiny` does not support this endpoint: use /v1/chat/completions or "
                                "/v1/completions.")
