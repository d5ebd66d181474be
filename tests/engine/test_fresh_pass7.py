"""Adversarial pass 7 (in-process side): faults a hostile file or caller could cause, found and fixed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import ModelLoadError


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


@pytest.mark.parametrize("count", [("10000000000", "STRING"), (1e10, "FLOAT64")], ids=["string", "float"])
def test_a_block_count_that_is_no_int_is_checked_before_any_per_layer_work(tmp_path, monkeypatch, count) -> None:
    """``gguf_config`` checked ``<arch>.block_count`` against the layers the tensors hold only where it was an
    int; a string ("10000000000") or a float (1e10) went through ``int()`` into the config, and a Gemma file
    (whose sliding-window pattern is one entry a layer) built a list of 10**10 entries first: ~25 s and a
    MemoryError under a 4 GiB limit, all of the machine's memory without one. The count is now checked as the
    int the config takes, before any per-layer work."""
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
    with pytest.raises(ModelLoadError, match=r"gemma2\.block_count = 10000000000, but its tensors hold 0 layer"):
        loader.gguf_config(GGUFFile(path))
