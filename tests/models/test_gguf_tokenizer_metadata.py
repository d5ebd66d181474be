"""A GGUF file's tokenizer metadata that transformers' conversion cannot follow is refused before the tokenizer is
built, naming the key and the value: a vocabulary that is not strings, merges that are not two pieces, a special token id past
the vocabulary. Built first, each failed seconds later in transformers' own words ("list index out of range",
"expected tuple of length 2"), naming neither."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncinfer import AsyncEngine, ModelLoadError
from asyncinfer.models import loader
from benchmarks import make_gguf
from benchmarks.make_gguf import SHAPES, write

TINY = dict(SHAPES["tiny"], hidden=64, intermediate=128, heads=4, kv_heads=2, vocab_size=300, layers=1)


def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **change: Any) -> Path:
    """A tiny random Llama GGUF whose SentencePiece vocabulary's metadata is ``change``d: ``tokens`` replaces the
    token list; ``merges`` and ``padding_token_id`` are added."""
    import gguf

    def vocabulary(writer: Any, size: int) -> None:
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
        tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
        tokens = change.get("tokens", tokens)
        writer.add_tokenizer_model("llama")
        kind = gguf.GGUFValueType.STRING if all(isinstance(token, str) for token in tokens) else gguf.GGUFValueType.UINT32
        writer.add_key_value("tokenizer.ggml.tokens", tokens, gguf.GGUFValueType.ARRAY, sub_type=kind)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if "merges" in change:
            writer.add_token_merges(change["merges"])
        if "padding_token_id" in change:
            writer.add_pad_token_id(change["padding_token_id"])

    monkeypatch.setattr(make_gguf, "add_spm_vocab", vocabulary)
    path = tmp_path / "tiny.gguf"
    write(path, TINY, "llama", "q8_0", "q8_0", "spm", 0)

    def never(path: Path, header: object = None, vocab_size: int | None = None) -> None:
        raise AssertionError(f"the tokenizer of {path} was built")

    monkeypatch.setattr(loader, "gguf_tokenizer", never)
    return path


@pytest.mark.parametrize(("change", "told"), [
    ({"tokens": list(range(300))}, (r"metadata tokenizer\.ggml\.tokens is not a list of strings; a tokenizer needs a "
                                   r"vocabulary of at least one token")),
    ({"padding_token_id": 5000}, (r"metadata tokenizer\.ggml\.padding_token_id = 5000 is not a token of its vocabulary "
                                 r"\(an integer in \[0, 299\], tokenizer\.ggml\.tokens holds 300\)")),
    ({"tokens": ["<unk>", "<s>"]}, (r"metadata tokenizer\.ggml\.eos_token_id = 2 is not a token of its vocabulary "
                                   r"\(an integer in \[0, 1\], tokenizer\.ggml\.tokens holds 2\)")),
    ({"merges": ["\u2581 t", "abc"]}, (r"metadata tokenizer\.ggml\.merges holds 'abc'; each merge must be a string of "
                                      r"two pieces parted by one space")),
])
def test_tokenizer_metadata_transformers_cannot_follow_is_named_before_the_build(tmp_path, monkeypatch, change,
                                                                                 told) -> None:
    path = tiny_gguf(tmp_path, monkeypatch, **change)
    with pytest.raises(ModelLoadError, match=rf"GGUF file .*tiny\.gguf: {told}$"):
        asyncio.run(AsyncEngine.load(str(path), max_model_len=64, num_threads=1))


def test_a_vocabulary_that_holds_its_special_ids_goes_on_to_the_build(tmp_path, monkeypatch) -> None:
    path = tiny_gguf(tmp_path, monkeypatch, padding_token_id=0, merges=["\u2581 t"])
    with pytest.raises(ModelLoadError, match="the tokenizer of .*tiny\\.gguf was built$"):
        asyncio.run(AsyncEngine.load(str(path), max_model_len=64, num_threads=1))
