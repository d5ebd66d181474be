"""Fixtures for tests/models (the shared code they use is in tests/helpers.py)."""

from __future__ import annotations

import pytest
import torch

from asyncinfer.models import load_model
from tests.helpers import tiny_hf_model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Factory: kind -> (hf_model, our LoadedModel) on the same saved weights, cached per module."""
    cache: dict[str, tuple] = {}

    def make(kind: str):
        if kind not in cache:
            hf = tiny_hf_model(kind)
            path = tmp_path_factory.mktemp(f"tiny_{kind}")
            hf.save_pretrained(path, safe_serialization=True)
            cache[kind] = (hf, load_model(path, torch.float32, torch.device("cpu")))
        return cache[kind]

    return make
