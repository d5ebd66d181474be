"""Scheduler-test fixtures: the tiny Llama's directory and a pinned step-cost model."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    """The tiny random Llama checkpoint of tests/conftest.py (its directory)."""
    return tiny_models["llama"][0]


@pytest.fixture(scope="session")
def cpu_cost():
    """The shipped SmolLM2-135M CPU cost model's coefficients, pinned (rounded) so that a
    recalibration on another machine does not move these tests' ground."""
    from asyncinfer.lab import StepCostModel

    return StepCostModel({"const": 0.061, "tokens": 0.00248, "sampled": 0.0, "prefill_seqs": 0.00247,
                          "decode_keys": 2.14e-05, "prefill_keys": 9.3e-07})
