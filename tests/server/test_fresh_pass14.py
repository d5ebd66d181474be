"""Adversarial pass 14 (issue 25), HTTP side: a structured-output schema's integer bounds.

llguidance reads a JSON schema's ``minimum``/``maximum`` (and the exclusive ones) of an integer range as i64,
saturating what does not fit. A range whose bounds both lie near -2**63 (``{"type": "integer", "minimum": -2e19,
"maximum": -1e19}``, as a chat request's ``response_format``, or inside a Lark grammar's ``%json {...}``) crashed the
whole process with a segmentation fault while the grammar was compiled: one caller's request took the server
and every other caller's stream down. A range above 2**63 - 1 compiled and constrained the reply to
9223372036854775807, text outside the schema. A bound of 2**63 or more in size is refused now, by ``structured``
(a 400 over HTTP), before the library reads it.
"""

from __future__ import annotations

import pytest

from tests.helpers import compile_in_child

_CRASHING = '{"type": "integer", "minimum": -2e19, "maximum": -1e19}'
_SPECS = {
    "crash": f"StructuredOutput.json_schema({_CRASHING!r})",
    "crash_i64": 'StructuredOutput.json_schema({"type": "integer", "minimum": -9223372036854775807, '
                 '"maximum": -9223372036854775807})',
    "nested": 'StructuredOutput.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, '
              '"required": ["a"], "$defs": {"n": {"type": "integer", "minimum": -2e19, "maximum": -1e19}}})',
    "lark": f"StructuredOutput.grammar('start: x\\nx: %json ' + {_CRASHING!r})",
    "saturated": 'StructuredOutput.json_schema({"type": "integer", "minimum": 1e19, "maximum": 2e19})',
    "huge_int": 'StructuredOutput.json_schema({"type": "integer", "maximum": 10**400})',
    "fits": 'StructuredOutput.json_schema({"type": "integer", "minimum": -9223372036854774784, "maximum": 5})',
    "property_named_minimum": 'StructuredOutput.json_schema({"type": "object", "properties": {"minimum": '
                              '{"type": "integer", "minimum": 3, "maximum": 4}}, "required": ["minimum"]})',
}


@pytest.mark.parametrize("name", list(_SPECS))
def test_an_integer_bound_past_i64_is_refused_before_the_grammar_library_reads_it(tiny_chat_model, name) -> None:
    """Each spec is compiled in a child interpreter, as the engine compiles it: before, the crashing ones ended it
    with SIGSEGV (status -11) and ``saturated`` compiled; now each is an InvalidParameterError on ``structured``
    naming the bound, and bounds under 2**63 (or a property that is named ``minimum``) still compile."""
    done = compile_in_child(tiny_chat_model, _SPECS[name])
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    if name in ("fits", "property_named_minimum"):
        assert done.stdout.strip() == "compiled", done.stdout
    else:
        assert done.stdout.startswith("refused structured "), done.stdout
        if name != "huge_int":  # (past f64's range: the library's own reader refuses it)
            assert "under 2**63 (9223372036854775808) in size" in done.stdout, done.stdout


def test_over_http_the_crashing_schema_is_a_400_and_the_server_serves_on(tiny_chat_model) -> None:
    import httpx

    from asyncinfer.server import ModelSpec, create_app
    from tests.server.conftest import TINY_OPTIONS, LiveServer

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -2e19, "maximum": -1e19}},
              "required": ["n"]}
    with LiveServer(create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={
            **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format.json_schema.schema" and "minimum -2e+19" in r.json()["error"]["message"]
        assert r.headers["x-request-id"]
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
