"""Stranger 24's first hour: a ``generate --file`` line that asks for structured output.

``generate --help`` says a line's keys are prompt, messages, id and SamplingParams' fields, ``structured``
among them; but that field takes a Python ``StructuredOutput``, which no JSON line can hold, so every value
but null was refused, naming Python's constructors (``allowed null or a StructuredOutput
(StructuredOutput.json_schema(...), ...)``). A line now writes it as an object of one key named after the
constructor: ``{"regex": "[0-9]+"}``, ``{"json_schema": {...}}``, ...
"""

from __future__ import annotations

import argparse
import io

import pytest

from asyncinfer import SamplingParams, StructuredOutput, cli
from asyncinfer.commands import generate

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _line_params(structured: object) -> SamplingParams:
    import json

    line = json.dumps({"prompt": "x", "structured": structured})
    return generate._job(line, 1, SamplingParams(), argparse.Namespace(file="in.jsonl", chat=False)).params


@pytest.mark.parametrize(("structured", "expected"), [
    ({"json_schema": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
    ({"json_schema": '{"type": "object"}'}, StructuredOutput.json_schema({"type": "object"})),
    ({"json_object": True}, StructuredOutput.json_object()),
    ({"regex": "[0-9]+"}, StructuredOutput.regex("[0-9]+")),
    ({"choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"grammar": 'root ::= "a"'}, StructuredOutput.grammar('root ::= "a"')),
    (None, None),
])
def test_a_lines_structured_is_the_constructor_its_key_names(structured, expected) -> None:
    assert _line_params(structured).structured == expected


@pytest.mark.parametrize(("structured", "message"), [
    ('"abc"', ('structured="abc" is invalid: allowed null or an object of one key: {"json_schema": {...}}, '
               '{"json_object": true}, {"regex": "..."}, {"choice": ["...", ...]} or {"grammar": "..."}')),
    ('{"regex": "a", "choice": ["b"]}', "structured={"),
    ('{"nope": 1}', 'structured={"nope": 1} is invalid: allowed null or an object of one key'),
    ('{"json_object": false}', 'structured={"json_object": false} is invalid: allowed {"json_object": true}'),
    ('{"regex": 3}', "structured.regex=3 is invalid: allowed a regular expression"),
])
def test_a_bad_structured_names_its_line_and_the_form(capsys, monkeypatch, structured, message) -> None:
    """Before the model loads, as every other bad line: status 2, one line naming the line and the JSON form."""
    monkeypatch.setattr("sys.stdin", io.StringIO(f'{{"prompt": "x", "structured": {structured}}}\n'))
    assert cli.main(["generate", "--file", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncinfer: error: stdin line 1: {message}"), err
    assert err.count("\n") == 1 and "StructuredOutput(" not in err


def test_generate_help_shows_the_form() -> None:
    assert '{"json_schema": {...}}' in generate.__doc__ and '{"regex": "[0-9]+"}' in generate.__doc__
