"""Fixtures of the command-line tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: every refusal checked with it comes before one."""
    import asyncinfer.engine

    async def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "load", load)
    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "from_pretrained", load)
