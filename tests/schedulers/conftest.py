"""Scheduler-test fixtures: the tiny Llama's directory (the pinned cost model is tests.helpers.CPU_COST)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    """The tiny random Llama checkpoint of tests/conftest.py (its directory)."""
    return tiny_models["llama"][0]


@pytest.fixture
def forget_registrations():
    """What a test registers with register_scheduler is gone after it (the registry is the process's)."""
    from asyncinfer.schedulers import registry

    before = dict(registry._REGISTERED)
    yield
    registry._REGISTERED.clear()
    registry._REGISTERED.update(before)
