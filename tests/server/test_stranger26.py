"""A newcomer's first hour (stranger 26) with structured output (docs/structured_output.md): a schema the docs do
not show. A JSON schema that compiles but that no text satisfies (``{"$ref": "#"}``, two definitions referring to
each other) was refused, as the page says, but the reason was llguidance's matcher state: ``NoExtensionBias``
followed by ``<state>``, its tokens, flags and some 20 lines of parser statistics (``"compute_time_us": 21``,
``"lexer_cost": 1436``, ...), in the ``InvalidParameterError`` and in the 400's message. The state dump is left out
now (as it already was for a spec the library gives up on mid-reply), and the refusal says what is wrong: no text
satisfies the schema."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer import InvalidParameterError, StructuredOutput

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

LOOPS = [
    {"$ref": "#"},
    {"anyOf": [{"$ref": "#"}]},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
]


@pytest.fixture(scope="module")
def compiler(tiny_chat_model):
    from transformers import AutoTokenizer

    from asyncinfer.grammar import GrammarCompiler

    return GrammarCompiler(AutoTokenizer.from_pretrained(tiny_chat_model), 320, [2])


@pytest.mark.parametrize("schema", LOOPS)
def test_a_schema_no_text_satisfies_is_refused_in_one_line(compiler, schema) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        compiler.compile(StructuredOutput.json_schema(schema))
    assert refused.value.parameter == "structured"
    assert refused.value.allowed == "a JSON schema that some text satisfies (llguidance: NoExtensionBias)"
    assert "\n" not in str(refused.value) and "<state>" not in str(refused.value)


def test_the_matcher_s_state_dump_is_never_a_reason() -> None:
    from asyncinfer.grammar import _reason

    dump = 'NoExtensionBias\n<state>\nTokens: ⟦⟧\n0 tokens, 0 bytes; grm_prefix: ""\nParser: {\n  "rows": 1,\n}'
    assert _reason(dump) == "NoExtensionBias"


def test_over_http_it_is_a_400_on_the_field_in_one_line(server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for field, value in [("guided_json", LOOPS[0]),
                             ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOPS[2]}})]:
            reply = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, field: value})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == (field if field == "guided_json" else "response_format.json_schema.schema")
            assert error["message"].endswith("is invalid: allowed a JSON schema that some text satisfies "
                                             "(llguidance: NoExtensionBias)"), error["message"]
            assert "<state>" not in error["message"] and "\n" not in error["message"]
