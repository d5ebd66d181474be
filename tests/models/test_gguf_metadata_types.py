"""A GGUF header's number of another type is refused naming its key: read with ``int()`` or ``float()``, a string
``"4096"`` passed as the number it spells, a float ``4096.5`` as its integer part and a bool as 0 or 1, so a file
whose header disagreed with the format loaded as if it agreed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncinfer import ModelLoadError
from asyncinfer.models.loader import read_model_config
from benchmarks.make_gguf import SHAPES, write

TINY = dict(SHAPES["tiny"], hidden=64, intermediate=128, heads=4, kv_heads=2, vocab_size=300, layers=1)


def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, value: Any, kind: Any) -> Path:
    """A tiny random Llama GGUF whose ``GGUFWriter.<method>`` key is written as ``value`` of GGUF type ``kind``."""
    import gguf

    def add(self: Any, _given: Any) -> None:
        key = {"add_context_length": "context_length", "add_block_count": "block_count",
               "add_rope_freq_base": "rope.freq_base"}[method]
        self.add_key_value(f"llama.{key}", value, kind)

    monkeypatch.setattr(gguf.GGUFWriter, method, add)
    path = tmp_path / "tiny.gguf"
    write(path, TINY, "llama", "q8_0", "q8_0", "none", 0)
    return path


def kinds() -> Any:
    import gguf

    return gguf.GGUFValueType


@pytest.mark.parametrize(("method", "value", "kind", "told"), [
    ("add_context_length", "4096", "STRING", r"metadata llama\.context_length = '4096' is not an integer \(a str\)"),
    ("add_context_length", 4096.5, "FLOAT32", r"metadata llama\.context_length = 4096\.5 is not an integer \(a float\)"),
    ("add_block_count", True, "BOOL", r"metadata llama\.block_count = True is not an integer \(a bool\)"),
    ("add_rope_freq_base", "1e4", "STRING", r"metadata llama\.rope\.freq_base = '1e4' is not a number \(a str\)"),
])
def test_a_header_number_of_another_type_is_refused_naming_its_key(tmp_path, monkeypatch, method, value, kind,
                                                                     told) -> None:
    path = tiny_gguf(tmp_path, monkeypatch, method, value, getattr(kinds(), kind))
    with pytest.raises(ModelLoadError, match=rf"GGUF file .*tiny\.gguf: {told}$"):
        read_model_config(path)


def test_the_header_numbers_of_their_own_types_read_as_before(tmp_path, monkeypatch) -> None:
    path = tiny_gguf(tmp_path, monkeypatch, "add_context_length", 4096, kinds().UINT64)
    config = read_model_config(path)
    assert (config.max_position_embeddings, config.num_layers, config.rope_theta) == (4096, 1, 10000.0)


async def test_add_model_names_the_refused_file_as_the_text_it_was_given(tiny_models, tmp_path, monkeypatch) -> None:
    """add_model resolved the caller's string to a Path before the check, and the refusal showed its repr:
    "cannot load PosixPath('/.../tiny.gguf')"."""
    from asyncinfer import AsyncEngine

    bad = tiny_gguf(tmp_path, monkeypatch, "add_context_length", "4096", kinds().STRING)
    engine = await AsyncEngine.load(tiny_models["llama"][0], kv_cache_memory=4 * 1024 * 1024, max_model_len=256,
                                    dtype="float32", device="cpu")
    async with engine:
        with pytest.raises(ModelLoadError) as caught:
            await engine.add_model("second", str(bad))
        assert str(caught.value) == (f"cannot load {str(bad)!r}: GGUF file {bad}: metadata llama.context_length = "
                                     "'4096' is not an integer (a str); the serving models are untouched")
        assert [info.name for info in engine.model_info()] == ["default"]
