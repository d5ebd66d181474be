"""A GGUF header that states what asyncinfer does not run is refused from the header, naming the key: value heads
of another width than the key heads (``attention.value_length``), and a mixture of experts (``expert_count``).
Both loaded and generated: the value width was never read, and a dense file's feed-forwards were taken as the
model's whatever the header said."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncinfer import ModelLoadError
from asyncinfer.models.loader import read_model_config
from benchmarks.make_gguf import SHAPES, write

TINY = dict(SHAPES["tiny"], hidden=64, intermediate=128, heads=4, kv_heads=2, vocab_size=300, layers=1)


def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, int]) -> Path:
    """A tiny random Llama GGUF (head size 16) whose header also holds ``extra`` keys (after ``llama.``, uint32)."""
    import gguf

    original = gguf.GGUFWriter.add_block_count

    def add(self: Any, count: int) -> None:
        original(self, count)
        for key, value in extra.items():
            self.add_uint32(f"llama.{key}", value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", add)
    path = tmp_path / "tiny.gguf"
    write(path, TINY, "llama", "q8_0", "q8_0", "none", 0)
    return path


@pytest.mark.parametrize(("extra", "told"), [
    ({"attention.value_length": 32}, (r"metadata llama\.attention\.value_length = 32 differs from the key head size "
                                     r"\(16, .*\): value heads of another width are not supported")),
    ({"expert_count": 8, "expert_used_count": 2}, (r"metadata llama\.expert_count = 8: mixture-of-experts models are "
                                                  r"not supported")),
])
def test_a_header_asking_what_is_not_run_is_refused_from_the_header(tmp_path, monkeypatch, extra, told) -> None:
    path = tiny_gguf(tmp_path, monkeypatch, extra)
    with pytest.raises(ModelLoadError, match=told):
        read_model_config(path)


@pytest.mark.parametrize("extra", [{"attention.value_length": 16}, {"expert_count": 0}])
def test_a_header_stating_what_is_run_loads(tmp_path, monkeypatch, extra) -> None:
    config = read_model_config(tiny_gguf(tmp_path, monkeypatch, extra))
    assert (config.head_dim, config.num_heads) == (16, 4)
