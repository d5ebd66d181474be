"""A GGUF model with a sliding attention window (issue 10, item 6).

The runner has full attention only, which equals sliding-window attention while
the context fits the window. A GGUF file that declares a window
(``<arch>.attention.sliding_window``, as llama.cpp writes for Mistral-style
models) is served only with ``max_model_len`` within it; past it ``build_core``
refuses at load, naming both numbers, instead of silently attending too far.
The check reads only the file's header, so these files carry metadata alone.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from asyncinfer import ConfigurationError
from asyncinfer.loading import check_sliding_window, gguf_sliding_window


def header_only_gguf(path: Path, sliding_window: int | None) -> str:
    """A GGUF file with a Llama header (and a window, if given) and no tensors; its ``source``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return f"gguf:{path}"


def loaded(source: str) -> SimpleNamespace:
    # All check_sliding_window reads of a LoadedModel: the window the loader read from the header.
    return SimpleNamespace(config=SimpleNamespace(sliding_window=gguf_sliding_window(source)))


def test_a_context_past_the_window_is_refused_naming_both_numbers(tmp_path) -> None:
    source = header_only_gguf(tmp_path / "windowed.gguf", sliding_window=64)
    assert gguf_sliding_window(source) == 64
    with pytest.raises(ConfigurationError, match=r"max_model_len=128 exceeds .* window of 64") as err:
        check_sliding_window(loaded(source), 128)
    assert "pass max_model_len=64 or less" in str(err.value)
    check_sliding_window(loaded(source), 64)  # within the window: served as it is
    check_sliding_window(loaded(source), 16)


def test_no_window_no_limit(tmp_path) -> None:
    source = header_only_gguf(tmp_path / "plain.gguf", sliding_window=None)
    assert gguf_sliding_window(source) is None
    check_sliding_window(loaded(source), 512)
    # A Hugging Face directory: its config's window already caps the model's context.
    assert gguf_sliding_window(f"safetensors:{tmp_path}") is None


def test_build_core_makes_the_check(tiny_models, monkeypatch) -> None:
    """The refusal happens at load, before any KV memory is planned."""
    import dataclasses

    from asyncinfer import AsyncEngine
    from asyncinfer.models import loader

    real = loader._merge_generation_eos
    monkeypatch.setattr(loader, "_merge_generation_eos",
                        lambda config, path: dataclasses.replace(real(config, path), sliding_window=32))
    kwargs = {"kv_cache_memory": 4 * 1024 * 1024, "dtype": "float32", "device": "cpu"}
    with pytest.raises(ConfigurationError, match=r"max_model_len=64 exceeds .* window of 32"):
        AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, **kwargs)
    assert AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=32, **kwargs).max_model_len == 32


@pytest.mark.parametrize("window", [None, 0, 48])
def test_the_loader_reads_the_window_from_the_header_it_parses(tmp_path, window) -> None:
    from asyncinfer.models.gguf_file import GGUFFile
    from asyncinfer.models.loader import gguf_model_config

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(320)
    if window is not None:
        writer.add_sliding_window(window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_model_config(GGUFFile(path)).sliding_window == (window or None)  # 0: no window
