"""Adversarial pass 15 (issue 25), in-process: an embedding model whose tokenizer the tokenizers library panics on.

A ``Precompiled`` normalizer whose charsmap declares what it holds but points past its end loads, and the library's
Rust code panics on every text it normalizes (``index out of bounds``): ``embed()`` raised its PanicException, which
derives from ``BaseException`` only and went past the caller's ``except Exception``. It is an InvalidParameterError
on ``texts`` now, and the load, whose warm-up embeds a word, a ModelLoadError.
"""

from __future__ import annotations

import json

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, ModelLoadError
from tests.helpers import save_tiny_bert

_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]


def _panicking_bert(path):
    save_tiny_bert(path, _VOCAB)
    data = json.loads((path / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAAAAAAAAAAAAAA"}
    (path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # (BertTokenizerFast builds a normalizer of its own)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_texts_the_tokenizer_panics_on_are_an_invalid_parameter(tmp_path) -> None:
    from transformers import AutoTokenizer

    from asyncinfer.models.encoder import tokenize_texts

    _panicking_bert(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(InvalidParameterError, match="2 texts its tokenizer panicked on") as caught:
        tokenize_texts(tokenizer, ["hello world", "world"], 16)
    assert caught.value.parameter == "texts"


async def test_an_embedding_model_whose_tokenizer_panics_on_a_word_is_a_model_load_error(tmp_path) -> None:
    """The load's warm-up embeds a word: it raised the PanicException out of ``load`` (and ``add_model``)."""
    _panicking_bert(tmp_path)
    with pytest.raises(ModelLoadError, match="its tokenizer cannot encode the warm-up text .*panicked on"):
        await AsyncEngine.load(str(tmp_path), num_threads=1, max_wait_ms=0)
