"""A tool's ``parameters`` with local ``$ref``s (``#/$defs/...``, as pydantic and the OpenAI SDK's
``pydantic_function_tool`` write them) are served: the forced call's grammar places the parameters inside the
call's schema, and their references are rebased there (they named the call's root and were a 400, "Pointer
'/$defs/Addr' does not exist")."""

from __future__ import annotations

import pytest

from asyncinfer.server.tool_formats import Llama3JsonFormat, MistralFormat
from asyncinfer.server.tools import HERMES, parse_tool_use

llguidance = pytest.importorskip("llguidance")

ADDR = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
#: a pydantic model with a nested one: the nested one is a $def, referred to from the root
HOME = {"$defs": {"Addr": ADDR}, "type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}},
        "required": ["home"], "additionalProperties": False}
#: a recursive model, and data that looks like a reference (a const, a property named $ref)
NODE = {"$defs": {"Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"},
                                                                              {"type": "null"}]}},
                           "required": ["next"], "additionalProperties": False}},
        "type": "object", "properties": {"head": {"$ref": "#/$defs/Node"}, "$ref": {"const": {"$ref": "#/x"}}},
        "required": ["head"], "additionalProperties": False}


def _tool(name, parameters):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_the_call_schemas_rebase_local_references_and_leave_data_alone() -> None:
    one = parse_tool_use([_tool("home", HOME)], "required", None).call_schemas("arguments")
    assert one["properties"]["arguments"]["properties"]["home"] == {"$ref": "#/properties/arguments/$defs/Addr"}
    two = parse_tool_use([_tool("home", HOME), _tool("node", NODE)], "required", None).call_schemas("parameters")
    first, second = (s["properties"]["parameters"] for s in two["anyOf"])
    assert first["properties"]["home"] == {"$ref": "#/anyOf/0/properties/parameters/$defs/Addr"}
    assert second["properties"]["head"] == {"$ref": "#/anyOf/1/properties/parameters/$defs/Node"}
    assert second["$defs"]["Node"]["properties"]["next"]["anyOf"][0] == {
        "$ref": "#/anyOf/1/properties/parameters/$defs/Node"}
    assert second["properties"]["$ref"] == {"const": {"$ref": "#/x"}}  # a property's name, a const's data
    assert HOME["properties"]["home"] == {"$ref": "#/$defs/Addr"}  # the body's own schema unchanged


@pytest.mark.parametrize("fmt", [HERMES, Llama3JsonFormat(), MistralFormat(None)], ids=lambda f: f.name)
@pytest.mark.parametrize("tools", [[HOME], [HOME, NODE]], ids=["one-tool", "two-tools"])
def test_a_forced_call_of_parameters_with_defs_compiles(fmt, tools) -> None:
    use = parse_tool_use([_tool(f"t{i}", p) for i, p in enumerate(tools)], "required", None).bound(fmt)
    spec = use.structured()
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
