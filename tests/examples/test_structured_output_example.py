"""examples/structured_output.py on the real model: every message becomes a Contact whose JSON validates."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jsonschema
import pytest

from asyncinfer import AsyncEngine

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
pytestmark = pytest.mark.real_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "structured_output.py"


def load_example():
    spec = importlib.util.spec_from_file_location("structured_output_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is built
    spec.loader.exec_module(module)
    return module


async def test_every_message_becomes_a_contact_that_validates(real_gguf) -> None:
    example = load_example()
    async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
        records = await example.extract(engine, example.MESSAGES)
    assert len(records) == len(example.MESSAGES)
    for record in records:
        assert isinstance(record, example.Contact), record
        jsonschema.validate(vars(record), example.CONTACT_SCHEMA)


async def test_a_reply_cut_by_max_tokens_is_reported_not_parsed(real_gguf, monkeypatch) -> None:
    example = load_example()
    monkeypatch.setattr(example, "PARAMS", example.PARAMS.with_updates(max_tokens=3))
    async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
        [record] = await example.extract(engine, example.MESSAGES[:1])
    assert record == "no record: the reply was cut (length) after 3 tokens"
