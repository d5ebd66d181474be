"""A ninth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx

from asyncinfer.server.errors import MAX_LISTED_MODELS, not_found

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_an_unknown_model_is_a_404_that_names_the_models_served(server) -> None:
    """A client asking for ``gpt-4o`` or the Hub id it read in a guide was told only "The model `x` does not
    exist.": it had to find /v1/models on its own. The 404 now lists the names it can ask for, on every route
    that takes a model and on /v1/models/NAME."""
    served = "This server serves: `tiny`, `ids`, `minilm`."  # /v1/models' order
    for path, body in (
        ("/v1/chat/completions", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": MESSAGES}),
        ("/v1/completions", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2}),
        ("/v1/embeddings", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "input": "Hi"}),
    ):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert error["message"] == f"The model `HuggingFaceTB/SmolLM2-135M-Instruct` does not exist. {served}"
    r = httpx.get(server.url + "/v1/models/gpt-4o", timeout=60)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"The model `gpt-4o` does not exist. {served}"


def test_a_404_lists_at_most_twenty_names_and_says_so_when_none_is_served() -> None:
    names = [f"m{i}" for i in range(MAX_LISTED_MODELS + 3)]
    message = not_found("x", names).message
    assert message.endswith("`m19` and 3 more (GET /v1/models lists them).") and "`m20`" not in message
    assert not_found("x", []).message == "The model `x` does not exist. This server serves no model now."
    assert not_found("x", ["a"]).status == 404


def test_a_415_names_the_header_and_the_value_to_send(server) -> None:
    """``curl -d '{...}'`` without ``-H`` sends a form type: the 415 says which header to set, to what."""
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "Hi"}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 415
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert error["message"] == (
        "The request body must be JSON: send the header `Content-Type: application/json` (UTF-8; curl: -H "
        "'Content-Type: application/json'), got Content-Type 'application/x-www-form-urlencoded'."
    )


def test_a_hub_id_is_served_under_the_whole_id(tmp_path, monkeypatch) -> None:
    """``asyncinfer serve Qwen/Qwen2.5-0.5B-Instruct`` (from the local Hugging Face cache) served it as
    ``Qwen2.5-0.5B-Instruct``, and the clients written for vLLM, which ask for the whole id, got a 404."""
    from asyncinfer.server import ModelSpec

    monkeypatch.chdir(tmp_path)
    assert ModelSpec.served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert ModelSpec.served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"  # a known name
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").mkdir()
    assert ModelSpec.served_name("models/tiny") == "tiny"  # a path here: its directory's name
    assert ModelSpec.served_name("/abs/dir/m.gguf") == "m"
