"""Checkpoint-directory helpers shared by the decoder loader and the sentence encoder: each failure names its file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.checkpoint import iter_safetensors, load_hf_tokenizer, read_json, safetensors_files
from asyncinfer.models.loader import load_model
from tests.helpers import tiny_hf_config


def test_shards_in_index_order_and_their_tensors(tmp_path) -> None:
    save_file({"b": torch.ones(2)}, tmp_path / "part-2.safetensors")
    save_file({"a": torch.zeros(3)}, tmp_path / "part-1.safetensors")
    weight_map = {"b": "part-2.safetensors", "a": "part-1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = safetensors_files(tmp_path)
    assert [f.name for f in files] == ["part-1.safetensors", "part-2.safetensors"]
    assert [(name, t.tolist()) for name, t in iter_safetensors(files)] == [("a", [0.0] * 3), ("b", [1.0] * 2)]
    assert load_hf_tokenizer(tmp_path) is None  # no tokenizer files


@pytest.mark.parametrize(
    "index, message",
    [("{not json", "cannot read .*index.json"), ("[]", "no 'weight_map'"),
     ('{"weight_map": {"a": "gone.safetensors"}}', "gone.safetensors listed in the index does not exist")],
)
def test_bad_index_files(tmp_path, index: str, message: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=message):
        safetensors_files(tmp_path)


def test_missing_and_corrupt_files(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        safetensors_files(tmp_path)
    with pytest.raises(ModelLoadError, match="cannot read .*missing.json"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="cannot read weights from .*bad.safetensors"):
        list(iter_safetensors([tmp_path / "bad.safetensors"]))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/dev/zero",
                                   "{outside}", "/dev/../etc/passwd"])
def test_an_index_naming_files_outside_the_directory_is_refused_before_opening_them(tmp_path, monkeypatch,
                                                                                   shard: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    outside = tmp_path / "outside.safetensors"
    save_file({"a": torch.zeros(3)}, outside)
    shard = shard.format(outside=outside)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    opened: list[str] = []
    real_open = open

    def spy(file, *args, **kwargs):  # records every file Python opens while the index is read
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(ModelLoadError, match=f"weight shard {re.escape(repr(shard))} is not a file name inside"):
        safetensors_files(model)
    monkeypatch.undo()
    assert not [f for f in opened if not f.startswith(str(model))], opened
    tiny_hf_config("llama").save_pretrained(model)  # the loader refuses it the same way, before any weight
    with pytest.raises(ModelLoadError, match="is not a file name inside"):
        load_model(model, torch.float32, "cpu")


def test_an_index_in_a_hugging_face_cache_snapshot_follows_its_links_to_the_blobs(tmp_path) -> None:
    """The Hugging Face cache keeps a snapshot's files as links to ``../../blobs/HASH``: the directory's own
    links are followed (only the index's names are held inside it); a link to a device is still refused."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i in range(2):
        save_file({f"t{i}": torch.full((3,), float(i))}, blobs / f"hash{i}")
        (snapshot / f"model-0000{i + 1}-of-00002.safetensors").symlink_to(Path("../..") / "blobs" / f"hash{i}")
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"t0": "model-00001-of-00002.safetensors", "t1": "model-00002-of-00002.safetensors"}}))
    files = safetensors_files(snapshot)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert {name: t.tolist() for name, t in iter_safetensors(files)} == {"t0": [0.0] * 3, "t1": [1.0] * 3}
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    (snapshot / "model-00002-of-00002.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ModelLoadError, match="is not a regular file"):
        safetensors_files(snapshot)


def test_an_index_with_a_shard_name_that_is_not_a_string_is_refused(tmp_path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    with pytest.raises(ModelLoadError, match="must be shard file names"):
        safetensors_files(tmp_path)
