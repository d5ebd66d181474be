"""Adversarial pass 7 (in-process side): faults a hostile file or caller could cause, found and fixed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import ModelLoadError
from tests.helpers import llama_header_gguf


def _header_only_gguf(path: Path, arch: str, **values) -> Path:
    """A GGUF file of metadata alone (no tensors): a small model's keys, with ``values`` (key -> (value, type),
    ``A`` standing for the architecture) put over them."""
    import gguf

    kind = gguf.GGUFValueType
    keys = {"A.embedding_length": (64, kind.UINT32), "A.attention.head_count": (4, kind.UINT32),
            "A.feed_forward_length": (128, kind.UINT32), "A.attention.layer_norm_rms_epsilon": (1e-5, kind.FLOAT32),
            "A.context_length": (128, kind.UINT32), "A.block_count": (0, kind.UINT32),
            "A.vocab_size": (32, kind.UINT32), **values}
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in keys.items():
        writer.add_key_value(key.replace("A", arch, 1), value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers_reads_at_most(monkeypatch, layers: int) -> None:
    """transformers' AutoConfig fails the test when handed a config.json of more than ``layers`` layers."""
    import json

    import transformers

    read = transformers.AutoConfig.from_pretrained

    def bounded(path, *args, **kwargs):
        count = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        assert count <= layers, f"transformers was handed a config of {count} layers"
        return read(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", bounded)


@pytest.mark.parametrize("count", [("10000000000", "STRING"), (1e10, "FLOAT64")], ids=["string", "float"])
def test_a_block_count_that_is_no_int_is_checked_before_any_per_layer_work(tmp_path, monkeypatch, count) -> None:
    """``gguf_config`` checked ``<arch>.block_count`` against the layers the tensors hold only where it was an
    int; a string ("10000000000") or a float (1e10) went through ``int()`` into the config, and a Gemma file
    (whose sliding-window pattern is one entry a layer) built a list of 10**10 entries first: ~25 s and a
    MemoryError under a 4 GiB limit, all of the machine's memory without one. A count of another type than the
    format's integers is now refused as such (naming the key), before any per-layer work."""
    import gguf

    from asyncinfer.models import loader
    from asyncinfer.models.gguf_file import GGUFFile

    window = loader._gguf_window

    def bounded_window(reader, arch, num_layers):
        assert num_layers < 1000, f"per-layer work for {num_layers} layers before the count was checked"
        return window(reader, arch, num_layers)

    monkeypatch.setattr(loader, "_gguf_window", bounded_window)
    value, vtype = count
    path = _header_only_gguf(tmp_path / "blocks.gguf", "gemma2",
                             **{"A.block_count": (value, getattr(gguf.GGUFValueType, vtype))})
    with pytest.raises(ModelLoadError, match=r"gemma2\.block_count = '?10000000000(\.0)?'? is not an integer"):
        loader.gguf_config(GGUFFile(path))


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "llama"])
def test_a_config_json_layer_count_past_its_weights_is_refused_before_transformers_reads_it(
        tmp_path, monkeypatch, model_type) -> None:
    """A Hugging Face directory whose config.json said ``num_hidden_layers: 10000000000`` went to transformers'
    ``AutoConfig`` as it was, and its Qwen2 and Gemma 2 config classes build ``layer_types``, one entry a layer:
    minutes and all of the machine's memory (a MemoryError after 64 s under a 6 GiB limit) before anything
    refused it. The count is now checked against the layers the shards' headers name, before transformers."""
    import json

    import torch
    from safetensors.torch import save_file

    from asyncinfer.models.loader import open_checkpoint

    config = {"model_type": model_type, "num_hidden_layers": 10**10, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 32,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({f"model.layers.{i}.input_layernorm.weight": torch.zeros(64) for i in range(2)},
              str(tmp_path / "model.safetensors"))
    _transformers_reads_at_most(monkeypatch, 2)
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers = 10000000000, but its weights hold 2 layer"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert open_checkpoint(tmp_path).config.num_layers == 2  # a count the weights hold is read as before


def test_a_layer_count_beside_unreadable_shards_is_bounded_by_their_bytes(tmp_path, monkeypatch) -> None:
    """Shards whose headers cannot be read leave the count to the load (which names the config's own errors
    first), but bounded by the bytes they could hold: a garbage shard beside 10**10 layers is refused before
    transformers builds its list of one entry a layer; a count that fits is read (and its shard refused) as before."""
    import json

    from asyncinfer.models.loader import open_checkpoint

    config = {"model_type": "qwen2", "num_hidden_layers": 10**10, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4096)
    _transformers_reads_at_most(monkeypatch, 4096)
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers = 10000000000 is more layers than its weights could "
                                             r"hold \(4096 bytes of \*\.safetensors shards: at most 4096\)"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert open_checkpoint(tmp_path).config.num_layers == 2  # the shard is refused by the load, as before


def test_an_encoder_config_with_more_layers_than_its_weights_is_refused_before_they_are_built(
        tmp_path, monkeypatch, minilm_dir) -> None:
    """An embedding model's config.json with ``num_hidden_layers: 10000000000`` built the encoder's layers (one
    module each, on the meta device) until the memory ran out: no refusal within a minute under a 4 GB limit.
    The count is now checked against the layers the shards' headers name before any is built."""
    import json
    import shutil

    import torch

    from asyncinfer.models import encoder

    model = tmp_path / "minilm"
    shutil.copytree(minilm_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**10}))
    built = encoder.SentenceEncoder

    def bounded(cfg):
        assert cfg.num_layers <= 6, f"an encoder of {cfg.num_layers} layers was built"
        return built(cfg)

    monkeypatch.setattr(encoder, "SentenceEncoder", bounded)
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers = 10000000000, but its weights hold 6 layer"):
        encoder.load_encoder(model, torch.float32, "cpu")
    (model / "config.json").write_text(json.dumps(config))
    assert encoder.load_encoder(model, torch.float32, "cpu").config.num_layers == 6  # as before


@pytest.mark.parametrize(("arch", "values", "message"), [
    ("llama", {"A.attention.head_count": (0, "UINT32")}, r"llama\.attention\.head_count = 0 must be a positive int"),
    ("gemma2", {"A.attention.scale": (0.0, "FLOAT32")}, r"gemma2\.attention\.scale = 0\.0 must be > 0"),
    ("gemma2", {"A.attention.scale": (-0.25, "FLOAT32")}, r"gemma2\.attention\.scale = -0\.25 must be > 0"),
    ("llama", {"A.rope.dimension_count": (10**9, "UINT32")},
     r"llama\.rope\.dimension_count = 1000000000 must be at most the head size \(16\)"),
    # pass70: said "partial rotary embeddings (rope dim 64 < head dim 82)", a head size rounded down
    ("llama", {"A.attention.head_count": (7, "UINT32")},
     (r"llama\.embedding_length = 64 is not a multiple of llama\.attention\.head_count = 7 \(and no "
     r"llama\.attention\.key_length says the head size\)$")),
], ids=["head-count-0", "scale-0", "scale-negative", "rope-past-head", "heads-not-dividing"])
def test_a_gguf_size_that_divides_by_zero_is_refused_by_its_key(tmp_path, arch, values, message) -> None:
    """A GGUF file with ``attention.head_count = 0`` (the head size's default divides by it) or a Gemma file with
    ``attention.scale = 0`` raised a bare ZeroDivisionError from ``read_model_config`` and
    ``AsyncEngine.plan_memory`` (the CLI's ``info``: "internal error"); a negative scale lost its sign. Each is
    now a ModelLoadError naming the key."""
    import gguf

    from asyncinfer.memory import read_model_config

    typed = {key: (value, getattr(gguf.GGUFValueType, kind)) for key, (value, kind) in values.items()}
    path = _header_only_gguf(tmp_path / "sizes.gguf", arch, **typed)
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(path)


def test_an_encoder_config_with_no_heads_is_refused_by_name(tmp_path, minilm_dir) -> None:
    """An embedding model's config.json with ``num_attention_heads: 0`` raised a bare ZeroDivisionError from
    ``read_encoder_config`` (the encoder's config checks divided by it first); now a ModelLoadError naming it."""
    import json
    import shutil

    from asyncinfer.models.encoder import read_encoder_config

    model = tmp_path / "minilm"
    shutil.copytree(minilm_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(ModelLoadError, match=r"num_heads=0 must be a positive int"):
        read_encoder_config(model)


def test_a_block_tensor_of_no_dimension_is_refused_at_parse(tmp_path) -> None:
    """A Q4_0 tensor of no dimension holds one value, but its bytes were counted as none (the product of no
    dimensions, divided by the 32 values of a block), so the reader took it; read as ``rope_freqs.weight`` (which
    the config dequantizes before the tensor index is checked) it was a bare RuntimeError from torch ("shape '[]'
    is invalid for input of size 0") out of ``read_model_config``. Its one value is not a whole block: refused."""
    import struct

    import gguf
    import numpy as np

    from asyncinfer.memory import read_model_config
    from asyncinfer.models.gguf_file import GGUFFile

    path = tmp_path / "rope.gguf"
    writer = llama_header_gguf(path, block_count=0)
    writer.add_tensor("rope_freqs.weight", np.zeros((1, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"rope_freqs.weight") + len("rope_freqs.weight")  # then n_dims (u32) and its dims (u64 each)
    assert struct.unpack_from("<I", data, at)[0] == 2
    data[at:at + 4 + 16] = struct.pack("<I", 0)  # no dimension
    path.write_bytes(bytes(data))
    message = r"'rope_freqs\.weight' \(q4_0\) has rows of 1 values, not a whole number of 32-value blocks"
    with pytest.raises(ModelLoadError, match=message):
        GGUFFile(path)
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(path)


class _AnyVersion(int):
    """A version id equal to every other (``==`` and ``!=`` answer so whatever they are compared with)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


async def test_a_version_id_that_poses_as_any_version_is_read_as_the_int_it_holds(tiny_models) -> None:
    """``generate(..., version_id=)`` pins a prompt to the version that made it; an ``int`` subclass whose ``!=``
    said False passed the check for version 99 while version 0 served, and the request ran on a version that
    never made its ids. The id is now read as the plain int it holds: ModelChangedError, nothing queued."""
    from asyncinfer import AsyncEngine, ModelChangedError, SamplingParams

    options = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu",
               "block_size": 4}
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **options) as engine:
        with pytest.raises(ModelChangedError, match="made for version 99 of the model, and version 0 serves it"):
            await engine.generate([1, 2], SamplingParams(max_tokens=2), version_id=_AnyVersion(99))
        out = await engine.generate([1, 2], SamplingParams(max_tokens=2), version_id=_AnyVersion(0))
        assert out.finish_reason == "length"  # the version that serves: runs as before
        assert engine.kv_stats().used_blocks == 0
