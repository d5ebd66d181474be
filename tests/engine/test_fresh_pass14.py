"""Adversarial pass 14 (issue 25), in-process: a model directory's safetensors index.

An index whose ``weight_map`` holds a value that is not hashable (a list, an object) was refused with a bare
``TypeError: unhashable type`` from ``load_model`` (the check that the values are strings ran after they were
put in a set); it is a ModelLoadError naming the index, as a number or null already was.

A ``generation_config.json`` whose ``eos_token_id`` list holds ``Infinity`` (which Python's JSON reader takes) was
refused with a bare ``OverflowError`` from ``load_model``; ``NaN`` was already a ModelLoadError naming the file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.checkpoint import safetensors_files
from asyncinfer.models.loader import load_model
from tests.helpers import tiny_hf_config


@pytest.mark.parametrize("value", [["model.safetensors"], {"file": "model.safetensors"}, 3, None])
def test_an_index_whose_weight_map_holds_a_value_that_is_no_string_is_a_model_load_error(tmp_path, value) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": value}}))
    with pytest.raises(ModelLoadError, match="'weight_map' values must be shard file names"):
        safetensors_files(tmp_path)
    tiny_hf_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'weight_map' values must be shard file names"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("eos", ["[Infinity]", "[-Infinity]", "Infinity", "[NaN]"])
def test_a_generation_config_whose_eos_id_is_infinite_is_a_model_load_error(tiny_models, tmp_path, eos) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"][0], model)
    (model / "generation_config.json").write_text(f'{{"eos_token_id": {eos}}}')
    with pytest.raises(ModelLoadError, match="cannot read .*generation_config.json"):
        load_model(model, torch.float32, "cpu")
