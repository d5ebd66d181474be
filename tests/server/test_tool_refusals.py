"""A forced tool call whose tool's ``parameters`` no arguments satisfy is refused naming the tool: the refusal named
``tools`` in llguidance's words for the calls' grammar ("required property 'arguments' is unsatisfiable"), the
wrapper the server writes around each tool, which no caller wrote and which named no tool."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer.server import ModelSpec, create_app

from .conftest import LiveServer

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

GOOD = {"type": "object", "properties": {"n": {"type": "integer"}}}
NEVER = {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}


@pytest.fixture(scope="module")
def smol(real_gguf):
    """The default model (its Hermes tools format and a context that holds a tools prompt)."""
    app = create_app(ModelSpec(str(real_gguf), "smol", {"max_model_len": 2048, "kv_cache_memory": 96 * 1024 * 1024}))
    with LiveServer(app) as live:
        yield live


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("tools", "choice"), [
    ([_tool("never", NEVER)], "required"),
    ([_tool("roll", GOOD), _tool("never", NEVER)], {"type": "function", "function": {"name": "never"}}),
], ids=["required", "named"])
def test_a_forced_call_of_a_tool_no_arguments_satisfy_names_the_tool(smol, tools, choice, stream) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            "tools": tools, "tool_choice": choice}
    r = httpx.post(smol.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == ("tools", "invalid_request_error"), error
    assert error["message"].startswith("`tools`: the `parameters` of function \"never\" are refused: "), error
    assert "required property 'a' is unsatisfiable" in error["message"], error["message"]
    assert "'arguments'" not in error["message"] and r.headers["x-request-id"]


def test_a_tool_whose_parameters_some_arguments_satisfy_is_called(smol) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "tools": [_tool("roll", GOOD)], "tool_choice": "required"}
    r = httpx.post(smol.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
