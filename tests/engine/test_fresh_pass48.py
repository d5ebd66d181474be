"""Hostile model files: a GGUF header's sizes that pass their bounds but that no memory holds are refused before the
load allocates them."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine, ConfigurationError
from asyncinfer.models.layers import rope_table_bytes
from asyncinfer.models.loader import read_model_config
from benchmarks.make_gguf import SHAPES, write

TINY = dict(SHAPES["tiny"], hidden=64, intermediate=128, heads=4, kv_heads=2, vocab_size=300, layers=1)


def gguf_with_context(path: Path, context: int) -> Path:
    """A tiny random Llama GGUF (with its vocabulary) whose header's ``llama.context_length`` (a u32) is ``context``."""
    write(path, TINY, "llama", "q8_0", "q8_0", "spm", 0)
    data = bytearray(path.read_bytes())
    key = b"llama.context_length"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 4096)  # UINT32, make_gguf's context
    struct.pack_into("<I", data, at + 4, context)
    path.write_bytes(bytes(data))
    return path


def test_a_context_whose_rope_tables_no_memory_holds_is_refused_before_the_load_allocates_them(tmp_path) -> None:
    """A header's ``context_length`` of 2**31 - 1 (within MAX_CONFIG_SIZE) made the load build rope tables of a row a
    position whatever ``max_model_len`` is: 16 GiB of positions, then 64 GiB tables, for this 100 KB file, the process killed for memory or a
    RuntimeError from the allocator. The plan counts the tables beside the weights and refuses, naming the key."""
    path = gguf_with_context(tmp_path / "long.gguf", 2**31 - 1)
    config = read_model_config(path)
    assert config.max_position_embeddings == 2**31 - 1
    assert rope_table_bytes(config) == 4 * (2**31 - 1) * 8 * 4 + 12 * (2**31 - 1)  # head_dim 16: 8 angles a row
    with pytest.raises(ConfigurationError, match=r"rope tables, a row for each of its max_position_embeddings = "
                                                 r"2147483647 positions, need 280\.0 GiB beside 0\.1 MiB of weights, but 8\.0 GiB are available"):
        AsyncEngine.plan_memory(str(path), max_model_len=64, available_bytes=2**33)
    with pytest.raises(ConfigurationError, match="max_position_embeddings = 2147483647"):
        asyncio.run(AsyncEngine.load(str(path), max_model_len=64, num_threads=1))


def test_a_context_whose_rope_tables_fit_plans_and_loads_as_before(tmp_path) -> None:
    path = gguf_with_context(tmp_path / "short.gguf", 4096)
    config = read_model_config(path)
    assert rope_table_bytes(config) == 4 * 4096 * 8 * 4 + 12 * 4096
    AsyncEngine.plan_memory(str(path), max_model_len=64, available_bytes=2**33)

    async def main() -> list[int]:
        engine = await AsyncEngine.load(str(path), max_model_len=64, num_threads=1)
        try:
            rotary = engine.core.runner.model.rotary  # the tables the plan counted
            assert rotary.cos_cache.nbytes + rotary.sin_cache.nbytes == rope_table_bytes(config) // 2 - 6 * 4096
            return [len(engine.tokenizer.encode("hello"))]
        finally:
            await engine.aclose()

    assert asyncio.run(main())[0] > 0


def test_a_vocabulary_larger_than_the_embedding_is_refused_before_the_tokenizer_is_built(tmp_path,
                                                                                         monkeypatch) -> None:
    """200,000 tokens beside 300 embedding rows: transformers built the tokenizer (10 s and 580 MB here; minutes
    and GBs at the header's 8 million items) before the count was compared. The header's distinct tokens are."""
    from asyncinfer import ModelLoadError
    from asyncinfer.models import loader
    from benchmarks import make_gguf

    def vocabulary(writer, size: int) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                               *(f"\u2581t{i}" for i in range(200_000))])
        writer.add_token_scores([0.0] * 200_259)
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 200_000)

    monkeypatch.setattr(make_gguf, "add_spm_vocab", vocabulary)
    path = tmp_path / "wide.gguf"
    write(path, TINY, "llama", "q8_0", "q8_0", "spm", 0)

    def never(path: Path, header: object = None):
        raise AssertionError(f"the tokenizer of {path} was built")

    monkeypatch.setattr(loader, "gguf_tokenizer", never)
    with pytest.raises(ModelLoadError, match=r"the tokenizer has 200259 tokens \(GGUF metadata tokenizer\.ggml\.tokens "
                                             r"of .*wide\.gguf\) but the model embeds only 300$"):
        asyncio.run(AsyncEngine.load(str(path), max_model_len=64, num_threads=1))


@pytest.mark.parametrize(("field", "value", "told"), [
    ("dtype", "F16", "of shape [256, 64] and dtype F16 needs 32768 bytes, but its data_offsets [0, 65536] hold 65536"),
    ("shape", [2**31, 0], ("of shape [2147483648, 0] and dtype F32 needs 0 bytes, but its data_offsets [0, 65536] "
                           "hold 65536")),
    ("data_offsets", [0, 0], "of shape [256, 64] and dtype F32 needs 65536 bytes, but its data_offsets [0, 0] hold 0"),
])
def test_a_safetensors_tensor_whose_shape_and_dtype_disagree_with_its_offsets_is_named(tmp_path, field, value,
                                                                                      told) -> None:
    """The library refuses such a header saying only "invalid shape, data type, or offset for tensor", naming none:
    the refusal names the tensor and the numbers that disagree."""
    import json

    from asyncinfer import ModelLoadError
    from asyncinfer.models.loader import open_checkpoint
    from tests.helpers import tiny_hf_model

    model = tmp_path / "m"
    tiny_hf_model("llama").save_pretrained(model, safe_serialization=True)
    raw = (model / "model.safetensors").read_bytes()
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8 : 8 + length])
    assert header["lm_head.weight"] == {"dtype": "F32", "shape": [256, 64], "data_offsets": [0, 65536]}
    header["lm_head.weight"][field] = value
    text = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'lm_head\.weight' "
                                             + told.replace("[", r"\[").replace("]", r"\]")):
        open_checkpoint(model).load(torch.float32, "cpu", lambda done, total: None)
